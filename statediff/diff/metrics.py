"""Error metrics of one (hit, cold) tensor pair, in float64, streamed.

Small pure functions compute each metric on one block of decoded values
(``abs_error``, ``beyond``, ``nonfinite_mismatch``, ``ulp_distance``); an
``Accumulator`` folds them over the blocks of a tensor so memory stays
bounded by one block per side; ``measure_pair`` runs the two-phase check:
equal fingerprint hashes short-circuit without reading any data, otherwise
both tensors are streamed with ``Trace.iter_blocks``.

Conventions: the cold tensor is the reference (``rel_l2 = |hit-cold| /
|cold|``); metrics other than the non-finite count are over elements finite
on both sides; NaN at the same place on both sides, or the same infinity,
compare equal; NaN/Inf on one side only always diverges. Each side is
decoded with its own logical dtype: a pair whose dtypes differ (a bf16 SSM
state against a float32 one) is compared in float64 after decoding, with
no ULP distance (it has no meaning across dtypes).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from statediff.trace.dtypes import FLOAT_DTYPES, ordered_bits, to_float
from statediff.errors import TraceError
from .tolerance import Tolerance

if TYPE_CHECKING:
    from statediff.trace.reader import Trace
    from statediff.trace.schema import TensorEntry

STREAM_BLOCK_BYTES = 2 << 20  # per side; the arithmetic runs on SUB_ELEMS pieces of it (~3 MB of temporaries)
ULP_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})  # dtypes.ordered_bits knows them


# -- per-block metric functions ------------------------------------------------

def decode64(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (storage dtype) as float64; integers cast exactly."""
    if dtype in FLOAT_DTYPES:
        return to_float(stored, dtype).astype(np.float64, copy=False)
    return stored.astype(np.float64)


def bits(stored: np.ndarray) -> np.ndarray:
    """The stored bit patterns as unsigned integers (for bit-identity checks)."""
    return stored.view(f"u{stored.itemsize}") if stored.dtype.kind == "f" else stored


def abs_error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| where both are finite, 0 elsewhere (float64)."""
    both = np.isfinite(a) & np.isfinite(b)
    return np.abs(np.subtract(a, b, out=np.zeros(np.broadcast(a, b).shape), where=both))


def nonfinite_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """True where NaN/Inf appears on one side only (or infinities of opposite sign)."""
    both_finite = np.isfinite(a) & np.isfinite(b)
    same = (np.isnan(a) & np.isnan(b)) | (a == b)
    return ~both_finite & ~same


def threshold(b: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Allowed |hit - cold| per element: atol + rtol * |cold|."""
    return tol.atol + tol.rtol * np.abs(np.where(np.isfinite(b), b, 0.0))


def ulp_distance(a_stored: np.ndarray, b_stored: np.ndarray, dtype: str) -> np.ndarray | None:
    """|ordered_bits(a) - ordered_bits(b)| (int64), or None for non-ULP dtypes."""
    oa, ob = ordered_bits(a_stored, dtype), ordered_bits(b_stored, dtype)
    if oa is None or ob is None:
        return None
    return np.abs(oa - ob)


SUB_ELEMS = 12288  # elements per piece of a block: float64 temporaries of 96 KiB (< glibc's 128 KiB mmap threshold)
_ORDERED = {"float32": (np.int32, np.int64), "bfloat16": (np.int16, np.int32), "float16": (np.int16, np.int32)}


def _max_ulp(a_stored: np.ndarray, b_stored: np.ndarray, dtype: str) -> int | None:
    """max |ordered_bits(a) - ordered_bits(b)| over all elements (the value of
    ``ulp_distance(...).max()``, 0 when empty), without widening both sides first.

    Where a and b have the same sign bit the ULP distance is the difference of
    their bit patterns; only blocks holding a sign change take the general path.
    """
    spec = _ORDERED.get(dtype)
    if spec is None or a_stored.size == 0:
        u = ulp_distance(a_stored, b_stored, dtype)
        return None if u is None else (int(u.max()) if u.size else 0)
    narrow, wide = spec
    ia, ib = a_stored.view(narrow), b_stored.view(narrow)
    if (np.bitwise_xor(ia, ib) < 0).any():  # a sign change somewhere
        u = ulp_distance(a_stored, b_stored, dtype)
        return int(u.max())
    diff = np.subtract(ia, ib, dtype=wide)
    return int(max(diff.max(), -diff.min()))


