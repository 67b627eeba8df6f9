"""Hostile and damaged traces: every one is refused with one TraceError line, nothing else.

The cases live in tests/hostile/corpus.py (generated from one valid trace);
files that broke a bound of the read guard (a libhdf5 loop, crash or memory
blow-up) are kept as found in tests/hostile/found/, each with a JSON note.

Two fuzz tiers. The byte tier mutates any bytes of a valid trace (fixed
examples in CI; run it longer, on other examples, with e.g.
``STATEDIFF_FUZZ_EXAMPLES=20000 STATEDIFF_FUZZ_SEED=7 python -m pytest tests/trace/test_trace_hostile.py -k fuzz``).
The metadata tier (tests/hostile/metafuzz.py) mutates the structures
libhdf5 parses, with their checksums recomputed, for
``STATEDIFF_FUZZ_SECONDS`` (default 90 s) with a seed that changes between
runs unless ``STATEDIFF_FUZZ_SEED`` is set; the seed is printed first, and
every file that breaks a bound is saved to tests/hostile/found/. By hand:
``.venv/bin/python tests/hostile/metafuzz.py --seconds 3600``. The terminal
tier sets random bytes of ``traces/hit.h5`` and runs inspect, compare, report,
verify and audit on it: their output must be printable UTF-8
(``tests/hostile/terminal.py``; ``STATEDIFF_FUZZ_EXAMPLES // 15`` cases).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hostile.corpus import CASES, PARTIAL_CASES, READ_CASES, TENSORS, write_valid  # noqa: E402

from statediff.errors import StatediffError, TraceError  # noqa: E402
from statediff.trace import open_trace  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("STATEDIFF_FUZZ_EXAMPLES", 300))
FUZZ_SEED = os.environ.get("STATEDIFF_FUZZ_SEED")  # unset: the same examples every run


def _fuzz(max_examples: int):
    """Hypothesis settings of the fuzz tier: derandomized unless STATEDIFF_FUZZ_SEED is set."""
    def deco(fn):
        fn = settings(max_examples=max_examples, derandomize=FUZZ_SEED is None, deadline=None,
                      database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(fn)
        return seed(int(FUZZ_SEED))(fn) if FUZZ_SEED is not None else fn
    return deco


def _one_line(e: TraceError) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    assert isinstance(e, StatediffError)  # the CLI turns it into exit code 2
    return msg


@pytest.mark.parametrize("name", list(CASES))
def test_open_refuses(tmp_path: Path, name: str) -> None:
    build, fragment = CASES[name]
    path = build(tmp_path)
    with pytest.raises(TraceError) as info:
        open_trace(path)
    msg = _one_line(info.value)
    assert fragment in msg
    assert str(path) in msg or path.name in msg


@pytest.mark.parametrize("name", list(READ_CASES))
def test_read_refuses(tmp_path: Path, name: str) -> None:
    build, fragment = READ_CASES[name]
    path = build(tmp_path)
    with open_trace(path) as t:  # the index is fine: the trace opens
        e = next(e for e in t.entries if e.dataset == "t000000000")
        with pytest.raises(TraceError) as info:
            t.read(e)
        assert fragment in _one_line(info.value)
        with pytest.raises(TraceError) as info:
            for _ in t.iter_blocks(e, block_bytes=16):
                pass
        _one_line(info.value)
        others = [x for x in t.entries if x.dataset != "t000000000"]
        for x in others:  # the damage stays with its tensor
            assert t.read(x).tobytes() == TENSORS[x.dataset][0].tobytes()


@pytest.mark.parametrize("name", list(PARTIAL_CASES))
def test_damaged_parts_directory_serves_its_valid_prefix(tmp_path: Path, name: str) -> None:
    build, n_entries, reason = PARTIAL_CASES[name]
    path = build(tmp_path)
    with open_trace(path) as t:
        assert t.partial and reason in t.partial_reason
        assert sorted(e.dataset for e in t.entries) == sorted(TENSORS)[:n_entries]
        for e in t.entries:
            assert t.read(e).tobytes() == TENSORS[e.dataset][0].tobytes()


def test_bombs_and_absurd_declarations_stay_in_bounded_memory(tmp_path: Path) -> None:
    """Decompression bombs and a 2**40-element declaration, read in a fresh process.

    With h5py's own read path the 2 GiB bomb alone takes ~2.1 GB of memory;
    here the process may grow by less than 300 MB past its imports.
    """
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from hostile.corpus import READ_CASES
        from statediff.errors import TraceError
        from statediff.trace import open_trace
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        refused = 0
        for name in ("decompression_bomb", "decompression_bomb_small_frame",
                     "tensor_declares_2_pow_40_elements", "tensor_huge_chunks"):
            d = Path({str(tmp_path)!r}) / name
            d.mkdir()
            t = open_trace(READ_CASES[name][0](d))
            e = [e for e in t.entries if e.dataset == "t000000000"][0]
            for read in (lambda: t.read(e), lambda: list(t.iter_blocks(e))):
                try:
                    read()
                except TraceError:
                    refused += 1
        print(refused, base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, base_mb, peak_mb = map(int, out.stdout.split())
    assert refused == 8
    assert peak_mb - base_mb < 300, f"peak {peak_mb} MB after imports at {base_mb} MB"


# -- fuzz tier ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory) -> bytes:
    return write_valid(tmp_path_factory.mktemp("fuzz") / "base.h5").read_bytes()


_mutation = st.tuples(
    st.floats(0, 1, exclude_max=True),  # where, as a fraction of the file
    st.sampled_from(["set", "flip", "int32", "truncate"]),
    st.integers(0, 2 ** 32 - 1),
)


def _mutate(data: bytes, mutations: list[tuple[float, str, int]]) -> bytes:
    b = bytearray(data)
    for where, how, value in mutations:
        pos = int(where * len(b))
        if how == "set":
            b[pos] = value & 0xFF
        elif how == "flip":
            b[pos] ^= 1 << (value % 8)
        elif how == "int32":
            b[pos:pos + 4] = value.to_bytes(4, "little")
        else:
            del b[pos:]
            break
    return bytes(b)


def _open_and_read_everything(path: Path) -> None:
    """Open, read every tensor whole and in pieces, touch every request: TraceError or success."""
    try:
        with open_trace(path) as t:
            for e in t.entries:
                t.read(e)
                for _ in t.iter_blocks(e, block_bytes=64):
                    pass
            assert isinstance(t.run, dict) and isinstance(t.requests, dict)
            t.storage_bytes()
    except TraceError as e:
        _one_line(e)


@_fuzz(FUZZ_EXAMPLES)
@given(st.lists(_mutation, min_size=1, max_size=12))
def test_fuzz_mutated_trace_is_read_or_refused(valid_bytes: bytes, mutations) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzzed.h5"
        path.write_bytes(_mutate(valid_bytes, mutations))
        _open_and_read_everything(path)


@pytest.fixture(scope="module")
def valid_parts(tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hostile.corpus import _parts
    return _parts(tmp_path_factory.mktemp("fuzzparts"), "base")


@_fuzz(max(20, FUZZ_EXAMPLES // 5))
@given(st.lists(_mutation, min_size=1, max_size=8), st.sampled_from(["seg-00000000.h5",
                                                                     "seg-00000001.h5"]))
def test_fuzz_mutated_segment_is_read_or_refused(valid_parts: Path, mutations, segment) -> None:
    with tempfile.TemporaryDirectory() as d:
        parts = Path(d) / "t.h5.parts"
        shutil.copytree(valid_parts, parts)
        seg = parts / segment
        seg.write_bytes(_mutate(seg.read_bytes(), mutations))
        _open_and_read_everything(parts)


# -- the terminal tier: what the commands print from a damaged reference trace ----------------------
# The issue-32 recipe: 1-8 bytes of traces/hit.h5 set at random in its first 8 KiB (superblock, root
# group, the global heap with the run and request records) or its last 64 KiB; every command that
# prints from a trace runs on it in this process, its stdout and stderr written as a process writes
# them (tests/hostile/terminal.py), and must end with exit 0, 1 or 2, no traceback, and nothing but
# printable UTF-8 (newline and tab aside) on either stream: a byte of the file that is not UTF-8, or
# an escape sequence, is shown escaped (statediff/textsafe.py), never passed on.

REF_HIT, REF_COLD = REPO / "traces" / "hit.h5", REPO / "traces" / "cold.h5"
TERMINAL_COMMANDS = (("inspect", "H"), ("inspect", "H", "--json"), ("compare", "H", "C"), ("report", "H", "C"),
                     ("verify", "H"), ("audit", "H"))


def _flipped(flips: list[tuple[int, int]]) -> Path:
    """traces/hit.h5 with byte ``value`` at each ``(offset, value)``, in a temporary directory."""
    b = bytearray(REF_HIT.read_bytes())
    for at, value in flips:
        b[at] = value
    path = Path(tempfile.mkdtemp(prefix="statediff-flipped-")) / "hit.h5"
    path.write_bytes(b)
    return path


def _print_all(hit: Path) -> dict[tuple, tuple[int, str, str]]:
    """Every command of TERMINAL_COMMANDS on ``hit`` (and the reference cold trace), each checked
    by ``hostile.terminal.checked``: {command: (exit code, stdout, stderr)}."""
    from hostile.terminal import checked

    try:
        return {cmd: checked([{"H": hit, "C": REF_COLD}.get(a, a) for a in cmd]) for cmd in TERMINAL_COMMANDS}
    finally:
        shutil.rmtree(hit.parent)


@_fuzz(max(10, FUZZ_EXAMPLES // 15))
@given(st.integers(0, 2 ** 32 - 1))
def test_fuzz_flipped_reference_trace_prints_only_printable_utf8(case: int) -> None:
    """The issue's recipe, case ``case``: 1-8 bytes, each in the first 8 KiB or the last 64 KiB
    (even odds), set to a random value."""
    import random

    rng, size = random.Random(case), REF_HIT.stat().st_size
    flips = [(rng.randrange(8192) if rng.random() < 0.5 else rng.randrange(size - 65536, size), rng.randrange(256))
             for _ in range(rng.randint(1, 8))]
    _print_all(_flipped(flips))


def test_a_run_key_with_a_byte_that_is_not_utf8_is_shown_escaped() -> None:
    """One of the cases the issue found: byte 0x8a in the run key statediff_version (h5py hands it
    over as U+DC8A; printed as it is, the raw byte reached the terminal)."""
    at = REF_HIT.read_bytes().find(b'"statediff_version"')
    assert at > 0
    out = _print_all(_flipped([(at + 7, 0x8A)]))
    code, text, err = out[("inspect", "H")]
    assert (code, err) == (0, "")
    assert "  stated\\x8aff_version   0.1.0" in text.splitlines()
    assert '"stated\\\\x8aff_version": "0.1.0"' in out[("inspect", "H", "--json")][1]


# -- version 3: /digests rows that summarise tensors with data -------------------------------------
# (built here rather than in the corpus: the corpus's valid trace has no summaries)


def _summary_trace(path: Path) -> Path:
    """A valid version-3 trace: the corpus tensors with their summaries (linked /digests rows) but
    the 0-d one (a tensor without a summary is valid too), one digest-only row with a summary and
    one with only a digest."""
    from hostile.corpus import DIGESTS
    from statediff.trace import TraceWriter
    from statediff.trace.summary import summarize

    w = TraceWriter(path, {"engine": "synthetic", "mode": "cold", "block_size": 16})
    w.begin_request(0, "req-0", list(range(40)))
    w.begin_request(1, "req-1", list(range(10, 30)))
    for i, (name, (arr, dtype, kind, role, layer, pos, start)) in enumerate(TENSORS.items()):
        w.add(arr, request=i // 2, position=pos, layer=layer, kind=kind, role=role,
              module=f"model.layers.{layer}", dtype=dtype, token_start=start, step=0,
              summary=summarize(arr, dtype) if arr.ndim else None)
    for k, (block, req, pos) in enumerate(DIGESTS):
        w.add_digest(summarize(block, "bfloat16") if k == 0 else summarize(block, "bfloat16").digest,
                     request=req, position=pos, token_start=pos - 16, layer=1, kind="attn.k",
                     role="resumed", module="model.layers.1", dtype="bfloat16", shape=block.shape,
                     step=0, block=3)
    w.end_step()
    w.close()
    return path


def _edit_summary_rows(path: Path, edit) -> Path:
    """Apply ``edit(rows)`` to the /digests table of ``path`` (rewritten with the same layout)."""
    import h5py

    with h5py.File(path, "r+") as f:
        rows = f["digests"][()]
        rows = edit(rows) if edit is not None else rows
        del f["digests"]
        f.create_dataset("digests", data=rows)
    return path


def _linked(rows, dataset: bytes = b"t000000000") -> int:
    """Row number of the /digests row linked to ``dataset``."""
    return int(next(i for i, d in enumerate(rows["dataset"].tolist()) if d == dataset))


def _set(field: str, value, dataset: bytes = b"t000000000"):
    def edit(rows):
        rows[field][_linked(rows, dataset)] = value
        return rows
    return edit


def _twice(rows):
    import numpy as np

    n = _linked(rows)
    return np.concatenate([rows, rows[n:n + 1]])


def _swap_links(rows):
    a, b = _linked(rows, b"t000000000"), _linked(rows, b"t000000001")
    rows["dataset"][a], rows["dataset"][b] = b"t000000001", b"t000000000"
    return rows


SUMMARY_CASES = {
    # name: (edit of the /digests rows, fragment of the one-line refusal)
    "link_not_a_dataset_name": (_set("dataset", b"../tensors/t0"), "dataset name is not t<digits>"),
    "link_with_trailing_text": (_set("dataset", b"t000000000x"), "dataset name is not t<digits>"),
    "link_to_a_missing_tensor": (_set("dataset", b"t000000099"),
                                 "/digests names dataset t000000099, which is not in the index"),
    "two_rows_for_one_tensor": (_twice, "dataset t000000000 has two /digests rows"),
    "link_to_the_wrong_tensor": (_swap_links, "disagrees with its index row on"),
    "linked_row_other_position": (_set("position", 40), "disagrees with its index row on position"),
    "linked_row_other_layer": (_set("layer", 5), "disagrees with its index row on layer"),
    "linked_row_other_kind": (_set("kind", b"gdn.conv_state"), "disagrees with its index row on kind"),
    # t000000000 is float32 with a bf16 digest: another dtype is refused for carrying one
    "linked_row_other_dtype": (_set("dtype", b"float16"), "digest_bf16 on a float16 tensor"),
    "linked_row_other_shape": (_set("shape", [8, 4, 0, 0, 0, 0, 0, 0]),
                               "disagrees with its index row on shape"),
    "linked_row_other_token_start": (_set("token_start", 0), "disagrees with its index row on token_start"),
    "n_nan_below_minus_1": (_set("n_nan", -2), "NaN/Inf counts below -1 (-2, 0)"),
    "n_inf_below_minus_1": (_set("n_inf", -(1 << 62)), "NaN/Inf counts below -1"),
    "digest_bf16_uppercase": (_set("digest_bf16", b"A" * 32),
                              "digest_bf16 is neither empty nor 32 lowercase hex digits"),
    "digest_bf16_short": (_set("digest_bf16", b"0123"),
                          "digest_bf16 is neither empty nor 32 lowercase hex digits"),
    "digest_bf16_not_ascii": (_set("digest_bf16", b"\xff" * 32), "digest_bf16"),
    "linked_digest_not_hex": (_set("digest", b"g" * 32), "digest is not 32 lowercase hex digits"),
    "linked_digest_empty": (_set("digest", b""), "digest is not 32 lowercase hex digits"),
}


@pytest.mark.parametrize("name", list(SUMMARY_CASES))
def test_summary_rows_are_refused(tmp_path: Path, name: str) -> None:
    edit, fragment = SUMMARY_CASES[name]
    path = _edit_summary_rows(_summary_trace(tmp_path / f"{name}.h5"), edit)
    with pytest.raises(TraceError) as info:
        open_trace(path)
    msg = _one_line(info.value)
    assert fragment in msg and path.name in msg, msg


def test_summary_layout_must_match_the_version(tmp_path: Path) -> None:
    import h5py
    import numpy as np

    from statediff.trace.schema import DIGEST_DTYPE_V2

    v3 = _summary_trace(tmp_path / "v3.h5")
    with h5py.File(v3, "r+") as f:  # a version-3 file with the version-2 layout
        rows = f["digests"][()]
        del f["digests"]
        f.create_dataset("digests", data=rows[list(DIGEST_DTYPE_V2.names)].astype(DIGEST_DTYPE_V2))
    with pytest.raises(TraceError, match="/digests has an unexpected record layout"):
        open_trace(v3)
    v2 = _summary_trace(tmp_path / "v2.h5")
    with h5py.File(v2, "r+") as f:  # a version-2 file with the version-3 layout
        f.attrs["format_version"] = 2
    with pytest.raises(TraceError, match="/digests has an unexpected record layout"):
        open_trace(v2)
    assert np.dtype(DIGEST_DTYPE_V2).itemsize == 281


def test_valid_summary_trace_reads_back(tmp_path: Path) -> None:
    """The base of the cases above is itself valid: summaries attach to their tensors."""
    from statediff.trace.summary import summarize

    path = _summary_trace(tmp_path / "ok.h5")
    with open_trace(path) as t:
        assert t.format_version == 3
        for e in t.entries:
            arr = TENSORS[e.dataset][0]
            if arr.ndim == 0:
                assert e.summary is None and e.digest_value is None
                continue
            assert e.summary == summarize(arr, e.dtype)
            assert e.digest_value == e.summary.digest
        known, digest_only = t.digests
        assert known.summary is not None and known.summary.sketch is not None
        assert digest_only.summary is None and digest_only.digest_value == digest_only.digest


def test_summary_values_a_writer_can_produce_are_accepted(tmp_path: Path) -> None:
    """Unknown fields (NaN moments, -1 counts, an all-NaN sketch) and non-finite sums (float64 data
    can overflow them; a float32 sketch of huge values rounds to +-Inf) are read as they are."""
    import math

    inf, nan = float("inf"), float("nan")

    def edit(rows):
        n = _linked(rows)
        rows["sum"][n], rows["sumsq"][n], rows["absmax"][n] = nan, nan, nan
        rows["n_nan"][n], rows["n_inf"][n] = -1, -1
        rows["sketch"][n] = [nan] * 16
        m = _linked(rows, b"t000000001")
        rows["sum"][m], rows["sumsq"][m] = -inf, inf
        rows["sketch"][m][3] = inf
        return rows

    path = _edit_summary_rows(_summary_trace(tmp_path / "edge.h5"), edit)
    with open_trace(path) as t:
        by = {e.dataset: e.summary for e in t.entries}
    a, b = by["t000000000"], by["t000000001"]
    assert a.sketch is None and not a.known_moments and math.isnan(a.absmax)
    assert b.sum == -inf and b.sumsq == inf and b.sketch[3] == inf


def test_partly_nan_sketch_is_refused(tmp_path: Path) -> None:
    def edit(rows):
        rows["sketch"][_linked(rows)][5] = float("nan")
        return rows

    path = _edit_summary_rows(_summary_trace(tmp_path / "partnan.h5"), edit)
    with pytest.raises(TraceError, match="sketch is partly NaN"):
        open_trace(path)


@pytest.fixture(scope="module")
def valid_summary_bytes(tmp_path_factory) -> bytes:
    return _summary_trace(tmp_path_factory.mktemp("fuzz3") / "base3.h5").read_bytes()


@_fuzz(max(20, FUZZ_EXAMPLES // 5))
@given(st.lists(_mutation, min_size=1, max_size=12))
def test_fuzz_mutated_summary_trace_is_read_or_refused(valid_summary_bytes: bytes, mutations) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzzed3.h5"
        path.write_bytes(_mutate(valid_summary_bytes, mutations))
        _open_and_read_everything(path)


def test_tables_shorter_than_the_run_field_keep_says_are_refused(tmp_path: Path) -> None:
    """A /digests table cut to fewer rows than the recorder counted: refused, not read as "not captured"."""
    import h5py
    import numpy as np

    from statediff.trace import TraceWriter
    from statediff.trace.summary import summarize

    path = tmp_path / "cut.h5"
    w = TraceWriter(path, {"mode": "cold", "keep": {"policy": "none", "kept_tensors": 0,
                                                    "digest_only_tensors": 2}})
    w.begin_request(0, "r0", [1, 2, 3])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for pos in (16, 32):
        w.add_digest(summarize(x + pos, "float32"), request=0, position=pos, layer=0, kind="gdn.ssm_state",
                     role="checkpoint", module="model.layers.0", dtype="float32", shape=x.shape)
    w.end_step()
    w.close()
    with open_trace(path) as t:
        assert len(t.digests) == 2
    with h5py.File(path, "r+") as f:
        rows = f["digests"][:1]
        del f["digests"]
        f.create_dataset("digests", data=rows)
    with pytest.raises(TraceError) as info:
        open_trace(path)
    assert str(info.value) == (f"{path}: run field keep.digest_only_tensors is 2 but /digests holds 1 such "
                               "tensors (a table was cut or edited)")


# -- the metadata tier and the files it found ----------------------------------------------------------

FUZZ_SECONDS = float(os.environ.get("STATEDIFF_FUZZ_SECONDS", 30))  # per CI run; seeds differ run to run
FOUND = REPO / "tests" / "hostile" / "found"
FOUND_NAMES = sorted(p.name.removesuffix(".h5.gz") for p in FOUND.glob("*.h5.gz"))


def test_metadata_fuzz_cases_are_read_or_refused_in_one_line(capsys, tmp_path) -> None:
    """Every case of the metadata tier is read or refused in one line (``metafuzz.run_case`` raises
    anything else); a case that breaks a bound of the read guard is a finding, saved to
    $STATEDIFF_FUZZ_FOUND (default: this test's temporary directory; a test run never writes into
    the source tree) and reported here, not a failure: the guard turned it into one line. Copy a
    finding into tests/hostile/found/ to keep it in the corpus. Each case's whole read (the guarded map, then every table and tensor by byte range) must
    end within twice its guard bound plus 60 s: generous, so that a loaded CI machine is no finding
    (the bound itself is 10 s, or 100 times the bases' map time on this machine if longer)."""
    from hostile import metafuzz

    seed = int(os.environ["STATEDIFF_FUZZ_SEED"]) if os.environ.get("STATEDIFF_FUZZ_SEED") else None
    lines: list[str] = []
    found = Path(os.environ.get("STATEDIFF_FUZZ_FOUND") or tmp_path / "found")
    report = metafuzz.fuzz(FUZZ_SECONDS, seed, found=found, log=lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines + [report.line()]))
    assert report.cases > 0, report.line()
    assert set(report.outcomes) <= {"read", "refused", "time", "cpu", "memory", "crash"}, report.line()
    assert report.slowest[0] <= 2 * report.bound + 60, report.line()
    if report.findings:
        import warnings

        warnings.warn(f"metadata fuzz (seed {report.seed}) found {len(report.findings)} files that broke a "
                      f"bound, in {found} (copy them into tests/hostile/found/ to keep them): "
                      f"{report.findings}")


