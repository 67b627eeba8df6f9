"""Round trips through the trace format: every byte written reads back, with its hash."""

from __future__ import annotations

import xxhash
import json
import math
import os
import tempfile
import time
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  lets plain h5py decode the Zstandard chunks
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statediff.trace.dtypes import STORAGE, ordered_bits, round_to_bf16, to_float
from statediff.errors import TraceError
from statediff.trace import TraceWriter, open_trace
from statediff.trace.fingerprint import Fingerprint, fingerprint
from statediff.trace.schema import FORMAT_NAME, FORMAT_VERSION, RUN_KEYS
from statediff.trace.storage import WRITE_CHUNK_BYTES, chunk_shape


def _blake(a: np.ndarray) -> str:
    return xxhash.xxh3_128(np.ascontiguousarray(a).tobytes()).hexdigest()


def _write(path: Path, tensors: list[tuple[np.ndarray, str]], **kw) -> None:
    """One step per tensor; tensor i is (request i % 3, position i, layer i)."""
    w = TraceWriter(path, {"engine": "synthetic", "replay": "exact"}, **kw)
    for r in range(3):
        w.begin_request(r, f"req-{r}", [r, r + 1])
    for i, (arr, dtype) in enumerate(tensors):
        w.add(arr, request=i % 3, position=i, layer=i, kind="gdn.ssm_state", role="checkpoint",
              module=f"layers.{i}", dtype=dtype, step=i)
        w.end_step()
    w.close()


def _by_layer(t) -> list:
    return sorted(t.entries, key=lambda e: e.layer)


# -- every logical dtype, every special bit pattern ----------------------------------

ALL_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
ALL_FP16 = ALL_BF16.view(np.float16)
ALL_FP8 = np.arange(256, dtype=np.uint8).reshape(16, 16)
SPECIAL_FP32 = np.array(
    [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
     0x7FC12345, 0xFFFFFFFF, 0x7F800001, 0x3F800000, 0x7F7FFFFF], dtype=np.uint32).view(np.float32)
RANDOM_FP32 = np.random.default_rng(0).integers(0, 1 << 32, (7, 13, 5), dtype=np.uint32).view(np.float32)
RANDOM_FP64 = np.random.default_rng(1).integers(0, 1 << 63, (9, 4), dtype=np.uint64).view(np.float64)

DTYPE_CASES = {
    "bfloat16_all_65536_patterns": (ALL_BF16, "bfloat16"),
    "float16_all_65536_patterns": (ALL_FP16, "float16"),
    "float8_e4m3fn_all_256": (ALL_FP8, "float8_e4m3fn"),
    "float8_e5m2_all_256": (ALL_FP8, "float8_e5m2"),
    "float32_specials": (SPECIAL_FP32, "float32"),
    "float32_random_bits": (RANDOM_FP32, "float32"),
    "float64_random_bits": (RANDOM_FP64, "float64"),
    "int64_extremes": (np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], "<i8"), "int64"),
    "int32_extremes": (np.array([[np.iinfo(np.int32).min, 0], [7, np.iinfo(np.int32).max]], "<i4"), "int32"),
    "int16": (np.arange(-300, 300, dtype="<i2").reshape(2, 300), "int16"),
    "int8": (np.arange(-128, 128, dtype="i1"), "int8"),
    "uint8": (np.arange(256, dtype="u1"), "uint8"),
    "bool": (np.array([[0, 1, 1], [0, 0, 1]], dtype="u1"), "bool"),
    "empty_2d": (np.zeros((0, 5), "<f4"), "float32"),
    "empty_inner": (np.zeros((5, 0, 3), "<u2"), "bfloat16"),
    "zero_dim_fp32": (np.array(-0.0, "<f4"), "float32"),
    "zero_dim_bf16": (np.array(0x7FC1, "<u2"), "bfloat16"),
    "eight_dims": (np.arange(2 ** 8, dtype="<f4").reshape((2,) * 8), "float32"),
}


@pytest.fixture(scope="module")
def dtype_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rt") / "dtypes.h5"
    _write(path, list(DTYPE_CASES.values()))
    return path


