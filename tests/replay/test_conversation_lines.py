"""Conversation lines refused with their line number (issue 19): unknown keys, messages without
content, negative or non-integer token ids."""

from __future__ import annotations

import json

import pytest

from statediff.errors import StatediffError
from statediff.replay.conversation import load_conversation


@pytest.mark.parametrize("line,message", [
    ({"prompt_token_ids": [1, 2], "max_token": 8},
     "unknown key 'max_token' (a line holds id, prompt_token_ids, messages, tools, max_tokens, temperature, "
     "top_p, top_k, seed)"),
    ({"messages": [{"role": "user"}]}, "'messages'[0] (user) has no 'content'"),
    ({"messages": [{"content": "hi"}]}, "'messages'[0] has no 'role'"),
    ({"prompt_token_ids": [5, -3]}, "'prompt_token_ids'[1] is -3: token ids are >= 0"),
    ({"prompt_token_ids": [5, 1.5]}, "'prompt_token_ids'[1] is 1.5, not a token id (a whole number >= 0)"),
    ({"prompt_token_ids": []}, "'prompt_token_ids' must be a non-empty list of token ids"),
])
def test_a_bad_line_is_named_with_its_number(tmp_path, line, message):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [1]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(StatediffError) as e:
        load_conversation(p)
    assert str(e.value) == f"{p}:2: {message}"


def test_an_assistant_tool_call_without_content_is_accepted(tmp_path):
    p = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]
    p.write_text(json.dumps({"messages": msgs, "id": "a", "top_k": 3}) + "\n")
    (t,) = load_conversation(p)
    assert (t.messages, t.id, t.sampling["top_k"]) == (msgs, "a", 3)


def test_a_fifo_a_directory_or_binary_bytes_are_refused_in_one_line(tmp_path):
    import os

    fifo = tmp_path / "conv.jsonl"
    os.mkfifo(fifo)  # reading it would block with nothing said
    with pytest.raises(StatediffError, match=r"^conversation file .*conv\.jsonl is not a regular file \(give a JSONL file\)$"):
        load_conversation(fifo)
    with pytest.raises(StatediffError, match=r"is not a regular file"):
        load_conversation(tmp_path)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(StatediffError) as e:
        load_conversation(binary)
    assert str(e.value) == f"cannot read conversation file {binary}: it is not UTF-8 text (give a JSONL file)"
