"""Per-tensor summaries: the torch twin (statediff_hooks.recording.digest.summarize_rows) equals the numpy
reference (statediff.trace.summary.summarize) field by field, both follow the definition in
docs/trace-format.md, and the sketch's L2 estimate behaves as documented."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from statediff.trace.digest import MASK64, digest_array
from statediff.trace.dtypes import round_to_bf16
from statediff.trace.summary import (Q_HI, Q_LO, SKETCH_DIM, SKETCH_SEED, Summary, estimate_l2, sketch_signs,
                                     summarize)
from statediff_hooks.recording import digest as tdigest
from statediff_hooks.recording.recorder import to_host

pytestmark = pytest.mark.engine  # imports torch when it loads

FP8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool,
          torch.int32, torch.int64, *FP8]
SHAPES = [(), (0,), (1,), (3,), (7, 5), (2, 3, 33), (4, 32, 16), (3, 8193)]


def _f32_ulps(a: float, b: float) -> int:
    """Distance of two float32 values in units in the last place."""
    ia, ib = (int(np.array([x], np.float32).view(np.int32)[0]) for x in (a, b))
    ia, ib = (i if i >= 0 else -(i & 0x7FFFFFFF) for i in (ia, ib))  # sign-magnitude -> ordered
    return abs(ia - ib)


def assert_same_summary(twin, ref, host: np.ndarray, dtype: str):
    """Digests, counts and absmax bit-exact; sum/sumsq to 1e-12 of the magnitude summed; sketch to
    1 float32 ulp (both accumulate in float64, in a different order, then round to float32), or to
    1e-12 of the magnitude summed where a sketch value is near 0 (then an ulp is tiny)."""
    assert twin.digest == ref.digest
    assert twin.digest_bf16 == ref.digest_bf16
    assert (twin.n_nan, twin.n_inf) == (ref.n_nan, ref.n_inf)
    assert twin.absmax == ref.absmax
    v = np.abs(summarize_values(host, dtype))
    scale = float(v.sum())
    assert math.isclose(twin.sum, ref.sum, rel_tol=1e-12, abs_tol=1e-12 * scale)
    assert math.isclose(twin.sumsq, ref.sumsq, rel_tol=1e-12, abs_tol=1e-300)
    assert len(twin.sketch) == len(ref.sketch) == SKETCH_DIM
    for a, b in zip(twin.sketch, ref.sketch):
        assert _f32_ulps(a, b) <= 1 or abs(a - b) <= 1e-12 * scale, (twin.sketch, ref.sketch)


def summarize_values(host: np.ndarray, dtype: str) -> np.ndarray:
    """The decoded finite values (NaN/Inf -> 0), float64, flat: what moments and sketch sum."""
    from statediff.trace.dtypes import to_float

    flat = host.reshape(-1)
    if dtype == "bool":
        flat = (flat != 0).astype(np.uint8)
    with np.errstate(invalid="ignore"):
        v = to_float(flat, dtype).astype(np.float64)
    return np.where(np.isfinite(v), v, 0.0)


def _random(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in FP8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)  # every pattern
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1 << 40), min(info.max, 1 << 40), shape, generator=g, dtype=dtype)


def _check_rows(x: torch.Tensor, summaries) -> None:
    assert len(summaries) == x.shape[0]
    for row, twin in zip(x, summaries):
        host, dtype = to_host(row)
        with np.errstate(invalid="ignore"):  # casting signalling NaNs
            ref = summarize(host, dtype)
        assert_same_summary(twin, ref, host, dtype)


def _gpu_method(x: torch.Tensor):
    """The GPU method (sign matrices, matmul, no host checks) run here on the CPU."""
    x2d = x.contiguous().reshape(x.shape[0], -1)
    return tdigest._summaries(tdigest._summary_table(x2d, gpu=True), x.dtype == torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_twin_equals_reference(dtype, shape):
    t = _random(dtype, shape, hash((str(dtype), shape)) & 0xFFFF)
    host, name = to_host(t)
    with np.errstate(invalid="ignore"):
        ref = summarize(host, name)
    assert_same_summary(tdigest.summarize_tensor(t), ref, host, name)
    assert_same_summary(_gpu_method(t.reshape(1, *t.shape))[0], ref, host, name)
    assert ref.digest_bf16 == (digest_array(round_to_bf16(host)) if dtype == torch.float32 else "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, *FP8], ids=str)
def test_nan_and_inf_are_counted_and_left_out(dtype):
    x = _random(torch.float32, (5, 300), 1).to(dtype)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[1, 299] = -float("inf")
    x[2] = float("nan")  # a row of NaN only: moments 0, absmax 0
    x[4, 7] = float("nan")
    x[4, 8] = float("inf")
    for summaries in (tdigest.summarize_rows(x), _gpu_method(x)):
        _check_rows(x, summaries)
    s = tdigest.summarize_rows(x)
    e4m3 = dtype == getattr(torch, "float8_e4m3fn", None)  # no infinities: torch saturates them to +-448
    assert [(r.n_nan, r.n_inf) for r in s] == (
        [(1, 0), (0, 0), (300, 0), (0, 0), (1, 0)] if e4m3 else [(1, 0), (0, 2), (300, 0), (0, 0), (1, 1)])
    assert (s[2].sum, s[2].sumsq, s[2].absmax, s[2].sketch) == (0.0, 0.0, 0.0, (0.0,) * SKETCH_DIM)
    assert s[3].n_nan == 0 and s[3].absmax == float(x[3].double().abs().max())


def test_float32_nan_payloads_and_rounding_edges():
    bits = [0x7F800001, 0xFFC12345, 0x7FFFFFFF,  # NaNs: kept with all their bits by round_to_bf16
            0x00000001, 0x807FFFFF, 0x00018000,  # subnormals, a tie
            0x3F808000, 0x3F818000, 0x3F808001,  # ties to even (down, up), just above a tie
            0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000]  # rounds to +-Inf, Inf
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    host = x.numpy()
    with np.errstate(invalid="ignore"):
        expect = digest_array(round_to_bf16(host))
    assert tdigest.summarize_tensor(x).digest_bf16 == expect
    assert _gpu_method(x.reshape(1, -1))[0].digest_bf16 == expect
    _check_rows(x.reshape(1, -1), tdigest.summarize_rows(x.reshape(1, -1)))


def test_bf16_digest_is_the_digest_of_the_rounded_tensor():
    cold = _random(torch.float32, (48, 16, 16), 2)
    hit = torch.from_numpy(round_to_bf16(cold.numpy()))  # what a bf16 round trip of the state gives
    c, h = tdigest.summarize_tensor(cold), tdigest.summarize_tensor(hit)
    assert h.digest != c.digest and h.digest == c.digest_bf16  # the diagnosis "rounded to bf16"
    assert c.digest_bf16 == tdigest.digest_tensor(cold.to(torch.bfloat16).to(torch.float32))
    assert h.digest_bf16 == h.digest  # rounding is idempotent


def test_bf16_digest_ignores_flush_to_zero():
    # Engines may run with FTZ/DAZ; the rounding is integer arithmetic, so subnormals still round.
    x = torch.tensor([1e-40, -3e-39, 1e-45, 1.5, -2.25e-38], dtype=torch.float32)
    expect = digest_array(round_to_bf16(x.numpy()))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        s = tdigest.summarize_tensor(x)
    finally:
        torch.set_flush_denormal(False)
    assert s.digest_bf16 == expect
    assert s.digest == digest_array(x.numpy())


def test_rows_of_a_batch_and_strided_views():
    t = _random(torch.bfloat16, (6, 4, 32, 16), 3)
    rows = tdigest.summarize_rows(t)
    _check_rows(t, rows)
    assert len({r.digest for r in rows}) == 6
    assert rows[2] == tdigest.summarize_tensor(t[2])  # a row's summary does not depend on its batch
    v = t.transpose(2, 3)  # non-contiguous: summarized in its logical (C) order
    _check_rows(v, tdigest.summarize_rows(v))
    assert tdigest.summarize_rows(v)[0].digest == tdigest.digest_tensor(v[0])
    assert tdigest.summarize_rows(v)[0].sketch != rows[0].sketch  # same values, other order


def test_the_gpu_method_equals_the_cpu_method():
    x = _random(torch.float32, (9, 3000), 4)
    x[3, 5] = float("nan")
    for a, b in zip(tdigest.summarize_rows(x), _gpu_method(x)):
        assert (a.digest, a.digest_bf16, a.n_nan, a.n_inf, a.absmax) == (b.digest, b.digest_bf16, b.n_nan,
                                                                          b.n_inf, b.absmax)
        assert all(_f32_ulps(p, q) <= 1 for p, q in zip(a.sketch, b.sketch))


def test_long_rows_are_processed_in_pieces(monkeypatch):
    x = _random(torch.float32, (2, 5001), 5)
    x[1, 4999] = float("nan")
    whole = tdigest.summarize_rows(x)
    # blocks of a few columns, keys and weights made per piece (rows "too long" to keep)
    monkeypatch.setattr(tdigest, "CPU_SUMMARY_BATCH", 700)
    monkeypatch.setattr(tdigest, "SUMMARY_BATCH", 1500)
    monkeypatch.setattr(tdigest, "SIGN_PIECE", 600)
    monkeypatch.setattr(tdigest, "SKETCH_CACHE_ELEMENTS", 1000)
    monkeypatch.setattr(tdigest, "PIECE_WORDS", 1000)
    for pieces in (tdigest.summarize_rows(x), _gpu_method(x)):
        for a, b in zip(pieces, whole):
            assert (a.digest, a.digest_bf16, a.n_nan, a.n_inf, a.absmax) == (b.digest, b.digest_bf16, b.n_nan,
                                                                              b.n_inf, b.absmax)
            assert math.isclose(a.sumsq, b.sumsq, rel_tol=1e-12)
            assert all(_f32_ulps(p, q) <= 1 for p, q in zip(a.sketch, b.sketch))
        _check_rows(x, pieces)


def test_input_is_not_modified():
    x = torch.tensor([[1.0, float("nan"), float("inf"), -2.0]], dtype=torch.float64)
    before = x.clone()
    tdigest.summarize_rows(x)
    _gpu_method(x)
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


def test_bool_bytes_and_wide_integers_decode_as_the_reference():
    b = torch.tensor([0, 1, 2, 255, 0], dtype=torch.uint8).view(torch.bool)  # stored bools may be any byte
    s = tdigest.summarize_tensor(b)
    assert (s.sum, s.sumsq, s.absmax) == (3.0, 3.0, 1.0)
    _check_rows(b.reshape(1, -1), [s])
    # int32/int64 decode through float32 as statediff.trace.dtypes.to_float does (exact up to 2**24)
    i = torch.tensor([2**24 + 1, -(2**40) - 3, 7], dtype=torch.int64)
    s = tdigest.summarize_tensor(i)
    assert s.sum == float(np.float32(2**24 + 1)) + float(np.float32(-(2**40) - 3)) + 7.0
    _check_rows(i.reshape(1, -1), [s])


def test_errors():
    with pytest.raises(ValueError, match="0-d"):
        tdigest.summarize_rows(torch.tensor(1.0))
    with pytest.raises(TypeError, match="complex64"):
        tdigest.summarize_rows(torch.zeros(2, 3, dtype=torch.complex64))
    assert tdigest.summarize_rows(torch.zeros(0, 3)) == []
    s = tdigest.summarize_tensor(torch.tensor(2.5))  # 0-d: one element
    assert (s.sum, s.sumsq, s.absmax, s.n_nan, s.n_inf) == (2.5, 6.25, 2.5, 0, 0)


def _naive_sketch(values: list[float]) -> list[float]:
    """The definition in Python integers and floats: sign_ij = bit j of splitmix(SKETCH_SEED, i)."""
    out = [0.0] * SKETCH_DIM
    for i, v in enumerate(values):
        z = (SKETCH_SEED + (i + 1) * 0x9E3779B97F4A7C15) & MASK64
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & MASK64
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        for j in range(SKETCH_DIM):
            out[j] += v if (z >> j) & 1 else -v
    return [float(np.float32(s / math.sqrt(SKETCH_DIM))) for s in out]


def test_known_values():
    # Pinned (docs/trace-format.md, "Digests") so a change of the definition cannot go unnoticed.
    s = tdigest.summarize_tensor(torch.arange(4, dtype=torch.float32))
    assert s == Summary(digest="384777a7b3a132f5fecad0b54c16fad7", digest_bf16="384777a7b3a132f5fecad0b54c16fad7",
                        sum=6.0, sumsq=14.0, absmax=3.0, n_nan=0, n_inf=0,
                        sketch=(-0.5, 0.5, 0.5, -0.5, 1.5, 1.5, -1.5, -1.5, -1.5, -1.0, -1.5, 1.0, 1.0, -1.0,
                                0.5, 1.0))
    assert s == summarize(np.arange(4, dtype=np.float32), "float32")
    one = tdigest.summarize_tensor(torch.ones(1))  # the signs of h_0 = 0x0433ebf21b5f33f3: bits of 0x33f3
    assert one.sketch == tuple(0.25 if (0x33F3 >> j) & 1 else -0.25 for j in range(SKETCH_DIM))


def test_sketch_follows_the_definition():
    assert SKETCH_SEED == 0xA4093822299F31D0
    values = [0.5, -1.0, 2.0, 0.0, 3.25, -0.125, 7.0, 1.0, 1.0, -4.5, 0.75]
    t = torch.tensor(values, dtype=torch.float32)
    assert list(tdigest.summarize_tensor(t).sketch) == _naive_sketch(values)
    assert list(summarize(t.numpy(), "float32").sketch) == _naive_sketch(values)
    # one element: every sketch value is +-v/4, the signs are the low 16 bits of h_0
    s = tdigest.summarize_tensor(torch.tensor([8.0]))
    assert [int(x > 0) for x in s.sketch] == [int(x > 0) for x in sketch_signs(0, 1)[0]]
    assert {abs(x) for x in s.sketch} == {2.0}
    # signs of an element depend on its index only, and are balanced
    assert np.array_equal(sketch_signs(5, 3), sketch_signs(0, 8)[5:])
    assert abs(sketch_signs(0, 100_000).mean()) < 0.01


def test_estimate_is_exact_for_one_differing_element_and_zero_for_equal_tensors():
    cold = _random(torch.float32, (4, 64, 32), 6)
    hit = cold.clone()
    same = estimate_l2(tdigest.summarize_tensor(hit), tdigest.summarize_tensor(cold))
    assert (same.l2, same.low, same.high) == (0.0, 0.0, 0.0)
    hit[2, 10, 7] += 0.5  # every sign is +-1: the sketch difference is +-0.5/4 in all 16 values
    est = estimate_l2(tdigest.summarize_tensor(hit), tdigest.summarize_tensor(cold))
    d = float(hit[2, 10, 7]) - float(cold[2, 10, 7])
    assert math.isclose(est.l2, abs(d), rel_tol=1e-6)  # float32 rounding of the two sketches
    assert est.low <= abs(d) <= est.high


def test_estimator_is_unbiased_and_its_interval_holds():
    # 200 differences of several structures (dense, sparse, one block, a constant offset on a block)
    # in a 60K-element tensor: est^2 / ||d||^2 should average 1 and fall in [Q_LO, Q_HI] ~99% of the
    # time. The guarantee is over the choice of signs; with one seed the differences must be varied
    # or they sample the same few signs (a constant offset of a whole tensor of n = 200..6000
    # elements is one random walk of the signs: its ratios averaged ~1.5).
    rng = np.random.default_rng(13)
    ratios = []
    n = 60_000
    for k in range(200):
        cold = rng.standard_normal(n).astype(np.float32)
        d = np.zeros(n)
        if k % 4 == 0:
            d = rng.standard_normal(n) * 1e-3
        elif k % 4 == 1:
            idx = rng.choice(n, size=int(rng.integers(1, 40)), replace=False)
            d[idx] = rng.standard_normal(idx.size)
        elif k % 4 == 2:
            start = int(rng.integers(0, n - 100))
            d[start:start + 100] = rng.standard_normal(100) * 0.1
        else:
            start = int(rng.integers(0, n - 50))
            d[start:start + int(rng.integers(50, 1000))] = 1e-2
        hit = (cold + d).astype(np.float32)
        true = float(np.linalg.norm(hit.astype(np.float64) - cold.astype(np.float64)))
        est = estimate_l2(tdigest.summarize_tensor(torch.from_numpy(hit)),
                          tdigest.summarize_tensor(torch.from_numpy(cold)))
        ratios.append((est.l2 / true) ** 2)
        assert est.rel_l2 == est.l2 / est.norm_cold
    ratios = np.array(ratios)
    inside = int(((ratios >= Q_LO) & (ratios <= Q_HI)).sum())
    assert abs(ratios.mean() - 1.0) < 0.1, ratios.mean()  # observed: 0.952
    assert 197 <= inside <= 200, inside  # observed: 200 of 200 (fixed seed; >= 97% required)
