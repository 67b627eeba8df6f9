"""The terminal during ``statediff record``: statediff's lines, not the engine's.

An engine start prints ~60 lines on the tiny model and hundreds on a real
one: vLLM's logger (``vllm``, INFO, to stdout), Python warnings from torch
and transformers, C++ warnings from torch (``[W... utils.cpp:68] Warning:
NUMA binding``), Triton notices and tqdm bars. ``engine_output(log)`` points
file descriptors 1 and 2 at ``log`` (``hit.h5.log`` next to the trace) for
the replay, so all of it, C++ and child processes included, lands there; a
watcher thread reads the log as it grows and passes to the terminal only
the warning and error lines this module cannot classify as known
(``KNOWN_WARNINGS``). statediff's own lines (the engine status line, the
progress bar) go to a copy of the terminal's stderr taken before the
redirect (``Console``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from . import log_lines as vllm_lines

#: Engine warnings seen on every run that say nothing about the replay: (pattern on the message,
#: why it is harmless); vLLM's own are in ``vllm/log_lines.py``.
KNOWN_WARNINGS: list[tuple[re.Pattern, str]] = vllm_lines.KNOWN_WARNINGS + [
    (re.compile(r"NUMA binding"), "torch's memory placement; speed only"),
]
#: Python warning categories that are API notices, not findings.
KNOWN_CATEGORIES = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PY_WARNING = re.compile(r"^\S+:\d+: (\w*Warning): (.*)$")  # warnings.formatwarning
_CPP_WARNING = re.compile(r"^\[W\d{4} [\d:.]+ ([^\]]+)\] Warning: (.*)$")  # c10 TORCH_WARN


def classify(line: str) -> tuple[str, str] | None:
    """What of one engine log line the terminal should show; None for nothing.

    Returns ``(source, "engine WARNING [cpu.py:224]: message")`` for a vLLM
    warning or error, a Python warning or a torch C++ warning that matches
    neither ``KNOWN_WARNINGS`` nor ``KNOWN_CATEGORIES`` (``source``: the
    emitting file:line or category, to cap repeats); None for everything
    else (INFO lines, prints, progress bars, known warnings).
    """
    line = _ANSI.sub("", line).rstrip()
    if m := vllm_lines.LINE.match(line):
        level, where, msg = m.groups()
    elif m := _PY_WARNING.match(line):
        level, msg = m.groups()
        if level in KNOWN_CATEGORIES:
            return None
        where = None
    elif m := _CPP_WARNING.match(line):
        where, msg = m.groups()
        level = "WARNING"
    else:
        return None
    if any(p.search(msg) for p, _ in KNOWN_WARNINGS):
        return None
    source = f"{level} [{where}]" if where else level
    return source, f"engine {source}: {msg}"


class Console:
    """Where statediff's own lines go while the engine's output is redirected.

    ``stream``: the terminal (a text stream); ``progress``: draw progress bars
    (only when ``stream`` is a TTY); ``log_path``: the engine log, if any.
    Thread-safe: the log watcher writes through ``warn`` from its own thread.
    """

    def __init__(self, stream: TextIO, *, progress: bool = True, log_path: Path | None = None) -> None:
        self.stream = stream
        self.log_path = log_path
        self.progress = progress and _isatty(stream)
        self._lock = threading.RLock()
        self._open_line = False  # a status line waits for its "done"

    def warn(self, text: str) -> None:
        """One line for the user (an engine warning), clear of any progress bar or open status line."""
        from tqdm import tqdm

        with self._lock:
            if self._open_line:
                self.stream.write("\n")
                self._open_line = False
            tqdm.write(text, file=self.stream)
            self.stream.flush()

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[dict]:
        """``text... done in 31 s`` around a slow step; the caller may put ``note``
        in the yielded dict to end the line with it (e.g. the block size vLLM chose)."""
        t0 = time.perf_counter()
        info: dict[str, Any] = {}
        with self._lock:
            self.stream.write(f"{text}... ")
            self.stream.flush()
            self._open_line = True
        ok = False
        try:
            yield info
            ok = True
        finally:
            with self._lock:
                head = "" if self._open_line else "... "
                took = time.perf_counter() - t0
                end = (f"done in {took:.0f} s" if took >= 10 else f"done in {took:.1f} s") if ok else "failed"
                note = f" ({info['note']})" if ok and info.get("note") else ""
                self.stream.write(f"{head}{end}{note}\n")
                self.stream.flush()
                self._open_line = False

    def replay_bar(self, desc: str, requests: int, tokens: int) -> "ReplayBar":
        """A progress bar over one replay: requests done and tokens (prompt + max_tokens) done,
        with elapsed and expected time; drawn only in a terminal."""
        return ReplayBar(self, desc, requests, tokens)


class ReplayBar:
    """``record hit: 3/5 requests |######    | 1771/3459 tokens [00:38<00:30]`` (tqdm)."""

    def __init__(self, console: Console, desc: str, requests: int, tokens: int) -> None:
        from tqdm import tqdm

        self.desc, self.requests, self.done = desc, requests, 0
        self.bar = tqdm(total=tokens, file=console.stream, disable=not console.progress, leave=True,
                        unit="tok", dynamic_ncols=True,
                        desc=self._desc(), bar_format="{desc} |{bar:24}| {n_fmt}/{total_fmt} tokens "
                                                      "[{elapsed}<{remaining}]")

    def _desc(self) -> str:
        return f"{self.desc}: {self.done}/{self.requests} requests"

    def request_done(self, tokens: int) -> None:
        """One more request finished, worth ``tokens`` (its prompt + max_tokens)."""
        self.done += 1
        self.bar.set_description_str(self._desc(), refresh=False)
        self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def plain_console(progress: bool = True) -> Console:
    """A console on ``sys.stderr`` with no redirect (library callers, ``--engine-log``)."""
    return Console(sys.stderr, progress=progress)


