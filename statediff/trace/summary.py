"""Per-tensor summaries: what a trace keeps of every captured tensor, with or without its data.

A ``Summary`` answers "is this tensor the same in both runs?" without the
data: an exact 128-bit fingerprint (``statediff.trace.digest``), the same
fingerprint of the tensor rounded to bfloat16 (float32 tensors), float64
moments, and a 16-value random-projection sketch from which the L2 norm of
a hit/cold difference is estimated (``estimate_l2``). The engine side
computes them on the device (``statediff_hooks.recording.digest.summarize_rows``);
this module is the numpy reference, bit-identical for digests and counts.
Definitions, the estimator's interval and what each field supports:
docs/trace-format.md, "Digests".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .digest import GOLDEN, digest_array, mix64
from .dtypes import round_to_bf16, to_float

SKETCH_DIM = 16
SKETCH_SEED = 0xA4093822299F31D0  # more digits of pi
SKETCH_PIECE = 1 << 16  # elements per piece: a [piece, 16] float64 sign matrix is 8 MiB
# chi-square quantiles of SKETCH_DIM degrees of freedom, divided by SKETCH_DIM: with probability
# 99%, est**2 / ||d||**2 lies in [Q_LO, Q_HI] (Gaussian projection; Rademacher signs are dominated)
Q_LO = 0.32138784019023076  # chi2.ppf(0.005, 16) / 16
Q_HI = 2.141699158614241  # chi2.ppf(0.995, 16) / 16

_U64 = np.uint64


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """What a trace keeps of one tensor whatever the keep policy (a ``/digests`` row, version 3).

    Attributes:
        digest: 32 lowercase hex digits, ``digest_array`` of the storage bytes.
        digest_bf16: float32 tensors: the digest of ``round_to_bf16`` of the
            tensor (stored back as float32); "" for other dtypes.
        sum, sumsq: float64 sum and sum of squares of the finite decoded values (NaN: unknown).
        absmax: float64 max |x| of the finite values, 0.0 when there are none (NaN: unknown).
        n_nan, n_inf: counts of NaN and +-Inf elements (-1: unknown).
        sketch: ``SKETCH_DIM`` values, rounded to float32 (None: unknown, version-2 rows).
    """

    digest: str
    digest_bf16: str = ""
    sum: float = math.nan
    sumsq: float = math.nan
    absmax: float = math.nan
    n_nan: int = -1
    n_inf: int = -1
    sketch: tuple[float, ...] | None = None

    @property
    def known_moments(self) -> bool:
        return self.n_nan >= 0 and self.n_inf >= 0 and not math.isnan(self.sumsq)

    @property
    def is_zero(self) -> bool:
        """Every element is 0.0 (or -0.0): no NaN/Inf and a zero sum of squares."""
        return self.known_moments and self.n_nan == 0 and self.n_inf == 0 and self.sumsq == 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"sketch": None if self.sketch is None else list(self.sketch)}


def sketch_hash(start: int, n: int) -> np.ndarray:
    """``h_i`` for elements ``start .. start + n - 1``: uint64 ``[n]``; bit j is the sign of row j."""
    with np.errstate(over="ignore"):
        z = np.arange(start + 1, start + 1 + n, dtype=_U64)
        z *= _U64(GOLDEN)
        z += _U64(SKETCH_SEED)
        return mix64(z)


def sketch_signs(start: int, n: int) -> np.ndarray:
    """The projection's signs for elements ``start .. start + n - 1``: float64 ``[n, SKETCH_DIM]`` of +-1."""
    h = sketch_hash(start, n)
    bits = (h[:, None] >> np.arange(SKETCH_DIM, dtype=_U64)[None, :]) & _U64(1)
    return bits.astype(np.float64) * 2.0 - 1.0


