"""`statediff check` without an engine: the runs it would record, and the inputs it refuses
before the first engine starts (one line, exit 2, nothing left behind)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff_hooks.check import CheckOptions, RecordFailed
from statediff_hooks.cli.record import argv_from_options, options_from_argv
from statediff_hooks.recording import RecordingOptions


@pytest.fixture
def no_record(monkeypatch):
    """Replace the recording subprocess (the only way `check` starts vLLM) by one that keeps its options."""
    calls = []

    def fake(options, timeout):
        calls.append(options)
        raise RecordFailed(2)

    monkeypatch.setattr("statediff_hooks.check.record_in_subprocess", fake)
    return calls


def check(*args: str):
    return CliRunner().invoke(cli, ["check", *args])


def test_split_form_runs_are_the_record_commands_of_the_split_form(tmp_path):
    base = RecordingOptions(output="", mode="hit", model="tiny", block_size=32, fault="ssm-bf16:layer=2")
    o = CheckOptions(output_dir=str(tmp_path / "d"), base=base)
    hit, cold = o.run_options("hit"), o.run_options("cold")
    assert (hit.mode, hit.exact, hit.exact_split, hit.split_like, hit.fault) == (
        "hit", False, True, None, "ssm-bf16:layer=2")
    assert (cold.mode, cold.exact, cold.exact_split, cold.split_like, cold.fault) == (
        "cold", False, True, str(tmp_path / "d" / "hit.h5"), "")
    assert argv_from_options(cold) == [
        "--output", str(tmp_path / "d" / "cold.h5"), "--mode", "cold", "--exact-split",
        "--split-like", str(tmp_path / "d" / "hit.h5"), "--block-size", "32", "--overwrite"]
    back = options_from_argv(argv_from_options(cold))
    assert back.__class__(**{**back.__dict__, "record_argv": None}) == cold


def test_exact_selects_one_block_per_step_in_both_runs(tmp_path):
    o = CheckOptions(output_dir=str(tmp_path), base=RecordingOptions(output="", mode="hit"), exact=True)
    for mode in ("hit", "cold"):
        r = o.run_options(mode)
        assert (r.exact, r.exact_split, r.split_like) == (True, False, None)


@pytest.mark.parametrize("args,line", [
    (["--fault", "bogus"], "--fault: unknown fault 'bogus'; known: conv-zero, drafter-kv-zero, drafter-perturb, "
                           "drafter-shift, "
                           "group-shortfall, kv-stale, kv-swap, logits, recycled-slot, ssm-bf16, ssm-nan, "
                           "ssm-wrong-block"),
    (["--keep", "xyz"], "--keep 'xyz': expected hits, all, none or a byte budget such as 500MB or 2GiB"),
    (["--focus", "request=1,position=448"], "No such option '--focus'. (see 'statediff --help')"),
])
def test_bad_options_are_refused_before_any_engine_and_leave_no_directory(tmp_path, no_record, args, line):
    out = tmp_path / "d"
    r = check(*args, "-o", str(out))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line}"])
    assert no_record == [] and not out.exists()


def test_a_directory_that_holds_files_needs_overwrite(tmp_path, no_record):
    (tmp_path / "hit.h5").write_text("earlier")
    r = check("-o", str(tmp_path))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: -o {tmp_path}: the directory is not empty (give --overwrite to replace its check files)"])
    assert (tmp_path / "hit.h5").read_text() == "earlier" and no_record == []


def test_a_file_as_directory_is_refused(tmp_path, no_record):
    f = tmp_path / "f"
    f.write_text("x")
    r = check("-o", str(f))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: Invalid value for '-o' / '--output': Directory '{f}' is a file. (see 'statediff --help')"])


def test_a_missing_parent_is_refused(tmp_path, no_record):
    out = tmp_path / "no" / "d"
    r = check("-o", str(out))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: -o {out}: cannot create it (its parent {tmp_path / 'no'} is missing or not writable)"])


def test_the_hit_run_is_recorded_first_after_every_check(tiny_model, tmp_path, no_record):
    """With the model and conversation checked, the first engine is the hit run's, in the split form;
    a recording that fails stops check with exit 2 (its own line was printed by it)."""
    out = tmp_path / "d"
    r = check("--model", str(tiny_model), "--block-size", "32", "-o", str(out))
    assert r.exit_code == 2
    assert [(o.mode, o.exact_split, o.output) for o in no_record] == [("hit", True, str(out / "hit.h5"))]
    assert r.stderr.splitlines() == [f"[1/3] hit run (the engine's own chunking) -> {out / 'hit.h5'}"]


def test_engine_arguments_are_checked_before_the_hit_run(tiny_model, tmp_path, no_record):
    out = tmp_path / "d"
    r = check("--model", str(tiny_model), "--engine-arg", "oops", "-o", str(out))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: --engine-arg 'oops': expected KEY=VALUE (VALUE as JSON or text)"])
    assert no_record == [] and not out.exists()
