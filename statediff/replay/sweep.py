"""Boundary sweeps: a generated replay whose prompt lengths straddle prefix-cache block boundaries.

``boundary_sweep`` makes one request per length (one short of a boundary,
on it, past it by 1, by ``1 + K``, ...), every prompt a prefix of one base
sequence, ordered so that each request resumes from a boundary an earlier
one left; ``expected_hits`` says where. The order, the retention model it
relies on and its measurement: docs/replay.md, "Boundary sweeps". No engine
here: ``statediff_hooks.drivers.sweep`` supplies the actual block size,
``K`` and the vocabulary size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from .conversation import Turn
from .hits import expected_hits_align, replay_boundary  # noqa: F401 - replay_boundary: public here too
from statediff.errors import StatediffError

FIRST_TOKEN = 3  # ids 0..2 are bos/eos/pad in most vocabularies: never drawn
DEFAULT_FEW = 3  # "a few tokens past a boundary"


@dataclasses.dataclass(frozen=True)
class SweepRequest:
    """One generated request: its label (e.g. ``"2B+1"``), prompt length and expected hit (tokens)."""

    label: str
    length: int
    expected_hit: int


@dataclasses.dataclass
class Sweep:
    """A generated boundary sweep.

    Attributes:
        block_size: ``B``, tokens per KV-cache block the engine really uses.
        num_speculative_tokens: ``K`` (0 without a drafter).
        blocks: how many boundaries were straddled (``2B .. (blocks+1)B``).
        few: the "few tokens past a boundary" offset.
        vocab_size: the model's vocabulary size; tokens are drawn from
            ``[FIRST_TOKEN, vocab_size)`` minus ``excluded``.
        seed: seed of the token draw.
        excluded: how many ids in that range were excluded (special tokens).
        requests: the requests, in replay order.
        turns: the same as ``statediff.replay.conversation.Turn`` (prompt token ids).
    """

    block_size: int
    num_speculative_tokens: int
    blocks: int
    few: int
    vocab_size: int
    seed: int
    requests: list[SweepRequest]
    turns: list[Turn]
    excluded: int = 0

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.requests]

    @property
    def expected_hits(self) -> list[int]:
        return [r.expected_hit for r in self.requests]

    def to_json(self) -> dict[str, Any]:
        """Run metadata (``run["sweep"]``): parameters, labels, lengths and expected hits."""
        return {"block_size": self.block_size, "num_speculative_tokens": self.num_speculative_tokens,
                "blocks": self.blocks, "few": self.few, "vocab_size": self.vocab_size,
                "seed": self.seed, "num_excluded_ids": self.excluded,
                "labels": [r.label for r in self.requests], "lengths": self.lengths,
                "expected_hits": self.expected_hits}

    def check(self, hits: list[int], *, cold: bool = False) -> list[str]:
        """Lines saying where measured hits (``num_cached_tokens`` per request) differ from expected.

        ``cold``: the run gave every request a unique cache_salt, so 0 is expected everywhere.
        """
        out = []
        for i, (r, got) in enumerate(zip(self.requests, hits)):
            want = 0 if cold else r.expected_hit
            if got != want:
                out.append(f"request {i} ({r.label}, {r.length} tokens): hit {got} tokens, expected {want}")
        return out


def _label(n: int, offset: int, k: int) -> str:
    base = "B" if n == 1 else f"{n}B"
    if offset == 0:
        return base
    if k and offset == k + 1:
        return f"{base}+K+1"
    return f"{base}{offset:+d}"


def sweep_lengths(block_size: int, *, num_speculative_tokens: int = 0, blocks: int = 2,
                  few: int = DEFAULT_FEW) -> list[tuple[str, int]]:
    """Labels and prompt lengths of a sweep, in replay order (docs/replay.md, "Boundary sweeps").

    ``few`` is raised by one when it equals ``K + 1``, so that the ``1 + K``
    prefill stays a request of its own that resumes at ``n*B``.

    Raises:
        StatediffError: ``blocks`` < 1, ``few`` < 2, a negative ``K``, or a
            block too small to hold the offsets (``B < max(K + 1, few) + 2``).
    """
    b, k = block_size, num_speculative_tokens
    if blocks < 1:
        raise StatediffError(f"--sweep-blocks must be at least 1, not {blocks}")
    if k < 0:
        raise StatediffError(f"number of speculative tokens must be >= 0, not {k}")
    if few < 2:
        raise StatediffError(f"the 'few tokens past a boundary' offset must be at least 2, not {few}")
    if b < max(k + 1, few) + 2:
        raise StatediffError(f"block size {b} is too small for a boundary sweep with {k} speculative "
                             f"tokens (needs at least {max(k + 1, few) + 2})")
    if k and k + 1 == few:  # keep the 1+K prefill a request of its own, right after a hit
        few += 1
    if b < max(k + 1, few) + 2:
        raise StatediffError(f"block size {b} is too small for a boundary sweep with {k} speculative "
                             f"tokens (needs at least {max(k + 1, few) + 2})")
    offsets = [-1, 0, few, 1] + ([k + 1] if k else [])
    out = [(_label(1, few, k), b + few)]
    for n in range(2, blocks + 2):
        out += [(_label(n, o, k), n * b + o) for o in offsets]
    return out


def expected_hits(lengths: list[int], block_size: int) -> list[int]:
    """Prefix-cache hit of each request when every prompt is a prefix of one sequence.

    ``hit_i`` = the largest ``replay_boundary(L_j)`` of an earlier request
    ``j`` that is at most ``replay_boundary(L_i)`` (0 if none): the module
    retention model (docs/replay.md), i.e. the align-mode hit of the run's hit
    accounting (``statediff.replay.hits``) for prompts that are prefixes of
    one sequence. The first request hits nothing.
    """
    return expected_hits_align(lengths, block_size)


def base_sequence(length: int, vocab_size: int, *, seed: int = 0,
                  exclude: Iterable[int] = ()) -> list[int]:
    """``length`` deterministic token ids drawn from ``[FIRST_TOKEN, vocab_size)`` minus ``exclude``.

    Raises:
        StatediffError: fewer than 2 token ids left to draw from.
    """
    allowed = np.setdiff1d(np.arange(FIRST_TOKEN, max(vocab_size, FIRST_TOKEN), dtype=np.int64),
                           np.fromiter((int(t) for t in exclude), dtype=np.int64))
    if allowed.size < 2:
        raise StatediffError(f"vocabulary of {vocab_size} ids leaves {allowed.size} token ids to draw "
                             f"a sweep from (ids < {FIRST_TOKEN} and special ids are excluded)")
    rng = np.random.default_rng(seed)
    return [int(t) for t in allowed[rng.integers(0, allowed.size, length)]]


def boundary_sweep(block_size: int, vocab_size: int, *, num_speculative_tokens: int = 0,
                   blocks: int = 2, few: int = DEFAULT_FEW, max_tokens: int = 16, seed: int = 0,
                   exclude: Iterable[int] = ()) -> Sweep:
    """Generate the replay of a boundary sweep (docs/replay.md, "Boundary sweeps").

    Args:
        block_size: the engine's actual block size ``B`` in tokens (for vLLM
            hybrids, after it raised the requested one).
        vocab_size: the model's vocabulary size (``config.json``).
        num_speculative_tokens: ``K``; 0 without a drafter.
        blocks: straddle the boundaries ``2B .. (blocks + 1)B``.
        few: offset of "a prefill ending a few tokens past a boundary"
            (one more when it equals ``K + 1``).
        max_tokens: output tokens per request (greedy).
        seed: seed of the base sequence.
        exclude: token ids never drawn (e.g. the tokenizer's special tokens).

    Returns:
        the sweep; ``sweep.turns`` is a replay (``prompt_token_ids`` turns).

    Raises:
        StatediffError: parameters that cannot make a sweep (``sweep_lengths``,
            ``base_sequence``) or ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise StatediffError(f"max_tokens must be at least 1, not {max_tokens}")
    labelled = sweep_lengths(block_size, num_speculative_tokens=num_speculative_tokens,
                             blocks=blocks, few=few)
    lengths = [n for _, n in labelled]
    excluded = sorted({int(t) for t in exclude if FIRST_TOKEN <= int(t) < vocab_size})
    base = base_sequence(max(lengths), vocab_size, seed=seed, exclude=excluded)
    hits = expected_hits(lengths, block_size)
    requests = [SweepRequest(label, n, h) for (label, n), h in zip(labelled, hits)]
    turns = [Turn(line=i + 1, id=f"sweep-{r.label}", prompt_token_ids=base[:r.length],
                  sampling={"max_tokens": max_tokens, "temperature": 0.0})
             for i, r in enumerate(requests)]
    return Sweep(block_size, num_speculative_tokens, blocks, few, vocab_size, seed, requests, turns,
                 excluded=len(excluded))
