"""What a wrong hit tensor matches instead: the diagnosis line of a report.

For a root divergence, the cold trace is searched for what the hit tensor
does equal, cheapest checks first:

1. all zeros, from the hit tensor's fingerprint or summary ("never written / zeroed");
2. bit-identical to a cold tensor of the same layer, kind, dtype and shape,
   with or without data (equal fingerprint hash between two tensors with
   data, else equal digests): the same request at another position (nearest
   first), another request at the same position, then any other;
3. the cold counterpart rounded to bfloat16: the hit digest equals the cold
   summary's ``digest_bf16`` (format version 3), or, for float32 tensors
   with data on both sides and no summary, the rounded cold data equals the hit data;
4. within tolerance of a same-shaped candidate with data of step 2's first
   two groups (at most ``MAX_FULL_COMPARES`` full reads; needs the hit data).

Steps 1-3 are exact matches and need no data when both traces carry
summaries (``/digests`` rows, version 3): a root recorded as a digest only
gets the same findings 1-3 as one with data. Without summaries (version 1
and 2 traces) digests are computed from the data on demand (``DigestCache``,
cold reads bounded by ``MAX_DIGEST_SEARCH_BYTES``).

Candidates are cold tensors only; the pair's own cold counterpart is not
one (it is the tensor that differs). For K/V blocks the finding also names
the logical blocks: "the block read as logical block j holds the cold
run's block j-1".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from statediff.trace.digest import digest_array
from statediff.trace.dtypes import round_to_bf16, storage_dtype, to_float
from statediff.trace.layers import label
from statediff.trace.reader import Trace
from statediff.trace.schema import DigestEntry, TensorEntry
from statediff.trace.summary import Summary, summarize

from .align import Entry, Pair
from .metrics import compare_arrays
from .tolerance import Policy

MAX_FULL_COMPARES = 32
MAX_READ_BYTES = 64 << 20  # no full-read checks on tensors larger than this
MAX_DIGEST_SEARCH_BYTES = 256 << 20  # cold data read to digest candidate tensors, per diagnosed root


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

    @property
    def key(self) -> tuple[int, int, int, str]:
        """The root's key (request, position, layer, kind), as ``Divergence.key``."""
        return (self.request, self.position, self.layer, self.kind)

    def to_text(self) -> str:
        return self.text

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _noun(kind: str) -> str:
    if kind.startswith("gdn."):
        return "state"
    if kind.startswith("attn."):
        return "KV block"
    if kind in ("drafter.input", "drafter.model_input"):
        return "drafter input row"
    return "tensor"


def offset_words(position: int, match_position: int, block_size: int | None) -> str:
    """'one block earlier (position 64, 16 tokens)' / '5 tokens later (position 85)'."""
    delta = match_position - position
    n, direction = abs(delta), ("earlier" if delta < 0 else "later")
    if block_size and n % block_size == 0:
        k = n // block_size
        blocks = "one block" if k == 1 else f"{k} blocks"
        return f"{blocks} {direction} (position {match_position}, {n} tokens)"
    return f"{n} token{'' if n == 1 else 's'} {direction} (position {match_position})"


def logical_block(e: Entry) -> int | None:
    """Logical block index of a K/V block entry (tokens [token_start, position)), None for a partial block."""
    n = e.position - e.token_start
    return e.token_start // n if n > 0 and e.token_start % n == 0 else None


def _where(e: Entry, run: Mapping[str, Any]) -> str:
    """"diagnosis: request R layer L KIND at position P" ("drafter layer i (layer L)" for the drafter's)."""
    return f"diagnosis: request {e.request} {label(run, e.layer, e.kind)} {e.kind} at position {e.position}"


def _finding(e: Entry, m: Entry, exact: bool, block_size: int | None, run: Mapping[str, Any]) -> Diagnosis:
    how = ", bit for bit" if exact else ", within tolerance"
    where = _where(e, run)
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


def has_data(e: Entry) -> bool:
    """The trace holds the tensor's data (an index entry), not only its digest row."""
    return isinstance(e, TensorEntry)


