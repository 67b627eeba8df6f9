"""`statediff record --keep / --focus / --focus-check`: checked before any engine starts
(one stderr line, exit 2), handed to the replay, left out of the reproduce command;
the digest check of a re-record (``refocus.check_replay``) on synthetic traces."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.trace import open_trace
from statediff_hooks.recording.keep import Focus, KeepSpec
from statediff_hooks.recording.refocus import check_replay

from no_engine import no_engine  # noqa: F401  the fixture
from synth import Fault, write_trace

pytestmark = pytest.mark.engine  # test_the_keep_policy_reaches_engine_processes_through_the_environment imports the recorder (torch)


@pytest.fixture
def conv(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": list(range(3, 103)), "max_tokens": 8}) + "\n"
                    + json.dumps({"prompt_token_ids": list(range(3, 203)), "max_tokens": 8}) + "\n")
    return path


def record(tiny_model, conv, tmp_path, *args: str, mode: str = "hit"):
    return CliRunner().invoke(cli, ["record", str(conv), "--model", str(tiny_model), "--mode", mode,
                                    "-o", str(tmp_path / "x.h5"), *args])


def compare_doc(tmp_path, hit="hit.h5", cold="cold.h5", **kw) -> str:
    doc = {"statediff": "compare", "hit": {"path": str(hit)}, "cold": {"path": str(cold)},
           "first": {"request": 1, "position": 48, "layer": 1, "kind": "gdn.ssm_state"},
           "roots": [{"request": 1, "position": 48, "layer": 1, "kind": "gdn.ssm_state"}]} | kw
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("args,message", [
    (["--keep", "lots"], "--keep 'lots': expected hits, all, none or a byte budget such as 500MB or 2GiB"),
    (["--keep", "0MB"], "--keep '0MB': expected hits, all, none or a byte budget such as 500MB or 2GiB"),
    (["--keep", "all", "--focus", "request=1,position=48"],
     "--focus chooses what is kept: combine it with --keep hits (default) or a byte budget, not --keep all"),
    (["--focus", "request=1"], "--focus: 'request=1': expected request=R,position=P[,layers=L1/L2]"),
    (["--focus", "request=1,position=-4"], "--focus: 'request=1,position=-4': position=-4 must be a "
                                           "non-negative integer"),
    (["--focus-check", "old.h5"], "--focus-check goes with --focus (it checks a focused re-record)"),
    (["--focus", "request=2,position=48"], "--focus request 2: {conv} has 2 requests (0..1)"),
    (["--focus", "request=1,position=209"], "--focus position 209: request 1 of {conv} ends by token 208 "
                                            "(prompt 200 + max_tokens)"),
])
def test_bad_keep_and_focus_options_are_one_line_before_the_engine(tiny_model, conv, tmp_path, no_engine,
                                                                   args, message):
    r = record(tiny_model, conv, tmp_path, *args)
    assert r.exit_code == 2
    assert r.stderr.splitlines() == ["statediff: error: " + message.format(conv=conv)]
    assert no_engine == [] and not (tmp_path / "x.h5").exists()


def test_bad_compare_results_are_one_line_before_the_engine(tiny_model, conv, tmp_path, no_engine):
    missing = tmp_path / "none.json"
    r = record(tiny_model, conv, tmp_path, "--focus", str(missing))
    assert r.stderr.splitlines() == [f"statediff: error: --focus {missing}: cannot read it (No such file or "
                                     "directory); expected RESULT.json or request=R,position=P[,layers=L1/L2]"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = record(tiny_model, conv, tmp_path, "--focus", str(bad))
    assert r.exit_code == 2 and r.stderr.startswith(f"statediff: error: --focus {bad}: not JSON (")
    same = compare_doc(tmp_path, first=None, roots=[])
    r = record(tiny_model, conv, tmp_path, "--focus", same)
    assert r.stderr.splitlines() == [f"statediff: error: --focus {same}: the compare result has no divergence "
                                     "to focus on (verdict: same)"]
    gone = compare_doc(tmp_path, hit=tmp_path / "gone.h5")
    r = record(tiny_model, conv, tmp_path, "--focus", gone)
    assert r.exit_code == 2 and r.stderr.startswith("statediff: error: the earlier trace to check the replay "
                                                    f"against: {tmp_path / 'gone.h5'}")
    assert no_engine == []


def test_the_reference_trace_must_be_of_the_same_mode(tiny_model, conv, tmp_path, no_engine):
    cold = write_trace(tmp_path / "cold.h5", "cold")
    r = record(tiny_model, conv, tmp_path, "--focus", "request=1,position=48", "--focus-check", str(cold))
    assert r.stderr.splitlines() == [f"statediff: error: {cold} is a cold-mode trace; a --mode hit re-record is "
                                     "checked against the hit-mode trace (--focus-check OLD.h5)"]
    r = record(tiny_model, conv, tmp_path, "--focus", "request=1,position=48", "--focus-check", str(cold),
               "-o", str(cold), "--overwrite", mode="cold")
    assert r.stderr.splitlines() == [f"statediff: error: --focus-check {cold} is the output: write the "
                                     "re-record elsewhere"]
    assert no_engine == []


def test_keep_and_focus_reach_the_replay_but_not_the_reproduce_command(tiny_model, conv, tmp_path, no_engine):
    hit = write_trace(tmp_path / "hit.h5", "hit")
    result = compare_doc(tmp_path, hit=hit.name)  # relative: found next to RESULT.json
    r = record(tiny_model, conv, tmp_path, "--keep", "2GiB", "--focus", result, "--exact")
    assert r.exit_code == 2 and r.stderr.splitlines() == ["statediff: error: engine would start here"]
    (call,) = no_engine
    assert call["keep"] == KeepSpec("budget", 2 << 30, Focus(1, 48, None))
    assert call["run_extra"]["record_argv"] == [str(conv), "--exact", "--model", str(tiny_model)]
    r = record(tiny_model, conv, tmp_path)
    assert no_engine[1]["keep"] == KeepSpec("hits")


def test_help_says_when_record_exits_1():
    r = CliRunner().invoke(cli, ["record", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "1 a focused re-record (--focus) whose digests differ from the earlier trace's" in text
    assert "--keep hits|all|none|BYTES" in text


def test_check_replay_counts_equal_digests_and_names_the_first_difference(tmp_path):
    a = write_trace(tmp_path / "a.h5", "hit", keep="all")
    b = write_trace(tmp_path / "b.h5", "hit", keep="none")
    c = write_trace(tmp_path / "c.h5", "hit", keep="none", faults=[Fault("zero_conv", 1, 2)])
    with open_trace(a) as t:
        n = len(t.entries)
    same = check_replay(str(b), str(a))
    assert same.identical and same.equal == same.total == n == 78
    assert same.to_text() == f"replay identical to {a}: {same.total} of {same.total} digests equal"
    diff = check_replay(str(c), str(a))
    assert diff.first == (1, 48, 2, "gdn.conv_state") and diff.why == "digest differs"
    assert diff.to_text().startswith(f"replay differs from {a}: first at request 1 position 48 layer 2 "
                                     "gdn.conv_state (digest differs; ")
    # a trace without summaries (format before version 3): digested from its data
    old = write_trace(tmp_path / "old.h5", "hit")
    assert check_replay(str(b), str(old)).identical


def test_the_keep_policy_reaches_engine_processes_through_the_environment():
    from statediff_hooks.recording.config import RecorderConfig

    cfg = RecorderConfig(trace="t.h5", mode="hit", keep=KeepSpec("budget", 500_000_000, Focus(1, 448, (0, 3))))
    env = cfg.to_env()
    assert (env["STATEDIFF_KEEP"], env["STATEDIFF_FOCUS"]) == (
        "500000000", '{"request": 1, "position": 448, "layers": [0, 3]}')
    assert RecorderConfig.from_env(env).keep == cfg.keep
    assert RecorderConfig.from_env({"STATEDIFF_TRACE": "t.h5"}).keep == KeepSpec("hits")
    with pytest.raises(ValueError, match="STATEDIFF_FOCUS: request must be a non-negative integer"):
        RecorderConfig.from_env({"STATEDIFF_TRACE": "t.h5", "STATEDIFF_FOCUS": '{"request": -1, "position": 0}'})


def test_a_re_record_with_other_arguments_than_the_reference_is_refused_before_the_engine(
        tiny_model, conv, tmp_path, no_engine):
    argv = [str(conv), "--exact", "--model", str(tiny_model)]
    hit = write_trace(tmp_path / "hit.h5", "hit", record_argv=argv)
    r = record(tiny_model, conv, tmp_path, "--focus", "request=1,position=48", "--focus-check", str(hit))
    assert r.exit_code == 2 and r.stderr.splitlines() == [
        f"statediff: error: --focus-check {hit} was recorded with other arguments ('--exact --model' where "
        f"this command has '--model {tiny_model}'): a focused re-record must replay the same run; use: "
        f"statediff record {conv} --exact --model {tiny_model} --mode ... -o ... --focus ... --focus-check {hit}"]
    assert no_engine == []
    r = record(tiny_model, conv, tmp_path, "--focus", "request=1,position=48", "--focus-check", str(hit), "--exact")
    assert r.stderr.splitlines() == ["statediff: error: engine would start here"]


def test_focus_layers_outside_the_model_are_refused_before_the_engine(tiny_model, conv, tmp_path, no_engine):
    r = record(tiny_model, conv, tmp_path, "--focus", "request=1,position=48,layers=1/99")
    assert r.exit_code == 2 and r.stderr.splitlines() == [
        "statediff: error: --focus layers 99: the model has layers 0..3"]
    assert no_engine == []
