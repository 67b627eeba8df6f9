"""Cheap per-tensor fingerprints: an exact hash plus float64 moments.

Computed once at record time and stored in the index, so that ``compare``
can skip every pair whose stored bytes are identical without reading them
(two-phase compare), and can order and bound the rest cheaply. The reader
also checks the hash of every tensor it reads, so a damaged file is
reported as damaged, never as a divergence.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import xxhash

from statediff.trace.dtypes import FLOAT_DTYPES, to_float

CHUNK_ELEMS = 1 << 16  # decode this many elements at a time: bounded scratch, stays in cache


def new_hasher() -> "xxhash.xxh3_128":
    """XXH3-128: the hash stored in the index (hex, 32 chars).

    Not cryptographic: it detects damage and identical tensors, it does not
    authenticate. Chosen over BLAKE2b because the hash runs on every recorded
    byte and XXH3 costs ~10x less (docs/performance.md, trace write throughput).
    """
    return xxhash.xxh3_128()


def stored_hash(stored: np.ndarray) -> str:
    """XXH3-128 hex digest of the C-order bytes of ``stored`` (any shape, storage dtype)."""
    flat = np.ascontiguousarray(stored).reshape(-1)
    h = new_hasher()
    h.update(memoryview(flat).cast("B"))  # xxhash releases the GIL on large buffers
    return h.hexdigest()


# Values are reduced in float32 when that is exact (every float8/bfloat16/float16
# value, small integers), else float64; sums always accumulate in float64.
_COMPUTE = {"float64": np.float64, "int64": np.float64, "int32": np.float64}
_FP8_F32 = {k: to_float(np.arange(256, dtype=np.uint8), k) for k in ("float8_e4m3fn", "float8_e5m2")}


def _compute_dtype(logical: str) -> type:
    return _COMPUTE.get(logical, np.float32)


def _decode_into(block: np.ndarray, logical: str, out: np.ndarray) -> None:
    """Exact values of stored elements ``block`` into ``out`` (same length, compute dtype)."""
    if logical == "bfloat16":  # bf16 bits are the upper half of an fp32
        np.left_shift(block, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif logical in _FP8_F32:
        np.take(_FP8_F32[logical], block, out=out)
    else:
        out[...] = block  # exact: float16/32/64, integers, bool


_spare = threading.local()  # scratch buffers returned by finished fingerprints, per thread


class Fingerprint:
    """Streaming form of ``fingerprint``: feed the C-order elements in order, any piece sizes.

    Moments are reduced over fixed blocks of ``CHUNK_ELEMS`` elements
    counted from the tensor's first element, so the result does not depend
    on how the elements were fed.
    """

    def __init__(self, logical: str) -> None:
        self.logical = logical
        self.hasher = new_hasher()
        self.compute = _compute_dtype(logical)
        self.direct = logical in ("float32", "float64")  # whole blocks reduce in place
        free = getattr(_spare, "buffers", None)
        if free is None:
            free = _spare.buffers = {}
        spare = free.get(self.compute)
        self.values = spare.pop() if spare else np.empty(CHUNK_ELEMS, self.compute)
        self.fill = 0
        self.out = {"hash": "", "sum": 0.0, "sumsq": 0.0, "min": 0.0, "max": 0.0,
                    "n_nan": 0, "n_inf": 0}
        self.lo, self.hi, self.seen = math.inf, -math.inf, False

    def update(self, flat: np.ndarray) -> None:
        """Feed the next elements (a 1-D C-contiguous array in storage dtype)."""
        self.hasher.update(memoryview(flat).cast("B"))  # releases the GIL on large buffers
        i, size = 0, flat.size
        with np.errstate(invalid="ignore", over="ignore"):  # signalling NaNs, huge sums
            while i < size:
                if self.direct and self.fill == 0 and size - i >= CHUNK_ELEMS:
                    self._reduce(flat[i:i + CHUNK_ELEMS])
                    i += CHUNK_ELEMS
                    continue
                n = min(CHUNK_ELEMS - self.fill, size - i)
                _decode_into(flat[i:i + n], self.logical, self.values[self.fill:self.fill + n])
                self.fill += n
                i += n
                if self.fill == CHUNK_ELEMS:
                    self._reduce(self.values)
                    self.fill = 0

    def _reduce(self, x: np.ndarray) -> None:
        out = self.out
        s = float(np.add.reduce(x, dtype=np.float64))
        if not math.isfinite(s):
            # a NaN or infinity is present (a finite sum proves there is none:
            # float64 cannot overflow on values decoded from 32 bits or less)
            finite = np.isfinite(x)
            nan = np.isnan(x)
            out["n_nan"] += int(nan.sum())
            out["n_inf"] += int((~finite & ~nan).sum())
            x = x[finite]
            if x.size == 0:
                return
            s = float(np.add.reduce(x, dtype=np.float64))
        out["sum"] += s
        # einsum, not np.dot: BLAS thread wake-ups cost milliseconds per call
        out["sumsq"] += float(np.einsum("i,i->", x, x, dtype=np.float64))
        self.lo = min(self.lo, float(x.min()))
        self.hi = max(self.hi, float(x.max()))
        self.seen = True

    def result(self) -> dict:
        """The fingerprint dict (see ``fingerprint``); call once, after the last update."""
        with np.errstate(invalid="ignore", over="ignore"):
            if self.fill:
                self._reduce(self.values[: self.fill])
                self.fill = 0
        self.out["hash"] = self.hasher.hexdigest()
        if self.seen:
            self.out["min"], self.out["max"] = self.lo, self.hi
        spare = _spare.buffers.setdefault(self.compute, [])
        if len(spare) < 4:  # reuse scratch on this thread: fresh pages are slow in some VMs
            spare.append(self.values)
        return dict(self.out)


def fingerprint(stored: np.ndarray, logical: str) -> dict:
    """Hash and moments of one stored tensor.

    Args:
        stored: the array in its storage dtype (bf16 as uint16 bits), any shape.
        logical: its logical dtype name.

    Returns:
        dict with ``hash`` (XXH3-128 hex of the C-order bytes), ``sum``,
        ``sumsq``, ``min``, ``max`` (float64, over finite decoded values;
        min/max are 0.0 when there are none), ``n_nan`` and ``n_inf``
        (counts). The moments are a deterministic function of the stored
        bytes and dtype: identical tensors get identical moments.
    """
    fp = Fingerprint(logical)
    fp.update(np.ascontiguousarray(stored).reshape(-1))
    return fp.result()


# Storage of the 8/16-bit floats as (signed, unsigned) integer views: a sign-magnitude pattern
# orders like its value among non-negative floats (unsigned) and reversed among negative ones.
_BITS = {"bfloat16": (np.int16, np.uint16), "float16": (np.int16, np.uint16),
         "float8_e4m3fn": (np.int8, np.uint8), "float8_e5m2": (np.int8, np.uint8)}


class Extremes:
    """Streaming min and max of a float tensor's values without decoding them (~20 GB/s).

    For the writer's fast path (``storage.encode`` with a summary): the sums
    come from the summary, only ``min``/``max`` of the index row are computed
    here. float32/float64 reduce directly. 8/16-bit floats reduce their bit
    patterns as integers: a sign-magnitude pattern read as signed (``i``)
    orders like its value among non-negative values and reversed among
    negative ones, read as unsigned (``u``) negative values come last, most
    negative first. So with both signs present the largest value is the
    pattern ``max(i)`` and the smallest ``max(u)`` (two passes); with one
    sign ``min(i)`` is the other end (a third pass, only then). NaN and
    infinity patterns are the extreme magnitudes of every format, so
    ``result()`` is None exactly when one is present (the caller then
    computes the full moments).
    """

    def __init__(self, logical: str) -> None:
        if logical not in FLOAT_DTYPES:
            raise ValueError(f"no extremes for {logical!r} (float dtypes only)")
        self.logical = logical
        self.bits = _BITS.get(logical)
        self.acc: list | None = None  # float min, max
        self.imax = self.umax = self.imin = None  # bit patterns seen (8/16-bit floats)
        if self.bits is not None:
            self.sign = 1 << (8 * np.dtype(self.bits[1]).itemsize - 1)

    def update(self, flat: np.ndarray) -> None:
        """Feed the next elements (1-D, storage dtype)."""
        if flat.size == 0:
            return
        if self.bits is None:
            got = [flat.min(), flat.max()]  # NaN propagates: result() sees it
            if self.acc is not None:  # np.minimum/maximum propagate NaN (min/max would not)
                got = [np.minimum(self.acc[0], got[0]), np.maximum(self.acc[1], got[1])]
            self.acc = got
            return
        i, u = flat.view(self.bits[0]), flat.view(self.bits[1])
        imax, umax = int(i.max()), int(u.max())
        self.imax = imax if self.imax is None else max(self.imax, imax)
        self.umax = umax if self.umax is None else max(self.umax, umax)
        if imax < 0 or umax < self.sign:  # one sign only in this piece: min(i) is an end
            imin = int(i.min())
            self.imin = imin if self.imin is None else min(self.imin, imin)

    def result(self) -> tuple[float, float] | None:
        """``(min, max)`` as float64 (0.0, 0.0 for no elements), or None when a NaN or infinity is present."""
        if self.bits is None:
            if self.acc is None:
                return 0.0, 0.0
            with np.errstate(invalid="ignore"):
                lo, hi = float(self.acc[0]), float(self.acc[1])
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return None  # NaN compares false: NaN inputs leave a NaN or an infinity here
            return lo, hi
        if self.imax is None:
            return 0.0, 0.0
        negative, non_negative = self.umax >= self.sign, self.imax >= 0
        # a piece with both signs set no imin, but then both are seen overall
        lo_bits = self.umax if negative else self.imin
        hi_bits = self.imax if non_negative else self.imin
        unsigned = self.bits[1]
        pats = np.array([hi_bits & (2 * self.sign - 1), lo_bits], dtype=unsigned)
        if self.logical == "float16":  # stored as <f2, the others as unsigned bit patterns
            pats = pats.view(np.float16)
        with np.errstate(invalid="ignore"):  # fp8 NaN patterns through the table
            hi, lo = (float(x) for x in to_float(pats, self.logical).astype(np.float64))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        return lo, hi


def extremes(stored: np.ndarray, logical: str) -> tuple[float, float] | None:
    """``(min, max)`` of a float tensor (``Extremes``), or None when it holds a NaN or infinity."""
    ex = Extremes(logical)
    ex.update(np.ascontiguousarray(stored).reshape(-1))
    return ex.result()
