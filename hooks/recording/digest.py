"""Digests and summaries of captured tensors, computed on the engine's device with plain torch ops.

The torch twin of ``statediff.trace.digest`` and ``statediff.trace.summary``
(the numpy references; definitions, the collision bound and the sketch's
error bound are there and in docs/trace-format.md, "Digests"). Same tensor
in, same digests, counts and absmax out, whatever the device; sums and the
sketch to float64 rounding. ``tests/trace/test_digest.py`` and
``tests/trace/test_summary.py`` check the two against each other.

``summarize_rows`` (used by the recorder for every captured tensor) sends
200 bytes per tensor to the host in one transfer; ``digest_rows`` only the
two 64-bit lane sums. Digests are computed as
``D_l = 2 * sum_i w_i W_l(i) + sum_i W_l(i)`` (the same sum mod 2**64):
per batch of words one widening, one mask, and per lane one multiply
against the lane's weights and one row sum. Per-row-length tables (digest
weights and their sums, sketch keys) are computed once per device and kept
(``_CACHE``, at most ``CACHE_BYTES`` per device). Temporaries are bounded
by ``BATCH_WORDS``/``SUMMARY_BATCH`` (GPU) or ``CPU_BATCH_WORDS``/
``CPU_SUMMARY_BATCH`` (CPU: every op under torch's parallel grain).
int64 multiplication and summation in torch wrap modulo 2**64 (two's
complement), which is the definition's arithmetic: checked on CPU by the
tests; CUDA's int64 kernels wrap alike but are not run here. Right shifts
are made logical with a mask.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from statediff.trace.digest import GOLDEN, MIX1, MIX2, SEEDS, format_digest
from statediff.trace.summary import SKETCH_DIM, SKETCH_SEED, Summary

BATCH_WORDS = 1 << 23  # 16-bit words digested per torch op on a GPU (2 x 64 MiB of int64 temporaries)
# On a CPU every op stays under torch's parallel grain (32768 elements) and runs on the calling
# thread: an engine's bound OpenMP threads on a shared, busy machine made each parallel op wait
# milliseconds at its barrier (measured: 3 MB/s instead of ~1 GB/s).
CPU_BATCH_WORDS = 1 << 14
PIECE_WORDS = 1 << 22  # weights are cached for rows up to this many words (64 MiB for both lanes)
# Per-row-length tables (digest weights, sketch keys), kept per device while their total stays under
# this many bytes (least recently used dropped first): an engine captures a handful of shapes
# (conv and SSM states, K/V blocks, hidden rows); a 27B-class set needs ~70 MB on a CPU.
CACHE_BYTES = 256 << 20
_CACHE: collections.OrderedDict = collections.OrderedDict()


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix(seed: int, start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """splitmix64 outputs ``start .. start + n - 1`` of ``seed``: int64 ``[n]`` (the uint64 bits)."""
    z = torch.arange(start + 1, start + 1 + n, dtype=torch.int64, device=device)
    z.mul_(_s64(GOLDEN)).add_(_s64(seed))
    z.bitwise_xor_(_shr(z, 30))
    z.mul_(_s64(MIX1))
    z.bitwise_xor_(_shr(z, 27))
    z.mul_(_s64(MIX2))
    z.bitwise_xor_(_shr(z, 31))
    return z


def _step(n: int, device: torch.device | str) -> int:
    """Elements per op when making tables: all at once on a GPU, under the parallel grain on a CPU."""
    return max(1, n) if torch.device(device).type != "cpu" else CPU_BATCH_WORDS


def _cached(kind: str, n: int, device: torch.device, make) -> tuple:
    """``make()`` (a tuple of tensors) for this kind, row length and device, kept in ``_CACHE``."""
    key = (kind, n, str(device))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    hit = _CACHE[key] = make()
    held = [k for k in _CACHE if k[2] == key[2]]
    total = sum(t.numel() * t.element_size() for k in held for t in _CACHE[k])
    for k in held[:-1]:  # least recently used first, never the new entry
        if total <= CACHE_BYTES:
            break
        total -= sum(t.numel() * t.element_size() for t in _CACHE.pop(k))
    return hit


def weights(start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Weights of both lanes for words ``start .. start + n - 1``: int64 ``[2, n]`` on ``device``.

    Same bits as ``statediff.trace.digest.weights`` (viewed as int64).
    """
    out = torch.empty(2, n, dtype=torch.int64, device=device)
    step = _step(n, device)
    for p0 in range(0, n, step):
        p1 = min(n, p0 + step)
        for lane, seed in enumerate(SEEDS):
            out[lane, p0:p1] = _splitmix(seed, start + p0, p1 - p0, device)
    return out


