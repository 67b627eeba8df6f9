"""statediff.replay.command: every ``statediff record`` line a report, a bundle or compare prints."""

from __future__ import annotations

from statediff.replay.command import FOCUS_DROPPED, focus_lines, rebuilt_words, record_line, record_words, speculative

SWEEP = {"mode": "cold", "model": "m", "block_size": 64, "replay": "exact", "exact_form": "split",
         "conversation": "builtin:sweep-boundaries", "sampling": {"max_tokens": 4}}


def test_rebuilt_record_line_for_an_exact_split_sweep():
    line = record_line(dict(SWEEP), "cold", "cold.h5", split_like="hit.h5")
    assert not line.exact
    assert line.text == ("statediff record --sweep-boundaries --model m --block-size 64 --exact-split --max-tokens 4 "
                         "--mode cold --split-like hit.h5 -o cold.h5")


def test_a_replay_file_replaces_the_sweep_and_its_max_tokens():
    run = dict(SWEEP, record_argv=["--exact-split", "--model", "m", "--max-tokens", "4", "--sweep-boundaries"])
    line = record_line(run, "cold", "cold.h5", replay_file="b/replay.jsonl")
    assert line.exact and line.text == "statediff record b/replay.jsonl --exact-split --model m --mode cold -o cold.h5"
    conv = {"conversation": "agent.jsonl", "mode": "hit", "record_argv": ["agent.jsonl", "--max-tokens", "8", "--exact"]}
    assert record_line(conv, "hit", "hit.h5", replay_file="r.jsonl").text == (
        "statediff record r.jsonl --exact --mode hit -o hit.h5")


def test_the_stored_command_line_is_used_as_stored_unless_focused():
    run = {"record_argv": ["c.jsonl", "--keep", "hits", "--focus=request=1,position=2", "--focus-check", "x.h5",
                           "--exact"], "model": "ignored"}
    assert record_words(run) == (run["record_argv"], True)
    assert record_words(run, FOCUS_DROPPED) == (["c.jsonl", "--exact"], True)
    assert record_line(run, "hit", "hit.h5").text == (
        "statediff record c.jsonl --keep hits --focus=request=1,position=2 --focus-check x.h5 --exact "
        "--mode hit -o hit.h5")
    assert record_words({"record_argv": "c.jsonl --exact", "model": "m"}) == (
        ["CONVERSATION.jsonl", "--model", "m"], False)  # not a list of words: rebuilt


def test_focus_lines_replace_keep_and_focus_and_check_the_traces_compared():
    hit = {"record_argv": ["c.jsonl", "--exact-split", "--keep", "none"]}
    cold = {"record_argv": ["c.jsonl", "--exact-split", "--keep", "none"], "exact_form": "split"}
    lines = focus_lines(hit, cold, {"request": 1, "position": 448, "layers": [3, 7]}, ("h.h5", "c d.h5"))
    assert [line.text for line in lines] == [
        "statediff record c.jsonl --exact-split --mode hit -o hit-focus.h5 --focus request=1,position=448,layers=3/7 "
        "--focus-check h.h5",
        "statediff record c.jsonl --exact-split --mode cold --split-like hit-focus.h5 -o cold-focus.h5 "
        "--focus request=1,position=448,layers=3/7 --focus-check 'c d.h5'"]
    assert all(line.exact for line in lines)
    rebuilt = focus_lines({"mode": "hit", "conversation": "a.jsonl", "model": "m"}, {}, {"request": 0, "position": 32})
    assert [(line.text, line.exact) for line in rebuilt] == [
        ("statediff record a.jsonl --model m --mode hit -o hit-focus.h5 --focus request=0,position=32", False),
        ("statediff record CONVERSATION.jsonl --mode cold -o cold-focus.h5 --focus request=0,position=32", False)]


def test_rebuilt_words_name_the_engine_configuration():
    run = {"mode": "hit", "conversation": "c.jsonl", "model": "m", "dtype": "bfloat16", "block_size": 32, "seed": 1,
           "enforce_eager": True, "replay": "default", "max_num_batched_tokens": 512, "kv_cache_dtype": "fp8",
           "quantization": "fp8", "speculative_method": "eagle3", "num_speculative_tokens": 3,
           "drafter": {"model": "d"}, "fault": {"spec": "ssm-bf16:layer=2"}, "capture": {"kv": "none"}}
    assert rebuilt_words(run) == [
        "c.jsonl", "--model", "m", "--dtype", "bfloat16", "--block-size", "32", "--seed", "1", "--enforce-eager",
        "--max-num-batched-tokens", "512", "--engine-arg", "kv_cache_dtype=fp8", "--engine-arg", "quantization=fp8",
        "--speculative-config", '{"method": "eagle3", "model": "d", "num_speculative_tokens": 3}',
        "--fault", "ssm-bf16:layer=2", "--kv", "none"]


def test_speculative_reads_the_method_or_the_drafter_record():
    assert speculative({"speculative_method": "none"}) == (None, None, False)
    assert speculative({"drafter": {"method": "mtp", "num_speculative_tokens": 2}}) == ("mtp", 2, True)
    assert speculative({"speculative_method": "eagle3", "num_speculative_tokens": 4}) == ("eagle3", 4, True)