@contextlib.contextmanager
def engine_output(log_path: str | Path, *, progress: bool = True, poll_s: float = 0.2,
                  repeats: int = 2) -> Iterator[Console]:
    """Send everything written to file descriptors 1 and 2 to ``log_path`` (truncated)
    while the block runs; yield the ``Console`` for statediff's own lines.

    Unclassified warnings (``classify``) reach the terminal within ``poll_s``
    seconds, at most ``repeats`` from one source (file:line) and then one
    line saying the rest are in the log. On exit (normal or not) the descriptors are restored and the
    rest of the log is scanned, so nothing is lost when the block raises.

    Raises:
        OSError: ``log_path`` cannot be created (nothing is redirected then).
    """
    log_path = Path(log_path)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    saved = (os.dup(1), os.dup(2))
    term = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    console = Console(term, progress=progress, log_path=log_path)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    stop = threading.Event()
    reader = open(log_path, "rb")  # noqa: SIM115 - closed in finally
    pending = b""
    seen: dict[str, int] = {}

    def scan(final: bool = False) -> None:
        nonlocal pending
        pending += reader.read()
        *lines, pending = pending.split(b"\n")
        if final and pending:
            lines, pending = lines + [pending], b""
        for raw in lines:
            text = raw.decode("utf-8", "replace").split("\r")[-1]
            shown = classify(text)
            if not shown:
                continue
            n = seen[shown[0]] = seen.get(shown[0], 0) + 1
            if n <= repeats:
                console.warn(shown[1])
            elif n == repeats + 1:
                console.warn(f"engine {shown[0]}: more like these in {log_path}")

    def watch() -> None:
        while not stop.wait(poll_s):
            scan()

    watcher = threading.Thread(target=watch, name="statediff-engine-log", daemon=True)
    watcher.start()
    try:
        yield console
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        stop.set()
        watcher.join()
        scan(final=True)
        reader.close()
        term.close()
