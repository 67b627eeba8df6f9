"""Cheap per-tensor fingerprints: an exact hash plus float64 moments.

Computed once at record time and stored in the index, so that ``compare``
can skip every pair whose stored bytes are identical without reading them
(two-phase compare), and can order and bound the rest cheaply. The reader
also checks the hash of every tensor it reads, so a damaged file is
reported as damaged, never as a divergence.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..dtypes import FLOAT_DTYPES, to_float

CHUNK_ELEMS = 1 << 18  # decode this many elements at a time: bounds extra memory, stays in cache


def new_hasher() -> "hashlib._Hash":
    """blake2b with a 16-byte digest: the hash stored in the index (hex, 32 chars)."""
    return hashlib.blake2b(digest_size=16)


def stored_hash(stored: np.ndarray) -> str:
    """blake2b-128 hex digest of the C-order bytes of ``stored`` (any shape, storage dtype)."""
    flat = np.ascontiguousarray(stored).reshape(-1)
    h = new_hasher()
    h.update(memoryview(flat).cast("B"))  # hashlib releases the GIL on large buffers
    return h.hexdigest()


def _decode64(block: np.ndarray, logical: str) -> np.ndarray:
    """Exact float64 values of a block of stored elements."""
    if logical in ("float32", "float16", "float64"):
        return block.astype(np.float64)
    if logical in FLOAT_DTYPES:  # bf16 / fp8 bit patterns
        return to_float(block, logical).astype(np.float64)
    return block.astype(np.float64)  # integers and bool: exact below 2**53


def fingerprint(stored: np.ndarray, logical: str) -> dict:
    """Hash and moments of one stored tensor.

    Args:
        stored: the array in its storage dtype (bf16 as uint16 bits), any shape.
        logical: its logical dtype name.

    Returns:
        dict with ``hash`` (blake2b-128 hex of the C-order bytes), ``sum``,
        ``sumsq``, ``min``, ``max`` (float64, over finite decoded values;
        min/max are 0.0 when there are none), ``n_nan`` and ``n_inf``
        (counts). The moments are a deterministic function of the stored
        bytes, shape and dtype: identical tensors get identical moments.
    """
    flat = np.ascontiguousarray(stored).reshape(-1)
    out = {"hash": stored_hash(flat), "sum": 0.0, "sumsq": 0.0, "min": 0.0, "max": 0.0,
           "n_nan": 0, "n_inf": 0}
    lo, hi, seen = np.inf, -np.inf, False
    for start in range(0, flat.size, CHUNK_ELEMS):
        x = _decode64(flat[start:start + CHUNK_ELEMS], logical)
        s = float(x.sum())
        if not np.isfinite(s):
            # a NaN or infinity is present (a finite sum proves there is none:
            # float64 cannot overflow on values decoded from 32 bits or less)
            finite = np.isfinite(x)
            nan = np.isnan(x)
            out["n_nan"] += int(nan.sum())
            out["n_inf"] += int((~finite & ~nan).sum())
            x = x[finite]
            if x.size == 0:
                continue
            s = float(x.sum())
        out["sum"] += s
        out["sumsq"] += float(np.dot(x, x))
        lo, hi, seen = min(lo, float(x.min())), max(hi, float(x.max())), True
    if seen:
        out["min"], out["max"] = lo, hi
    return out
