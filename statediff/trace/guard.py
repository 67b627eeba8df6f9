"""The read guard: libhdf5 parses a file statediff did not write only in a child process, bounded.

A trace from a stranger (a bundle attached to an issue) is parsed by
libhdf5, whose parsers trust the bytes: a crafted superblock, object
header, attribute, heap or chunk index can make it loop forever or
allocate without bound (``tests/hostile/found/`` keeps such files). So the
reader never calls libhdf5 on such a file in its own process. ``map_files``
forks a child that maps each file (``h5map.map_file``: attributes, links,
dataset headers, chunk locations; no data) under two bounds:

- time: each file's map must arrive within ``READ_SECONDS`` of wall time
  (environment ``STATEDIFF_READ_SECONDS``, default 60 s; a normal trace
  needs milliseconds to a second) and the child gets that much CPU time
  (``RLIMIT_CPU``) per file as well;
- memory: the child may grow its address space by ``READ_MEMORY`` bytes
  beyond what it inherited (``RLIMIT_AS``; ``STATEDIFF_READ_MEMORY``,
  default 2 GiB, Linux).

A breach kills the child; the file is refused with one ``TraceError``
line naming the bound, and so is a child that dies (libhdf5 crashing on a
damaged file). The parent then reads every table and tensor itself, by
byte range at the offsets the map gives, with each size checked against
``schema``'s limits (``arrays.StoredArray``): data reads cannot loop, and
a frame cannot decode to more than its chunk.

The child is a ``fork`` of the caller (milliseconds; nothing to import),
taken while holding h5py's global lock so that no other thread of the
caller is inside libhdf5 at that moment. Messages are JSON text over a
pipe: nothing is unpickled. Where ``fork`` does not exist (Windows), or
with ``STATEDIFF_READ_GUARD=0``, the map is made in process, unbounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import TraceError, first_line as _short

READ_SECONDS = float(os.environ.get("STATEDIFF_READ_SECONDS") or 60)
READ_MEMORY = int(float(os.environ.get("STATEDIFF_READ_MEMORY") or 2 * (1 << 30)))
ENABLED = os.environ.get("STATEDIFF_READ_GUARD", "1") not in ("0", "off", "") and hasattr(os, "fork")
_HEADER = struct.Struct("<Q")


class GuardBreach(TraceError):
    """A file refused because libhdf5 broke a bound reading it: ``bound`` is "time" (no answer
    within ``READ_SECONDS``), "cpu" (``RLIMIT_CPU``), "memory" (the child ran out of its
    ``READ_MEMORY``) or "crash" (the child died on a signal, or ended without answering)."""

    def __init__(self, message: str, bound: str) -> None:
        super().__init__(message)
        self.bound = bound


def bounds_text() -> str:
    """The bounds in force, for messages and docs."""
    return f"{READ_SECONDS:g} s and {READ_MEMORY / (1 << 30):g} GiB"


def map_files(paths: Sequence[Path], mapper: Callable[[Path], Any] | None = None,
              seconds: float | None = None) -> Iterator[Any]:
    """``mapper(path)`` (default ``h5map.map_file``) of each path, in order, in one bounded child.

    Yields per path either the mapper's result (a ``FileMap``) or the ``TraceError`` that
    refuses that file: the mapper's own, or the guard's when the child breaks a bound or dies
    (later paths are then not mapped). The caller decides whether an error ends its reading.
    """
    from . import h5map

    mapper = mapper or h5map.map_file
    seconds = READ_SECONDS if seconds is None else seconds
    if not ENABLED:
        for p in paths:
            try:
                yield mapper(p)
            except TraceError as e:
                yield e
        return
    yield from _forked(list(paths), mapper, seconds)


def map_file(path: Path, seconds: float | None = None) -> Any:
    """``h5map.map_file(path)`` in a bounded child.

    Raises:
        TraceError: libhdf5 refuses the file, or the child breaks a bound or dies.
    """
    got = next(iter(map_files([path], seconds=seconds)))
    if isinstance(got, TraceError):
        raise got
    return got


def _forked(paths: list[Path], mapper: Callable[[Path], Any], seconds: float) -> Iterator[Any]:
    from h5py import _objects

    rfd, wfd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "fork() with threads": see the docstring
        with _objects.phil:  # no other thread of ours is inside libhdf5 while we fork
            try:
                pid = os.fork()
            except OSError as e:
                os.close(rfd)
                os.close(wfd)
                raise TraceError(f"{paths[0]}: cannot start the read guard's child ({e.strerror}); "
                                 "STATEDIFF_READ_GUARD=0 reads traces without it") from None
            if pid == 0:
                # keep only stdio and the pipe: an inherited descriptor would hold the caller's files
                # (and HDF5's locks on them) open for as long as the child lives
                os.closerange(3, wfd)
                os.closerange(wfd + 1, _max_fd())
                os.write(wfd, b"R")
            else:  # hold the lock until then: no file of ours is closed and reopened meanwhile
                _read_exactly(rfd, 1, time.monotonic() + seconds)
    if pid == 0:  # the child: never returns
        _child(wfd, paths, mapper, seconds)
    os.close(wfd)
    ended = False
    try:
        for p in paths:
            msg, how = _receive(rfd, seconds)
            if msg is None:
                status = _end(pid, kill=how == "timeout")
                ended = True
                yield _breach(p, status, seconds, how)
                return
            if "bound" in msg:
                yield GuardBreach(msg["error"], msg["bound"])
            elif "error" in msg:
                yield TraceError(msg["error"])
            else:
                yield _decode(msg["ok"])
    finally:
        os.close(rfd)
        if not ended:
            _end(pid, kill=True)


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 256)
    except (ValueError, OSError):
        return 65536


def _decode(doc: dict) -> Any:
    from .h5map import FileMap

    return FileMap.from_json(doc)


def _child(wfd: int, paths: list[Path], mapper: Callable[[Path], Any], seconds: float) -> None:
    """Map each path and send the result; exit without running the parent's exit handlers."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which kills us
        _limit_memory(READ_MEMORY)
        used = 0.0
        for p in paths:
            used += seconds
            _limit_cpu(used)
            try:
                doc = {"ok": mapper(p).to_json()}
            except TraceError as e:
                doc = {"error": str(e)}
            except MemoryError:
                doc = {"error": f"{p}: reading its HDF5 metadata needs more than the read guard's "
                                f"{READ_MEMORY / (1 << 30):g} GiB (STATEDIFF_READ_MEMORY): damaged or hostile file",
                       "bound": "memory"}
            except Exception as e:  # libhdf5 through h5py: OSError, KeyError, RuntimeError, ...
                doc = {"error": f"{p} is damaged: {_short(e)}"}
            try:
                _send(wfd, doc)
            except (TypeError, ValueError) as e:  # a map that is not plain data: a reader bug, still one line
                _send(wfd, {"error": f"{p}: its map could not be sent ({_short(e)})"})
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _limit_memory(extra: int) -> None:
    """Cap the address space at what this process maps now plus ``extra`` bytes (Linux)."""
    try:
        import resource

        with open("/proc/self/statm") as fh:
            mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + extra
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError, ImportError):
        pass  # no /proc (macOS) or no permission: the time bound still holds