def found_file(name: str, d: Path) -> Path:
    """The found file ``name`` (``tests/hostile/found/<name>.h5.gz``) unpacked into ``d``."""
    import gzip

    path = d / f"{name}.h5"
    path.write_bytes(gzip.decompress((FOUND / f"{name}.h5.gz").read_bytes()))
    return path


@pytest.fixture(scope="module")
def found_paths(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("found")
    return {name: found_file(name, d) for name in FOUND_NAMES}


@pytest.fixture(scope="module")
def found_refusals(found_paths) -> dict[str, tuple[str, bool, str] | None]:
    """Every found file opened, eight at a time, each in its own guarded child with a 2 s bound
    (``hostile.refusal``: in processes, not threads): such a file never maps, so the bound only decides
    which line refuses it (libhdf5's own refusal, once fixed, or the guard's), never whether it is
    refused; the hangs cost a bound per eight files."""
    from hostile.refusal import refusals

    return dict(zip(found_paths, refusals(list(found_paths.values()), 2.0)))


@pytest.mark.parametrize("name", FOUND_NAMES)
def test_found_files_are_refused_in_one_line(name: str, found_refusals, found_paths) -> None:
    """Files that made libhdf5 loop, crash or blow its memory: refused in one line naming the file."""
    import json

    note = json.loads((FOUND / f"{name}.json").read_text())
    assert note["bound"] in ("time", "cpu", "memory", "crash") and note["bound"] == name.split("-")[0]
    assert {"h5py", "hdf5", "message", "mutations", "base"} <= set(note)
    got = found_refusals[name]
    assert got is not None, f"{name} was read"
    cls, is_statediff_error, msg = got
    assert is_statediff_error, cls  # the CLI turns it into exit code 2
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    assert str(found_paths[name]) in msg


def test_the_root_attribute_loop_is_refused_by_the_guard(tmp_path, monkeypatch) -> None:
    """The global heap whose free-space object is shorter than its header: libhdf5 2.0.0 loops forever
    reading the root attribute 'format'; the guard stops it at its bound (here 2 s)."""
    import h5py

    from statediff.trace import guard

    path = found_file("time-c780b351f391", tmp_path)
    monkeypatch.setattr(guard, "READ_SECONDS", 2.0)
    with pytest.raises(TraceError) as info:
        open_trace(path)
    if h5py.version.hdf5_version == "2.0.0":
        assert isinstance(info.value, guard.GuardBreach) and info.value.bound == "time"
        assert str(info.value) == (f"{path}: reading its HDF5 metadata did not finish within 2 s (the read "
                                   "guard's bound, STATEDIFF_READ_SECONDS): damaged or hostile file")