@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_every_dtype_reads_back_bit_exact(dtype_trace: Path, name: str) -> None:
    i = list(DTYPE_CASES).index(name)
    arr, dtype = DTYPE_CASES[name]
    with open_trace(dtype_trace) as t:
        e = _by_layer(t)[i]
        got = t.read(e)
        assert (e.dtype, e.shape, e.layer, e.position) == (dtype, arr.shape, i, i)
        assert got.dtype == STORAGE[dtype] and got.shape == arr.shape
        assert got.tobytes() == arr.tobytes()
        assert e.hash == _blake(arr)
        pieces = list(t.iter_blocks(e, block_bytes=100))
        assert b"".join(p.tobytes() for p in pieces) == arr.tobytes()
    with h5py.File(dtype_trace, "r") as f:  # any HDF5 reader with hdf5plugin sees the same bytes
        assert f["tensors"][e.dataset][()].tobytes() == arr.tobytes()


def test_bf16_moments_count_every_nan_and_inf(dtype_trace: Path) -> None:
    with open_trace(dtype_trace) as t:
        e = _by_layer(t)[list(DTYPE_CASES).index("bfloat16_all_65536_patterns")]
    # exponent all ones: mantissa 0 is +-inf, the 127 other mantissas are NaN, per sign
    assert (e.n_nan, e.n_inf) == (254, 2)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        finite = to_float(ALL_BF16, "bfloat16").astype(np.float64)
    finite = finite[np.isfinite(finite)]
    assert e.min == finite.min() == -float(np.float32(3.3895314e38))
    assert e.max == finite.max()
    assert e.sum == 0.0  # every finite value has its negation in the set
    assert math.isclose(e.sumsq, float(np.dot(finite, finite)), rel_tol=1e-12)


@pytest.mark.parametrize("dtype,n_nan,n_inf,vmax", [
    ("float8_e4m3fn", 2, 0, 448.0), ("float8_e5m2", 6, 2, 57344.0)])
def test_fp8_moments(dtype_trace: Path, dtype: str, n_nan: int, n_inf: int, vmax: float) -> None:
    name = "float8_e4m3fn_all_256" if dtype == "float8_e4m3fn" else "float8_e5m2_all_256"
    with open_trace(dtype_trace) as t:
        e = _by_layer(t)[list(DTYPE_CASES).index(name)]
    assert (e.n_nan, e.n_inf, e.max, e.min, e.sum) == (n_nan, n_inf, vmax, -vmax, 0.0)


def test_float32_specials_fingerprint(dtype_trace: Path) -> None:
    with open_trace(dtype_trace) as t:
        e = _by_layer(t)[list(DTYPE_CASES).index("float32_specials")]
    # NaNs: 7FC00000, 7FC12345, FFFFFFFF, 7F800001; infinities: +-inf
    assert (e.n_nan, e.n_inf) == (4, 2)
    largest_negative_denormal = float(np.array(0x807FFFFF, np.uint32).view(np.float32))
    assert e.max == float(np.finfo(np.float32).max) and e.min == largest_negative_denormal


def test_int64_moments_are_exact_float64(dtype_trace: Path) -> None:
    with open_trace(dtype_trace) as t:
        e = _by_layer(t)[list(DTYPE_CASES).index("int64_extremes")]
    assert (e.min, e.max, e.n_nan) == (-(2.0 ** 63), 2.0 ** 63, 0)


# -- layout: chunking, edge chunks, many requests --------------------------------------

LAYOUT_SHAPES = {
    "gdn_ssm_state_fp32": ((48, 128, 128), "<f4"),  # 3 MiB: 3 chunks of (16, 128, 128)
    "edge_chunk_fp32": ((49, 128, 128), "<f4"),  # last chunk padded on disk, cut on read
    "one_row_over_a_chunk_bf16": ((3, 1, 700_001), "<u2"),  # split on the last axis
    "kv_block_bf16": ((4, 96, 256), "<u2"),
}