def _limit_cpu(seconds: float) -> None:
    """At most ``seconds`` more CPU time than used so far (SIGXCPU ends the child)."""
    try:
        import resource

        used = resource.getrusage(resource.RUSAGE_SELF)
        limit = int(used.ru_utime + used.ru_stime + seconds) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))
    except (OSError, ValueError, ImportError):
        pass


def _send(fd: int, doc: dict) -> None:
    data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _receive(fd: int, seconds: float) -> tuple[dict | None, str]:
    """One message and "ok"; or None and "timeout" (the child was silent for ``seconds``) or
    "ended" (it closed the pipe first: it died)."""
    deadline = time.monotonic() + seconds
    header, how = _read_exactly(fd, _HEADER.size, deadline)
    if header is None:
        return None, how
    body, how = _read_exactly(fd, _HEADER.unpack(header)[0], deadline)
    return (None, how) if body is None else (json.loads(body), "ok")


def _read_exactly(fd: int, n: int, deadline: float) -> tuple[bytes | None, str]:
    parts, got = [], 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None, "timeout"
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None, "ended"
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts), "ok"


def _end(pid: int, kill: bool) -> int | None:
    """Wait for the child (SIGKILL first when ``kill``); its exit status, None if already reaped."""
    try:
        if kill:
            os.kill(pid, signal.SIGKILL)
        return os.waitpid(pid, 0)[1]
    except (ChildProcessError, ProcessLookupError):
        return None


def _breach(path: Path, status: int | None, seconds: float, how: str) -> GuardBreach:
    """The refusal when the child sent nothing in time (killed) or died (how)."""
    if how == "ended" and status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return GuardBreach(f"{path}: reading its HDF5 metadata used more than {seconds:g} s of CPU "
                               "(the read guard's bound, STATEDIFF_READ_SECONDS): damaged or hostile file", "cpu")
        return GuardBreach(f"{path}: the HDF5 library crashed reading it ({_signame(sig)}): "
                           "damaged or hostile file", "crash")
    if how == "ended":
        code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else "unknown"
        return GuardBreach(f"{path}: the read guard's child ended while reading it (exit code {code}): "
                           "damaged or hostile file", "crash")
    return GuardBreach(f"{path}: reading its HDF5 metadata did not finish within {seconds:g} s (the read "
                       "guard's bound, STATEDIFF_READ_SECONDS): damaged or hostile file", "time")


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe() -> dict[str, Any]:
    """The guard's settings (for ``inspect --json`` and benchmarks)."""
    return {"enabled": ENABLED, "seconds": READ_SECONDS, "memory_bytes": READ_MEMORY,
            "pid": os.getpid(), "platform": sys.platform}