def summarize(arr: np.ndarray, dtype: str) -> Summary:
    """The summary of one tensor (reference implementation).

    Args:
        arr: any shape, in trace storage form (``statediff.trace.dtypes.STORAGE``:
            bfloat16 as ``<u2`` bit patterns, fp8 as ``u1``), as ``Trace.read`` returns it.
        dtype: its logical dtype name ("float32", "bfloat16", ...).

    Returns:
        the ``Summary`` (field definitions in the class docstring).

    Raises:
        TraceError: an unknown logical dtype (from ``dtypes``).
    """
    arr = np.ascontiguousarray(arr)
    digest = digest_array(arr)
    flat = arr.reshape(-1)
    if dtype == "bool":
        flat = (flat != 0).astype(np.uint8)
    with np.errstate(invalid="ignore"):  # signalling NaNs warn in the cast; they are counted below
        v = to_float(flat, dtype).astype(np.float64)
    nan, inf = np.isnan(v), np.isinf(v)
    v = np.where(nan | inf, 0.0, v)
    sketch = np.zeros(SKETCH_DIM, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 sums of huge values may overflow: Inf is kept
        for s in range(0, v.size, SKETCH_PIECE):
            piece = v[s:s + SKETCH_PIECE]
            sketch += piece @ sketch_signs(s, piece.size)
        sketch /= math.sqrt(SKETCH_DIM)
        sketch32 = sketch.astype(np.float32)
    bf16 = ""
    if dtype == "float32":
        bf16 = digest_array(round_to_bf16(arr.astype("<f4", copy=False)).reshape(arr.shape))
    return Summary(
        digest=digest, digest_bf16=bf16, sum=float(v.sum()), sumsq=float(np.dot(v, v)),
        absmax=float(np.abs(v).max()) if v.size else 0.0, n_nan=int(nan.sum()), n_inf=int(inf.sum()),
        sketch=tuple(float(x) for x in sketch32))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The L2 norm of a hit/cold difference, estimated from two sketches.

    Attributes:
        l2: ``||sketch_hit - sketch_cold||_2`` (float64; tensor units).
        low, high: the 99% interval of the true ``||hit - cold||_2``
            (``l2 / sqrt(Q_HI)``, ``l2 / sqrt(Q_LO)``).
        norm_cold: ``sqrt(cold.sumsq)``, the cold tensor's L2 norm.
        rel_l2: ``l2 / norm_cold`` (inf when the cold tensor is all zeros and l2 > 0; 0 when both 0).
    """

    l2: float
    low: float
    high: float
    norm_cold: float
    rel_l2: float

    def to_json(self) -> dict:
        return {k: (v if math.isfinite(v) else None) for k, v in dataclasses.asdict(self).items()}


def estimate_l2(hit: Summary, cold: Summary) -> Estimate | None:
    """Estimate ``||hit - cold||_2`` from the two sketches; None if either sketch is unknown or
    not finite (values near the float32 maximum can round a sketch value to +-Inf)."""
    if hit.sketch is None or cold.sketch is None or len(hit.sketch) != len(cold.sketch):
        return None
    a, b = np.asarray(hit.sketch, np.float64), np.asarray(cold.sketch, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    d = a - b
    l2 = float(math.sqrt(float(np.dot(d, d))))
    norm = math.sqrt(cold.sumsq) if cold.sumsq >= 0 else math.nan
    rel = l2 / norm if norm > 0 else (0.0 if l2 == 0 else math.inf)
    return Estimate(l2, l2 / math.sqrt(Q_HI), l2 / math.sqrt(Q_LO), norm, rel)


def l2_budget(atol: float, rtol: float, n: int, norm_cold: float) -> float:
    """The largest L2 norm a difference within the elementwise tolerance can have.

    ``|d_i| <= atol + rtol |c_i|`` for every i implies
    ``||d||_2 <= atol sqrt(n) + rtol ||c||_2``: a difference whose L2 norm is
    surely above this (``Estimate.low``) has an element beyond tolerance.
    """
    return atol * math.sqrt(n) + rtol * (norm_cold if math.isfinite(norm_cold) else 0.0)
