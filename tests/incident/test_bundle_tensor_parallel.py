"""statediff extract of two tensor-parallel sets (issue 20): the bundle holds the root rank's tensors
as any bundle does, and every other rank's shards of the root tensor, nothing more; compare, inspect,
verify and report work on it; inspect of a set names every rank and its shard layout. Synthetic
2-rank sets split the way vLLM 0.32 shards (synth.split_ranks), the fault in rank 1's shards only."""

from __future__ import annotations

import json
import zipfile

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.incident.bundle import open_bundle
from statediff.trace import open_trace
from synth import Fault, split_ranks, write_trace

ROOT = (2, 80, 1, "gdn.ssm_state")
PREV_BLOCK = ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state "
              "one block earlier (position 64, 16 tokens), bit for bit")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-bundle")
    clean, bad = write_trace(d / "clean.h5", "hit"), write_trace(d / "bad.h5", "hit", faults=[Fault("prev_block", 2, 1)])
    hit, _ = split_ranks([clean, bad], d / "hit-set.h5")  # rank 0 restored correctly, rank 1 one block early
    cold, _ = split_ranks(write_trace(d / "cold.h5", "cold"), d / "cold-set.h5")
    return hit, cold


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def held(trace) -> list[tuple]:
    with open_trace(trace) as t:
        return [(e.request, e.position, e.layer, e.kind, e.role, tuple(e.shape)) for e in [*t.entries, *t.digests]]


