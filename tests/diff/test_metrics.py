"""Float64 metrics, NaN/Inf rules, ULP distances, streaming, tolerances."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synth import entry

from statediff.errors import StatediffError, TraceError
from statediff.diff.metrics import compare_arrays, compare_blocks, measure_pair, paired_blocks
from statediff.diff.tolerance import Policy, Rule, Tolerance, ToleranceKind, dtype_default, parse_rule
from statediff.trace.reader import open_trace
from statediff.trace.writer import TraceWriter

FP32 = Tolerance(1e-5, 1e-4, ToleranceKind.DTYPE_DEFAULT, "test")
EXACT = Tolerance(0.0, 0.0, ToleranceKind.EXACT, "test")


def bf16(values) -> np.ndarray:
    return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_known_difference_values():
    cold = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    hit = cold.copy()
    hit[1, 0] = 3.5
    m = compare_arrays(hit, cold, "float32", FP32)
    assert m.max_abs == 0.5
    assert m.worst_index == (1, 0)
    assert (m.hit_value, m.cold_value) == (3.5, 3.0)
    assert m.rel_l2 == pytest.approx(0.5 / math.sqrt(30))
    assert m.cosine == pytest.approx((1 + 4 + 10.5 + 16) / math.sqrt(33.25 * 30))
    assert m.n_beyond == 1 and not m
    assert m.worst_ulp == 1 << 21  # 3.0 -> 3.5 in float32: mantissa 0.5 -> 0.75, 2**21 ULP apart


def test_within_tolerance_is_not_beyond():
    cold = np.array([1.0, 100.0], dtype=np.float32)
    hit = cold + np.array([9e-6, 9e-3], dtype=np.float32)  # < atol + rtol*|cold|
    m = compare_arrays(hit, cold, "float32", FP32)
    assert m.within and m.n_beyond == 0
    assert 0 < m.severity < 1


def test_nan_on_one_side_is_always_a_divergence_with_its_first_index():
    cold = np.zeros((2, 3), dtype=np.float32)
    hit = cold.copy()
    hit[1, 2] = np.nan
    hit[0, 1] = np.inf
    m = compare_arrays(hit, cold, "float32", Tolerance(1e9, 1e9, ToleranceKind.USER_RULE, "huge"))
    assert m.n_nonfinite == 2 and m.n_beyond == 2
    assert m.first_nonfinite == (0, 1)
    assert (m.nonfinite_hit, m.nonfinite_cold) == (math.inf, 0.0)


def test_matching_nan_and_inf_compare_equal_and_opposite_inf_does_not():
    cold = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    assert compare_arrays(cold.copy(), cold, "float32", FP32).within
    hit = np.array([np.nan, -np.inf, -np.inf, 1.0], dtype=np.float32)
    m = compare_arrays(hit, cold, "float32", FP32)
    assert (m.n_nonfinite, m.first_nonfinite) == (1, (1,))


def test_exact_tolerance_means_any_differing_bit():
    cold = np.array([0.0, 1.0], dtype=np.float32)
    hit = np.array([-0.0, 1.0], dtype=np.float32)
    assert compare_arrays(hit, cold, "float32", FP32).within
    m = compare_arrays(hit, cold, "float32", EXACT)
    assert m.n_beyond == 1 and m.worst_index == (0,) and m.worst_ulp == 0
    one_ulp = np.nextafter(np.float32(1.0), np.float32(2.0))
    m = compare_arrays(np.array([0.0, one_ulp], np.float32), cold, "float32", EXACT)
    assert (m.n_beyond, m.worst_ulp, m.max_ulp, m.severity) == (1, 1, 1, math.inf)


def test_bf16_ulp_and_values_are_decoded():
    cold = bf16([1.0, -2.0])
    hit = cold.copy()
    hit[1] += 3  # three bf16 ULPs further from zero
    m = compare_arrays(hit, cold, "bfloat16", EXACT)
    assert m.worst_index == (1,) and m.worst_ulp == 3
    assert m.cold_value == -2.0 and m.hit_value == pytest.approx(-2.0 - 3 * 2 ** -6)


def test_integers_are_exact_and_large_values_keep_precision():
    cold = np.array([2 ** 40, 5], dtype=np.int64)
    hit = np.array([2 ** 40 + 1, 5], dtype=np.int64)
    m = compare_arrays(hit, cold, "int64", Tolerance(*dtype_default("int64"), ToleranceKind.DTYPE_DEFAULT, "d"))
    assert m.n_beyond == 1 and m.max_abs == 1.0 and m.max_ulp is None


def test_zero_norms():
    z = np.zeros(4, np.float32)
    m = compare_arrays(z, z.copy(), "float32", FP32)
    assert (m.rel_l2, m.cosine) == (0.0, 1.0)
    m = compare_arrays(np.ones(4, np.float32), z, "float32", FP32)
    assert (m.rel_l2, m.cosine) == (math.inf, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64),
       st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64),
       st.integers(1, 7))
def test_streamed_blocks_equal_whole_array(a, b, block):
    n = min(len(a), len(b))
    hit, cold = np.array(a[:n], np.float32), np.array(b[:n], np.float32)
    whole = compare_arrays(hit, cold, "float32", FP32)
    pieces = [(hit[i:i + block], cold[i:i + block]) for i in range(0, n, block)]
    streamed = compare_blocks(pieces, (n,), "float32", FP32)
    assert streamed.n_beyond == whole.n_beyond
    assert streamed.max_abs == whole.max_abs and streamed.worst_index == whole.worst_index
    assert streamed.max_ulp == whole.max_ulp
    assert streamed.rel_l2 == pytest.approx(whole.rel_l2) and streamed.cosine == pytest.approx(whole.cosine)


def test_paired_blocks_realigns_different_block_sizes_and_finishes_both():
    finished = []

    def stream(name, sizes):
        start = 0
        for n in sizes:
            yield np.arange(start, start + n)
            start += n
        finished.append(name)

    pairs = list(paired_blocks(stream("a", [3, 0, 5, 2]), stream("b", [4, 6])))
    assert [len(x) for x, _ in pairs] == [3, 1, 4, 2]
    assert all((x == y).all() for x, y in pairs)
    assert finished == ["a", "b"]
    with pytest.raises(TraceError, match="different numbers of elements"):
        list(paired_blocks(stream("c", [3]), stream("d", [2, 2])))
    assert finished[-2:] == ["c", "d"]


def _trace(path, arr):
    w = TraceWriter(path, {"engine": "synthetic"})
    w.add(arr, request=0, position=16, layer=0, kind="gdn.ssm_state", role="checkpoint",
          module="m", dtype="float32")
    w.close()
    return open_trace(path)


def test_measure_pair_streams_small_blocks_and_matches_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    cold_arr = rng.standard_normal((64, 8, 8)).astype(np.float32)
    hit_arr = cold_arr.copy()
    hit_arr[50, 3, 4] += 1.0
    with _trace(tmp_path / "h.h5", hit_arr) as h, _trace(tmp_path / "c.h5", cold_arr) as c:
        he, ce = h.entries[0], c.entries[0]
        assert len(list(h.iter_blocks(he, 1024))) == 16  # really streamed: 4 rows of 8x8 fp32 per KiB
        m = measure_pair(h, he, c, ce, FP32, block_bytes=1024)
    assert m.worst_index == (50, 3, 4) and m.max_abs == pytest.approx(1.0)
    assert m.n_beyond == 1 and m.numel == 64 * 64


def test_equal_hash_short_circuits_without_reading(tmp_path):
    arr = np.ones((4, 4), np.float32)
    with _trace(tmp_path / "h.h5", arr) as h, _trace(tmp_path / "c.h5", arr) as c:
        h.iter_blocks = c.iter_blocks = None  # any read would fail
        m = measure_pair(h, h.entries[0], c, c.entries[0], EXACT)
    assert m.identical and m.within and m.numel == 16


# -- tolerances -------------------------------------------------------------------

def test_parse_rule():
    assert parse_rule("gdn.ssm_state=1e-6,1e-5") == Rule("gdn.ssm_state", 1e-6, 1e-5)
    for bad, msg in [("gdn.ssm_state", "expected PATTERN=ATOL,RTOL"), ("x=1", "expected PATTERN"),
                     ("x=a,1", "must be numbers"), ("x=-1,0", "finite and >= 0"), ("=1,1", "expected")]:
        with pytest.raises(StatediffError, match=msg):
            parse_rule(bad)


def _entry(kind="gdn.ssm_state", module="model.layers.1.linear_attn", dtype="float32", layer=1):
    return dataclasses.replace(entry(0, 16, layer, kind), module=module, dtype=dtype)


def test_policy_order_rules_then_exact_then_dtype():
    e = _entry()
    assert Policy().for_entry(e) == Tolerance(1e-5, 1e-4, ToleranceKind.DTYPE_DEFAULT, "dtype default float32")
    assert Policy(exact=True).for_entry(e).exact
    rules = (parse_rule("attn.*=1,1"), parse_rule("model.layers.1.*:gdn.ssm_state=0.5,0"),
             parse_rule("gdn.*=2,2"))
    assert Policy(rules, exact=True).for_entry(e) == Tolerance(0.5, 0.0, ToleranceKind.USER_RULE, "--tol model.layers.1.*:gdn.ssm_state")
    assert Policy(rules).for_entry(_entry("attn.k")).atol == 1
    assert Policy(rules).for_entry(_entry(module="model.layers.2.linear_attn")).atol == 2
    assert Policy().for_entry(_entry(dtype="bfloat16")) == Tolerance(1e-2, 2e-2, ToleranceKind.DTYPE_DEFAULT, "dtype default bfloat16")
    assert Policy().for_entry(_entry(dtype="int32")).exact


def test_policy_describe_names_the_policy():
    assert Policy().describe().startswith("dtype defaults (float32 atol 1e-05 rtol 0.0001")
    assert Policy(exact=True).describe() == "exact: bit identity (both traces replay=exact)"
    assert Policy((parse_rule("a=1,2"),)).describe().endswith("; --tol rules first: a=1,2")


SPECIALS = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf])


@given(st.lists(st.one_of(st.floats(-1e3, 1e3, width=32), SPECIALS), min_size=0, max_size=48),
       st.data(), st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
       st.sampled_from([FP32, EXACT, Tolerance(0.0, 1e-3, ToleranceKind.USER_RULE, "rtol only")]))
@settings(max_examples=200, deadline=None)
def test_fast_path_gives_the_general_paths_metrics(values, data, dtype, tol):
    """Pieces with only finite values take Accumulator._update_finite: same metrics, field for field."""
    import statediff.diff.metrics as metrics

    n = len(values)
    noise = data.draw(st.lists(st.sampled_from([0.0, 0.0, 1e-6, -1e-3, 0.5]), min_size=n, max_size=n))
    specials = data.draw(st.lists(st.one_of(st.none(), SPECIALS), min_size=n, max_size=n))
    a = np.array(values, dtype=np.float64)
    b = np.array([v + e if s is None else s for v, e, s in zip(values, noise, specials)], dtype=np.float64)
    if dtype == "bfloat16":
        a, b = bf16(a), bf16(b)
    else:
        a, b = a.astype(dtype), b.astype(dtype)
    block = data.draw(st.integers(1, max(n, 1)))
    blocks = [(a[i:i + block], b[i:i + block]) for i in range(0, n, block)] or [(a, b)]
    sub = metrics.SUB_ELEMS
    general = metrics.Accumulator._update_finite
    try:
        metrics.SUB_ELEMS = data.draw(st.integers(1, 8))  # many pieces: fast and general ones mixed
        with np.errstate(all="ignore"):
            fast = compare_blocks(blocks, (n,), dtype, tol)
            metrics.Accumulator._update_finite = lambda self, x, y: False
            ref = compare_blocks(blocks, (n,), dtype, tol)
    finally:
        metrics.SUB_ELEMS, metrics.Accumulator._update_finite = sub, general
    assert fast.to_json().keys() == ref.to_json().keys()
    for k, v in ref.to_json().items():
        w = fast.to_json()[k]
        assert w == v or (isinstance(v, float) and math.isnan(v) and math.isnan(w)), (k, w, v)
