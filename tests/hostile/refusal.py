"""How a found file is refused, computed in a worker process (``refusals``).

Each file is opened, and its tensors read, under the read guard, which forks a bounded child per
file. The files are many and some hold the guard to its bound, so they are opened eight at a time,
in processes: from threads, the guard's fork (taken under h5py's global lock) deadlocked against
the garbage collector finalizing h5py objects in the main thread (seen once: every thread waiting
on the lock, the process asleep for ten minutes).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from pathlib import Path


def refusal(path: str, seconds: float) -> tuple[str, bool, str] | None:
    """(error class name, whether it is a ``StatediffError``, message) of the refusal of ``path``,
    with the guard's bound set to ``seconds``; None when the file opens and every tensor reads."""
    from statediff.errors import StatediffError, TraceError
    from statediff.trace import guard, open_trace

    guard.READ_SECONDS = seconds
    try:
        with open_trace(Path(path)) as t:  # a file that opens after all must still fail on its data
            for e in t.entries:
                t.read(e)
    except TraceError as e:
        return type(e).__name__, isinstance(e, StatediffError), str(e)
    return None


def refusals(paths: list[Path], seconds: float, workers: int = 8) -> list[tuple[str, bool, str] | None]:
    """``refusal`` of each path, in order, ``workers`` at a time in spawned processes."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no lock held by a thread of ours
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return list(pool.map(refusal, [str(p) for p in paths], [seconds] * len(paths)))