# -- result and accumulation ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PairMetrics:
    """What comparing one pair measured (all errors in the tensor's units).

    Attributes:
        numel: elements compared.
        identical: bit-identical (equal fingerprint hash; no data was read).
        max_abs, rel_l2, cosine: over elements finite on both sides
            (cosine is 1.0 when both are all zero, 0.0 when one is).
        n_beyond: elements beyond tolerance (incl. NaN/Inf on one side only).
        worst_index, hit_value, cold_value: the element of largest abs error
            (the first differing one if none differs in value), index into
            the logical shape; None when nothing differs.
        worst_ulp, max_ulp: ULP distance at the worst element, and the
            largest over finite elements (None for non-float/fp8 dtypes).
        n_nonfinite: elements NaN/Inf on one side only.
        first_nonfinite, nonfinite_hit, nonfinite_cold: the first such element.
        severity: max over elements of |error| / threshold (inf when the
            threshold is 0 and the element differs); <= 1 means within.
    """

    numel: int
    identical: bool = False
    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0
    n_beyond: int = 0
    worst_index: tuple[int, ...] | None = None
    hit_value: float | None = None
    cold_value: float | None = None
    worst_ulp: int | None = None
    max_ulp: int | None = None
    n_nonfinite: int = 0
    first_nonfinite: tuple[int, ...] | None = None
    nonfinite_hit: float | None = None
    nonfinite_cold: float | None = None
    severity: float = 0.0

    @property
    def within(self) -> bool:
        """No element beyond tolerance (``bool(metrics)`` is the same)."""
        return self.n_beyond == 0

    def __bool__(self) -> bool:
        return self.within

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Accumulator:
    """Folds per-block metrics of one pair (blocks in C order) into PairMetrics.

    ``dtype`` is the hit side's logical dtype, ``cold_dtype`` the cold
    side's (default: the same); blocks arrive in each side's storage dtype.
    """

    def __init__(self, shape: tuple[int, ...], dtype: str, tol: Tolerance, cold_dtype: str | None = None) -> None:
        self.shape, self.dtype, self.tol = shape, dtype, tol
        self.cold_dtype = dtype if cold_dtype is None else cold_dtype
        self.mixed = self.cold_dtype != dtype  # compared by value only: bits and ULPs mean nothing across dtypes
        # running values of PairMetrics' fields; result() builds the frozen record once
        self.m = types.SimpleNamespace(**dataclasses.asdict(PairMetrics(numel=math.prod(shape))))
        self._ss_d = self._ss_a = self._ss_b = self._dot = 0.0
        self._worst_flat: int | None = None
        self._first_diff: tuple[int, float, float] | None = None
        self._offset = 0

    def update(self, a_stored: np.ndarray, b_stored: np.ndarray) -> None:
        """Add one block (flat, storage dtype, same length on both sides).

        Works in pieces of ``SUB_ELEMS`` elements, so that the float64
        temporaries stay in cache and on the heap (bigger ones are fresh
        mmap'd pages each time, which page-fault: ~15x slower here). A piece
        whose values are all finite on both sides takes a shorter path
        (``_update_finite``) with exactly the same results.
        """
        # NaN/Inf are counted explicitly; casting a signalling NaN or squaring a huge value must not
        # print numpy warnings (a damaged tensor's bytes decode to anything before its hash fails)
        with np.errstate(invalid="ignore", over="ignore"):
            if a_stored.size == 0:
                self._update(a_stored, b_stored)
            for i in range(0, a_stored.size, SUB_ELEMS):
                a, b = a_stored[i:i + SUB_ELEMS], b_stored[i:i + SUB_ELEMS]
                if not self._update_finite(a, b):
                    self._update(a, b)

    def _update_finite(self, a_stored: np.ndarray, b_stored: np.ndarray) -> bool:
        """The fast path; returns False (having changed nothing) unless every value is finite."""
        a, b = decode64(a_stored, self.dtype), decode64(b_stored, self.cold_dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.subtract(a, b)
            np.abs(d, out=d)
            finite = math.isfinite(float(np.add.reduce(d)))
        if not finite:
            return False  # NaN/Inf on a side (or a float64 overflow): the general path
        tol, m = self.tol, self.m
        if tol.exact:
            n = int(np.count_nonzero(d if self.mixed else bits(a_stored) != bits(b_stored)))
            sev = math.inf if n else 0.0
        else:
            if tol.atol <= 0.0:
                return False  # thresholds may be 0: the general path handles the division
            thr = np.abs(b)
            thr *= tol.rtol
            thr += tol.atol
            n = int(np.count_nonzero(d > thr))
            np.divide(d, thr, out=thr)
            sev = float(thr.max()) if thr.size else 0.0
        off = self._offset
        self._offset += a_stored.size
        m.n_beyond += n
        m.severity = max(m.severity, sev)
        self._ss_d += float(np.einsum("i,i->", d, d))
        self._ss_a += float(np.einsum("i,i->", a, a))
        self._ss_b += float(np.einsum("i,i->", b, b))
        self._dot += float(np.einsum("i,i->", a, b))
        dmax = float(d.max()) if d.size else 0.0
        if dmax > m.max_abs:
            i = int(d.argmax())
            m.max_abs, self._worst_flat = dmax, off + i
            m.hit_value, m.cold_value = float(a[i]), float(b[i])
            u = None if self.mixed else ulp_distance(a_stored[i:i + 1], b_stored[i:i + 1], self.dtype)
            m.worst_ulp = None if u is None else int(u[0])
        elif self._first_diff is None and dmax == 0.0 and not self.mixed:  # values equal: any differing bits are -0.0/+0.0
            differ = bits(a_stored) != bits(b_stored)
            if differ.any():
                i = int(differ.argmax())
                self._first_diff = (off + i, float(a[i]), float(b[i]))
        u = None if self.mixed else _max_ulp(a_stored, b_stored, self.dtype)
        if u is not None:
            m.max_ulp = max(m.max_ulp or 0, u)
        return True

    def _update(self, a_stored: np.ndarray, b_stored: np.ndarray) -> None:
        m, off = self.m, self._offset
        self._offset += a_stored.size
        a, b = decode64(a_stored, self.dtype), decode64(b_stored, self.cold_dtype)
        both = np.isfinite(a) & np.isfinite(b)
        d = abs_error(a, b)
        bad = nonfinite_mismatch(a, b)
        differ = (d > 0) | bad if self.mixed else bits(a_stored) != bits(b_stored)
        if self.tol.exact:
            beyond = differ
            sev = np.where(beyond, np.inf, 0.0)
        else:
            thr = threshold(b, self.tol)
            beyond = (d > thr) | bad
            sev = np.divide(d, thr, out=np.where(d > 0, np.inf, 0.0), where=thr > 0)
            sev[bad] = np.inf
        m.n_beyond += int(beyond.sum())
        if sev.size:
            m.severity = max(m.severity, float(sev.max()))
        af, bf = np.where(both, a, 0.0), np.where(both, b, 0.0)
        self._ss_d += float(np.einsum("i,i->", d, d))
        self._ss_a += float(np.einsum("i,i->", af, af))
        self._ss_b += float(np.einsum("i,i->", bf, bf))
        self._dot += float(np.einsum("i,i->", af, bf))
        if d.size and d.max() > m.max_abs:
            i = int(d.argmax())
            m.max_abs, self._worst_flat = float(d[i]), off + i
            m.hit_value, m.cold_value = float(a[i]), float(b[i])
            u = None if self.mixed else ulp_distance(a_stored[i:i + 1], b_stored[i:i + 1], self.dtype)
            m.worst_ulp = None if u is None else int(u[0])
        if self._first_diff is None:
            diff = differ & both
            if diff.any():
                i = int(diff.argmax())
                self._first_diff = (off + i, float(a[i]), float(b[i]))
        if bad.any():
            if m.first_nonfinite is None:
                i = int(bad.argmax())
                m.first_nonfinite = self._unravel(off + i)
                m.nonfinite_hit, m.nonfinite_cold = float(a[i]), float(b[i])
            m.n_nonfinite += int(bad.sum())
        u = None if self.mixed else ulp_distance(a_stored[both], b_stored[both], self.dtype)
        if u is not None:
            m.max_ulp = max(m.max_ulp or 0, int(u.max()) if u.size else 0)

    def _unravel(self, flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, self.shape)) if self.shape else ()

    def result(self) -> PairMetrics:
        """Finish: norms to rel L2 / cosine, flat indices to logical indices; the frozen record."""
        m = types.SimpleNamespace(**vars(self.m))
        m.rel_l2 = _ratio(math.sqrt(self._ss_d), math.sqrt(self._ss_b))
        na, nb = math.sqrt(self._ss_a), math.sqrt(self._ss_b)
        m.cosine = 1.0 if na == nb == 0 else (0.0 if na * nb == 0 else self._dot / (na * nb))
        if self._worst_flat is not None:
            m.worst_index = self._unravel(self._worst_flat)
        elif self._first_diff is not None:  # finite values differ in bits only (-0.0 / +0.0)
            flat, m.hit_value, m.cold_value = self._first_diff
            m.worst_index = self._unravel(flat)
            m.worst_ulp = 0 if self.dtype in ULP_DTYPES else None
        return PairMetrics(**vars(m))


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def compare_blocks(blocks: Iterable[tuple[np.ndarray, np.ndarray]], shape: tuple[int, ...],
                   dtype: str, tol: Tolerance, cold_dtype: str | None = None) -> PairMetrics:
    """Metrics over (hit, cold) block pairs (flat, each in its storage dtype, C order).

    ``dtype``/``cold_dtype``: logical dtypes of the hit and cold side (cold
    defaults to the hit's).
    """
    acc = Accumulator(shape, dtype, tol, cold_dtype)
    for a, b in blocks:
        acc.update(a, b)
    return acc.result()


