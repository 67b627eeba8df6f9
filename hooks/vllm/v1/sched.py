"""Adapter for vLLM 0.32's V1 scheduler: exact replay's chunking.

Two ways to make a hit run and its cold run compute every prefill in the
same pieces: one block per step (``one_block_per_step``, ``--exact``), or
a cold run that splits its prefills where the hit run did (``wrap_split``,
``--exact-split``).

One block per step. The block size that matters is the one the engine
runs with, and vLLM 0.32 raises a hybrid model's attention block size at
engine start, after the model is built (``platforms/interface.py``
``_align_hybrid_block_size``, from ``update_block_size_for_backend``);
``EngineArgs.create_engine_config()`` does not apply the raise, so the
size cannot be known before the engine starts without re-implementing
vLLM's rule. The scheduler (``Scheduler.__init__``, built by
``EngineCore.__init__`` after the KV caches, so it already sees the raised
``cache_config.block_size``) reads its per-step budget once into
``self.max_num_scheduled_tokens`` (from ``scheduler_config
.max_num_scheduled_tokens``, else ``max_num_batched_tokens``). Lowering that
budget to the real block size right after the scheduler is built is exact
(no guess, in every process layout, with no second engine start: a second
start would load the model twice and, on a GPU, need the first engine's
memory back) and safe (the engine's buffers are sized by the larger
``max_num_batched_tokens``, which stays). It is recorded in
``scheduler_config.max_num_scheduled_tokens`` too, vLLM's own field for
"tokens the scheduler may issue per step", where the runner's run
metadata reads it.

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
#: Set to "1" by ``replay(exact=True)``: every engine process schedules one block per step.
EXACT_ENV = "STATEDIFF_EXACT_BLOCK"


class ExactReplayError(RuntimeError):
    """The engine cannot be scheduled one block per step (message: one line)."""


def exact_wanted(env: dict[str, str] | None = None) -> bool:
    """Whether ``STATEDIFF_EXACT_BLOCK=1`` asks for one block per step."""
    return (os.environ if env is None else env).get(EXACT_ENV) == "1"


def one_block_per_step(sched: Any) -> int:
    """Set a freshly built V1 ``Scheduler``'s per-step token budget to its block size.

    Args:
        sched: ``vllm.v1.core.sched.scheduler.Scheduler`` right after its
            ``__init__`` (``cache_config.block_size`` is then the effective,
            possibly raised, attention block size; in mamba cache mode
            ``align`` also the mamba block size).

    Returns:
        The budget set (tokens): the block size.

    Raises:
        ExactReplayError: chunked prefill is off (a prompt longer than one
            block could then never be scheduled), the engine's budget is
            smaller than one block (its buffers cannot hold a block), or a
            parallel drafter's draft slots leave less than one block of the
            step's input budget (below).

    A parallel drafter (DFlash: ``K`` slots, DSpark and P-EAGLE: ``K - 1``;
    ``SpeculativeConfig.max_num_new_slots_for_drafting``) reserves its draft
    slots from ``max_num_batched_tokens`` in every step
    (``Scheduler.schedule``: a chunk is at most ``input_budget - draft_slots``),
    and the align-mode split rounds a hybrid's prefill chunk down to whole
    blocks: with ``max_num_batched_tokens - slots < block`` it schedules 0
    tokens forever (measured: DFlash on the tiny hybrid at
    ``max_num_batched_tokens`` = block size never finished its first request).
    The chunk stays one block when ``max_num_batched_tokens >= block + slots``.
    """
    block = int(sched.cache_config.block_size)
    budget = int(sched.max_num_scheduled_tokens)
    if not sched.scheduler_config.enable_chunked_prefill:
        raise ExactReplayError("exact replay (one block per step) needs chunked prefill; "
                               "the engine runs with enable_chunked_prefill=False")
    if budget < block:
        raise ExactReplayError(
            f"exact replay schedules one block ({block} tokens, the engine's block size) per step, "
            f"but the engine's step budget is {budget} tokens: pass --max-num-batched-tokens {block} "
            "or more")
    spec = getattr(getattr(sched, "vllm_config", None), "speculative_config", None)
    slots = int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0) if spec is not None else 0
    inputs = int(sched.scheduler_config.max_num_batched_tokens)
    if slots and inputs - slots < block:
        raise ExactReplayError(
            f"exact replay schedules one block ({block} tokens) per step, but the drafter "
            f"({getattr(spec, 'method', None)}) reserves {slots} draft slots of the engine's {inputs}-token step "
            f"input (max_num_batched_tokens), leaving {inputs - slots}: vLLM's block-aligned prefill split would "
            f"then schedule nothing, forever; pass --max-num-batched-tokens {block + slots} or more")
    sched.max_num_scheduled_tokens = block
    sched.scheduler_config.max_num_scheduled_tokens = block
    return block


#: What the scheduler last built in this process runs with (``surface.scheduler_block_facts``: the
#: hit's last-block drop and the hashes' lookahead), noted by ``wrap_init_note``; empty where the
#: scheduler runs in another process (the engine core under tensor parallelism).
NOTED: dict[str, Any] = {}


def wrap_init_note(orig: Any) -> Any:
    """Wrapper for ``Scheduler.__init__`` noting ``surface.scheduler_block_facts`` in ``NOTED`` after it
    (vLLM 0.33 decides the drop there: lookahead block hashes turn it off)."""
    from ..surface import scheduler_block_facts

    @functools.wraps(orig)
    def __init__(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        try:
            NOTED.clear()
            NOTED.update(scheduler_block_facts(self))
        except AttributeError:
            pass  # a scheduler without a KV cache manager: the run metadata derives it from the config

    return __init__


def wrap_init_exact(orig: Any) -> Any:
    """Wrapper for ``Scheduler.__init__`` applying ``one_block_per_step`` after it."""

    @functools.wraps(orig)
    def __init__(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        one_block_per_step(self)

    return __init__


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
