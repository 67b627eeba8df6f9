"""Adapter for vLLM 0.32's V1 scheduler: split a cold run's prefills where the hit run did.

Mirrors ``v1/core/sched/scheduler.py`` (vLLM 0.32.0):
``Scheduler._mamba_block_aligned_split(request, num_new_tokens,
num_new_local_computed_tokens=0, num_external_computed_tokens=0)`` clips
every prefill chunk of a hybrid model (mamba cache mode ``align``) and is
called for waiting and running requests alike; its result is the number
of tokens the request computes this step. ``Request.cache_salt``
(``v1/request.py``) identifies the replayed request: the cold replay salts
request ``i`` with ``statediff-cold-<run>-<i>``.

Clipping further at the planned split points (``statediff.replay.splitplan``)
only shortens chunks, which the scheduler already does for its own
reasons, so it cannot make a schedule the engine would not make itself.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
from typing import Any

SALT_PREFIX = "statediff-cold-"


def cold_salt(run_id: str, index: int) -> str:
    """The cache_salt of replayed request ``index`` in a cold run."""
    return f"{SALT_PREFIX}{run_id}-{index}"


def salt_index(salt: str | None) -> int | None:
    if not salt or not salt.startswith(SALT_PREFIX):
        return None
    tail = salt.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def load_plan(env: dict[str, str] | None = None) -> dict[int, list[int]]:
    """The split plan passed in ``STATEDIFF_SPLITS`` (JSON {index: [token counts]})."""
    raw = (os.environ if env is None else env).get("STATEDIFF_SPLITS")
    if not raw:
        return {}
    return {int(k): sorted(int(x) for x in v) for k, v in json.loads(raw).items()}


def clip(start: int, num_new_tokens: int, splits: list[int]) -> int:
    """Shorten a chunk starting at ``start`` so it does not cross the next planned split."""
    i = bisect.bisect_right(splits, start)
    if i < len(splits) and start + num_new_tokens > splits[i]:
        return splits[i] - start
    return num_new_tokens


def wrap_split(orig: Any, plan: dict[int, list[int]]) -> Any:
    """Wrapper for ``Scheduler._mamba_block_aligned_split`` honouring ``plan``."""

    @functools.wraps(orig)
    def _mamba_block_aligned_split(self: Any, request: Any, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        n = orig(self, request, num_new_tokens, num_new_local_computed_tokens,
                 num_external_computed_tokens)
        idx = salt_index(getattr(request, "cache_salt", None))
        splits = plan.get(idx) if idx is not None else None
        if not splits or n <= 0:
            return n
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        return clip(start, n, splits)

    return _mamba_block_aligned_split