@pytest.fixture(scope="module")
def layout_trace(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    arrays = []
    for shape, dt in LAYOUT_SHAPES.values():
        if dt == "<f4":
            arrays.append(rng.standard_normal(shape, dtype=np.float32))
        else:
            arrays.append(rng.integers(0, 1 << 16, shape, dtype=np.uint16))
    path = tmp_path_factory.mktemp("layout") / "layout.h5"
    _write(path, [(a, "float32" if a.dtype == np.float32 else "bfloat16") for a in arrays])
    return path, arrays


@pytest.mark.parametrize("name", list(LAYOUT_SHAPES))
def test_chunked_tensors_read_back_and_stream_in_bounded_pieces(layout_trace, name: str) -> None:
    path, arrays = layout_trace
    i = list(LAYOUT_SHAPES).index(name)
    arr = arrays[i]
    with open_trace(path) as t:
        e = _by_layer(t)[i]
        assert t.read(e).tobytes() == arr.tobytes()
        block = 256 * 1024
        pieces = list(t.iter_blocks(e, block_bytes=block))
        assert b"".join(p.tobytes() for p in pieces) == arr.tobytes()
        assert max(p.nbytes for p in pieces) <= max(block, WRITE_CHUNK_BYTES)
    with h5py.File(path, "r") as f:
        ds = f["tensors"][e.dataset]
        assert ds.chunks == chunk_shape(arr.shape, arr.itemsize)
        assert [ds.id.get_create_plist().get_filter(0)[0]] == [32015]  # registered Zstandard id
        assert ds[()].tobytes() == arr.tobytes()


def test_chunk_shapes() -> None:
    assert chunk_shape((48, 128, 128), 4) == (16, 128, 128)
    assert chunk_shape((3, 1, 700_001), 2) == (1, 1, 524_288)
    assert chunk_shape((3, 4), 4) == (3, 4)
    assert chunk_shape((), 4) is None and chunk_shape((0, 5), 4) is None


def test_many_requests_and_run_metadata(tmp_path: Path) -> None:
    path = tmp_path / "many.h5"
    w = TraceWriter(path, {"engine": "synthetic", "mode": "hit", "block_size": 96,
                           "layers": [{"layer": 0, "module": "m", "type": "gdn"}],
                           "custom_field": {"x": 1}})
    n = 300
    for r in range(n):
        w.begin_request(r, f"req-{r}", list(range(r, r + 50 + r % 7)), cache_salt=f"salt-{r}")
    for r in range(n):
        w.add(np.full((2, 3), r, np.float32), request=r, position=96, layer=0,
              kind="gdn.conv_state", role="checkpoint", module="m", dtype="float32")
        w.update_request(r, output_token_ids=[r, 1, 2], num_cached_tokens=96 * (r % 2),
                         chunks=[[0, 50], [50, 96 + r]], finished=r % 5 != 0,
                         acceptance={"mean_length": 1.5, "drafts": r})
        if r % 10 == 9:
            w.end_step()
    w.update_run(engine_version="0.32.0")
    stats = w.close()
    assert stats["tensors"] == n and stats["segments"] == 30
    assert not (tmp_path / "many.h5.parts").exists()
    with open_trace(path) as t:
        assert not t.partial and t.partial_reason == "" and t.describe().endswith("[complete]")
        assert set(RUN_KEYS) <= set(t.run)
        assert t.run["engine_version"] == "0.32.0" and t.run["quantization"] is None
        assert t.run["custom_field"] == {"x": 1} and t.run["mode"] == "hit"
        assert len(t.requests) == n and len(t.entries) == n
        r = t.requests[123]
        assert r["prompt_token_ids"] == list(range(123, 123 + 50 + 123 % 7))
        assert r["prompt_len"] == 50 + 123 % 7 and r["output_token_ids"] == [123, 1, 2]
        assert r["num_cached_tokens"] == 96 and r["cache_salt"] == "salt-123"
        assert r["chunks"] == [[0, 50], [50, 96 + 123]] and r["finished"] is True
        assert r["acceptance"] == {"mean_length": 1.5, "drafts": 123}
        assert [e.request for e in t.entries] == list(range(n))  # causal order
        assert t.read(t.entries[250]).tolist() == [[250.0] * 3] * 2
        assert t.storage_bytes() > 0
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == FORMAT_NAME and f.attrs["format_version"] == 1  # no /digests: v1
        assert bool(f.attrs["complete"]) is True
        assert json.loads(f["run"].attrs["json"])["block_size"] == 96


def test_writer_threads_do_not_change_the_file_content(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = [(rng.standard_normal((40, 64, 128), dtype=np.float32), "float32"),
               (rng.integers(0, 1 << 16, (4, 96, 256), dtype=np.uint16), "bfloat16")] * 3
    rows = []
    for threads in (0, 3):
        path = tmp_path / f"th{threads}.h5"
        _write(path, tensors, threads=threads)
        with open_trace(path) as t:
            rows.append([(e.dataset, e.hash, e.sum, e.sumsq, e.min, e.max) for e in t.entries])
            for e, (arr, _) in zip(_by_layer(t), tensors):
                assert t.read(e).tobytes() == arr.tobytes()
    assert rows[0] == rows[1]


def test_fingerprint_does_not_depend_on_how_elements_are_fed() -> None:
    a = np.random.default_rng(1).standard_normal(300_001).astype(np.float32)
    a[5], a[70_000] = np.nan, -np.inf
    fp = Fingerprint("float32")
    for i in range(0, a.size, 12_345):
        fp.update(a[i:i + 12_345])
    whole = fingerprint(a, "float32")
    assert fp.result() == whole
    assert (whole["n_nan"], whole["n_inf"]) == (1, 1)
    assert whole["hash"] == _blake(a)


def test_reader_refuses_non_entries(dtype_trace: Path) -> None:
    with open_trace(dtype_trace) as t:
        e = t.entries[0]
    import dataclasses
    ghost = dataclasses.replace(e, dataset="t999999999")
    with open_trace(dtype_trace) as t, pytest.raises(TraceError, match="is not in this trace"):
        t.read(ghost)


# -- the dtype helpers the comparer builds on --------------------------------------------

def test_to_float_bf16_is_the_upper_half_of_fp32() -> None:
    f = to_float(ALL_BF16.reshape(-1), "bfloat16")
    assert f.dtype == np.float32
    assert (f.view(np.uint32) >> 16).astype(np.uint16).tobytes() == ALL_BF16.tobytes()


def test_ordered_bits_gives_ulp_distances() -> None:
    bits = np.array([0x3F80, 0x3F81, 0x0000, 0x8000, 0x8001, 0x0001], np.uint16)
    o = ordered_bits(bits, "bfloat16")
    assert o[1] - o[0] == 1  # one ULP above 1.0
    assert o[2] == o[3] == 0  # +0.0 and -0.0 coincide
    assert o[5] - o[4] == 2  # smallest negative to smallest positive denormal


def test_round_to_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, np.inf, np.nan], np.float32)
    r = round_to_bf16(x)
    assert r[0] == 1.0 and r[1] == 1.0 + 2 ** -6 and np.isinf(r[2]) and np.isnan(r[3])


