"""The ``statediff record`` line that reproduces a recorded run: one builder for every such line.

Reports and bundles print the lines that record both runs again
(``statediff.incident.reproduce``); ``compare`` prints, when the root has no
data on a side, the two lines that record them again keeping data around it
(``--focus``, ``focus_lines``). All come from ``record_line``:

- the arguments are the ones stored at recording (run field
  ``record_argv``: what followed ``statediff record``, without ``-o`` and
  ``--mode``), or, in traces that do not store them, rebuilt from the run
  metadata (``rebuilt_words``; the line is then marked approximate:
  ``RecordLine.exact`` False);
- a focused line drops the first recording's ``--keep``, ``--focus`` and
  ``--focus-check`` (the focus decides what is kept) and adds ``--focus``
  (``focus.focus_text``) and ``--focus-check TRACE`` (the re-record checks
  it replayed the same states);
- a replay file (a bundle's ``replay.jsonl``) replaces the conversation,
  a sweep and ``--max-tokens``.

Pure functions of run metadata (``schema.RUN_KEYS``); no trace I/O.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping
from typing import Any

from .focus import focus_text

FOCUS_OUT = {"hit": "hit-focus.h5", "cold": "cold-focus.h5"}
FOCUS_DROPPED = ("--keep", "--focus", "--focus-check")  # options of the first recording a focus replaces


@dataclasses.dataclass(frozen=True)
class RecordLine:
    """One ``statediff record`` shell line; ``exact``: its arguments are the stored command line
    (False: rebuilt from the run metadata, an approximation)."""

    text: str
    exact: bool


def speculative(run: Mapping[str, Any]) -> tuple[str | None, Any, bool]:
    """(speculative method, number of speculative tokens, whether the run metadata names a drafter).

    Reads ``speculative_method``/``num_speculative_tokens``, falling back to
    the ``drafter`` record (adapters that record only that). A
    ``speculative_method`` of ``"none"`` means the engine had no drafter.
    """
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    method = run.get("speculative_method")
    method = None if method == "none" else method or drafter.get("method")
    k = run.get("num_speculative_tokens")
    k = drafter.get("num_speculative_tokens") if k is None else k
    return method, k, bool(method or k)


def rebuilt_words(run: Mapping[str, Any]) -> list[str]:
    """``record`` arguments rebuilt from run metadata (traces without ``record_argv``)."""
    conv = run.get("conversation")
    words = [] if not isinstance(conv, str) or conv.startswith("builtin:") else [conv]
    if conv is None or run.get("mode") is None:
        words = ["CONVERSATION.jsonl"]
    if conv == "builtin:sweep-boundaries":
        words.append("--sweep-boundaries")
    for key, flag in (("model", "--model"), ("dtype", "--dtype"), ("block_size", "--block-size"),
                      ("seed", "--seed")):
        if run.get(key) is not None:
            words += [flag, str(run[key])]
    if run.get("enforce_eager"):
        words.append("--enforce-eager")
    if run.get("replay") == "exact":
        words.append("--exact-split" if run.get("exact_form") == "split" else "--exact")
    elif run.get("max_num_batched_tokens") is not None:
        words += ["--max-num-batched-tokens", str(run["max_num_batched_tokens"])]
    if run.get("kv_cache_dtype") not in (None, "auto"):
        words += ["--engine-arg", f"kv_cache_dtype={run['kv_cache_dtype']}"]
    if run.get("quantization") not in (None, "none"):
        words += ["--engine-arg", f"quantization={run['quantization']}"]
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    method, k, spec = speculative(run)
    if spec:
        cfg = {"method": method, "model": drafter.get("model"), "num_speculative_tokens": k}
        words += ["--speculative-config", json.dumps({a: b for a, b in cfg.items() if b is not None})]
    f = run.get("fault")
    if isinstance(f, dict) and f.get("spec"):
        words += ["--fault", str(f["spec"])]
    sampling = run.get("sampling")
    if isinstance(sampling, dict) and sampling.get("max_tokens") is not None and (
            conv is not None and str(conv).startswith("builtin:")):
        words += ["--max-tokens", str(sampling["max_tokens"])]
    if isinstance(run.get("capture"), dict) and run["capture"].get("kv") == "none":
        words += ["--kv", "none"]
    return words


def record_words(run: Mapping[str, Any], drop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """The run's ``record`` arguments without the options in ``drop`` (and their values): the stored
    ``record_argv`` (second value True), or, when the trace does not store it as a list of
    strings, the arguments rebuilt from its metadata (False)."""
    argv = run.get("record_argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return rebuilt_words(run), False
    out: list[str] = []
    skip = False
    for w in argv:
        if skip:
            skip = False
        elif w in drop:
            skip = True
        elif not w.startswith(tuple(f"{d}=" for d in drop)):
            out.append(w)
    return out, True


def _with_replay_file(words: list[str], run: Mapping[str, Any], replay_file: str) -> list[str]:
    """Replace the conversation (and a sweep, and ``--max-tokens``) by a replay file of the same prompts."""
    conv = run.get("conversation")
    if words and isinstance(conv, str) and not conv.startswith("builtin:") and words[0] == conv:
        words = words[1:]
    elif words and words[0] == "CONVERSATION.jsonl":
        words = words[1:]
    kept, skip = [], 0
    for w in words:  # the replay file carries the prompts and max_tokens
        if skip:
            skip -= 1
        elif w == "--sweep-boundaries":
            pass
        elif w in ("--sweep-blocks", "--max-tokens"):
            skip = 1
        else:
            kept.append(w)
    return [replay_file] + kept


def record_line(run: Mapping[str, Any], mode: str, out: str, *, split_like: str | None = None,
                replay_file: str | None = None, focus: Mapping[str, Any] | None = None,
                focus_check: str | None = None) -> RecordLine:
    """The ``statediff record`` line that records ``run`` again in ``mode`` to ``out``.

    Args:
        run: the trace's run metadata.
        mode: ``hit`` or ``cold``.
        out: the trace to write.
        split_like: a cold run in the split exact form replays the splits of this hit trace.
        replay_file: replaces the conversation (and a sweep) by a replay file of the same prompts.
        focus: keep data only around ``{"request", "position", "layers"}`` (``--focus``); the
            first recording's ``--keep``/``--focus``/``--focus-check`` are dropped.
        focus_check: with ``focus``: the trace the re-record checks its digests against.
    """
    words, exact = record_words(run, FOCUS_DROPPED if focus is not None else ())
    if replay_file is not None:
        words = _with_replay_file(words, run, replay_file)
    words += ["--mode", mode] + (["--split-like", split_like] if split_like else []) + ["-o", out]
    if focus is not None:
        words += ["--focus", focus_text(focus)] + (["--focus-check", str(focus_check)] if focus_check else [])
    return RecordLine(shlex.join(["statediff", "record", *words]), exact)


def focus_lines(hit_run: Mapping[str, Any], cold_run: Mapping[str, Any], focus: Mapping[str, Any],
                paths: tuple[str, str] | None = None) -> list[RecordLine]:
    """The hit and the cold ``statediff record`` lines that keep data around ``focus``.

    Args:
        hit_run, cold_run: the traces' run metadata (``record_argv``, ``exact_form``).
        focus: ``{"request": R, "position": P, "layers": [...]}`` (``CompareResult.focus``).
        paths: the hit and cold traces compared: each line gets ``--focus-check PATH``.
    Returns:
        the two lines (``FOCUS_OUT`` the traces they write); a cold run recorded in the split
        exact form (``--exact-split``) gets ``--split-like hit-focus.h5``.
    """
    split = FOCUS_OUT["hit"] if cold_run.get("exact_form") == "split" else None
    checks = paths or (None, None)
    return [record_line(run, mode, FOCUS_OUT[mode], split_like=split_like, focus=focus, focus_check=check)
            for run, mode, split_like, check in ((hit_run, "hit", None, checks[0]),
                                                 (cold_run, "cold", split, checks[1]))]
