"""Logical tensor dtypes and their storage form in a trace.

numpy has no bfloat16 or float8, so a trace stores their raw bit patterns
(bfloat16 as ``<u2``, float8 as ``u1``) and names the logical dtype in the
index. Round trips are bit-exact: the stored integers are the engine's bytes.
Decoding to float is only done for metrics, never for storage.
"""

from __future__ import annotations

import numpy as np

from statediff.errors import TraceError

# logical dtype -> numpy storage dtype (little-endian, fixed size, no objects)
STORAGE = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("u1"),
}

FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
)

# mantissa bits, for ULP distances and default tolerances
MANTISSA_BITS = {
    "float64": 52,
    "float32": 23,
    "float16": 10,
    "bfloat16": 7,
    "float8_e4m3fn": 3,
    "float8_e5m2": 2,
}


def storage_dtype(logical: str) -> np.dtype:
    """numpy dtype a tensor of ``logical`` dtype is stored as.

    Raises:
        TraceError: ``logical`` is not a dtype this format knows.
    """
    try:
        return STORAGE[logical]
    except KeyError:
        raise TraceError(f"unknown logical dtype {logical!r}") from None


def _fp8_table(exp_bits: int, man_bits: int, bias: int, e4m3fn: bool) -> np.ndarray:
    """float64 value of every fp8 bit pattern (256 entries), OCP FP8 rules."""
    out = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> man_bits) & ((1 << exp_bits) - 1)
        man = code & ((1 << man_bits) - 1)
        if e4m3fn and exp == 0xF and man == 0x7:
            out[code] = np.nan  # e4m3fn has NaN only, no infinities
        elif not e4m3fn and exp == (1 << exp_bits) - 1:
            out[code] = sign * np.inf if man == 0 else np.nan
        elif exp == 0:
            out[code] = sign * (man / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            out[code] = sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
    return out


_FP8 = {
    "float8_e4m3fn": _fp8_table(4, 3, 7, True),
    "float8_e5m2": _fp8_table(5, 2, 15, False),
}


def to_float(stored: np.ndarray, logical: str) -> np.ndarray:
    """Decode a stored array to float32 (float64 for float64 input).

    bfloat16 bit patterns widen exactly to float32 (bf16 is the upper half
    of an fp32); fp8 goes through a 256-entry table. Integers are cast.
    """
    if logical == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if logical in _FP8:
        return _FP8[logical][stored].astype(np.float32)
    if logical == "float64":
        return stored
    return stored.astype(np.float32)


def ordered_bits(stored: np.ndarray, logical: str) -> np.ndarray | None:
    """Map float bit patterns to int64s whose differences are ULP distances.

    Negative floats are reflected so that the integer order matches the
    float order (the classic sign-magnitude to two's-complement trick).
    Returns None for dtypes without a ULP notion here (fp8, integers).
    """
    if logical == "bfloat16":
        raw = stored.astype(np.int64)
        sign_bit = 1 << 15
    elif logical == "float16":
        raw = stored.view(np.uint16).astype(np.int64)
        sign_bit = 1 << 15
    elif logical == "float32":
        raw = stored.view(np.uint32).astype(np.int64)
        sign_bit = 1 << 31
    elif logical == "float64":
        u = stored.view(np.uint64)
        neg = (u >> np.uint64(63)).astype(bool)
        mag = (u & np.uint64((1 << 63) - 1)).astype(np.int64)
        return np.where(neg, -mag, mag)
    else:
        return None
    neg = raw >= sign_bit
    mag = raw & (sign_bit - 1)
    return np.where(neg, -mag, mag)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (round-to-nearest-even), back as float32.

    Used by the diagnosis "a reduced-precision copy": an fp32 SSM state that
    went through bf16 on the restore path equals this of the cold state.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    r = ((u + rounding) >> 16) << 16
    r = np.where(np.isnan(x), u, r).astype(np.uint32)
    return r.view(np.float32)
