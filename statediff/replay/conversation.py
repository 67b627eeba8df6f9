"""Replay files: an ordered conversation, one request per JSONL line.

Each line is a JSON object, either pre-tokenised::

    {"prompt_token_ids": [1, 2, 3], "max_tokens": 16}

or OpenAI-style chat, rendered with the model's chat template::

    {"messages": [{"role": "user", "content": "hi"}], "tools": [...], "max_tokens": 16}

Optional keys: ``id`` (a label), ``max_tokens`` (default 16),
``temperature`` (default 0: greedy), ``top_p``, ``top_k``, ``seed``; values
vLLM would refuse are refused here, with the line number (``sampling_problem``).
Requests are replayed in file order on a fresh engine, one at a time, so a
later request can hit the prefix cache filled by the earlier ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
#: Every key a line may hold; any other (a typo such as ``max_token``) is refused.
KNOWN_KEYS = ("id", "prompt_token_ids", "messages", "tools", *SAMPLING_KEYS)


@dataclasses.dataclass
class Turn:
    """One replayed request: exactly one of ``prompt_token_ids`` / ``messages`` is set."""

    line: int
    id: str
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"id": self.id, **self.sampling}
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
        else:
            d["messages"] = self.messages
            if self.tools:
                d["tools"] = self.tools
        return d


def _fail(path: Path, line: int, msg: str) -> StatediffError:
    return StatediffError(f"{path}:{line}: {msg}")


def sampling_problem(sampling: dict[str, Any]) -> str | None:
    """What vLLM would refuse in a request's sampling fields, as one sentence; None if nothing.

    Mirrors ``SamplingParams._verify_args`` of vLLM 0.32 (``vllm/sampling_params.py``)
    so that a bad line is refused with its line number before an engine starts,
    not after it: ``max_tokens`` a whole number >= 1, ``temperature`` finite in
    [0, 2] (0 is greedy), ``top_p`` in (0, 1], ``top_k`` a whole number >= -1
    (-1 and 0 turn it off), ``seed`` a whole number.
    """
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    mt = sampling.get("max_tokens")
    if mt is not None and (not whole(mt) or mt < 1):
        return f"'max_tokens' must be a whole number of at least 1, not {mt!r}"
    t = sampling.get("temperature")
    if t is not None and not (math.isfinite(t) and 0 <= t <= 2):
        return f"'temperature' must be in [0, 2] (0 is greedy), not {t!r}"
    p = sampling.get("top_p")
    if p is not None and not (math.isfinite(p) and 0 < p <= 1):
        return f"'top_p' must be in (0, 1], not {p!r}"
    k = sampling.get("top_k")
    if k is not None and (not whole(k) or k < -1):
        return f"'top_k' must be a whole number, -1 or 0 (off) or at least 1, not {k!r}"
    seed = sampling.get("seed")
    if seed is not None and not whole(seed):
        return f"'seed' must be a whole number, not {seed!r}"
    return None


def parse_turn(obj: Any, path: Path, line: int) -> Turn:
    """Validate one decoded JSONL line.

    Raises:
        StatediffError: the line is not a request object of either form.
    """
    if not isinstance(obj, dict):
        raise _fail(path, line, "expected a JSON object per line")
    unknown = [k for k in obj if k not in KNOWN_KEYS]
    if unknown:
        raise _fail(path, line, f"unknown key {unknown[0]!r} (a line holds {', '.join(KNOWN_KEYS)})")
    has_ids, has_msgs = "prompt_token_ids" in obj, "messages" in obj
    if has_ids == has_msgs:
        raise _fail(path, line, "needs exactly one of 'prompt_token_ids' or 'messages'")
    sampling = {"max_tokens": 16, "temperature": 0.0}
    for key in SAMPLING_KEYS:
        if key in obj:
            val = obj[key]
            if not isinstance(val, (int, float)) or isinstance(val, bool):
                raise _fail(path, line, f"'{key}' must be a number")
            sampling[key] = val
    problem = sampling_problem(sampling)
    if problem:
        raise _fail(path, line, problem)
    turn = Turn(line=line, id=str(obj.get("id", f"turn-{line}")), sampling=sampling)
    if has_ids:
        turn.prompt_token_ids = _token_ids(obj["prompt_token_ids"], path, line)
    else:
        turn.messages = _messages(obj["messages"], path, line)
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _fail(path, line, "'tools' must be a list")
        turn.tools = tools
    return turn


def _token_ids(ids: Any, path: Path, line: int) -> list[int]:
    """``prompt_token_ids`` checked: a non-empty list of whole numbers >= 0 (the first bad one named)."""
    if not isinstance(ids, list) or not ids:
        raise _fail(path, line, "'prompt_token_ids' must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise _fail(path, line, f"'prompt_token_ids'[{i}] is {t!r}, not a token id (a whole number >= 0)")
        if t < 0:
            raise _fail(path, line, f"'prompt_token_ids'[{i}] is {t}: token ids are >= 0")
    return ids


def _messages(msgs: Any, path: Path, line: int) -> list[dict]:
    """``messages`` checked: a non-empty list of objects, each with ``role`` and ``content``
    (``content`` may be null only in an assistant message that holds ``tool_calls``)."""
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise _fail(path, line, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(msgs):
        if "role" not in m:
            raise _fail(path, line, f"'messages'[{i}] has no 'role'")
        if "content" not in m and "tool_calls" not in m:
            raise _fail(path, line, f"'messages'[{i}] ({m['role']}) has no 'content'")
    return msgs


def load_conversation(path: str | Path) -> list[Turn]:
    """Read a replay file.

    Raises:
        StatediffError: missing/unreadable file, not a regular file (a FIFO, a directory), not
            UTF-8, invalid JSON, a bad line, or no requests.
    """
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO would block here with nothing said; a directory: not a file
        raise StatediffError(f"conversation file {p} is not a regular file (give a JSONL file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise StatediffError(f"cannot read conversation file {p}: it is not UTF-8 text (give a JSONL file)") from None
    except OSError as e:
        raise StatediffError(f"cannot read conversation file {p}: {e.__class__.__name__}: {e}") from None
    turns = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise _fail(p, n, f"invalid JSON ({e.msg})") from None
        turns.append(parse_turn(obj, p, n))
    if not turns:
        raise StatediffError(f"{p} holds no requests")
    return turns


def turns_of_trace(requests: dict[int, dict], source: str) -> list[Turn]:
    """The conversation a trace replayed, from its request records (``Trace.requests``): each
    request's ``prompt_token_ids`` and sampling (``max_tokens`` the number of tokens it sampled
    when its sampling was not recorded), in request order. For a cold run shaped like a trace
    that no conversation file describes (a deployment recorded through ``STATEDIFF_TRACE``).

    Raises:
        StatediffError: a request without prompt token ids, or no request.
    """
    turns = []
    for n, i in enumerate(sorted(requests), start=1):
        rec = requests[i]
        s = rec.get("sampling") if isinstance(rec.get("sampling"), dict) else {}
        line = {k: s[k] for k in SAMPLING_KEYS
                if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)}
        if isinstance(line.get("top_k"), int) and line["top_k"] <= 0:
            del line["top_k"]  # vLLM's "disabled"
        if "max_tokens" not in line and rec.get("output_token_ids"):
            line["max_tokens"] = len(rec["output_token_ids"])
        if not rec.get("prompt_token_ids"):
            raise StatediffError(f"{source}: request {i} has no prompt token ids to replay")
        turns.append(parse_turn({"id": f"request-{i}", "prompt_token_ids": list(rec["prompt_token_ids"]),
                                 **line}, Path(source), n))
    if not turns:
        raise StatediffError(f"{source} holds no requests")
    return turns


def dump_conversation(turns: list[Turn], path: str | Path) -> None:
    """Write turns as a replay file (one JSON object per line)."""
    with open(path, "w", encoding="utf-8") as f:
        for t in turns:
            f.write(json.dumps(t.to_json()) + "\n")
