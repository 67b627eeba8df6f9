"""What a wrong hit tensor matches instead: the diagnosis line of a report.

For a root divergence, the cold trace is searched for what the hit tensor
does equal, cheapest checks first:

1. all zeros, from the hit tensor's fingerprint ("never written / zeroed");
2. bit-identical (equal fingerprint hash) to a cold tensor of the same
   layer, kind, dtype and shape: the same request at another position
   (nearest first), another request at the same position, then any other;
3. for float32 tensors, the cold counterpart rounded to bfloat16;
4. within tolerance of a same-shaped candidate of step 2's first two groups
   (at most ``MAX_FULL_COMPARES`` full reads).

Candidates are cold tensors only; the pair's own cold counterpart is not
one (it is the tensor that differs). For K/V blocks the finding also names
the logical blocks: "the block read as logical block j holds the cold
run's block j-1".

A digest-only block (``/digests``: no data, only its digest) is diagnosed
by digest (``diagnose_digest``): all zeros, then the cold blocks of the same
request, layer and kind, nearest first, digested on demand
(``DigestCache``), bit for bit only.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from statediff.trace.digest import digest_array
from statediff.trace.dtypes import round_to_bf16, storage_dtype, to_float
from statediff.trace.reader import Trace
from statediff.trace.schema import DigestEntry, TensorEntry

from .align import Entry, Pair
from .metrics import compare_arrays
from .tolerance import Policy

MAX_FULL_COMPARES = 32
MAX_READ_BYTES = 64 << 20  # no full-read checks on tensors larger than this
MAX_DIGEST_SEARCH_BYTES = 256 << 20  # cold data read to digest candidate blocks, per searched block


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """A finding about one root divergence.

    Attributes:
        request, position, layer, kind: the root's key.
        finding: "zeros", "other_position", "other_request", "bf16_rounded".
        exact: the match is bit for bit (else within tolerance).
        match_request, match_position: the cold tensor matched, if any.
        offset_tokens: match_position - position (negative: earlier).
        text: the one-line finding, as printed first in the report.
    """

    request: int
    position: int
    layer: int
    kind: str
    finding: str
    exact: bool
    match_request: int | None
    match_position: int | None
    offset_tokens: int | None
    text: str

    def to_text(self) -> str:
        return self.text

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _noun(kind: str) -> str:
    if kind.startswith("gdn."):
        return "state"
    if kind.startswith("attn."):
        return "KV block"
    return "tensor"


def offset_words(position: int, match_position: int, block_size: int | None) -> str:
    """'one block earlier (position 64, 16 tokens)' / '5 tokens later (position 85)'."""
    delta = match_position - position
    n, direction = abs(delta), ("earlier" if delta < 0 else "later")
    if block_size and n % block_size == 0:
        k = n // block_size
        blocks = "one block" if k == 1 else f"{k} blocks"
        return f"{blocks} {direction} (position {match_position}, {n} tokens)"
    return f"{n} tokens {direction} (position {match_position})"


def logical_block(e: Entry) -> int | None:
    """Logical block index of a K/V block entry (tokens [token_start, position)), None for a partial block."""
    n = e.position - e.token_start
    return e.token_start // n if n > 0 and e.token_start % n == 0 else None


def _finding(e: Entry, m: Entry, exact: bool, block_size: int | None) -> Diagnosis:
    how = ", bit for bit" if exact else ", within tolerance"
    where = f"diagnosis: request {e.request} layer {e.layer} {e.kind} at position {e.position}"
    noun = _noun(e.kind)
    if m.request == e.request:
        finding = "other_position"
        text = f"{where} matches the cold {noun} {offset_words(e.position, m.position, block_size)}{how}"
        j, k = logical_block(e), logical_block(m)
        if e.kind.startswith("attn.") and j is not None and k is not None and j != k \
                and e.position - e.token_start == m.position - m.token_start:
            text += f": the block read as logical block {j} holds the cold run's block {k}"
    else:
        finding = "other_request"
        at = "at the same position" if m.position == e.position else f"at position {m.position}"
        text = f"{where} matches request {m.request}'s cold {noun} {at}{how}"
    return Diagnosis(e.request, e.position, e.layer, e.kind, finding, exact, m.request, m.position,
                     m.position - e.position, text)


def _candidates(pair: Pair, cold: Trace) -> tuple[list[TensorEntry], list[TensorEntry], list[TensorEntry]]:
    h, c = pair.hit, pair.cold
    same_req, same_pos, other = [], [], []
    for e in cold.entries:
        if (e.layer, e.kind, e.dtype, e.shape) != (h.layer, h.kind, h.dtype, h.shape) or e.dataset == c.dataset:
            continue
        if e.request == h.request:
            same_req.append(e)
        elif e.position == h.position:
            same_pos.append(e)
        else:
            other.append(e)
    same_req.sort(key=lambda e: (abs(e.position - h.position), e.position > h.position))
    same_pos.sort(key=lambda e: e.request)
    other.sort(key=lambda e: (e.request, abs(e.position - h.position)))
    return same_req, same_pos, other


def _is_zero(e: TensorEntry) -> bool:
    return e.numel > 0 and e.n_nan == 0 and e.n_inf == 0 and e.sumsq == 0.0


def diagnose(pair: Pair, hit: Trace, cold: Trace, policy: Policy) -> Diagnosis | None:
    """Search the cold trace for what the hit tensor of a root pair matches.

    Args:
        pair: the root divergence (same dtype and shape on both sides).
        hit, cold: the open traces the pair came from.
        policy: tolerances for the within-tolerance search.
    Returns:
        the first finding (order in the module docstring), or None.
    Raises:
        TraceError: a tensor needed for a full compare is unreadable.
    """
    h = pair.hit
    block_size = cold.run.get("block_size") if isinstance(cold.run.get("block_size"), int) else None
    where = f"diagnosis: request {h.request} layer {h.layer} {h.kind} at position {h.position}"
    if _is_zero(h):
        return Diagnosis(h.request, h.position, h.layer, h.kind, "zeros", True, None, None, None,
                         f"{where} is all zeros: never written / zeroed")
    same_req, same_pos, other = _candidates(pair, cold)
    for cand in same_req + same_pos + other:
        if cand.hash == h.hash:
            return _finding(h, cand, True, block_size)
    if hit.nbytes(h) > MAX_READ_BYTES:
        return None
    hit_data = hit.read(h)
    if h.dtype == "float32" and pair.cold.dtype == "float32":
        rounded = round_to_bf16(to_float(cold.read(pair.cold), "float32"))
        if np.array_equal(rounded.view(np.uint32), hit_data.view(np.uint32)):
            return Diagnosis(h.request, h.position, h.layer, h.kind, "bf16_rounded", True,
                             pair.cold.request, pair.cold.position, 0,
                             f"{where} matches the cold {_noun(h.kind)} rounded to bfloat16")
    if policy.for_pair(h, pair.cold).exact or not pair.same_dtype:
        return None  # within tolerance == bit identity: hashes said no (or nothing of the cold dtype to try)
    for cand in (same_req + same_pos)[:MAX_FULL_COMPARES]:
        if compare_arrays(hit_data, cold.read(cand), h.dtype, policy.for_entry(cand)).within:
            return _finding(h, cand, False, block_size)
    return None


class DigestCache:
    """Block digests (``statediff.trace.digest``) of trace tensors, computed once each.

    A ``DigestEntry`` carries its digest; a ``TensorEntry`` is read in full
    (storage form) and digested on first use. ``bytes_read`` counts what was read.
    """

    def __init__(self) -> None:
        self._done: dict[tuple[int, str], str] = {}
        self.bytes_read = 0

    def of(self, trace: Trace, e: Entry) -> str:
        """The digest of ``e`` (32 lowercase hex digits).

        Raises:
            TraceError: the tensor is unreadable.
        """
        if isinstance(e, DigestEntry):
            return e.digest
        key = (id(trace), e.dataset)
        if key not in self._done:
            self.bytes_read += trace.nbytes(e)
            self._done[key] = digest_array(trace.read(e))
        return self._done[key]


def _zeros_digest(e: Entry) -> str:
    return digest_array(np.zeros(e.shape, storage_dtype(e.dtype)))


def match_block(pair: Pair[Entry], hit: Trace, cold: Trace, digests: DigestCache,
                budget_bytes: int = MAX_DIGEST_SEARCH_BYTES, nearest: int | None = None) -> Entry | None:
    """The cold block of the same request, layer, kind, dtype and shape, at another position,
    whose digest equals the hit block's (nearest position first, earlier before later), or None.

    Cold tensors are read and digested up to ``budget_bytes`` (each at most
    once per ``digests``); cold digest rows cost nothing. ``nearest`` limits
    the search to that many candidates (compare's judging of default-replay
    digests looks at the neighbours only, so that digesting stays one pass
    over the cold K/V).
    """
    h = pair.hit
    want = digests.of(hit, h)
    cands = [e for e in [*cold.entries, *getattr(cold, "digests", ())]
             if (e.request, e.layer, e.kind, e.dtype, e.shape) == (h.request, h.layer, h.kind, h.dtype, h.shape)
             and e.position != h.position]
    cands.sort(key=lambda e: (abs(e.position - h.position), e.position > h.position))
    cands = cands[:nearest]
    spent = 0
    for e in cands:
        if isinstance(e, TensorEntry):
            if spent + cold.nbytes(e) > budget_bytes:
                continue
            spent += cold.nbytes(e)
        if digests.of(cold, e) == want:
            return e
    return None


def diagnose_digest(pair: Pair[Entry], hit: Trace, cold: Trace, digests: DigestCache) -> Diagnosis | None:
    """What a digest-only root block matches instead, by digest (bit for bit only).

    Args:
        pair: the root pair; at least one side is a digest row; same dtype and shape.
        hit, cold: the open traces.
        digests: digests computed so far (shared with the judging).
    Returns:
        "zeros" when the hit block digests like all zeros, else "other_position"
        for a cold block of the same request that it equals, else None.
    Raises:
        TraceError: a cold tensor needed for a digest is unreadable.
    """
    h = pair.hit
    block_size = cold.run.get("block_size") if isinstance(cold.run.get("block_size"), int) else None
    if math.prod(h.shape) > 0 and digests.of(hit, h) == _zeros_digest(h):
        where = f"diagnosis: request {h.request} layer {h.layer} {h.kind} at position {h.position}"
        return Diagnosis(h.request, h.position, h.layer, h.kind, "zeros", True, None, None, None,
                         f"{where} is all zeros: never written / zeroed")
    m = match_block(pair, hit, cold, digests)
    return None if m is None else _finding(h, m, True, block_size)
