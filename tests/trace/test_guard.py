"""The read guard: libhdf5 maps a file only in a child process bounded in time and memory, and any
breach (a loop, a crash, too much memory) is one ``TraceError`` line.

The bounds in these tests are short on purpose where the outcome is a breach
whatever the machine's speed (a mapper that never returns, or that crashes);
where a real file must map, the default bound (60 s) applies.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from statediff.errors import TraceError
from statediff.trace import guard, h5map, open_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hostile.corpus import write_valid  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    return write_valid(tmp_path_factory.mktemp("guard") / "valid.h5")


def test_the_child_maps_what_the_process_itself_would(valid):
    assert guard.ENABLED
    assert guard.map_file(valid) == h5map.map_file(valid)
    fmap = guard.map_file(valid)
    assert sorted(fmap.members) == ["digests", "frames", "index", "requests", "run", "tensors"]
    assert fmap.attrs["format"].value == "statediff.trace" and fmap.attrs["format_version"].value == 3
    # /frames locates the tensors: their datasets' headers are not mapped, only their names
    assert fmap.members["tensors"].names == ("t000000000", "t000000001", "t000000002", "t000000003")
    assert fmap.members["tensors"].members == {}
    index = fmap.members["index"].dataset
    assert (index.shape, index.filters, index.layout) == ((4,), (), 1)  # a small table: contiguous


def test_without_frames_every_tensor_header_is_mapped(valid, tmp_path):
    import shutil

    old = tmp_path / "old.h5"
    shutil.copyfile(valid, old)
    with h5py.File(old, "r+") as f:
        del f["frames"]
    t0 = guard.map_file(old).members["tensors"].members["t000000000"].dataset
    assert (t0.shape, t0.dtype, t0.filters, len(t0.chunks)) == ((4, 8), "float32", (32015,), 1)
    with open_trace(old) as t:  # read through the datasets, as traces written before /frames
        assert [t.read(e).shape for e in t.entries] == [(4, 8), (2, 3, 5), (), (0, 4)]


def _hang(path: Path):
    while True:
        time.sleep(1)


def _crash(path: Path):
    os.kill(os.getpid(), signal.SIGSEGV)


def _hog(path: Path):
    return bytearray(guard.READ_MEMORY + (1 << 30))  # over the address-space bound: MemoryError


def test_a_mapper_that_never_returns_is_stopped_at_the_time_bound(valid):
    t0 = time.monotonic()
    (got,) = list(guard.map_files([valid], mapper=_hang, seconds=1))
    assert isinstance(got, guard.GuardBreach) and got.bound == "time"
    assert str(got) == (f"{valid}: reading its HDF5 metadata did not finish within 1 s (the read guard's bound, "
                        "STATEDIFF_READ_SECONDS): damaged or hostile file")
    assert time.monotonic() - t0 < 600  # generous: the child is killed, not waited for


def test_a_crash_in_the_child_is_one_line(valid):
    (got,) = list(guard.map_files([valid], mapper=_crash))
    assert isinstance(got, guard.GuardBreach) and got.bound == "crash"
    assert str(got) == f"{valid}: the HDF5 library crashed reading it (SIGSEGV): damaged or hostile file"


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="the memory bound needs /proc (Linux)")
def test_memory_beyond_the_bound_is_refused(valid):
    (got,) = list(guard.map_files([valid], mapper=_hog))
    assert isinstance(got, guard.GuardBreach) and got.bound == "memory"
    assert "STATEDIFF_READ_MEMORY" in str(got) and str(got).startswith(str(valid))


def test_after_a_breach_later_files_are_not_mapped(valid, tmp_path):
    other = write_valid(tmp_path / "other.h5")
    got = list(guard.map_files([valid, other], mapper=_crash))
    assert len(got) == 1 and got[0].bound == "crash"


def test_a_mapper_refusal_is_passed_on_and_the_next_file_mapped(valid, tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    got = list(guard.map_files([bad, valid]))
    assert isinstance(got[0], TraceError) and not isinstance(got[0], guard.GuardBreach)
    assert str(got[0]).startswith(f"{bad} is damaged or truncated: ")
    assert got[1] == h5map.map_file(valid)


def test_fork_while_another_thread_uses_h5py(valid, tmp_path):
    """The child is forked holding h5py's lock: another thread inside libhdf5 cannot leave it locked."""
    stop = threading.Event()
    scratch = tmp_path / "busy.h5"

    def busy() -> None:
        while not stop.is_set():
            with h5py.File(scratch, "w") as f:
                f.create_dataset("x", data=np.arange(1000))
                f.attrs["a"] = "b" * 100

    th = threading.Thread(target=busy)
    th.start()
    try:
        for _ in range(20):
            with open_trace(valid) as t:
                assert len(t.entries) == 4
    finally:
        stop.set()
        th.join()


def test_a_file_replaced_between_open_and_map_is_refused(valid, tmp_path, monkeypatch):
    other = write_valid(tmp_path / "other.h5")
    real = guard.map_file
    monkeypatch.setattr(guard, "map_file", lambda p, seconds=None: real(other))
    with pytest.raises(TraceError, match="changed while it was read"):
        open_trace(valid)


def test_without_fork_or_when_switched_off_the_map_is_made_in_process(valid):
    script = ("import sys; from statediff.trace import guard, open_trace\n"
              "assert not guard.ENABLED\n"
              f"t = open_trace({str(valid)!r}); print(len(t.entries))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, STATEDIFF_READ_GUARD="0", PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "4"


def test_the_bounds_come_from_the_environment():
    script = "from statediff.trace import guard; print(guard.READ_SECONDS, guard.READ_MEMORY, guard.bounds_text())"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, STATEDIFF_READ_SECONDS="7.5", STATEDIFF_READ_MEMORY="1073741824",
                                PYTHONPATH=str(REPO)))
    assert p.stdout.split() == ["7.5", "1073741824", "7.5", "s", "and", "1", "GiB"]


def test_a_map_survives_its_json_round_trip(valid):
    fmap = h5map.map_file(valid)
    assert h5map.FileMap.from_json(fmap.to_json()) == fmap
    assert dataclasses.asdict(fmap) == fmap.to_json()


def test_a_segment_that_breaks_a_bound_ends_the_valid_prefix(tmp_path, monkeypatch):
    """A parts directory whose second segment makes libhdf5 loop: the first step is served, and the
    trace says which bound ended it (the root-attribute loop of tests/hostile/found/, 2 s bound)."""
    from hostile.corpus import _parts

    import gzip

    parts = _parts(tmp_path, "loop")
    found = Path(__file__).resolve().parents[1] / "hostile" / "found" / "time-c780b351f391.h5.gz"
    (parts / "seg-00000001.h5").write_bytes(gzip.decompress(found.read_bytes()))
    monkeypatch.setattr(guard, "READ_SECONDS", 2.0)
    with open_trace(parts) as t:
        assert t.segments == 1 and t.breach == "time"
        assert sorted(e.dataset for e in t.entries) == ["t000000000", "t000000001"]
        assert t.partial_reason == (
            f"the recording did not finish; read up to step 1 (segment seg-00000001.h5 is damaged: "
            f"{parts / 'seg-00000001.h5'}: reading its HDF5 metadata did not finish within 2 s (the read guard's "
            "bound, STATEDIFF_READ_SECONDS): damaged or hostile file)")
