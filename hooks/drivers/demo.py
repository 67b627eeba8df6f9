"""The built-in replay: a 5-request agent conversation with tool schemas.

Each request repeats the whole conversation so far (system prompt with the
tool schemas, earlier user turns, fixed assistant replies and tool results)
plus one new user turn, as an agent loop replayed request by request does.
Later requests therefore share long prefixes with earlier ones and resume
from prefix-cache blocks; this is the situation in which restore bugs show.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from statediff.replay.conversation import Turn

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite and return failures.",
        "parameters": {"type": "object", "properties": {
            "selector": {"type": "string", "description": "pytest node id or keyword expression."}},
            "required": []}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the code base for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["pattern"]}}},
]

SYSTEM = ("You are a careful coding agent. Use the tools to inspect the repository before "
          "answering, keep answers short, and cite file paths and line numbers.")

EXCHANGES = [
    ("The cache tests fail after the last merge. Find out why.",
     "I will run the failing tests first.\n<tool_call>run_tests(selector=\"cache\")</tool_call>",
     "FAILED tests/test_cache.py::test_eviction - AssertionError: expected 3 blocks, got 4"),
    ("Show me the eviction code.",
     "Reading the block cache implementation.\n<tool_call>read_file(path=\"src/cache.py\", start_line=1, end_line=60)</tool_call>",
     "class BlockCache:\n    def put(self, key, value):\n        if len(self.blocks) > self.capacity:\n            self.evict()\n        self.blocks[key] = value"),
    ("Is the comparison off by one?",
     "Yes: put() evicts only when the cache already holds more than capacity blocks, so it "
     "grows to capacity + 1. It should evict when len(self.blocks) >= self.capacity.",
     None),
    ("Where else is capacity compared like that?",
     "Searching for other comparisons.\n<tool_call>search_code(pattern=\"> self.capacity\")</tool_call>",
     "src/cache.py:3\nsrc/prefix_index.py:41"),
    ("Fix both places and rerun the tests.",
     None, None),
]


def demo_conversation(max_tokens: int = 16) -> list[Turn]:
    """Five chat requests, each the previous conversation plus one user turn."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for i, (user, assistant, tool_result) in enumerate(EXCHANGES):
        messages.append({"role": "user", "content": user})
        turns.append(Turn(line=i + 1, id=f"turn-{i}", messages=[dict(m) for m in messages],
                          tools=TOOLS, sampling={"max_tokens": max_tokens, "temperature": 0.0}))
        if assistant:
            messages.append({"role": "assistant", "content": assistant})
        if tool_result:
            messages.append({"role": "tool", "content": tool_result})
    return turns


#: The one line said when the built-in conversation falls back to plain text (``builtin_turns``).
NO_TEMPLATE_NOTE = ("statediff: note: {model} has no chat template: the built-in conversation is sent as "
                    "token ids of plain 'role: content' text")


def plain_text(turn: Turn) -> str:
    """A chat turn as plain text, for a tokenizer without a chat template: the tool schemas
    (JSON) after the system prompt, one ``role: content`` paragraph per message, and an open
    ``assistant:`` paragraph (the generation prompt)."""
    parts = []
    for m in turn.messages or ():
        parts.append(f"{m['role']}: {m.get('content', '')}")
        if m["role"] == "system" and turn.tools:
            parts.append("tools: " + json.dumps(turn.tools, sort_keys=True))
    return "\n\n".join(parts + ["assistant:"])


def builtin_turns(model_dir: str, max_tokens: int, say: Callable[[str], None]) -> list[Turn]:
    """The built-in conversation for ``model_dir``: chat turns when its tokenizer has a chat
    template, else the same exchanges as token ids of ``plain_text`` (``tokenizer.encode``,
    special tokens as the tokenizer adds them), said in one line through ``say``.

    Raises:
        StatediffError: the tokenizer cannot be loaded (``shared.load_tokenizer``).
    """
    from ..recording.fields import load_tokenizer

    turns = demo_conversation(max_tokens)
    tok = load_tokenizer(model_dir)
    if getattr(tok, "chat_template", None):
        return turns
    say(NO_TEMPLATE_NOTE.format(model=model_dir))
    return [dataclasses.replace(t, messages=None, tools=None, prompt_token_ids=[int(x) for x in tok.encode(
        plain_text(t))]) for t in turns]
