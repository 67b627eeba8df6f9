"""The statediff CLI: exit codes, one-line errors, JSON, lazy plugin commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from click.testing import CliRunner

import statediff.cli as cli_mod
from statediff.cli import cli
from synth import Fault, write_trace

ROOT = Path(__file__).resolve().parents[2]
PREV_BLOCK = ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state "
              "one block earlier (position 64, 16 tokens), bit for bit")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {"cold": write_trace(d / "cold.h5", "cold"),
            "clean": write_trace(d / "clean.h5", "hit"),
            "fault": write_trace(d / "fault.h5", "hit", faults=[Fault("prev_block", 2, 1)]),
            "other_model": write_trace(d / "other.h5", "hit", architecture="Qwen3_5ForCausalLM"),
            "cold_b": write_trace(d / "cold-b.h5", "cold", noise_seed=1),
            "noisy": write_trace(d / "noisy.h5", "hit", noise_seed=2),
            "dir": d}


def run(*args: object, env: dict | None = None):
    return CliRunner(env=env).invoke(cli, [str(a) for a in args])


def one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("statediff: error: ") and fragment in lines[0], lines[0]


def test_compare_same_exits_0(traces):
    r = run("compare", traces["clean"], traces["cold"])
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0] == "SAME: no divergence beyond tolerance in 78 pairs"


def test_compare_fault_exits_1_with_diagnosis_first(traces):
    r = run("compare", traces["fault"], traces["cold"])
    assert r.exit_code == 1 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == PREV_BLOCK
    assert lines[1] == ("DIVERGED: first divergence at request 2, position 80, layer 1 "
                        "(model.layers.1.linear_attn), gdn.ssm_state")


def test_compare_json_is_one_object_with_the_same_root(traces):
    r = run("compare", "--json", traces["fault"], traces["cold"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert [doc["first"][k] for k in ("request", "position", "layer", "kind")] == [2, 80, 1, "gdn.ssm_state"]
    assert doc["diagnosis"]["text"] == PREV_BLOCK and doc["first"]["propagated"] == 8


def test_mismatched_models_exit_2_with_the_message(traces):
    r = run("compare", traces["other_model"], traces["cold"])
    one_line_error(r, "statediff: error: traces differ in architecture (hit 'Qwen3_5ForCausalLM', "
                      "cold 'Qwen3NextForCausalLM'): different model or config")
    r = run("compare", "--allow-engine-mismatch", traces["other_model"], traces["cold"])
    assert r.exit_code == 0 and "warning: engine mismatch allowed: architecture differs" in r.stdout


def test_bad_tol_and_usage_errors_are_one_line(traces):
    one_line_error(run("compare", "--tol", "attn.k", traces["fault"], traces["cold"]),
                   "--tol 'attn.k': expected PATTERN=ATOL,RTOL")
    one_line_error(run("compare", traces["fault"]), "Missing argument 'COLD'")
    one_line_error(run("compare", "--bogus", traces["fault"], traces["cold"]), "No such option")
    one_line_error(run("nosuchcommand"), "No such command")


def test_tol_rule_moves_the_first_divergence(traces):
    r = run("compare", "--json", "--tol", "gdn.ssm_state=1,1", traces["fault"], traces["cold"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1
    assert [doc["first"][k] for k in ("position", "layer", "kind")] == [96, 0, "gdn.conv_state"]
    assert doc["tolerance_policy"].endswith("--tol rules first: gdn.ssm_state=1,1")


def test_calibrate_then_compare_with_noise(traces):
    out = traces["dir"] / "noise.json"
    r = run("calibrate", traces["cold"], traces["cold_b"], "-o", out)
    assert r.exit_code == 0 and out.exists()
    assert r.stdout.startswith("calibrated 8 (layer, kind) envelopes from 136 pairs")
    assert run("compare", traces["noisy"], traces["cold"]).exit_code == 2  # between the noise bands: cannot judge
    r = run("compare", "--noise", out, traces["noisy"], traces["cold"])
    assert r.exit_code == 0, r.output
    assert f"tolerance: noise file {out}" in r.stdout
    one_line_error(run("compare", "--noise", traces["cold"], traces["noisy"], traces["cold"]),
                   "is not valid JSON")
    one_line_error(run("compare", "--noise", traces["dir"] / "missing.json", traces["noisy"], traces["cold"]),
                   "cannot read noise file")


def test_noise_in_exact_mode_refused(traces, tmp_path):
    out = traces["dir"] / "noise.json"
    run("calibrate", traces["cold"], traces["cold_b"], "-o", out, "--overwrite")
    hit = write_trace(tmp_path / "h.h5", "hit", replay="exact")
    cold = write_trace(tmp_path / "c.h5", "cold", replay="exact")
    assert run("compare", hit, cold).exit_code == 0
    one_line_error(run("compare", "--noise", out, hit, cold), "use --allow-noise-in-exact")


def test_inspect_text_and_json(traces):
    r = run("inspect", traces["fault"])
    assert r.exit_code == 0
    assert "format: statediff.trace v1, complete" in r.stdout
    assert "  quantization           unknown" in r.stdout
    assert "        2     106      80        80        8  req-2" in r.stdout  # cached, expected (hits.py)
    assert "  by kind: gdn.conv_state 27, gdn.ssm_state 27, attn.k 12, attn.v 12" in r.stdout
    doc = json.loads(run("inspect", "--json", traces["fault"]).stdout)
    assert doc["tensors"] == 78 and doc["partial"] is False
    assert doc["requests"][2]["num_cached_tokens"] == 80 and doc["positions"]["3"] == [32, 48, 64, 80]
    assert doc["sizes"]["raw_bytes"] == 27 * 32768 + 27 * 1536 + 24 * 4096  # ssm fp32, conv bf16, K/V bf16
    assert doc["sizes"]["ratio"] > 1.0


def test_plot_writes_a_png(traces, tmp_path):
    r = run("compare", "--plot", tmp_path / "err.png", traces["fault"], traces["cold"])
    assert r.exit_code == 1
    assert (tmp_path / "err.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line(traces, tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    one_line_error(run("compare", "--plot", tmp_path / "x.png", traces["fault"], traces["cold"]),
                   "--plot needs matplotlib")
    assert run("compare", traces["fault"], traces["cold"]).exit_code == 1  # the rest still works


def test_plugin_command_that_fails_to_load_says_what_to_install(traces, monkeypatch):
    eps = {"record": EntryPoint("record", "statediff_no_such_module:record", "statediff.commands")}
    monkeypatch.setattr(cli_mod, "_plugin_entry_points", lambda: eps)
    one_line_error(run("record", "--model", "x", "out.h5"),
                   "'statediff record' is unavailable: loading statediff_no_such_module:record failed "
                   "(No module named 'statediff_no_such_module'); it needs the engine side: pip install")
    r = run("--help")
    assert r.exit_code == 0
    assert "record needs torch and vLLM (statediff_no_such_module:record)" in " ".join(r.stdout.split())
    assert run("compare", traces["clean"], traces["cold"]).exit_code == 0


def test_plugin_command_is_loaded_lazily(monkeypatch):
    eps = {"hello": EntryPoint("hello", "click.testing:CliRunner", "statediff.commands")}
    monkeypatch.setattr(cli_mod, "_plugin_entry_points", lambda: eps)
    one_line_error(run("hello"), "is not a click command")


def test_unexpected_errors_are_one_line_unless_debug(traces, monkeypatch):
    import statediff.diff.compare

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(statediff.diff.compare, "compare", boom)
    r = run("compare", traces["clean"], traces["cold"])
    one_line_error(r, "unexpected RuntimeError: kaboom (set STATEDIFF_DEBUG=1 for a traceback)")
    r = run("compare", traces["clean"], traces["cold"], env={"STATEDIFF_DEBUG": "1"})
    assert isinstance(r.exception, RuntimeError)


# -- through a real process --------------------------------------------------------

def run_process(*args: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STATEDIFF_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "statediff", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("case", ["missing", "not_hdf5", "truncated"])
def test_bad_trace_files_exit_2_with_one_stderr_line(traces, tmp_path, case):
    bad = tmp_path / "bad.h5"
    fragment = {"missing": "bad.h5 does not exist", "not_hdf5": "is not an HDF5 file",
                "truncated": "bad.h5 is damaged"}[case]
    if case == "not_hdf5":
        bad.write_text("hello, not a trace\n")
    elif case == "truncated":
        data = Path(traces["fault"]).read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    p = run_process("compare", bad, traces["cold"])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("statediff: error: ") and fragment in lines[0], p.stderr
    assert p.stdout == ""


def test_process_exit_codes_for_same_and_divergent(traces):
    assert run_process("compare", traces["clean"], traces["cold"]).returncode == 0
    p = run_process("compare", "--json", traces["fault"], traces["cold"])
    assert p.returncode == 1 and json.loads(p.stdout)["exit_code"] == 1


def test_inspect_partial_recording(tmp_path):
    import time

    import numpy as np

    from statediff.trace.writer import TraceWriter
    from synth import run_meta

    w = TraceWriter(tmp_path / "t.h5", run_meta("hit"))
    w.begin_request(0, "req-0", [1, 2, 3])
    w.add(np.zeros((2, 2), np.float32), request=0, position=16, layer=0, kind="gdn.ssm_state",
          role="checkpoint", module="m", dtype="float32")
    w.end_step()  # a killed process leaves <trace>.parts/ with this step's segment
    deadline = time.monotonic() + 30
    while not list((tmp_path / "t.h5.parts").glob("seg-*.h5")) and time.monotonic() < deadline:
        time.sleep(0.01)
    r = run("inspect", tmp_path / "t.h5")
    assert r.exit_code == 0, r.output
    assert "format: statediff.trace v1, partial (recording did not finish" in r.stdout
    assert "  block_size             16" in r.stdout and "captured: 1 tensors" in r.stdout
    w.close()
