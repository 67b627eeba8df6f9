"""``statediff_hooks.drivers.record``: one recording as a library call (``RecordingOptions`` ->
``make_recording`` -> ``RecordingResult``), and ``statediff record``'s words to options and back."""

from __future__ import annotations

import dataclasses
import json

import click
import pytest

from statediff.errors import StatediffError
from statediff_hooks.cli.record import argv_from_options, options_from_argv, record, recorded_argv
from statediff_hooks.drivers.record import RecordingOptions, RecordingResult, Replayed, make_recording
from statediff_hooks.recording.refocus import ReplayCheck

from no_engine import no_engine  # noqa: F401  the fixture


def test_every_record_option_is_a_field_with_the_same_default():
    fields = {f.name: f.default for f in dataclasses.fields(RecordingOptions)}
    ctx = click.Context(record)
    for p in record.params:
        name = "progress" if p.name == "no_progress" else p.name
        assert name in fields, p.name
        if p.required:
            continue
        default = p.get_default(ctx)
        if not isinstance(default, (str, int, bool, type(None))):  # click's "unset"
            default = () if p.multiple else None
        want = (not default) if p.name == "no_progress" else default
        assert fields[name] == want, p.name
    assert set(fields) - {"progress" if p.name == "no_progress" else p.name for p in record.params} == {"record_argv"}


def test_words_to_options_and_back():
    words = ["c.jsonl", "--mode", "cold", "-o", "x.h5", "--exact-split", "--split-like", "h.h5",
             "--engine-arg", "a=1", "--engine-arg", "b=[2]", "--no-progress", "--keep", "all", "--block-size", "32"]
    o = options_from_argv(words)
    assert (o.conversation, o.mode, o.output, o.exact_split, o.split_like) == ("c.jsonl", "cold", "x.h5", True, "h.h5")
    assert (o.engine_args, o.progress, o.keep, o.block_size, o.model) == (("a=1", "b=[2]"), False, "all", 32, "tiny")
    assert o.record_argv == ("c.jsonl", "--exact-split", "--block-size", "32", "--engine-arg", "a=1",
                             "--engine-arg", "b=[2]")
    assert options_from_argv(argv_from_options(o)) == o
    assert recorded_argv(o) == list(o.record_argv)
    assert argv_from_options(RecordingOptions(output="y.h5", mode="hit")) == ["--output", "y.h5", "--mode", "hit"]
    with pytest.raises(click.UsageError, match="Missing parameter: mode"):
        options_from_argv(["-o", "x.h5"])


def test_the_run_metadata_every_recording_adds():
    assert RecordingOptions(output="o.h5", mode="hit").run_extra() == {"conversation": "builtin:demo"}
    o = RecordingOptions(output="o.h5", mode="hit", conversation="c.jsonl", record_argv=("c.jsonl", "--exact"))
    assert o.run_extra() == {"conversation": "c.jsonl", "record_argv": ["c.jsonl", "--exact"]}


@pytest.mark.parametrize("change,message", [
    ({"fault": "ssm-sideways"}, "--fault: unknown fault 'ssm-sideways'; known: "),
    ({"sweep_boundaries": True, "conversation": "c.jsonl"},
     "--sweep-boundaries generates the replay: give it or CONVERSATION, not both"),
    ({"focus_check": "old.h5"}, "--focus-check goes with --focus (it checks a focused re-record)"),
    ({"model": "{tmp}/none"}, "--model {tmp}/none: no such directory"),
])
def test_refused_before_the_engine_without_click(tmp_path, no_engine, change, message):
    change = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in change.items()}
    with pytest.raises(StatediffError) as e:
        make_recording(RecordingOptions(output=str(tmp_path / "x.h5"), mode="hit", **change))
    assert str(e.value).startswith(message.format(tmp=tmp_path))
    assert no_engine == [] and not (tmp_path / "x.h5").exists()


def test_an_existing_output_is_refused_unless_overwrite(tmp_path, no_engine):
    out = tmp_path / "x.h5"
    out.write_bytes(b"old")
    with pytest.raises(StatediffError, match="exists"):
        make_recording(RecordingOptions(output=str(out), mode="hit", model=str(tmp_path / "none")))
    with pytest.raises(StatediffError, match="no such directory"):  # overwrite: the next check speaks
        make_recording(RecordingOptions(output=str(out), mode="hit", model=str(tmp_path / "none"), overwrite=True))


def test_the_replay_gets_the_checked_prompts_and_engine_arguments(tiny_model, tmp_path, no_engine):
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"prompt_token_ids": [5] * 300, "max_tokens": 40}) + "\n")
    opts = RecordingOptions(output=str(tmp_path / "x.h5"), mode="cold", conversation=str(conv),
                            model=str(tiny_model), block_size=32, engine_args=("gpu_memory_utilization=0.5",),
                            exact=True, record_argv=(str(conv), "--exact"))
    with pytest.raises(StatediffError, match="engine would start here"):
        make_recording(opts)
    call = no_engine[0]
    assert call["prompts"] == [[5] * 300] and call["mode"] == "cold" and call["exact"] is True
    assert call["kw"] | {"model": "M"} == {"model": "M", "dtype": "bfloat16", "enable_prefix_caching": True,
                                          "enforce_eager": False, "seed": 0, "block_size": 32,
                                          "max_model_len": 352, "gpu_memory_utilization": 0.5}
    assert call["run_extra"] == {"conversation": str(conv), "record_argv": [str(conv), "--exact"]}
    # the engine log was opened for the replay; the refusal wrote nothing to it, so none is left (issue 19)
    assert not (tmp_path / "x.h5.log").exists()


def _result(check=None, kept=None) -> RecordingResult:
    replayed = Replayed("recorded 2 requests (hit, default chunking, block size 32) to o.h5 in 1.0 s", (),
                        {"tensors": 10, "bytes_raw": 2_500_000, "bytes_file": 1_200_000}, None)
    return RecordingResult(RecordingOptions(output="o.h5", mode="hit"), replayed,
                           ("  request 0: hit 0 of 0 expected",), kept, check)


def test_the_lines_record_prints_and_the_exit_code():
    assert _result().lines() == ["recorded 2 requests (hit, default chunking, block size 32) to o.h5 in 1.0 s",
                                 "  request 0: hit 0 of 0 expected", "  tensors: 10, raw 2.5 MB, file 1.2 MB"]
    kept = {"policy": "hits", "kept_tensors": 4, "kept_bytes": 1_000_000, "digest_only_tensors": 6,
            "focus": {"request": 1, "position": 48, "layers": None}}
    same = _result(ReplayCheck("old.h5", 10, 10), kept)
    assert same.lines()[-2:] == ["  kept: 4 tensors with data (1.0 MB raw), 6 digest only (--keep hits, focus "
                                 "request=1,position=48)",
                                 "replay identical to old.h5: 10 of 10 digests equal"]
    assert same.exit_code == 0 and _result().exit_code == 0
    assert _result(ReplayCheck("old.h5", 10, 9, (1, 48, 0, "gdn.conv_state"), "digest differs")).exit_code == 1
