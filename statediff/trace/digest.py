"""Block digests: the 128-bit fingerprint of a K/V block that a trace keeps instead of its data (``/digests``).

The reference implementation, in numpy: ``digest_array`` digests a tensor
the offline side holds in full, to compare it with what the engine side
(``statediff_hooks.recording.digest``, torch ops on the device) recorded. Definition
(``DIGEST_VERSION`` 1) and collision bound: docs/trace-format.md, "Digests".
"""

from __future__ import annotations

import numpy as np

DIGEST_VERSION = 1
SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # digits of pi: nothing up the sleeve
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
PIECE_WORDS = 1 << 18  # 16-bit words per piece: ~2 MiB uint64 scratch per temporary

_U64 = np.uint64


def weights(lane: int, start: int, n: int) -> np.ndarray:
    """Weights ``W_lane(start) .. W_lane(start + n - 1)`` as uint64 (wrapping arithmetic).

    Raises:
        IndexError: ``lane`` is not 0 or 1.
    """
    seed = SEEDS[lane]
    z = np.arange(start + 1, start + 1 + n, dtype=_U64)
    z *= _U64(GOLDEN)
    z += _U64(seed)
    return mix64(z)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array, in place (wrapping arithmetic, logical shifts)."""
    z ^= z >> _U64(30)
    z *= _U64(MIX1)
    z ^= z >> _U64(27)
    z *= _U64(MIX2)
    z ^= z >> _U64(31)
    return z


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    """The C-order little-endian bytes of ``arr`` as a flat uint8 view (copies only if needed)."""
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise TypeError(f"cannot digest an array of dtype {arr.dtype}")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(arr).reshape(-1)
    return flat.view(np.uint8)


def digest_bytes_lanes(data: np.ndarray) -> tuple[int, int]:
    """Both lane sums ``(D_0, D_1)`` of a flat uint8 array (odd lengths padded with one zero).

    Works in pieces of ``PIECE_WORDS`` words, so scratch memory stays ~10 MiB
    whatever the size of ``data``.
    """
    nbytes = int(data.size)
    acc = [0, 0]
    step = 2 * PIECE_WORDS
    for off in range(0, nbytes, step):
        piece = data[off:off + step]
        if piece.size % 2:
            piece = np.concatenate([piece, np.zeros(1, np.uint8)])
        terms = piece.view("<u2").astype(_U64)
        terms *= _U64(2)
        terms += _U64(1)
        word0 = off // 2
        for lane in (0, 1):
            prod = terms * weights(lane, word0, terms.size)
            acc[lane] = (acc[lane] + int(prod.sum(dtype=_U64))) & MASK64
    return acc[0], acc[1]


def format_digest(d0: int, d1: int) -> str:
    """The 32-hex-digit text of two lane sums (each taken mod 2**64)."""
    return f"{d0 & MASK64:016x}{d1 & MASK64:016x}"


def digest_array(arr: np.ndarray) -> str:
    """Digest of an array's bytes in C order, as 32 lowercase hex digits.

    Args:
        arr: any shape, a fixed-size numeric dtype. Pass tensors in their trace
            storage form (``Trace.read`` returns it: bfloat16 as ``<u2`` bit
            patterns, fp8 as ``u1``) so the bytes are the engine's. Big-endian
            arrays are digested as their little-endian bytes (the same values).

    Returns:
        ``"%016x%016x" % (D_0, D_1)`` (module docstring). An empty array
        digests to 32 zeros.

    Raises:
        TypeError: an object, string-object or structured dtype.
    """
    return format_digest(*digest_bytes_lanes(_as_bytes(np.asarray(arr))))
