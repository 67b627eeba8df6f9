"""Offline refusals of issue 19: outputs kept without --overwrite, the same file twice,
an option calibrate does not have, warnings on stderr."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from synth import write_trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    return {"cold": write_trace(d / "cold.h5", "cold"), "cold_b": write_trace(d / "cold-b.h5", "cold", noise_seed=1),
            "hit": write_trace(d / "hit.h5", "hit"),
            "other": write_trace(d / "other.h5", "cold", architecture="Qwen3_5ForCausalLM"), "dir": d}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_an_existing_output_needs_overwrite(traces, tmp_path, command):
    out = tmp_path / "out"
    out.write_text("earlier")
    a, b = (traces["cold"], traces["cold_b"]) if command == "calibrate" else (traces["hit"], traces["cold"])
    r = run(command, a, b, "-o", out)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {out} already exists (use --overwrite to replace it)"])
    assert out.read_text() == "earlier"
    r = run(command, a, b, "-o", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert out.read_text() != "earlier"


def test_calibrate_refuses_the_same_file_twice(traces, tmp_path):
    r = run("calibrate", traces["cold"], traces["cold"], "-o", tmp_path / "n.json")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {traces['cold']} and {traces['cold']} are the same file: give two cold runs "
        "recorded apart"])
    assert not (tmp_path / "n.json").exists()


def test_calibrate_suggests_nothing_it_does_not_have(traces, tmp_path):
    r = run("calibrate", traces["cold"], traces["other"], "-o", tmp_path / "n.json")
    assert r.exit_code == 2
    (line,) = r.stderr.splitlines()
    assert line.endswith("different model or config (calibrate two cold runs of the same model and config)")
    assert "--allow-engine-mismatch" not in line


def test_calibrate_refuses_a_hit_run(traces, tmp_path):
    """A hit run cannot calibrate noise (its differences from a cold run are what compare judges);
    this used to be a warning and a noise file."""
    r = run("calibrate", traces["hit"], traces["cold"], "-o", tmp_path / "n.json")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {traces['hit']} is a hit run (mode hit): calibration needs two cold runs "
        "('statediff record --mode cold', recorded apart)"])
    assert not (tmp_path / "n.json").exists()


def test_calibrate_refuses_byte_copies(traces, tmp_path):
    import shutil

    copy = tmp_path / "copy.h5"
    shutil.copyfile(traces["cold"], copy)
    r = run("calibrate", traces["cold"], copy, "-o", tmp_path / "n.json")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {traces['cold']} and {copy} are byte-identical copies of one trace: calibration "
        "needs two cold runs recorded apart (their differences are the noise)"])
    assert not (tmp_path / "n.json").exists()


def test_calibrate_warns_on_stderr(traces, tmp_path):
    """Request 3 of the second cold run kept as digests only (no data): calibrate says so on stderr, one
    line per warning, and leaves its report on stdout without them; --json puts them in the JSON."""
    digests = write_trace(traces["dir"] / "cold-digests.h5", "cold", noise_seed=1,
                          keep=lambda request, position, layer, kind, role: request != 3)
    expected = ["40 tensors recorded as a digest only (no data) were not calibrated: record both cold runs with "
                "--keep all to calibrate them", "40 tensors had no counterpart and were not calibrated"]
    r = run("calibrate", traces["cold"], digests, "-o", tmp_path / "n.json")
    assert (r.exit_code, r.stderr.splitlines()) == (0, [f"statediff: warning: {w}" for w in expected])
    assert r.stdout.startswith("calibrated 8 (layer, kind) envelopes from 96 pairs") and "warning" not in r.stdout
    r = run("calibrate", traces["cold"], digests, "-o", tmp_path / "j.json", "--json")
    assert (r.exit_code, r.stderr, json.loads(r.stdout)["warnings"]) == (0, "", expected)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_noise_factor_must_be_finite_and_above_zero(traces, value):
    r = run("compare", traces["hit"], traces["cold"], "--noise-factor", value)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: --noise-factor must be a finite number above 0, not {value}"])


@pytest.mark.parametrize("command", ["compare", "report", "extract"])
def test_noise_factor_without_noise_is_refused(traces, tmp_path, command):
    extra = ["-o", tmp_path / "b.zip"] if command == "extract" else []
    r = run(command, traces["hit"], traces["cold"], "--noise-factor", "8", *extra)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: --noise-factor 8 needs --noise NOISE.json: it multiplies the calibrated envelopes, "
        "and without --noise nothing would use it"])


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5"])
def test_extract_max_mb_must_be_finite_and_above_zero(traces, tmp_path, value):
    r = run("extract", traces["hit"], traces["cold"], "-o", tmp_path / "b.zip", "--max-mb", value)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: --max-mb must be a finite number of MB above 0, not {value}"])


def test_inspect_says_what_an_empty_field_means_where_the_run_says_it(tmp_path):
    hit = write_trace(tmp_path / "h.h5", "hit", speculative_method="none", num_speculative_tokens=None)
    out = run("inspect", hit).stdout.splitlines()
    assert "  cold_policy            none (a hit run: normal prefix caching)" in out
    assert "  num_speculative_tokens 0 (no drafter)" in out
    assert "  fault                  none (no planted fault)" in out
    assert "  quantization           unknown" in out  # not said by the run: stays unknown


def test_the_hit_summary_of_a_cold_run_expects_no_hit():
    from statediff.replay.hits import HitAccount, summary_lines

    fields = {f: None for f in HitAccount.__dataclass_fields__}
    a = HitAccount(**(fields | {"request": 0, "prompt_len": 10, "measured": 0, "expected": 0}))
    assert summary_lines([a], "cold")[-1] == "  no request hit the prefix cache, as expected"
    assert summary_lines([a], "hit")[-1] == "  every request resumed from the hit expected"


@pytest.mark.parametrize("where", ["/sys", "/proc"])
def test_extract_into_a_pseudo_file_system_is_one_line_before_any_work(traces, where):
    out = f"{where}/bundle.zip"
    r = run("extract", traces["hit"], traces["cold"], "-o", out)
    assert r.exit_code == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"statediff: error: cannot write bundle {out}: directory {where} is not writable (")
    assert "unexpected" not in line


def test_a_full_stdout_is_one_line(traces):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "statediff", "inspect", str(traces["hit"])], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        "statediff: error: cannot write the output: No space left on device"])


@pytest.mark.parametrize("engine,quant,shown", [("vllm", None, "none (unquantized)"),
                                                ("synthetic", "none", "none (unquantized)"),
                                                ("synthetic", None, "unknown"), ("vllm", "fp8", "fp8")])
def test_inspect_and_report_say_the_same_quantization(tmp_path, engine, quant, shown):
    """report said "none (unquantized)" where inspect said "unknown" for the same vLLM trace."""
    hit = write_trace(tmp_path / "h.h5", "hit", engine=engine, quantization=quant)
    cold = write_trace(tmp_path / "c.h5", "cold", engine=engine, quantization=quant)
    assert f"  quantization           {shown}" in run("inspect", hit).stdout.splitlines()
    report = run("report", hit, cold).stdout
    assert f"| quantization format | {shown} |" in report.splitlines()


@pytest.mark.parametrize("engine,method,shown", [("vllm", None, "none (no speculative decoding)"),
                                                 ("synthetic", "none", "none (no speculative decoding)"),
                                                 ("synthetic", None, "unknown")])
def test_inspect_and_report_say_the_same_speculative_method(tmp_path, engine, method, shown):
    run_fields = dict(engine=engine, speculative_method=method, num_speculative_tokens=None)
    hit = write_trace(tmp_path / "h.h5", "hit", **run_fields)
    cold = write_trace(tmp_path / "c.h5", "cold", **run_fields)
    lines = run("inspect", hit).stdout.splitlines()
    assert f"  speculative_method     {shown}" in lines
    assert f"  num_speculative_tokens {'unknown' if shown == 'unknown' else '0 (no drafter)'}" in lines
    assert f"| drafter method | {shown} |" in run("report", hit, cold).stdout.splitlines()