@pytest.fixture(scope="module")
def bundle(sets, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-zip") / "b.zip"
    r = run("extract", *sets, "-o", out, "--no-plot", "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def test_the_bundle_holds_every_ranks_shards_of_the_root_and_nothing_more(bundle):
    out, summary = bundle
    assert summary["tensor_parallel"] == {"world_size": 2, "root_rank": 1, "ranks": [
        {"rank": 0, "hit": "hit.rank0.h5", "cold": "cold.rank0.h5"}]}
    assert zipfile.ZipFile(out).namelist() == ["b/hit.h5", "b/cold.h5", "b/hit.rank0.h5", "b/cold.rank0.h5",
                                               "b/report.md", "b/replay.jsonl", "b/manifest.json"]
    with open_bundle(out) as b:
        assert b.root_rank == 1 and b.manifest["version"] == 3
        # rank 1 (the root rank): the usual selection, on its shards (SSM state: 1 of 2 heads)
        assert held(b.hit) == [(2, 80, 1, "gdn.conv_state", "resumed", (3, 128)),
                               (2, 80, 1, "gdn.ssm_state", "resumed", (1, 64, 64)),
                               (2, 96, 1, "gdn.conv_state", "checkpoint", (3, 128)),
                               (2, 96, 1, "gdn.ssm_state", "checkpoint", (1, 64, 64))]
        assert (2, 64, 1, "gdn.ssm_state", "checkpoint", (1, 64, 64)) in held(b.cold)  # the diagnosis match
        # rank 0: its shard of the root tensor, each side, nothing else
        assert held(b.ranks[0][0]) == [(2, 80, 1, "gdn.ssm_state", "resumed", (1, 64, 64))]
        assert held(b.ranks[0][1]) == [(2, 80, 1, "gdn.ssm_state", "checkpoint", (1, 64, 64))]
        with open_trace(b.ranks[0][0]) as t:
            assert t.run["tensor_parallel"]["rank"] == 0 and t.run["extracted_from"]["rank"] == 0
            assert len(t.requests) == 4  # every request record travels
    assert [(k["rank"], k["side"]) for k in summary["rank_kept"]] == [(0, "hit"), (0, "cold")]


def test_compare_of_the_bundle_names_the_root_rank_and_the_diagnosis(bundle, sets):
    r = run("compare", bundle[0], "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert out["tensor_parallel"] == {"world_size": 2, "root_rank": 1}
    assert (out["first"]["rank"], *(out["first"][k] for k in ("request", "position", "layer", "kind"))) == (1, *ROOT)
    assert out["diagnosis"]["text"] == PREV_BLOCK
    assert out["headline"].startswith("DIVERGED: first divergence at rank 1 of 2, request 2, position 80, layer 1 ")
    assert [(x["rank"], x["verdict"], x["pairs"]) for x in out["ranks"]] == [(0, "same", 1), (1, "diverged", 4)]
    assert [x["hit"] for x in out["ranks"]] == [f"{bundle[0]}:b/hit.rank0.h5", f"{bundle[0]}:b/hit.h5"]
    # the sets themselves: the same root
    full = json.loads(run("compare", *sets, "--json").stdout)
    assert full["first"]["rank"] == 1 and full["diagnosis"]["text"] == PREV_BLOCK


def test_inspect_verify_and_report_work_on_it(bundle, sets):
    out = bundle[0]
    r = run("inspect", out)
    assert r.exit_code == 0, r.output
    assert ("tensor parallel: rank 1 of 2 is the root rank (hit.h5, cold.h5); the other ranks' shards of the "
            "root: 2 tensors in hit.rank0.h5, cold.rank0.h5") in r.stdout
    j = json.loads(run("inspect", out, "--json").stdout)
    assert [t["path"] for t in j["traces"]] == [f"{out}:b/{n}" for n in ("hit.h5", "cold.h5", "hit.rank0.h5",
                                                                       "cold.rank0.h5")]
    assert j["kept"]["ranks"] == 2
    r = run("verify", out, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["traces"]) == 4
    r = run("report", *sets)
    assert r.exit_code == 1, r.output
    assert "(tensor parallel: rank 1 of 2)" in r.stdout.splitlines()[0]
    with zipfile.ZipFile(out) as z:
        md = z.read("b/report.md").decode()
    assert "hit.rank0.h5 and b/cold.rank0.h5 hold that rank's shards of the root tensor only" in md


def test_a_tampered_rank_member_is_refused(bundle, tmp_path):
    src, _ = bundle
    bad = tmp_path / "b.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for i in zin.infolist():
            data = zin.read(i)
            if i.filename == "b/manifest.json":
                m = json.loads(data)
                m["tensor_parallel"]["ranks"][0]["hit"] = "../x.h5"
                data = json.dumps(m).encode()
            zout.writestr(i, data)
    r = run("compare", bad)
    assert r.exit_code == 2
    assert r.stderr.startswith(f"statediff: error: bundle {bad}: its manifest's tensor_parallel field is malformed")


def test_extract_of_a_set_against_one_trace_is_refused_in_one_line(sets, tmp_path):
    cold = write_trace(tmp_path / "cold.h5", "cold")
    r = run("extract", sets[0], cold, "-o", tmp_path / "x.zip", "--allow-engine-mismatch")
    assert r.exit_code == 2
    assert r.stderr == (f"statediff: error: {sets[0]} is a tensor-parallel set and {cold} one trace: extract needs "
                        "two sets of the same size (rank by rank) or two single traces; compare them instead\n")


def test_inspect_of_a_set_names_every_rank_and_its_layout(sets, tmp_path):
    r = run("inspect", sets[0])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[2].startswith("tensor parallel: rank 0 of 2: this rank's shards only (the set: hit-set.h5, "
                               "hit-set.rank1.h5;")
    assert lines[4] == ("  rank 1: hit-set.rank1.h5; attn.k axis 1: [1,2) of 2; attn.v axis 1: [1,2) of 2; "
                        "gdn.conv_state axis 1: q [0,32)->[32,64), k [32,64)->[96,128), v [64,128)->[192,256); "
                        "gdn.ssm_state axis 0: [1,2) of 2")
    assert lines[3].startswith("  rank 0: this trace; attn.k axis 1: [0,1) of 2;")
    ranks = json.loads(run("inspect", sets[0], "--json").stdout)["ranks"]
    assert [(x["rank"], x["trace"], x["present"]) for x in ranks] == [(0, "hit-set.h5", True),
                                                                      (1, "hit-set.rank1.h5", True)]
    assert ranks[1]["shards"]["gdn.ssm_state"] == {"axis": 0, "of": 2, "slice": [1, 2]}
