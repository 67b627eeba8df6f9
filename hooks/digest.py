"""Block digests computed on the engine's device with plain torch ops.

The torch twin of ``statediff.trace.digest`` (the numpy reference; the
definition and its collision bound are there and in docs/trace-format.md,
"Digests"). Same bytes in, same 32 hex digits out, whatever the device:
``tests/trace/test_digest.py`` checks the two against each other on float32,
bfloat16, float16, int8, uint8, bool and odd sizes.

Computed as ``D_l = 2 * sum_i w_i W_l(i) + sum_i W_l(i)`` (the same sum
mod 2**64): per batch of words one widening, one mask, one broadcast
multiply against both lanes' weights and one row sum. The weights of a
row length and their sums are computed once per device and kept
(``_WEIGHT_CACHE``). Temporaries are bounded by ``BATCH_WORDS`` (GPU) or
``CPU_BATCH_WORDS``; only the two 64-bit sums per row cross to the host,
in one transfer.
int64 multiplication and summation in torch wrap modulo 2**64 (two's
complement), which is the definition's arithmetic: checked on CPU by the
tests; CUDA's int64 kernels wrap alike but are not run here. Right shifts
are made logical with a mask.
"""

from __future__ import annotations

import collections

import torch

from statediff.trace.digest import GOLDEN, MIX1, MIX2, SEEDS, format_digest

BATCH_WORDS = 1 << 23  # 16-bit words digested per torch op on a GPU (64 + 128 MiB of int64 temporaries)
# On a CPU every op stays under torch's parallel grain (32768 elements) and runs on the calling
# thread: an engine's bound OpenMP threads on a shared, busy machine made each parallel op wait
# milliseconds at its barrier (measured: 3 MB/s instead of ~1 GB/s).
CPU_BATCH_WORDS = 1 << 13
PIECE_WORDS = 1 << 22  # weights are cached for rows up to this many words (64 MiB for both lanes)
_WEIGHT_CACHE: collections.OrderedDict = collections.OrderedDict()
_WEIGHT_CACHE_ENTRIES = 4


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def weights(start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Weights of both lanes for words ``start .. start + n - 1``: int64 ``[2, n]`` on ``device``.

    Same bits as ``statediff.trace.digest.weights`` (viewed as int64).
    """
    out = torch.empty(2, n, dtype=torch.int64, device=device)
    for lane, seed in enumerate(SEEDS):
        z = torch.arange(start + 1, start + 1 + n, dtype=torch.int64, device=device)
        z.mul_(_s64(GOLDEN)).add_(_s64(seed))
        z.bitwise_xor_(_shr(z, 30))
        z.mul_(_s64(MIX1))
        z.bitwise_xor_(_shr(z, 27))
        z.mul_(_s64(MIX2))
        z.bitwise_xor_(_shr(z, 31))
        out[lane] = z
    return out


def _cached_weights(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[2, n]`` of a row length and their sums ``[2]`` (mod 2**64), kept per device."""
    key = (n, str(device))
    hit = _WEIGHT_CACHE.get(key)
    if hit is None:
        w = weights(0, n, device)
        hit = (w, w.sum(dim=1))
        _WEIGHT_CACHE[key] = hit
        while len(_WEIGHT_CACHE) > _WEIGHT_CACHE_ENTRIES:
            _WEIGHT_CACHE.popitem(last=False)
    else:
        _WEIGHT_CACHE.move_to_end(key)
    return hit


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x [B, ...]`` as its rows' 16-bit little-endian words, int16 ``[B, n]`` (odd rows zero-padded)."""
    b = x.shape[0]
    if x.numel() == 0:
        return torch.zeros(b, 0, dtype=torch.int16, device=x.device)
    raw = x.detach().contiguous().reshape(b, -1).view(torch.uint8)
    if raw.shape[1] % 2:
        raw = torch.cat([raw, raw.new_zeros(b, 1)], dim=1)
    return raw.view(torch.int16)  # little-endian on every device torch runs on


def digest_lanes(x: torch.Tensor) -> torch.Tensor:
    """Lane sums of each row of ``x``: int64 ``[B, 2]`` on ``x.device`` (no host transfer).

    Args:
        x: ``[B, ...]``, any dtype torch can view as bytes (float32/16,
            bfloat16, fp8, int8/16/32/64, uint8, bool); row ``b`` is digested
            as the C-order bytes of ``x[b]``.
    """
    words = _words(x)
    b, n = words.shape
    acc = torch.zeros(b, 2, dtype=torch.int64, device=x.device)
    if b == 0 or n == 0:
        return acc
    batch = BATCH_WORDS if x.device.type != "cpu" else CPU_BATCH_WORDS
    cached = _cached_weights(n, x.device) if n <= PIECE_WORDS else None
    wsum = cached[1] if cached is not None else torch.zeros(2, dtype=torch.int64, device=x.device)
    cols = min(n, batch, PIECE_WORDS)
    for c0 in range(0, n, cols):
        c1 = min(n, c0 + cols)
        if cached is not None:
            w = cached[0][:, c0:c1]
        else:  # a row too long to keep its weights: make them per piece
            w = weights(c0, c1 - c0, x.device)
            wsum = wsum + w.sum(dim=1)
        rows = max(1, batch // (c1 - c0))
        for r0 in range(0, b, rows):
            t = words[r0:r0 + rows, c0:c1].to(torch.int64).bitwise_and_(0xFFFF)  # unsigned words
            acc[r0:r0 + rows] += (t.unsqueeze(1) * w).sum(dim=2)  # [rows, 2]: sum of w * W per lane
    return acc.mul_(2).add_(wsum)  # + sum of W per lane: the "+ 1" of every 2w + 1


def digest_rows(x: torch.Tensor) -> list[str]:
    """Digest of each row ``x[b]`` (32 hex digits each), one device-to-host transfer.

    Equal to ``statediff.trace.digest.digest_array`` of the row's host copy
    in trace storage form (bfloat16 as its bit patterns).
    """
    return [format_digest(int(d0), int(d1)) for d0, d1 in digest_lanes(x).tolist()]


def digest_tensor(t: torch.Tensor) -> str:
    """Digest of one tensor's C-order bytes (see ``digest_rows``)."""
    return digest_rows(t.reshape(1, *t.shape))[0]
