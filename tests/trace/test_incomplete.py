"""Incomplete traces (run field ``stopped``): writer, reader, inspect, compare, report. Offline."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.trace import open_trace
from statediff.trace.schema import run_problem

from synth import write_trace

STOP = {"request": 3, "error": "RuntimeError: boom", "line": 4}
REASON = "the replay stopped early at request 3 of 4: RuntimeError: boom"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("incomplete")
    return {"stopped": write_trace(d / "stopped.h5", "hit", stopped=STOP, num_requests=4),
            "hit": write_trace(d / "hit.h5", "hit"), "cold": write_trace(d / "cold.h5", "cold")}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_stopped_replay_closes_as_an_incomplete_file(traces):
    import h5py

    with h5py.File(traces["stopped"]) as f:
        assert bool(f.attrs["complete"]) is False
    with open_trace(traces["stopped"]) as t:
        assert t.partial and t.partial_reason == REASON and t.run["stopped"] == STOP
    with open_trace(traces["hit"]) as t:
        assert not t.partial and t.run["stopped"] is None


def test_stopped_field_is_validated():
    assert run_problem({"stopped": STOP}) is None
    assert run_problem({"stopped": {"request": -1, "error": "x"}}) == (
        "run field 'stopped' is not an object {request: int >= 0 or null, error: str or null} or null")
    assert run_problem({"stopped": "yes"}) is not None


def test_inspect_says_so_first(traces):
    r = run("inspect", traces["stopped"])
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == f"INCOMPLETE: {REASON}"
    assert lines[2].endswith(", incomplete (the replay stopped early: see the first line)")
    assert json.loads(run("inspect", "--json", traces["stopped"]).stdout)["incomplete_reason"] == REASON
    assert not run("inspect", traces["hit"]).stdout.startswith("INCOMPLETE")


def test_compare_refuses_with_exit_2_unless_allowed(traces):
    r = run("compare", traces["stopped"], traces["cold"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == (f"statediff: error: the hit trace {traces['stopped']} is incomplete: {REASON}; refusing "
                        "to compare it (--allow-incomplete compares the requests it holds)\n")
    r = run("compare", "--allow-incomplete", traces["stopped"], traces["cold"])
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0] == f"INCOMPLETE: the hit trace {traces['stopped']} is incomplete: {REASON}"
    doc = json.loads(run("compare", "--allow-incomplete", "--json", traces["stopped"], traces["cold"]).stdout)
    assert doc["incomplete"] == [f"the hit trace {traces['stopped']} is incomplete: {REASON}"]
    assert run("report", traces["stopped"], traces["cold"]).exit_code == 2
    r = run("report", "--allow-incomplete", traces["stopped"], traces["cold"])
    assert r.exit_code == 0 and r.stdout.startswith("# statediff: no state divergence between the cache-hit and "
                                                    "cold runs (INCOMPLETE trace: the hit trace")