def _candidates(pair: Pair[Entry], cold: Trace) -> tuple[list[Entry], list[Entry], list[Entry]]:
    """Cold tensors (with data or digest only) of the hit tensor's layer, kind, dtype and shape:
    (same request, nearest position first and earlier before later; other requests at the same
    position; any other), the pair's own cold counterpart left out."""
    h, c = pair.hit, pair.cold
    same_req, same_pos, other = [], [], []
    for e in [*cold.entries, *getattr(cold, "digests", ())]:
        if (e.layer, e.kind, e.dtype, e.shape) != (h.layer, h.kind, h.dtype, h.shape) or e is c:
            continue
        if e.request == h.request:
            if e.position != h.position:
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


class DigestCache:
    """Digests and summaries (``statediff.trace.summary``) of trace tensors, computed once each.

    A digest row carries its digest (and, from format version 3, its
    summary); so does an index entry whose writer recorded a summary. Any
    other index entry is read in full (storage form) on first use and
    digested or summarised; ``bytes_read`` counts what was read.
    """

    def __init__(self) -> None:
        self._done: dict[tuple[int, str], str] = {}
        self._summaries: dict[tuple[int, str], Summary] = {}
        self.bytes_read = 0

    def known(self, trace: Trace, e: Entry) -> str | None:
        """The digest of ``e`` if it costs no read (a recorded one, or one computed before), else None."""
        if isinstance(e, DigestEntry):
            return e.digest_value
        summary = getattr(e, "summary", None)
        if summary is not None:
            return summary.digest
        return self._done.get((id(trace), e.dataset))

    def of(self, trace: Trace, e: Entry) -> str:
        """The digest of ``e`` (32 lowercase hex digits).

        Raises:
            TraceError: the tensor is unreadable.
        """
        d = self.known(trace, e)
        if d is not None:
            return d
        key = (id(trace), e.dataset)
        self.bytes_read += trace.nbytes(e)
        self._done[key] = digest_array(trace.read(e))
        return self._done[key]

    def summary(self, trace: Trace, e: Entry) -> Summary | None:
        """The summary of ``e``: the recorded one; for an index entry without one (a trace older
        than format version 3) computed from its data (``summarize``); None for a digest row
        without one (version 2: digest only).

        Raises:
            TraceError: the tensor is unreadable.
        """
        recorded = getattr(e, "summary", None)
        if recorded is not None or isinstance(e, DigestEntry):
            return recorded
        key = (id(trace), e.dataset)
        if key not in self._summaries:
            self.bytes_read += trace.nbytes(e)
            s = summarize(trace.read(e), e.dtype)
            self._summaries[key] = s
            self._done[key] = s.digest
        return self._summaries[key]


def _zeros_digest(e: Entry) -> str:
    return digest_array(np.zeros(e.shape, storage_dtype(e.dtype)))


def is_zeros(e: Entry, trace: Trace, digests: DigestCache) -> bool:
    """Every element of ``e`` is zero: from its index moments, its summary, or (a version-2 digest
    row) its digest against the digest of zeros. Reads no data."""
    if math.prod(e.shape) == 0:
        return False
    if isinstance(e, TensorEntry):
        return _is_zero(e)
    summary = getattr(e, "summary", None)
    if summary is not None and summary.known_moments:
        return summary.is_zero
    d = digests.known(trace, e)
    return d is not None and d == _zeros_digest(e)


def _bit_equal(h: Entry, hit: Trace, c: Entry, cold: Trace, digests: DigestCache, budget: list[int]) -> bool:
    """``h`` equals ``c`` bit for bit: fingerprint hashes when both have data, else digests.
    A cold tensor without a recorded digest is read only while ``budget[0]`` bytes remain."""
    if isinstance(h, TensorEntry) and isinstance(c, TensorEntry):
        return h.hash == c.hash
    want = digests.of(hit, h)
    got = digests.known(cold, c)
    if got is None:
        if cold.nbytes(c) > budget[0]:
            return False
        budget[0] -= cold.nbytes(c)
        got = digests.of(cold, c)
    return got == want


def _zeros(h: Entry, run: Mapping[str, Any]) -> Diagnosis:
    where = _where(h, run)
    return Diagnosis(h.request, h.position, h.layer, h.kind, "zeros", True, None, None, None,
                     f"{where} is all zeros: never written / zeroed")