def _cached_weights(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[2, n]`` of a row length and their sums ``[2]`` (mod 2**64), kept per device."""
    def make():
        w = weights(0, n, device)
        step = _step(n, device)
        return w, sum(w[:, p0:p0 + step].sum(dim=1) for p0 in range(0, n, step))
    return _cached("weights", n, device, make)


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x [B, ...]`` as its rows' 16-bit little-endian words, int16 ``[B, n]`` (odd rows zero-padded)."""
    b = x.shape[0]
    if x.numel() == 0:
        return torch.zeros(b, 0, dtype=torch.int16, device=x.device)
    raw = x.detach().contiguous().reshape(b, -1).view(torch.uint8)
    if raw.shape[1] % 2:
        raw = torch.cat([raw, raw.new_zeros(b, 1)], dim=1)
    return raw.view(torch.int16)  # little-endian on every device torch runs on


def _lane_sums(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i t[r, i] * w[l, i]`` (mod 2**64) for both lanes: int64 ``[rows, 2]``.

    One lane at a time, so no temporary is larger than ``t`` (on a CPU: under the parallel grain).
    """
    return torch.stack([(t * w[0]).sum(dim=1), (t * w[1]).sum(dim=1)], dim=1)


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
            acc[r0:r0 + rows] += _lane_sums(t, w)
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


# --- per-tensor summaries ------------------------------------------------------------------------

SUMMARY_BATCH = 1 << 20  # elements per summary op on a GPU: a float64 copy of 8 MiB
CPU_SUMMARY_BATCH = 1 << 14  # on a CPU: under torch's parallel grain, as CPU_BATCH_WORDS
SIGN_PIECE = 1 << 18  # GPU: columns per sign matrix, [SIGN_PIECE, SKETCH_DIM] float64 = 32 MiB
SKETCH_CACHE_ELEMENTS = 1 << 22  # sign keys are kept for rows up to this many elements
_TABLES: dict = {}

_DECODE_EXACT = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int16, torch.int8,
                 torch.uint8}
# int32/int64 decode through float32, as statediff.trace.dtypes.to_float does (exact up to 2**24)
_DECODE_VIA_F32 = {torch.int32, torch.int64}
_FLOATS = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DECODE_EXACT.add(getattr(torch, _name))
        _FLOATS.add(getattr(torch, _name))


def _sketch_keys(start: int, n: int, device: torch.device, gpu: bool) -> torch.Tensor:
    """Sign keys of elements ``start .. start + n - 1`` (bit j of ``h_i`` is the sign of sketch value j).

    GPU method: int32 ``[n]``, bits 0-15 of ``h_i`` (rows of the 65536-pattern sign table).
    CPU method: int64 ``[2, n]``, bits 0-7 and bits 8-15 plus 256 (buckets of a 512-bucket scatter).
    """
    out = torch.empty(n, dtype=torch.int32, device=device) if gpu else \
        torch.empty(2, n, dtype=torch.int64, device=device)
    step = _step(n, device)
    for p0 in range(0, n, step):
        p1 = min(n, p0 + step)
        h = _splitmix(SKETCH_SEED, start + p0, p1 - p0, device)
        if gpu:
            out[p0:p1] = h & 0xFFFF
        else:
            out[0, p0:p1] = h & 0xFF
            out[1, p0:p1] = ((h >> 8) & 0xFF).add_(256)
    return out


def _cached_keys(n: int, device: torch.device, gpu: bool) -> torch.Tensor | None:
    """``_sketch_keys(0, n)`` kept per (row length, device, method); None for rows too long to keep."""
    if n > SKETCH_CACHE_ELEMENTS:
        return None
    return _cached("keys-gpu" if gpu else "keys-cpu", n, device, lambda: (_sketch_keys(0, n, device, gpu),))[0]


def _sign_table(bits: int, device: torch.device) -> torch.Tensor:
    """float64 ``[2**bits, bits]``: row p, column j is +1 if bit j of p is set, else -1 (kept per device)."""
    key = (bits, str(device))
    table = _TABLES.get(key)
    if table is None:
        p = torch.arange(1 << bits, dtype=torch.int64, device=device)
        j = torch.arange(bits, dtype=torch.int64, device=device)
        table = _TABLES[key] = ((p[:, None] >> j[None, :]) & 1).to(torch.float64).mul_(2).sub_(1)
    return table


def _decode(xb: torch.Tensor) -> torch.Tensor:
    """The float64 values of a block (the reference's ``to_float``; a new tensor, never ``xb`` itself)."""
    if xb.dtype in _DECODE_EXACT:
        return xb.to(torch.float64, copy=True)
    if xb.dtype in _DECODE_VIA_F32:
        return xb.to(torch.float32).to(torch.float64)
    if xb.dtype == torch.bool:  # any nonzero byte is True, as the reference reads stored bools
        return (xb.view(torch.uint8) != 0).to(torch.float64)
    raise TypeError(f"cannot summarize a tensor of dtype {xb.dtype}")


def _summary_table(x2d: torch.Tensor, gpu: bool) -> torch.Tensor:  # long: a 25-column table built in one device pass, half of it its docstring
    """Everything a row's ``Summary`` needs: int64 ``[B, 25]`` on the device (no host transfer).

    Columns: digest lanes (2), bf16 digest lanes (2; zeros unless float32),
    n_nan, n_inf, then the bits of float64 sum, sumsq, absmax (3) and of the
    float64 sketch before rounding to float32 (``SKETCH_DIM``).

    Args:
        x2d: ``[B, n]`` contiguous (rows are the tensors, C order).
        gpu: the GPU method (sign matrices and matmul; deterministic) or the
            CPU one (a 512-bucket scatter of each block, single-threaded ops).
            Both are correct on any device; the tests run both on a CPU.

    Work is done in blocks of ``rows x cols`` elements (``SUMMARY_BATCH`` /
    ``SIGN_PIECE`` on a GPU, ``CPU_SUMMARY_BATCH`` on a CPU). Temporaries per
    block: a float64 copy, masks and int64 lane products of the same
    element count (GPU: 8 MiB each, plus the [cols, 16] float64 sign
    matrix, 32 MiB; CPU: 128 KiB each). Kept between calls (``_CACHE``):
    the sign keys of a row length (GPU 4, CPU 16 bytes per element) and,
    for float32, the digest weights of its words (16 bytes per word).
    """
    # Over 80 lines on purpose: one pass over each block feeds every column (moments, NaN counts,
    # sketch, bf16 digest); split into functions, each block would be decoded and read again.
    b, n = x2d.shape
    dev = x2d.device
    lanes = digest_lanes(x2d)
    bf = torch.zeros(b, 2, dtype=torch.int64, device=dev)
    cnt = torch.zeros(b, 2, dtype=torch.int64, device=dev)
    mom = torch.zeros(b, 3, dtype=torch.float64, device=dev)
    sk = torch.zeros(b, SKETCH_DIM, dtype=torch.float64, device=dev)
    if n:
        is_float = x2d.dtype in _FLOATS
        want_bf16 = x2d.dtype == torch.float32
        keys = _cached_keys(n, dev, gpu)
        wcache = _cached_weights(2 * n, dev) if want_bf16 and 2 * n <= PIECE_WORDS else None
        wsum = wcache[1] if wcache is not None else torch.zeros(2, dtype=torch.int64, device=dev)
        buckets = None if gpu else torch.zeros(b, 2 * 256, dtype=torch.float64, device=dev)
        table = _sign_table(SKETCH_DIM, dev) if gpu else None
        batch = SUMMARY_BATCH if gpu else CPU_SUMMARY_BATCH
        cols = min(n, batch, SIGN_PIECE)
        rows = max(1, batch // cols)
        for c0 in range(0, n, cols):
            c1 = min(n, c0 + cols)
            k = keys[..., c0:c1] if keys is not None else _sketch_keys(c0, c1 - c0, dev, gpu)
            signs = table.index_select(0, k) if gpu else None  # [cols, 16] +-1
            if want_bf16:
                if wcache is not None:
                    w = wcache[0][:, 2 * c0:2 * c1]
                else:  # a row too long to keep its weights: make them per piece
                    w = weights(2 * c0, 2 * (c1 - c0), dev)
                    wsum = wsum + w.sum(dim=1)
            for r0 in range(0, b, rows):
                r1 = min(b, r0 + rows)
                xb = x2d[r0:r1, c0:c1]
                v = _decode(xb)
                nan = None
                s = v.sum(dim=1)
                if is_float and (gpu or not math.isfinite(float(s.sum()))):
                    # a finite float64 sum proves there is no NaN/Inf (narrower floats cannot overflow
                    # it; float64 ones that do just take this path); a GPU would sync for the check
                    nan = torch.isnan(v)
                    cnt[r0:r1, 0] += nan.sum(dim=1)
                    cnt[r0:r1, 1] += torch.isinf(v).sum(dim=1)
                    v = v.nan_to_num_(0.0, 0.0, 0.0)
                    s = v.sum(dim=1)
                mom[r0:r1, 0] += s
                mom[r0:r1, 1] += torch.linalg.vecdot(v, v)
                mom[r0:r1, 2] = torch.maximum(mom[r0:r1, 2], v.abs().amax(dim=1))
                if gpu:
                    sk[r0:r1] += v @ signs
                else:
                    buckets[r0:r1].scatter_add_(1, k[0].expand(r1 - r0, -1), v)
                    buckets[r0:r1].scatter_add_(1, k[1].expand(r1 - r0, -1), v)
                if want_bf16:
                    bf[r0:r1] += _bf16_block(xb, nan, w)
        if not gpu:  # sketch_j = sum_p bucket[p] * sign_j(p); elementwise (a BLAS call may wait on threads)
            t8 = _sign_table(8, dev)
            for r0 in range(0, b, 4):
                r1 = min(b, r0 + 4)
                sk[r0:r1] = (buckets[r0:r1].view(r1 - r0, 2, 256, 1) * t8).sum(dim=2).reshape(r1 - r0, SKETCH_DIM)
        if want_bf16:
            bf = bf.mul_(2).add_(wsum)
    sk = sk.div_(math.sqrt(SKETCH_DIM))  # 4: exact
    return torch.cat([lanes, bf, cnt, mom.view(torch.int64), sk.view(torch.int64)], dim=1)


def _bf16_block(xb: torch.Tensor, nan: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i W(i)`` over the words of a float32 block rounded to bfloat16: int64 ``[rows, 2]``.

    ``round_to_bf16`` in int32 arithmetic (no float conversion, so no
    flush-to-zero or NaN canonicalisation can change it): add 0x7FFF plus
    bit 16, keep the upper 16 bits; NaNs keep all their bits. Element k's
    low word (word 2k) is then 0 except for NaNs, its high word (2k + 1) is
    the bfloat16 pattern. ``w``: the block's word weights ``[2, 2 * cols]``.
    """
    u = xb.view(torch.int32)
    hi = ((u >> 16) & 1).add_(u).add_(0x7FFF)  # wraps only for NaN bit patterns, which are replaced
    hi = (hi >> 16) & 0xFFFF
    acc = None
    if nan is not None:
        hi = torch.where(nan, (u >> 16) & 0xFFFF, hi)
        lo = torch.where(nan, u & 0xFFFF, 0).to(torch.int64)
        acc = _lane_sums(lo, w[:, 0::2])
    out = _lane_sums(hi.to(torch.int64), w[:, 1::2])
    return out if acc is None else out.add_(acc)


def _summaries(table: torch.Tensor, bf16: bool) -> list[Summary]:
    """``Summary`` objects from ``_summary_table``'s output, in one device-to-host transfer."""
    a = table.cpu().numpy()
    mom = a[:, 6:9].view(np.float64)
    sketch = a[:, 9:9 + SKETCH_DIM].view(np.float64).astype(np.float32)  # round to nearest even
    return [
        Summary(
            digest=format_digest(int(row[0]), int(row[1])),
            digest_bf16=format_digest(int(row[2]), int(row[3])) if bf16 else "",
            sum=float(m[0]), sumsq=float(m[1]), absmax=float(m[2]),
            n_nan=int(row[4]), n_inf=int(row[5]),
            sketch=tuple(float(x) for x in sk))
        for row, m, sk in zip(a, mom, sketch)
    ]


def summarize_rows(x: torch.Tensor) -> list[Summary]:
    """The ``Summary`` of each row ``x[b]``, computed where ``x`` lives, one device-to-host transfer.

    Equal to ``statediff.trace.summary.summarize`` of each row's host copy in
    trace storage form: digests and NaN/Inf counts bit for bit; ``sum``,
    ``sumsq`` to float64 rounding (blocks are summed in another order);
    ``absmax`` exactly; the float32 sketch to float64 rounding before its
    rounding to float32 (so equal, or rarely 1 float32 ulp apart).

    Args:
        x: ``[B, ...]`` of float32/16/64, bfloat16, float8 (e4m3fn, e5m2),
            int8/16/32/64, uint8 or bool, on any device; any strides (a
            non-contiguous view is copied once). Row ``b`` is the tensor ``x[b]``.

    Returns:
        B summaries. What crosses to the host is 200 bytes per row.

    Raises:
        ValueError: ``x`` is 0-d (there is no row dimension).
        TypeError: a dtype without a summary (complex, uint16/32/64).
    """
    if x.dim() == 0:
        raise ValueError("summarize_rows needs a [B, ...] tensor; use summarize_tensor for a 0-d one")
    if not (x.dtype in _DECODE_EXACT or x.dtype in _DECODE_VIA_F32 or x.dtype == torch.bool):
        raise TypeError(f"cannot summarize a tensor of dtype {x.dtype}")
    b = x.shape[0]
    if b == 0:
        return []
    x2d = x.detach().contiguous().reshape(b, -1)
    if x2d.dtype == torch.bool:  # bytes other than 0/1 (a view of uint8) are stored as 1 by to_host
        x2d = x2d.view(torch.uint8) != 0
    return _summaries(_summary_table(x2d, x.device.type != "cpu"), x.dtype == torch.float32)


def summarize_tensor(t: torch.Tensor) -> Summary:
    """The ``Summary`` of one tensor of any shape, 0-d included (see ``summarize_rows``)."""
    return summarize_rows(t.reshape(1, *t.shape))[0]
