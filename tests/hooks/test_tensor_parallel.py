"""Tensor-parallel recording without an engine (issue 20): rank trace paths, the GDN conv state's
per-rank q/k/v layout and its inverse, fault rank selectors, the checks before the engine, the
rank-by-rank compare's choice of root."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from statediff.diff.ranks import RankedResult, _root_rank, compare_ranks, rank_set, unshard
from statediff.errors import StatediffError
from statediff_hooks.recording.faults import parse_fault
from statediff_hooks.drivers.record import RecordingOptions, tensor_parallel_arguments
from statediff_hooks.vllm.v1.tp import check_supported, conv_parts, rank_trace_path


def test_rank_0_writes_the_path_and_rank_r_a_sibling():
    assert rank_trace_path("/d/hit.h5", 0) == "/d/hit.h5"
    assert rank_trace_path("/d/hit.h5", 1) == "/d/hit.rank1.h5"
    assert rank_trace_path("/d/hit", 2) == "/d/hit.rank2.h5"
    # a live audit's incident file under TP: each rank appends to its own
    assert rank_trace_path("/d/incidents.jsonl", 1, ".jsonl") == "/d/incidents.rank1.jsonl"
    assert rank_trace_path("/d/incidents", 1, ".jsonl") == "/d/incidents.rank1.jsonl"


def test_conv_parts_of_tiny_tp_rank_1():
    # tiny-tp: key_dim 2*64, value_dim 4*64; rank 1 of 2 holds q 64:128, k 192:256, v 384:512
    assert conv_parts(128, 256, 1, 2) == [
        {"name": "q", "local": [0, 64], "global": [64, 128]},
        {"name": "k", "local": [64, 128], "global": [192, 256]},
        {"name": "v", "local": [128, 256], "global": [384, 512]}]


def test_unshard_conv_inverts_the_per_rank_layout_and_naive_concatenation_does_not():
    full = np.arange(3 * 512, dtype=np.float32).reshape(3, 512)  # (state_len, conv_dim): layout SD
    parts = [conv_parts(128, 256, r, 2) for r in range(2)]
    shards = [np.concatenate([full[:, slice(*p["global"])] for p in ps], axis=1) for ps in parts]
    assert [s.shape for s in shards] == [(3, 256), (3, 256)]
    layouts = [{"gdn.conv_state": {"axis": 1, "parts": ps}} for ps in parts]  # run field tensor_parallel.shards
    assert np.array_equal(unshard("gdn.conv_state", shards, layouts), full)
    naive = np.concatenate(shards, axis=1)  # the mistake of vLLM #53078
    assert naive.shape == full.shape and not np.array_equal(naive, full)
    assert np.array_equal(naive[:, 64:128], full[:, 128:192])  # rank 0's k sits where rank 1's q belongs


def test_fault_rank_selector():
    assert parse_fault("kv-stale:rank=1").rank == 1
    assert parse_fault("kv-stale:layer=3:rank=1").spec == "kv-stale:layer=3:rank=1"
    assert parse_fault("kv-stale").rank is None
    with pytest.raises(ValueError, match="a rank is >= 0"):
        parse_fault("kv-stale:rank=-1")
    with pytest.raises(ValueError, match="group-shortfall acts in the scheduler, which no rank owns"):
        parse_fault("group-shortfall:rank=0")


def test_unverified_versions_and_pipeline_parallel_are_refused_in_one_line():
    assert check_supported("0.32.0", 2) is None
    assert check_supported("0.31.0", 1) is None
    assert check_supported("0.31.0", 2) == (
        "tensor parallel size 2 on vLLM 0.31.0: statediff verified the per-rank shard layout on vLLM 0.32 only; "
        "record with --tensor-parallel-size 1 on this version")
    assert check_supported("0.32.0", 1, 2).startswith("pipeline parallel size 2: statediff records "
                                                      "tensor-parallel engines only")


def test_record_refuses_a_fault_rank_past_the_world_size_and_a_double_size():
    with pytest.raises(StatediffError, match=r"^--fault kv-stale:rank=2: rank 2 does not exist with tensor "
                                             r"parallel size 2 \(ranks 0\.\.1\)$"):
        tensor_parallel_arguments(RecordingOptions("x.h5", "hit", fault="kv-stale:rank=2", tensor_parallel_size=2), {})
    with pytest.raises(StatediffError, match="rank 1 does not exist with tensor parallel size 1"):
        tensor_parallel_arguments(RecordingOptions("x.h5", "hit", fault="kv-stale:rank=1"), {})
    with pytest.raises(StatediffError, match="give one"):
        tensor_parallel_arguments(RecordingOptions("x.h5", "hit", tensor_parallel_size=2), {"tensor_parallel_size": 2})
    assert tensor_parallel_arguments(RecordingOptions("x.h5", "hit"), {}) == {}


def _run(rank: int, size: int = 2, shards: dict | None = None) -> dict:
    return {"tensor_parallel": {"rank": rank, "world_size": size, "traces": [f"t.h5", "t.rank1.h5"][:size],
                                "shards": shards or {"attn.k": {"axis": 0, "slice": [0, 2], "of": 4}}}}


def test_rank_set_names_each_rank_beside_rank_0():
    assert rank_set(Path("/d/t.h5"), _run(0)) == [Path("/d/t.h5"), Path("/d/t.rank1.h5")]
    assert rank_set(Path("/d/t.rank1.h5"), _run(1)) is None  # one rank alone compares as any trace
    assert rank_set(Path("/d/t.h5"), {}) is None
    bad = _run(0)
    bad["tensor_parallel"]["traces"] = ["../x.h5", "t.rank1.h5"]
    with pytest.raises(StatediffError, match="malformed"):
        rank_set(Path("/d/t.h5"), bad)


def test_a_set_against_a_plain_trace_or_another_layout_is_refused(tmp_path):
    with pytest.raises(StatediffError, match=r"\(tensor parallel size 2\) and .* \(tensor parallel size 1\)"):
        compare_ranks(tmp_path / "t.h5", tmp_path / "c.h5", _run(0), {}, lambda h, c: None)
    other = _run(0, shards={"attn.k": {"axis": 0, "slice": [2, 4], "of": 4}})
    with pytest.raises(StatediffError, match="the shard layouts differ"):
        compare_ranks(tmp_path / "t.h5", tmp_path / "c.h5", _run(0), other, lambda h, c: None)


def _res(first=None, code=0):
    d = None if first is None else types.SimpleNamespace(request=first[0], position=first[1], layer=first[2],
                                                         kind=first[3])
    return types.SimpleNamespace(first=d, exit_code=code, cause=None if code == 0 else "tensor" if first else
                                 "outputs", verdict="same" if code == 0 else "diverged", pairs=3,
                                 headline=lambda: "DIVERGED: ...")


def test_the_root_rank_is_the_earliest_first_divergence_in_causal_order():
    # a fault in rank 1's K at layer 3 reaches rank 0 only after the collective: later
    assert _root_rank([_res((1, 512, 0, "gdn.conv_state"), 1), _res((1, 448, 3, "attn.k"), 1)]) == 1
    assert _root_rank([_res((1, 448, 3, "attn.k"), 1), _res((1, 448, 3, "attn.v"), 1)]) == 0
    assert _root_rank([_res(), _res()]) is None
    assert _root_rank([_res(), _res(code=1)]) == 1  # outputs only
    r = RankedResult(2, [(Path("a"), Path("b"))] * 2, [_res(), _res(code=2)], None)
    assert r.exit_code == 2


def test_the_rank_lines_say_where_each_rank_diverged():
    r = RankedResult(2, [(Path("h.h5"), Path("c.h5")), (Path("h.rank1.h5"), Path("c.rank1.h5"))],
                     [_res(code=1), _res((1, 448, 3, "attn.k"), 1)], 1)
    r.results[1].first.where = lambda: "request 1, position 448, layer 3, attn.k"
    r.results[1].to_text = lambda: "(rank 1's report)"
    lines = r.to_text().splitlines()
    assert lines[0] == "DIVERGED: first divergence at rank 1 of 2, request 1, position 448, layer 3, attn.k"
    assert lines[2:4] == ["  rank 0: h.h5 vs c.h5: DIVERGED, 3 pairs (outputs only)",
                          "  rank 1: h.rank1.h5 vs c.rank1.h5: DIVERGED, 3 pairs; first divergence at request 1, "
                          "position 448, layer 3, attn.k"]
    assert lines[5:] == ["rank 1 of 2 (h.rank1.h5 vs c.rank1.h5):", "(rank 1's report)"]


def test_an_old_rank_trace_is_refused_or_with_overwrite_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setattr("statediff_hooks.vllm.surface.installed_version", lambda: "0.32.0")
    out, old = tmp_path / "t.h5", tmp_path / "t.rank1.h5"
    old.write_bytes(b"old")
    with pytest.raises(StatediffError, match=r"t\.rank1\.h5 exists \(rank 1's trace of -o .*\); --overwrite replaces it"):
        tensor_parallel_arguments(RecordingOptions(str(out), "hit", tensor_parallel_size=2), {})
    got = tensor_parallel_arguments(RecordingOptions(str(out), "hit", tensor_parallel_size=2, overwrite=True), {})
    assert got == {"tensor_parallel_size": 2} and not old.exists()


def test_a_model_whose_heads_or_experts_cannot_be_split_is_refused_before_the_engine(tmp_path):
    import json

    from statediff_hooks.drivers.record import check_model_splits

    cfg = {"num_attention_heads": 2, "linear_num_key_heads": 1, "linear_num_value_heads": 2, "num_experts": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StatediffError) as e:
        check_model_splits(str(tmp_path), 2)
    assert str(e.value) == (f"--tensor-parallel-size 2: {tmp_path} cannot be split across 2 ranks "
                            "(linear_num_key_heads = 1, num_experts = 1); the built-in model for it is --model tiny-tp")
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"linear_num_key_heads": 2, "num_experts": 4}))
    check_model_splits(str(tmp_path), 2)  # splits: no error
    check_model_splits("Qwen/some-hub-id", 2)  # no local config.json: left to the engine
