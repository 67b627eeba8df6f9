"""The CLI on traces that keep data for some tensors or none: inspect counts, compare --json focus, calibrate."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from synth import Fault, write_trace

KEEP = {"policy": "hits", "budget_bytes": None, "focus": None, "kept_bytes": 308736, "kept_tensors": 18,
        "digest_only_tensors": 60}


def resumed(request, position, layer, kind, role):
    return role == "resumed"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("keep")
    return {"hit": write_trace(d / "hit.h5", "hit", replay="exact", keep=resumed, faults=[Fault("prev_block", 2, 1)],
                               record_argv=["agent.jsonl", "--exact"]),
            "cold": write_trace(d / "cold.h5", "cold", replay="exact", keep="none", record_argv=["agent.jsonl",
                                                                                               "--exact"]),
            "cold_b": write_trace(d / "cold-b.h5", "cold", replay="exact", keep="none", noise_seed=1),
            "v1": write_trace(d / "v1.h5", "cold"),
            "dir": d}


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_inspect_counts_data_and_digest_only_tensors_per_kind(traces):
    r = run("inspect", traces["hit"])
    assert r.exit_code == 0, r.output
    assert "format: statediff.trace v3, complete" in r.stdout
    assert "captured: 78 tensors, 18 with data, 60 digest only" in r.stdout
    assert ("  by kind, with data + digest only: gdn.conv_state 9 + 18, gdn.ssm_state 9 + 18, attn.k 0 + 12, "
            "attn.v 0 + 12") in r.stdout
    assert "keep policy: custom" in r.stdout
    assert "  by role with data: resumed 18" in r.stdout
    doc = json.loads(run("inspect", "--json", traces["hit"]).stdout)
    assert (doc["tensors"], doc["digest_only"], doc["keep"]) == (18, 60, {"policy": "custom"})
    assert doc["kinds"] == {"gdn.conv_state": {"data": 9, "digest_only": 18},
                            "gdn.ssm_state": {"data": 9, "digest_only": 18},
                            "attn.k": {"data": 0, "digest_only": 12}, "attn.v": {"data": 0, "digest_only": 12}}
    # positions come from digest rows too: request 3 resumed at 48, K/V from 32
    assert doc["positions"]["3"] == [32, 48, 64, 80]
    assert doc["sizes"]["raw_bytes"] == 9 * 32768 + 9 * 1536  # the kept resumed SSM (fp32) and conv (bf16) states


def test_inspect_shows_the_recorded_keep_policy(tmp_path):
    t = write_trace(tmp_path / "t.h5", "hit", keep=resumed,
                    keep_run=KEEP | {"focus": {"request": 2, "position": 80, "layers": [1]}})
    r = run("inspect", t)
    assert ("keep policy: hits, focus request=2,position=80,layers=1; kept 18 tensors (301.5 KiB), "
            "60 digest only") in r.stdout
    t = write_trace(tmp_path / "b.h5", "hit", keep=resumed,
                    keep_run=KEEP | {"policy": "budget", "budget_bytes": 500 << 20})
    assert "keep policy: budget (500.00 MiB); kept 18 tensors" in run("inspect", t).stdout


def test_inspect_of_a_trace_without_summaries_is_unchanged(traces):
    r = run("inspect", traces["v1"])
    assert "format: statediff.trace v1, complete" in r.stdout
    assert "captured: 136 tensors\n" in r.stdout
    assert "keep policy: not recorded (a trace recorded before format version 3)" in r.stdout
    doc = json.loads(run("inspect", "--json", traces["v1"]).stdout)
    assert (doc["tensors"], doc["digest_only"], doc["keep"]) == (136, 0, None)
    assert doc["kinds"]["attn.k"] == {"data": 17, "digest_only": 0}


def test_compare_json_names_the_focus_and_the_commands(traces):
    r = run("compare", "--json", traces["hit"], traces["cold"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["focus"] == {"request": 2, "position": 80, "layers": []}
    assert doc["first"]["data"] == {"hit": True, "cold": False}
    assert doc["focus_commands"] == [
        "statediff record agent.jsonl --exact --mode hit -o hit-focus.h5 --focus request=2,position=80 "
        f"--focus-check {traces['hit']}",
        "statediff record agent.jsonl --exact --mode cold -o cold-focus.h5 --focus request=2,position=80 "
        f"--focus-check {traces['cold']}"]
    assert doc["diagnosis"]["finding"] == "other_position" and doc["diagnosis"]["match_position"] == 64
    assert (doc["digests"]["pairs"], doc["digests"]["by_digest"], doc["digests"]["identical"]) == (78, 78, 69)
    text = run("compare", traces["hit"], traces["cold"]).stdout
    assert "  the root has no data in the cold trace (recorded digest only); record it again keeping data " \
           "around it (--focus request=2,position=80), both runs:" in text


def test_calibrate_says_digest_only_tensors_were_not_calibrated(traces):
    out = traces["dir"] / "noise.json"
    r = run("calibrate", traces["cold"], traces["cold_b"], "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [
        "statediff: warning: 272 tensors recorded as a digest only (no data) were not calibrated: record both "
        "cold runs with --keep all to calibrate them"]
    assert "warning" not in r.stdout
    assert json.loads(out.read_text())["envelopes"] == []
