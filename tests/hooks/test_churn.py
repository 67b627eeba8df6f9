"""The churn replay without an engine: the conversation ``statediff.replay.churn`` writes, and
``record --num-gpu-blocks-override`` passed to the engine or refused in one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.errors import StatediffError
from statediff.replay.churn import churn_lines, main
from statediff_hooks.drivers.record import RecordingOptions, engine_arguments, replay_on_transformers


def test_the_churn_conversation_sends_its_prefix_around_a_pressure_request():
    lines = churn_lines()
    assert [d["id"] for d in lines] == ["prefix", "pressure", "prefix-again", "prefix-hit"]
    ids = [d["prompt_token_ids"] for d in lines]
    assert [len(p) for p in ids] == [384 + 42, 7 * 128 + 1, 384 + 52, 384 + 62]
    assert ids[0][:384] == ids[2][:384] == ids[3][:384]
    assert ids[0][384] != ids[2][384] != ids[3][384]  # each send of the prefix continues differently
    blocks = [{tuple(p[i:i + 128]) for i in range(0, len(p) - 127, 128)} for p in ids]
    assert not blocks[1] & blocks[0]  # the pressure request shares no block with the prefix
    assert all(10 <= t < 1000 for p in ids for t in p) and {d["max_tokens"] for d in lines} == {4}
    assert [len(d["prompt_token_ids"]) for d in churn_lines(16, 2, 3, 1)] == [37, 49, 47, 57]
    with pytest.raises(ValueError, match="prefix_blocks must be an integer >= 1, not 0"):
        churn_lines(prefix_blocks=0)


def test_the_module_writes_jsonl_or_says_why_not(tmp_path, capsys):
    out = tmp_path / "churn.jsonl"
    assert main([str(out), "--block-size", "16"]) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == churn_lines(16)
    assert main([str(out), "--pressure-blocks", "0"]) == 2
    assert capsys.readouterr().err == "statediff: error: pressure_blocks must be an integer >= 1, not 0\n"


def test_the_pool_size_reaches_the_engine_arguments():
    kw = engine_arguments(RecordingOptions(output="x.h5", mode="hit", num_gpu_blocks_override=16), "/m", 1024)
    assert kw["num_gpu_blocks_override"] == 16
    assert "num_gpu_blocks_override" not in engine_arguments(RecordingOptions(output="x.h5", mode="hit"), "/m", None)


@pytest.mark.parametrize("options,line", [
    (dict(num_gpu_blocks_override=0), "--num-gpu-blocks-override 0: expected an integer >= 1 (KV-cache blocks)"),
    (dict(num_gpu_blocks_override=16, engine_args=("num_gpu_blocks_override=8",)),
     "--num-gpu-blocks-override and --engine-arg num_gpu_blocks_override=...: give one"),
])
def test_a_bad_pool_size_is_refused_before_the_engine(options, line):
    with pytest.raises(StatediffError) as e:
        engine_arguments(RecordingOptions(output="x.h5", mode="hit", **options), "/m", 1024)
    assert str(e.value) == line


def test_the_pool_size_is_vllm_only():
    with pytest.raises(StatediffError) as e:
        replay_on_transformers(RecordingOptions(output="x.h5", mode="hit", engine="transformers",
                                                num_gpu_blocks_override=16), None, None)
    assert str(e.value) == "--num-gpu-blocks-override is not supported with --engine transformers"


def test_the_command_line_refuses_a_pool_below_one_block(tmp_path):
    r = CliRunner().invoke(cli, ["record", "--mode", "hit", "-o", str(tmp_path / "x.h5"),
                                 "--num-gpu-blocks-override", "0"])
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: Invalid value for '--num-gpu-blocks-override': 0 is not in the range x>=1. "
        "(see 'statediff --help')"])
