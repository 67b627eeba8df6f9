"""Hostile and damaged traces: every one is refused with one TraceError line, nothing else.

The cases live in tests/hostile/corpus.py (generated from one valid trace).
The fuzz tier mutates bytes of a valid trace (fixed examples in CI); run it
longer, on other examples, with e.g.
``STATEDIFF_FUZZ_EXAMPLES=20000 STATEDIFF_FUZZ_SEED=7 python -m pytest tests/trace/test_trace_hostile.py -k fuzz``.
Every failure it finds becomes a named case in the corpus.
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
FUZZ_EXAMPLES = int(os.environ.get("STATEDIFF_FUZZ_EXAMPLES", 1000))
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
