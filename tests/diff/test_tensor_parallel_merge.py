"""A tensor-parallel set's unsharded tensors (statediff.diff.ranks.merge_set) and the compare of a
set against a single trace (issue 20), on synthetic traces split into 2 ranks the way vLLM 0.32
shards them: the conv state's q, k and v parts each on its own, SSM state and K/V by heads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.ranks import merge_set
from statediff.trace import open_trace
from synth import split_ranks as _split, write_trace


def test_the_merged_set_holds_the_unsharded_tensors_bit_for_bit(tmp_path):
    full = write_trace(tmp_path / "full.h5", "hit", replay="exact")
    set0, rank1 = _split(full, tmp_path / "tp.h5")
    field = merge_set(set0, tmp_path / "merged.h5")
    with open_trace(full) as a, open_trace(tmp_path / "merged.h5") as b, open_trace(set0) as s0, \
            open_trace(rank1) as s1:
        assert field == {"world_size": 2, "traces": ["tp.h5", "tp.rank1.h5"], "merged": len(a.entries), "left_out": 0}
        assert b.run["tensor_parallel_merged"] == field and b.run.get("tensor_parallel") is None
        got = {(e.request, e.position, e.layer, e.kind): b.read(e) for e in b.entries}
        for e in a.entries:
            assert np.array_equal(got[e.request, e.position, e.layer, e.kind], a.read(e)), e.label()
        # the mistake of vLLM #53078: the ranks' conv states concatenated are not the state
        conv = next(e for e in a.entries if e.kind == "gdn.conv_state")
        pick = lambda t: next(x for x in t.entries if (x.request, x.position, x.layer, x.kind) ==  # noqa: E731
                              (conv.request, conv.position, conv.layer, conv.kind))
        naive = np.concatenate([s0.read(pick(s0)), s1.read(pick(s1))], axis=1)
        assert naive.shape == a.read(conv).shape and not np.array_equal(naive, a.read(conv))


def test_a_set_against_a_single_trace_needs_allow_engine_mismatch_then_is_judged_by_tolerance(tmp_path):
    set0, _ = _split(write_trace(tmp_path / "full.h5", "hit", replay="exact"), tmp_path / "tp.h5")
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact")
    r = CliRunner().invoke(cli, ["compare", str(set0), str(cold)])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"statediff: error: {set0} is a 2-rank tensor-parallel set and {cold} one trace: "
                                     "give --allow-engine-mismatch to compare the set's unsharded tensors with it by "
                                     "tolerance (the layout and the reduction order differ, so bit identity cannot hold)"]
    r = CliRunner().invoke(cli, ["compare", str(set0), str(cold), "--allow-engine-mismatch", "--json"])
    out = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert out["verdict"] == "same" and not out["tolerance_policy"].startswith("exact")
    assert out["warnings"][0].startswith(f"tensor parallel: the hit side is {set0} (2 ranks), unsharded")


def test_a_rank_trace_left_as_parts_is_present(tmp_path):
    """vllm serve's process manager kills the workers at shutdown: their traces stay ``.parts``
    directories (partial traces), which compare and inspect read as the rank's trace."""
    from statediff.diff.ranks import exists

    (tmp_path / "served.rank1.h5.parts").mkdir()
    assert exists(tmp_path / "served.rank1.h5") and not exists(tmp_path / "served.rank2.h5")
