"""The per-version table of ``statediff_hooks.vllm.surface``, the version check and its override,
and the Model Runner V2 refusal, without an engine (the version string is simulated; the smoke
set, ``test_vllm_smoke.py``, records with the override on a real engine)."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import pytest

from statediff.errors import StatediffError
from statediff_hooks.vllm import plugin, replay, surface

from plugin_fixtures import no_patching  # noqa: F401 - a fixture

REFUSAL_033 = ("vLLM 0.33.0 is not verified by statediff (verified: 0.29.0, 0.30.0, 0.31.0, 0.32.0); install one "
               "of those, or set STATEDIFF_ALLOW_UNVERIFIED=1 to record with the 0.32.0 adapter (the trace is then "
               "marked 'adapter: unverified')")


def test_one_row_per_verified_version_and_what_differs():
    assert surface.VERIFIED_VERSIONS == ("0.29.0", "0.30.0", "0.31.0", "0.32.0")
    rows = {v.version: v for v in surface.VERSIONS}
    assert [rows[v].eagle_drop_switch for v in surface.VERIFIED_VERSIONS] == \
        ["use_eagle", "use_eagle_block_drop", "use_eagle_block_drop", "use_eagle_block_drop"]
    assert [rows[v].one_token_first_chunk for v in surface.VERIFIED_VERSIONS] == \
        ["decode", "decode", "prefill", "prefill"]
    assert [rows[v].triton_dispatcher for v in surface.VERIFIED_VERSIONS] == [False, False, True, True]
    # the block-table row the mamba align kernels copy through (mamba_align_cpu mirrors it)
    assert [rows[v].align_block_table_row for v in surface.VERIFIED_VERSIONS] == ["batch", "batch", "batch", "slot"]
    assert rows["0.29.0"].v2_forced_by == () and "watermark_config" in rows["0.30.0"].v2_forced_by


@pytest.mark.parametrize("version,row,verified", [
    ("0.29.0", "0.29.0", True), ("0.31.0+cpu", "0.31.0", True), ("0.32.0", "0.32.0", True),
    ("0.33.0", "0.32.0", False), ("0.33.0rc1.dev12+g1234abc", "0.32.0", False), ("0.28.2", "0.29.0", False),
    ("0.30.1", "0.30.0", False), ("1.0.0", "0.32.0", False),
])
def test_the_adapter_is_the_versions_own_row_or_the_nearest(version, row, verified):
    a = surface.adapter_for(version, allow_unverified=True)
    assert (a.engine_version, a.facts.version, a.verified) == (version, row, verified)
    assert a.run_fields()["adapter"] == ("verified" if verified else "unverified")
    assert a.run_fields()["adapter_version"] == row


def test_an_unknown_version_is_refused_in_one_plain_line():
    with pytest.raises(surface.UnsupportedEngine) as e:
        surface.adapter_for("0.33.0")
    assert str(e.value) == REFUSAL_033
    assert isinstance(e.value, StatediffError)  # the CLI prints it as one line, exit 2 (no "unexpected ...")


def test_the_override_is_read_from_the_environment(monkeypatch):
    monkeypatch.setattr(surface, "installed_version", lambda: "0.33.0")
    monkeypatch.setattr(surface, "installed_surface", lambda runner="v1": None)  # the version string alone
    monkeypatch.delenv("STATEDIFF_ALLOW_UNVERIFIED", raising=False)
    with pytest.raises(surface.UnsupportedEngine, match="^vLLM 0.33.0 is not verified"):
        surface.check_version()
    monkeypatch.setenv("STATEDIFF_ALLOW_UNVERIFIED", "1")
    a = surface.check_version()
    assert a.run_fields() == {"adapter": "unverified", "adapter_version": "0.32.0",
                              "version_facts": {"one_token_first_chunk": "prefill",
                                                "eagle_drop_switch": "use_eagle_block_drop"}}


class SpecConfig:
    def __init__(self, method: str, disable: bool = False) -> None:
        self.method, self.disable_eagle_block_drop = method, disable

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp", "dflash", "dspark")

    def use_eagle_block_drop(self) -> bool:
        return self.use_eagle() and not self.disable_eagle_block_drop


def test_the_eagle_drop_is_read_through_the_versions_switch():
    v029, v032 = surface.VERSIONS[0], surface.VERSIONS[3]
    off = SpecConfig("eagle3", disable=True)  # vLLM 0.30+ can switch the drop off
    assert surface.eagle_block_drop(off, v032) is False
    assert surface.eagle_block_drop(off, v029) is True  # 0.29 has no switch: use_eagle decides
    assert surface.eagle_block_drop(SpecConfig("ngram"), v032) is False
    assert surface.eagle_block_drop(None, v032) is None




def test_install_capture_refuses_an_unknown_version_before_anything_is_patched(monkeypatch, no_patching, tmp_path):
    monkeypatch.setattr(surface, "installed_version", lambda: "0.33.0")
    monkeypatch.setattr(surface, "installed_surface", lambda runner="v1": None)  # the version string alone
    monkeypatch.delenv("STATEDIFF_ALLOW_UNVERIFIED", raising=False)
    with pytest.raises(StatediffError) as e:
        replay.install_capture({"STATEDIFF_TRACE": str(tmp_path / "t.h5")})
    assert str(e.value) == REFUSAL_033 and no_patching == []


@pytest.mark.engine  # install_capture imports vLLM (the capture's patch points)
def test_the_override_survives_install_capture_and_picks_the_nearest_adapter(monkeypatch, no_patching, tmp_path):
    """The override was lost before: install_capture cleared every STATEDIFF_* variable."""
    monkeypatch.setattr(surface, "installed_version", lambda: "0.33.0")
    monkeypatch.setattr(surface, "installed_surface", lambda runner="v1": None)  # the version string alone
    monkeypatch.setenv("STATEDIFF_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("STATEDIFF_FAULT", "left-over")  # an earlier replay's variable: cleared
    replay.install_capture({"STATEDIFF_TRACE": str(tmp_path / "t.h5")})
    assert os.environ["STATEDIFF_ALLOW_UNVERIFIED"] == "1" and "STATEDIFF_FAULT" not in os.environ
    from statediff_hooks.vllm.v2 import surface as v2
    assert surface.EXECUTE_MODEL in no_patching and v2.EXECUTE_MODEL in no_patching
    (adapter,) = plugin._adapter
    assert (adapter.engine_version, adapter.facts.version, adapter.verified) == ("0.33.0", "0.32.0", False)


def test_the_hit_accounting_takes_the_engines_own_answer_on_the_block_drop():
    from statediff.replay.hits import drops_last_block

    assert drops_last_block({"speculative_method": "eagle3"}) is True  # older traces: the method rule
    assert drops_last_block({"speculative_method": "ngram"}) is False
    off = {"speculative_method": "eagle3", "version_facts": {"eagle_block_drop": False}}  # 0.30+: switched off
    assert drops_last_block(off) is False
    assert drops_last_block({"speculative_method": "none", "version_facts": {"eagle_block_drop": None}}) is False
