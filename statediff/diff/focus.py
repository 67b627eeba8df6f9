"""The focused re-record of a root: ``statediff record ... --focus request=R,position=P,layers=L``.

A trace recorded with ``--keep hits`` or ``--keep none`` holds every
tensor's summary but the data of few: compare names the root from
summaries, and when the root has no data on a side, the report prints the
two commands that replay both runs again keeping data only around it (the
engine side reads ``--focus``; ``docs/trace-format.md``, keep policy).
They are built from the run's ``record_argv`` (the command line stored at
recording, without ``-o``/``--mode``); its own ``--keep``/``--focus`` are
dropped, since the focus decides what is kept.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

FOCUS_OUT = {"hit": "hit-focus.h5", "cold": "cold-focus.h5"}
DROPPED = ("--keep", "--focus")  # options of the first recording that the focus replaces
GENERIC = "<the arguments of the first recording>"


def focus_spec(focus: Mapping[str, Any]) -> str:
    """``request=R,position=P,layers=L1/L2`` (layers left out when none are given)."""
    words = [f"request={focus['request']}", f"position={focus['position']}"]
    layers = focus.get("layers") or []
    if layers:
        words.append("layers=" + "/".join(str(layer) for layer in layers))
    return ",".join(words)


def record_words(run: Mapping[str, Any]) -> list[str] | None:
    """The run's ``record_argv`` without ``--keep``/``--focus`` (and their values), or None when
    the trace does not store it (or stores something other than a list of strings)."""
    argv = run.get("record_argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return None
    out: list[str] = []
    skip = False
    for w in argv:
        if skip:
            skip = False
        elif w in DROPPED:
            skip = True
        elif not w.startswith(tuple(f"{d}=" for d in DROPPED)):
            out.append(w)
    return out


def _record_line(run: Mapping[str, Any], mode: str, out: str, split_like: str | None) -> str:
    """``statediff record <record_argv without --keep/--focus> --mode M [--split-like X] -o OUT``;
    the placeholder ``GENERIC`` for the arguments when the trace does not store its command line."""
    words = record_words(run)
    tail = ["--mode", mode] + (["--split-like", split_like] if split_like else []) + ["-o", out]
    if words is None:
        return f"statediff record {GENERIC} {shlex.join(tail)}"
    return shlex.join(["statediff", "record", *words, *tail])


def focus_commands(hit_run: Mapping[str, Any], cold_run: Mapping[str, Any], focus: Mapping[str, Any],
                   paths: tuple[str, str] | None = None,
                   record_line: Callable[[Mapping[str, Any], str, str, str | None], str] = _record_line,
                   ) -> list[str]:
    """The hit and the cold ``statediff record`` lines that keep data around ``focus``.

    Args:
        hit_run, cold_run: the traces' run metadata (``record_argv``, ``exact_form``).
        focus: ``{"request": R, "position": P, "layers": [...]}`` (``CompareResult.focus``).
        paths: the hit and cold traces compared: each line gets ``--focus-check PATH``,
            so the re-record checks that it replayed the same states (every digest equal).
        record_line: ``(run, mode, out, split_like) -> "statediff record ... -o OUT"``; the
            default uses ``record_argv`` (``GENERIC`` without it); reports rebuild the
            arguments from the run metadata instead (``statediff.incident.reproduce``).
    Returns:
        two shell lines; a cold run recorded in the split exact form (``--exact-split``)
        gets ``--split-like hit-focus.h5``.
    """
    spec = focus_spec(focus)
    split = FOCUS_OUT["hit"] if cold_run.get("exact_form") == "split" else None
    checks = paths or (None, None)
    return [record_line(run, mode, FOCUS_OUT[mode], split_like) + " " + shlex.join(
                ["--focus", spec] + (["--focus-check", str(check)] if check else []))
            for run, mode, split_like, check in ((hit_run, "hit", None, checks[0]),
                                                 (cold_run, "cold", split, checks[1]))]