# -- property: any array written reads back byte-identical with the same hash -----------

_DTYPES = sorted(STORAGE)


@st.composite
def _arrays(draw) -> tuple[np.ndarray, str]:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    store = STORAGE[dtype]
    n = math.prod(shape) * store.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    return np.frombuffer(raw, dtype=store).reshape(shape).copy(), dtype


@settings(max_examples=int(os.environ.get("STATEDIFF_ROUNDTRIP_EXAMPLES", 40)), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_arrays(), min_size=1, max_size=4))
def test_property_any_array_round_trips_with_its_hash(tensors) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.h5"
        _write(path, tensors, threads=0)
        with open_trace(path) as t:
            for e, (arr, dtype) in zip(_by_layer(t), tensors):
                got = t.read(e)
                assert (got.dtype, got.shape, e.dtype) == (arr.dtype, arr.shape, dtype)
                assert got.tobytes() == arr.tobytes()
                assert e.hash == _blake(arr) == fingerprint(got, dtype)["hash"]


def test_long_non_ascii_module_name_is_cut_at_a_character_boundary(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    module = "m" * 95 + "\u00e9t\u00e9"  # the 96-byte field ends inside the first e-acute
    w = TraceWriter(path, {})
    w.add(np.zeros(2, np.float32), request=0, position=0, layer=0, kind="hidden",
          role="activation", module=module, dtype="float32")
    w.close()
    with open_trace(path) as t:
        assert t.entries[0].module == "m" * 95


def test_metadata_numbers_json_cannot_hold_are_stored_as_null(tmp_path: Path) -> None:
    path = tmp_path / "nan.h5"
    w = TraceWriter(path, {"sampling": {"temperature": float("nan")}})
    w.begin_request(0, "r", [1], acceptance={"mean_length": np.float32("nan"), "drafts": 0})
    w.close()
    with open_trace(path) as t:
        assert t.run["sampling"] == {"temperature": None}
        assert t.requests[0]["acceptance"] == {"mean_length": None, "drafts": 0}


def test_digests_round_trip_through_segments_merge_and_parts(tmp_path: Path) -> None:
    """/digests rows (format version 2) read back exactly, from the merged file and from the parts."""
    from statediff.trace import DigestEntry
    from statediff.trace.digest import digest_array

    blocks = [np.full((2, 32, 16), j, np.uint16) for j in range(4)]
    path = tmp_path / "dig.h5"
    w = TraceWriter(path, {"engine": "synthetic", "mode": "hit"})
    w.begin_request(0, "r", list(range(130)), num_cached_tokens=128)
    for j in (2, 0, 1):  # any order in: causal order out
        w.add_digest(digest_array(blocks[j]), request=0, position=32 * (j + 1), token_start=32 * j,
                     layer=3, kind="attn.k", role="resumed", module="model.layers.3.self_attn",
                     dtype="bfloat16", shape=(2, 32, 16), step=0, block=10 + j)
    w.add(blocks[3], request=0, position=128, token_start=96, layer=3, kind="attn.k", role="resumed",
          module="model.layers.3.self_attn", dtype="bfloat16", step=0, block=13)
    w.end_step()
    w.add_digest(digest_array(blocks[0]), request=0, position=32, token_start=0, layer=3, kind="attn.v",
                 role="resumed", module="model.layers.3.self_attn", dtype="bfloat16",
                 shape=(2, 32, 16), step=1, block=10)
    w.end_step()
    import time

    deadline = time.monotonic() + 30
    while not (w.parts / "seg-00000001.h5").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the writer thread renames a segment into place when it is whole
    with open_trace(w.parts) as t:  # the partial trace (a killed recording) has them too
        assert len(t.digests) == 4 and t.format_version == 3
    stats = w.close()
    assert stats["digests"] == 4 and stats["tensors"] == 1
    with open_trace(path) as t:
        assert t.format_version == FORMAT_VERSION == 3  # /digests rows are written as version 3
        assert [d.key for d in t.digests] == [(0, 32, 3, "attn.k"), (0, 32, 3, "attn.v"),
                                             (0, 64, 3, "attn.k"), (0, 96, 3, "attn.k")]
        d = t.digests[0]
        assert d == DigestEntry(request=0, position=32, token_start=0, layer=3, kind="attn.k",
                                role="resumed", module="model.layers.3.self_attn", step=0, block=10,
                                dtype="bfloat16", shape=(2, 32, 16), digest=digest_array(blocks[0]))
        assert d.digest != t.digests[2].digest
        # a full tensor and a digest of the same bytes agree: what compare relies on
        assert digest_array(t.read(t.entries[0])) == digest_array(blocks[3])
    with h5py.File(path, "r") as f:
        assert f["digests"].dtype.itemsize == 449 and f["digests"].shape == (4,)


def test_version_1_traces_still_read(tmp_path: Path) -> None:
    path = tmp_path / "v1.h5"
    _write(path, [(np.arange(6, dtype=np.float32), "float32")])
    with h5py.File(path, "r") as f:  # nothing to digest: no table, the lowest version
        assert "digests" not in f and f.attrs["format_version"] == 1
    with open_trace(path) as t:
        assert t.format_version == 1 and t.digests == []
        assert t.read(t.entries[0]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# -- per-request output logprobs ---------------------------------------------------

def test_output_logprobs_round_trip_exactly_through_parts_and_merge(tmp_path: Path) -> None:
    """float32 logprobs and int64 top-k ids read back bit for bit, from the parts directory
    and from the merged file; None entries are NaN; requests without them read as null."""
    lps = np.array([-0.1, -2.5, np.float32(-1e-7)], dtype="<f4")
    ids = np.array([[5, 9], [6, 1], [7, 2]], dtype=np.int64)
    top = np.array([[-0.1, -3.25], [-1.5, -2.5], [-1e-7, -17.0]], dtype="<f4")
    path = tmp_path / "lp.h5"
    w = TraceWriter(path, {"engine": "synthetic", "logprobs_k": 2})
    w.begin_request(0, "a", [1, 2])
    w.begin_request(1, "b", [3])
    w.begin_request(2, "c", [4])
    w.update_request(0, output_token_ids=[5, 6, 7], output_logprobs=lps, output_topk_ids=ids,
                     output_topk_logprobs=top)
    w.update_request(1, output_token_ids=[8], output_logprobs=[None])  # sampled logprob only
    w.end_step()
    seg = path.with_name("lp.h5.parts") / "seg-00000000.h5"
    deadline = time.monotonic() + 30
    while not seg.exists() and time.monotonic() < deadline:  # the writer thread writes it
        time.sleep(0.01)
    with open_trace(path.with_name("lp.h5.parts")) as parts:
        assert parts.requests[0]["output_topk_ids"] == ids.tolist()
    w.close()
    with h5py.File(path) as f:
        g = f["requests/r00000000"]
        assert [(k, g[k].dtype.str, g[k].shape) for k in sorted(g)] == [
            ("output_logprobs", "<f4", (3,)), ("output_token_ids", "<i8", (3,)),
            ("output_topk_ids", "<i8", (3, 2)), ("output_topk_logprobs", "<f4", (3, 2)),
            ("prompt_token_ids", "<i8", (2,))]
        assert "output_logprobs" not in json.loads(g.attrs["json"])
    with open_trace(path) as t:
        r0, r1, r2 = t.requests[0], t.requests[1], t.requests[2]
        assert np.array(r0["output_logprobs"], "<f4").tobytes() == lps.tobytes()
        assert r0["output_topk_ids"] == [[5, 9], [6, 1], [7, 2]]
        assert np.array(r0["output_topk_logprobs"], "<f4").tobytes() == top.tobytes()
        assert math.isnan(r1["output_logprobs"][0]) and r1["output_topk_ids"] is None
        assert (r2["output_logprobs"], r2["output_topk_ids"], r2["output_topk_logprobs"]) == (None, None, None)
        assert t.run["logprobs_k"] == 2


def test_writer_refuses_logprobs_that_disagree_with_the_outputs(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "bad.h5", {"engine": "synthetic"})
    w.begin_request(0, "a", [1])
    with pytest.raises(ValueError, match="output_logprobs has 1 values for 0 output tokens"):
        w.update_request(0, output_logprobs=[-1.0])
    with pytest.raises(ValueError, match=r"output_topk_ids has shape \(1, 2\) but output_topk_logprobs \(1, 3\)"):
        w.update_request(0, output_token_ids=[4], output_logprobs=[-1.0], output_topk_ids=[[4, 5]],
                         output_topk_logprobs=[[-1.0, -2.0, -3.0]])
    with pytest.raises(TypeError, match="output_topk_ids: ids of type float64"):
        w.update_request(0, output_token_ids=[4], output_logprobs=[-1.0], output_topk_ids=[[4.5, 5.0]],
                         output_topk_logprobs=[[-1.0, -2.0]])
    with pytest.raises(ValueError, match="run field 'logprobs_k' is 65"):
        TraceWriter(tmp_path / "k.h5", {"engine": "synthetic", "logprobs_k": 65})
    assert w.request_field(0, "output_logprobs") is None  # nothing half-applied
    w.close()


def test_traces_with_logprobs_in_the_json_record_still_read(tmp_path: Path) -> None:
    """Before the datasets, `statediff record` stored the sampled logprobs as a JSON list."""
    path = tmp_path / "old.h5"
    w = TraceWriter(path, {"engine": "synthetic"})
    w.begin_request(0, "a", [1, 2], output_token_ids=[3, 4])
    w.close()
    with h5py.File(path, "r+") as f:
        rec = json.loads(f["requests/r00000000"].attrs["json"])
        f["requests/r00000000"].attrs["json"] = json.dumps(rec | {"output_logprobs": [-0.25, None]})
    with open_trace(path) as t:
        assert t.requests[0]["output_logprobs"] == [-0.25, None]
        assert t.requests[0]["output_topk_ids"] is None