def compare_arrays(hit: np.ndarray, cold: np.ndarray, dtype: str, tol: Tolerance,
                   cold_dtype: str | None = None) -> PairMetrics:
    """Metrics of two in-memory stored arrays of the same shape (logical dtypes as for ``compare_blocks``)."""
    return compare_blocks([(hit.reshape(-1), cold.reshape(-1))], tuple(cold.shape), dtype, tol, cold_dtype)


def identical(numel: int) -> PairMetrics:
    """Metrics of a bit-identical pair (nothing read)."""
    return PairMetrics(numel=numel, identical=True)


def measure_pair(hit: "Trace", he: "TensorEntry", cold: "Trace", ce: "TensorEntry",
                 tol: Tolerance, block_bytes: int = STREAM_BLOCK_BYTES) -> PairMetrics:
    """Two-phase compare of one aligned pair (same shape required; each side decoded with its own dtype).

    Equal fingerprint hashes (and dtypes) short-circuit without reading data;
    otherwise both tensors stream block by block (memory ~ one block per side).

    Raises:
        TraceError: a tensor is missing or unreadable.
    """
    if he.hash == ce.hash and he.dtype == ce.dtype:
        return identical(ce.numel)
    blocks = paired_blocks(hit.iter_blocks(he, block_bytes), cold.iter_blocks(ce, block_bytes))
    return compare_blocks(blocks, ce.shape, he.dtype, tol, ce.dtype)


def paired_blocks(a: Iterator[np.ndarray], b: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Equal-length pieces of two flat block streams whose block sizes may differ.

    Both iterators are always run to their end (the reader verifies a
    tensor's hash after its last block).

    Raises:
        TraceError: the streams hold different numbers of elements.
    """
    x = y = np.zeros(0)
    while True:
        x, y = _refill(a, x), _refill(b, y)
        if x is None or y is None:
            unequal = x is not None or y is not None
            for it in (a, b):
                for _ in it:  # finish both streams
                    unequal = True
            if unequal:
                raise TraceError("the two tensors of a pair stream different numbers of elements")
            return
        n = min(x.size, y.size)
        yield x[:n], y[:n]
        x, y = x[n:], y[n:]


def _refill(it: Iterator[np.ndarray], cur: np.ndarray | None) -> np.ndarray | None:
    """``cur`` if it has elements left, else the next non-empty block (None at the end)."""
    while cur is not None and cur.size == 0:
        cur = next(it, None)
    return cur
