"""``statediff_hooks.recording.fields``: what both engine adapters record alike (no torch, no engine)."""

from __future__ import annotations

import hashlib
import json

import pytest

from statediff.errors import StatediffError
from statediff.replay.conversation import Turn
from statediff_hooks.recording.fields import (ROW_RULE, WINDOW, Acceptance, config_digest, conversation_digest, drafter_rows,
                                    keep_row, render_prompts)


class FakeTokenizer:
    """``apply_chat_template`` as transformers calls it: one id per message, 99 for the generation prompt."""

    def __init__(self) -> None:
        self.calls = []

    def apply_chat_template(self, messages, *, tools, add_generation_prompt, tokenize, return_dict):
        self.calls.append((len(messages), tools, add_generation_prompt, tokenize, return_dict))
        if messages[0]["content"] == "boom":
            raise ValueError("template error\nsecond line")
        ids = [len(m["content"]) for m in messages] + [99]
        return {"input_ids": ids} if len(messages) > 1 else ids


def test_prompts_are_given_ids_or_the_chat_template_with_a_generation_prompt():
    tok = FakeTokenizer()
    turns = [Turn(line=1, id="a", prompt_token_ids=[5, 6]),
             Turn(line=2, id="b", messages=[{"role": "user", "content": "four"}], tools=[{"t": 1}]),
             Turn(line=3, id="c", messages=[{"role": "user", "content": "xy"}, {"role": "user", "content": "z"}])]
    assert render_prompts(turns, tok) == [[5, 6], [4, 99], [2, 1, 99]]
    assert tok.calls == [(1, [{"t": 1}], True, True, False), (2, None, True, True, False)]


def test_a_failing_chat_template_names_the_line():
    turns = [Turn(line=7, id="x", messages=[{"role": "user", "content": "boom"}])]
    with pytest.raises(StatediffError, match=r"^c\.jsonl:7: the model's chat template failed on this request: "
                                             r"ValueError: template error$"):
        render_prompts(turns, FakeTokenizer(), "c.jsonl")


def test_digests_are_sha256_of_canonical_json():
    cfg = {"b": 1, "a": [1, 2], "torch_dtype": object}
    want = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    assert config_digest(cfg) == want and config_digest({"a": [1, 2], "b": 1}) != want
    assert conversation_digest([[1, 2], [3]]) == hashlib.sha256(b"[[1, 2], [3]]").hexdigest()


def test_drafter_row_rule():
    kept = [q for q in range(1, 100) if keep_row(q, 70, 32)]
    assert kept == [1, 2, 3, 4, 32, 33, 34, 35, 36, 64, 65, 66, 67, 68, 70, 96, 97, 98, 99]
    assert keep_row(448, 459, 32) and keep_row(452, 459, 32) and keep_row(459, 459, 32)
    assert not keep_row(453, 459, 32) and WINDOW == 4
    assert [q for q in range(1, 20) if keep_row(q, 100, 8, window=1)] == [1, 8, 9, 16, 17]
    assert drafter_rows(32) == {"rule": ROW_RULE, "block_size": 32, "window": 4}


def test_acceptance_grows_to_the_longest_draft():
    a = Acceptance()
    assert a.to_json()["mean_acceptance_length"] is None and a.to_json()["accepted_per_position"] == []
    a.observe(3, 2)
    a.observe(3, 0)
    a.observe(2, 2)
    assert a.to_json() == {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 4,
                           "accepted_per_position": [2, 2, 0], "mean_acceptance_length": 1 + 4 / 3}


def test_acceptance_for_k_drafts_lists_every_position_from_the_start():
    a = Acceptance.for_drafts(3)
    assert a.to_json()["accepted_per_position"] == [0, 0, 0]
    a.observe(3, 2)
    a.observe(3, 0)
    assert a.to_json() == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 2,
                           "accepted_per_position": [1, 1, 0], "mean_acceptance_length": 2.0}