def _bf16(pair: Pair[Entry], hit: Trace, cold: Trace, digests: DigestCache) -> bool:
    """The hit tensor is the cold counterpart rounded to bfloat16 (stored back in its own dtype):
    by digests when the cold side has a summary, else from the data of two float32 tensors."""
    h, c = pair
    summary = getattr(c, "summary", None)
    if summary is not None and pair.same_layout:
        return bool(summary.digest_bf16) and digests.of(hit, h) == summary.digest_bf16
    if not (isinstance(h, TensorEntry) and isinstance(c, TensorEntry)):
        return False
    if h.dtype != "float32" or c.dtype != "float32" or cold.nbytes(c) > MAX_READ_BYTES:
        return False
    rounded = round_to_bf16(to_float(cold.read(c), "float32"))
    return np.array_equal(rounded.view(np.uint32), hit.read(h).view(np.uint32))


def diagnose(pair: Pair[Entry], hit: Trace, cold: Trace, policy: Policy,
             digests: DigestCache | None = None) -> Diagnosis | None:
    """Search the cold trace for what the hit tensor of a root pair matches.

    Args:
        pair: the root divergence (same dtype and shape on both sides); either
            side may be a digest row (no data).
        hit, cold: the open traces the pair came from.
        policy: tolerances for the within-tolerance search.
        digests: digests computed so far (shared with the judging); a new cache when None.
    Returns:
        the first finding (order in the module docstring), or None.
    Raises:
        TraceError: a tensor that had to be read is unreadable.
    """
    digests = DigestCache() if digests is None else digests
    h = pair.hit
    block_size = cold.run.get("block_size") if isinstance(cold.run.get("block_size"), int) else None
    if is_zeros(h, hit, digests):
        return _zeros(h, hit.run)
    same_req, same_pos, other = _candidates(pair, cold)
    budget = [MAX_DIGEST_SEARCH_BYTES]
    for cand in same_req + same_pos + other:
        if _bit_equal(h, hit, cand, cold, digests, budget):
            return _finding(h, cand, True, block_size, hit.run)
    if not isinstance(h, TensorEntry) or hit.nbytes(h) > MAX_READ_BYTES:
        # no hit data: only exact matches (digests) can be searched
        return _rounded(pair, hit.run) if _bf16(pair, hit, cold, digests) else None
    if _bf16(pair, hit, cold, digests):
        return _rounded(pair, hit.run)
    if policy.for_pair(h, pair.cold).exact or not pair.same_dtype:
        return None  # within tolerance == bit identity: hashes said no (or nothing of the cold dtype to try)
    hit_data = hit.read(h)
    withdata = [e for e in same_req + same_pos if isinstance(e, TensorEntry)]
    for cand in withdata[:MAX_FULL_COMPARES]:
        if compare_arrays(hit_data, cold.read(cand), h.dtype, policy.for_entry(cand)).within:
            return _finding(h, cand, False, block_size, hit.run)
    return None


def _rounded(pair: Pair[Entry], run: Mapping[str, Any]) -> Diagnosis:
    h = pair.hit
    where = _where(h, run)
    return Diagnosis(h.request, h.position, h.layer, h.kind, "bf16_rounded", True,
                     pair.cold.request, pair.cold.position, 0,
                     f"{where} matches the cold {_noun(h.kind)} rounded to bfloat16")


def match_block(pair: Pair[Entry], hit: Trace, cold: Trace, digests: DigestCache,
                budget_bytes: int = MAX_DIGEST_SEARCH_BYTES, nearest: int | None = None) -> Entry | None:
    """The cold block of the same request, layer, kind, dtype and shape, at another position,
    whose digest equals the hit block's (nearest position first, earlier before later), or None.

    Cold tensors without a recorded digest are read and digested up to
    ``budget_bytes`` (each at most once per ``digests``); cold digest rows
    cost nothing. ``nearest`` limits the search to that many candidates
    (compare's judging of default-replay digests looks at the neighbours
    only, so that digesting stays one pass over the cold K/V).
    """
    cands = _candidates(pair, cold)[0][:nearest]
    budget = [budget_bytes]
    return next((e for e in cands if _bit_equal(pair.hit, hit, e, cold, digests, budget)), None)
