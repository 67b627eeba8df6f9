"""Crash safety and the write path under pressure.

A child process records a trace step by step and is killed (SIGKILL) or
interrupted (SIGINT) at chosen points, and at random points many times over;
every leftover opens as a partial trace listing exactly the tensors of the
completed steps. Write failures (disk full, file too large) stop recording
without raising into the caller, and close() names the cause. The data is
written once: close() turns the parts directory's data file into the trace.
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from statediff.errors import TraceError
from statediff.trace import (
    TraceWriter,
    check_writable,
    open_trace,
    parts_dir,
    recover,
)
from statediff.trace import writer as writer_mod
from statediff.trace.digest import digest_array

REPO = Path(__file__).resolve().parents[2]
STEPS = 5


@functools.cache
def patience() -> float:
    """How long a hang guard here waits: generous, and scaled by this machine's speed.

    A child's start (interpreter and imports) is measured once; the guards wait 100 times that,
    and at least 5 minutes. A healthy run needs seconds even with both cores of a 2-core machine
    busy (benchmarks/bench_busy.py runs this module so); the guards only stop a test that hangs,
    so that it fails instead of blocking the suite.
    """
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import h5py, numpy, statediff.trace"], check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    return max(300.0, 100 * (time.monotonic() - t0))


def step_tensors(step: int) -> list[tuple[np.ndarray, str, str]]:
    """The tensors of one step: (array, logical dtype, kind); values encode the step."""
    return [
        (np.full((16, 64), step, np.float32), "float32", "gdn.ssm_state"),
        ((np.arange(3 * 32 * 8, dtype=np.uint16).reshape(3, 32, 8) + step), "bfloat16", "attn.k"),
        (np.arange(2 * 70_000, dtype=np.float32).reshape(2, 70_000) * step, "float32", "hidden"),
    ]


def step_digest(step: int) -> str:
    """The digest-only K block each step records (a /digests row): values encode the step."""
    return digest_array(np.full((3, 16, 8), step, np.uint16))


CHILD = textwrap.dedent('''
    import os, resource, signal, sys, time
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_trace_crash import STEPS, step_digest, step_tensors
    from statediff.trace import TraceWriter
    from statediff.trace import writer as W

    path, scenario = Path(sys.argv[1]), sys.argv[2]
    parts = W.parts_dir(path)
    # the interrupt must reach this child whatever its parent ignores (an ignored SIGINT is inherited)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def say(msg):  # one write: lines from the writer thread and the main thread never mix
        os.write(1, (msg + "\\n").encode())

    def park():
        time.sleep(600)

    def wait_segment(n):
        while not (parts / f"seg-{{n:08d}}.h5").exists():
            time.sleep(0.002)

    if scenario == "kill_in_segment":  # block inside the writer thread while step 3 is written
        real_encode = W.encode
        def encode(array, *args):
            if array.shape == (2, 70_000) and array[0, 1] == 3:
                say("WRITING 3")
                park()
            return real_encode(array, *args)
        W.encode = encode
    if scenario == "kill_in_finish":  # close() has begun adding the tables to the data file
        real_attr = W.write_json_attr
        def write_json_attr(*args):
            real_attr(*args)
            say("FINISHING")
            park()
        W.write_json_attr = write_json_attr
    if scenario == "kill_before_cleanup":
        def rmtree(*args, **kwargs):
            say("MERGED")
            park()
        W.shutil.rmtree = rmtree
    if scenario.startswith("sigint"):  # steps 3 and 4 stay queued until the interrupt
        real_encode = W.encode
        def encode(array, *args):
            if array.shape == (2, 70_000) and array[0, 1] == 3:
                time.sleep(0.3)
            return real_encode(array, *args)
        W.encode = encode
    if scenario.startswith("file_too_large"):  # a real write error from the OS: EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if scenario == "file_too_large_in_step":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    w = TraceWriter(path, {{"engine": "synthetic", "mode": "cold"}}, threads=0)
    say("READY")
    if scenario == "kill_before_first_step":
        park()

    def record():
        for step in range(STEPS):
            w.begin_request(step, f"req-{{step}}", list(range(10 + step)))
            for layer, (arr, dtype, kind) in enumerate(step_tensors(step)):
                if scenario == "file_too_large_in_step" and step == 3 and layer == 2:
                    # random floats do not compress: this step's segment is over 1 MB
                    arr = np.random.default_rng(3).standard_normal((8, 70_000), np.float32)
                w.add(arr, request=step, position=16 * (step + 1), layer=layer, kind=kind,
                      role="checkpoint", module=f"layers.{{layer}}", dtype=dtype, step=step)
            w.add_digest(step_digest(step), request=step, position=16 * (step + 1),
                         token_start=16 * step, layer=9, kind="attn.k", role="resumed",
                         module="layers.9", dtype="bfloat16", shape=(3, 16, 8), step=step)
            w.update_request(step, finished=True, output_token_ids=[step])
            w.end_step()
            if scenario.startswith("sigint") and step >= 3:
                continue
            if scenario not in ("kill_in_segment", "file_too_large_in_step") or step < 3:
                wait_segment(step)
            say(f"STEP {{step}}")
            if scenario == "kill_mid_run" and step == 2:
                park()
        if scenario.startswith("sigint"):
            say("QUEUED")
            park()

    if scenario == "sigint_close":
        try:
            record()
        finally:
            w.close()
    else:
        record()
        if scenario == "file_too_large_in_finish":  # every step is written; the tables do not fit
            limit = (parts / "data.h5").stat().st_size + 256
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            w.close()
        except Exception as e:
            say(f"CLOSE FAILED {{type(e).__name__}}: {{e}}")
            sys.exit(3)
        say("CLOSED")
''')


class Child:
    """The recording child process; ``wait_for`` waits (at most ``patience()``) for a line of its stdout."""

    def __init__(self, tmp_path: Path, scenario: str) -> None:
        script = tmp_path / "child.py"
        script.write_text(CHILD.format(tests=str(REPO / "tests" / "trace")))
        self.path = tmp_path / "trace.h5"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.path), scenario],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.lines: list[str] = []
        self._out: queue.Queue = queue.Queue()
        self._err: list[str] = []
        # both pipes are drained by threads: a chatty child can never block on a full pipe
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._out.put), daemon=True).start()
        self._err_thread = threading.Thread(target=self._pump, args=(self.proc.stderr, self._err.append),
                                            daemon=True)
        self._err_thread.start()

    @staticmethod
    def _pump(pipe, sink) -> None:
        for line in pipe:
            sink(line.rstrip("\n"))
        sink(None)

    def wait_for(self, line: str, timeout: float | None = None) -> None:
        timeout = patience() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {line!r} from the child within {timeout} s: {self.lines}") from None
            if got is None:
                self.proc.wait(timeout=patience())
                raise AssertionError(f"child ended before {line!r}: {self.lines} {self.stderr}")
            self.lines.append(got)
            if got == line:
                return

    @property
    def stderr(self) -> str:
        return "\n".join(x for x in self._err if x is not None)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=patience())
        self._err_thread.join(timeout=patience())
        return rc

    def finish(self) -> int:
        rc = self.proc.wait(timeout=patience())
        while (got := self._out.get(timeout=patience())) is not None:
            self.lines.append(got)
        self._err_thread.join(timeout=patience())
        return rc


def assert_steps(t, steps: list[int]) -> None:
    """The trace holds exactly the tensors and digests of ``steps``, bit-exact."""
    assert [(d.step, d.request, d.position, d.token_start, d.shape, d.digest) for d in t.digests] == \
        [(s, s, 16 * (s + 1), 16 * s, (3, 16, 8), step_digest(s)) for s in steps]
    got = sorted((e.step, e.layer) for e in t.entries)
    assert got == [(s, layer) for s in steps for layer in range(3)]
    for e in t.entries:
        expected = step_tensors(e.step)[e.layer][0]
        assert t.read(e).tobytes() == expected.tobytes()
        assert e.position == 16 * (e.step + 1) and e.request == e.step


@pytest.fixture
def child(tmp_path: Path):
    made = []

    def start(scenario: str) -> Child:
        c = Child(tmp_path, scenario)
        made.append(c)
        return c

    yield start
    for c in made:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


# -- SIGKILL at several points ----------------------------------------------------------

def test_kill_before_first_step_leaves_an_empty_partial_trace(child) -> None:
    c = child("kill_before_first_step")
    c.wait_for("READY")
    assert c.kill() == -signal.SIGKILL
    assert not c.path.exists() and parts_dir(c.path).is_dir()
    with open_trace(c.path) as t:
        assert t.partial and t.entries == [] and t.requests == {}
        assert t.run["engine"] == "synthetic" and t.run["mode"] == "cold"
        assert "(0 steps)" in t.partial_reason


def test_kill_mid_run_keeps_exactly_the_completed_steps(child) -> None:
    c = child("kill_mid_run")
    c.wait_for("STEP 2")
    c.kill()
    with open_trace(c.path) as t:
        assert t.partial and "(3 steps)" in t.describe()
        assert_steps(t, [0, 1, 2])
        assert sorted(t.requests) == [0, 1, 2]
        assert t.requests[2]["finished"] is True and t.requests[2]["output_token_ids"] == [2]


def test_kill_while_a_step_is_written_ignores_the_unfinished_one(child) -> None:
    c = child("kill_in_segment")
    c.wait_for("WRITING 3")  # step 3's first tensors are in the data file, its segment is not
    c.kill()
    parts = parts_dir(c.path)
    assert sorted(p.name for p in parts.iterdir()) == [
        "data.h5", "run.json", "seg-00000000.h5", "seg-00000001.h5", "seg-00000002.h5"]
    with open_trace(parts) as t:
        assert_steps(t, [0, 1, 2])


def test_kill_while_finishing_keeps_the_parts_and_recover_copies_them(child, tmp_path) -> None:
    c = child("kill_in_finish")
    c.wait_for("FINISHING")
    c.kill()
    assert not c.path.exists()
    with open_trace(c.path) as t:  # served from trace.h5.parts, whatever close wrote meanwhile
        assert t.partial
        assert_steps(t, list(range(STEPS)))
    out = tmp_path / "recovered.h5"
    stats = recover(parts_dir(c.path), out)
    assert stats["tensors"] == 3 * STEPS and stats["segments"] == STEPS and stats["digests"] == STEPS
    with open_trace(out) as t:
        assert t.partial and "did not finish" in t.partial_reason
        assert_steps(t, list(range(STEPS)))
        assert sorted(t.requests) == list(range(STEPS))
    with pytest.raises(TraceError, match="already exists"):
        recover(parts_dir(c.path), out)


def test_kill_after_merge_before_cleanup_serves_the_complete_file(child) -> None:
    c = child("kill_before_cleanup")
    c.wait_for("MERGED")
    c.kill()
    assert c.path.exists() and parts_dir(c.path).exists()
    with open_trace(c.path) as t:
        assert not t.partial
        assert_steps(t, list(range(STEPS)))


def test_normal_run_finishes_the_data_file_and_removes_the_parts(child) -> None:
    c = child("normal")
    assert c.finish() == 0 and "CLOSED" in c.lines
    assert not parts_dir(c.path).exists()
    with open_trace(c.path) as t:
        assert not t.partial
        assert_steps(t, list(range(STEPS)))


# -- Ctrl-C ------------------------------------------------------------------------------

def test_sigint_without_close_writes_every_step_handed_over(child) -> None:
    c = child("sigint_unhandled")
    c.wait_for("QUEUED")
    rc = c.kill(signal.SIGINT)
    assert rc != 0 and "KeyboardInterrupt" in c.stderr
    assert "did not finish; partial trace of 5 steps kept in" in c.stderr
    with open_trace(c.path) as t:
        assert t.partial
        assert_steps(t, list(range(STEPS)))  # steps 3 and 4 were still queued at the interrupt


def test_sigint_with_close_in_finally_gives_a_complete_file(child) -> None:
    c = child("sigint_close")
    c.wait_for("QUEUED")
    c.kill(signal.SIGINT)
    assert not parts_dir(c.path).exists()
    with open_trace(c.path) as t:
        assert not t.partial
        assert_steps(t, list(range(STEPS)))


# -- write failures ------------------------------------------------------------------------

def _record(w: TraceWriter, steps: range) -> None:
    for step in steps:
        w.begin_request(step, f"req-{step}", [1, 2, 3])
        for layer, (arr, dtype, kind) in enumerate(step_tensors(step)):
            w.add(arr, request=step, position=16 * (step + 1), layer=layer, kind=kind,
                  role="checkpoint", module="m", dtype=dtype, step=step)
        w.add_digest(step_digest(step), request=step, position=16 * (step + 1), token_start=16 * step,
                     layer=9, kind="attn.k", role="resumed", module="m", dtype="bfloat16",
                     shape=(3, 16, 8), step=step)
        w.end_step()


def test_disk_full_mid_recording_stops_cleanly(tmp_path, monkeypatch, capsys) -> None:
    real = TraceWriter._write_segment
    calls = []

    def write_segment(self, path, tensors, reqs, *rest):
        calls.append(path.name)
        if len(calls) == 3:
            real(self, path, tensors[:1], reqs, *rest)  # part of the file is on disk, then:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, tensors, reqs, *rest)

    monkeypatch.setattr(TraceWriter, "_write_segment", write_segment)
    path = tmp_path / "full.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(STEPS))  # never raises into the caller
    w.update_request(4, finished=True)
    w.update_run(seed=1)
    with pytest.raises(TraceError) as info:
        w.close()
    msg = str(info.value)
    assert "cannot write step 2 (seg-00000002.h5.tmp): No space left on device (errno 28)" in msg
    assert f"partial trace kept in {parts_dir(path)}" in msg and "\n" not in msg
    assert w.error is not None and "statediff: recording stopped" in capsys.readouterr().err
    assert not path.exists()
    assert sorted(p.name for p in parts_dir(path).iterdir()) == [
        "data.h5", "run.json", "seg-00000000.h5", "seg-00000001.h5"]  # no *.tmp left
    with open_trace(path) as t:
        assert t.partial
        assert_steps(t, [0, 1])


def test_disk_full_while_finishing_keeps_the_parts(tmp_path, monkeypatch) -> None:
    def write_json_attr(*args):  # the first table close() adds to the data file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "write_json_attr", write_json_attr)
    path = tmp_path / "merge.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(STEPS))
    with pytest.raises(TraceError, match=r"cannot write trace .*merge.h5: No space left on device"):
        w.close()
    assert not path.exists() and not path.with_name("merge.h5.tmp").exists()
    monkeypatch.undo()  # space freed: the parts are still whole
    with open_trace(path) as t:
        assert_steps(t, list(range(STEPS)))
    recover(parts_dir(path), tmp_path / "later.h5")
    with open_trace(tmp_path / "later.h5") as t:
        assert_steps(t, list(range(STEPS)))


def test_file_too_large_from_the_os_stops_recording_at_that_step(child) -> None:
    c = child("file_too_large_in_step")  # RLIMIT_FSIZE: the OS refuses writes past 1 MB
    assert c.finish() == 3
    stopped = [line for line in c.stderr.splitlines() if "recording stopped" in line]
    assert len(stopped) == 1 and "cannot write step 3 (data.h5): File too large" in stopped[0]
    closed = [line for line in c.lines if line.startswith("CLOSE FAILED")]
    assert closed and "TraceError: recording of" in closed[0] and "stopped early" in closed[0]
    assert not any(p.suffix == ".tmp" for p in parts_dir(c.path).iterdir())
    with open_trace(c.path) as t:
        assert t.partial
        assert_steps(t, [0, 1, 2])


def test_file_too_large_while_finishing_keeps_the_parts(child) -> None:
    c = child("file_too_large_in_finish")  # every step fits; the index and requests do not
    assert c.finish() == 3
    closed = [line for line in c.lines if line.startswith("CLOSE FAILED")]
    assert closed and "cannot write trace" in closed[0] and "File too large" in closed[0]
    assert len(closed[0]) < 600
    assert not c.path.exists() and not c.path.with_name("trace.h5.tmp").exists()
    with open_trace(c.path) as t:
        assert_steps(t, list(range(STEPS)))


def test_close_renames_the_data_file_it_wrote_the_tensors_to(tmp_path) -> None:
    path = tmp_path / "once.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(3))
    while not (parts_dir(path) / "seg-00000002.h5").exists():
        time.sleep(0.002)
    data = os.stat(parts_dir(path) / "data.h5")
    # segments are read only after a crash: close() does not need them
    (parts_dir(path) / "seg-00000001.h5").write_bytes(b"damaged")
    stats = w.close()
    assert stats["tensors"] == 9 and stats["digests"] == 3 and stats["segments"] == 3
    assert os.stat(path).st_ino == data.st_ino  # the same file: no tensor byte was copied
    assert not parts_dir(path).exists()
    with open_trace(path) as t:
        assert not t.partial
        assert_steps(t, [0, 1, 2])


def _frames(parts: Path, seg: int) -> np.ndarray:
    with h5py.File(parts / f"seg-{seg:08d}.h5", "r") as f:
        return f["frames"][()]


def test_data_file_cut_short_keeps_the_steps_before_the_cut(tmp_path) -> None:
    """A data file that lost its end (power loss, no fsync): the steps whose chunks lie in the
    part that survived are served, the first one pointing past the end is where the prefix stops."""
    path = tmp_path / "cut.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(3))
    w._at_exit()
    parts = parts_dir(path)
    end = [int((f["offset"] + f["size"]).max()) for f in (_frames(parts, s) for s in range(3))]
    cut = max(end[:2])  # small chunks of all steps share blocks near the start: cut after step 1's
    assert end[2] > cut
    os.truncate(parts / "data.h5", cut)
    with open_trace(parts) as t:
        assert t.partial and t.segments == 2
        assert "seg-00000002.h5 is damaged" in t.damage and "lies outside the data file" in t.damage
        assert_steps(t, [0, 1])


def test_damaged_chunk_in_the_data_file_is_reported_as_damage(tmp_path) -> None:
    path = tmp_path / "bad.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(2))
    w._at_exit()
    parts = parts_dir(path)
    frames = _frames(parts, 1)
    row = frames[frames["dataset"] == b"t000000005"][0]  # step 1's (2, 70000) float32 tensor
    with open(parts / "data.h5", "r+b") as fh:
        fh.seek(int(row["offset"]) + 100)
        fh.write(b"\x00" * 64)
    with open_trace(parts) as t:
        assert t.segments == 2
        bad = [e for e in t.entries if e.dataset == "t000000005"][0]
        with pytest.raises(TraceError, match=r"data.h5: /tensors/t000000005 .* chunk \(0, 0\)"
                                             r"|t000000005 .* is damaged"):
            t.read(bad)
        for e in t.entries:
            if e is not bad:
                assert t.read(e).tobytes() == step_tensors(e.step)[e.layer][0].tobytes()


def test_mutated_data_file_is_read_exactly_or_reported_as_damaged(tmp_path) -> None:
    """Random bytes of a killed recording's data file overwritten, 40 times: every tensor reads
    back bit-exact or raises one TraceError line, whatever the bytes hit (a chunk, HDF5 metadata)."""
    import shutil

    path = tmp_path / "fuzz.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(3))
    w._at_exit()
    size = (parts_dir(path) / "data.h5").stat().st_size
    rng = np.random.default_rng(11)
    damaged = 0
    for n in range(40):
        parts = tmp_path / f"m{n}.h5.parts"
        shutil.copytree(parts_dir(path), parts)
        with open(parts / "data.h5", "r+b") as fh:
            for _ in range(int(rng.integers(1, 6))):
                fh.seek(int(rng.integers(0, size)))
                fh.write(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes())
        with open_trace(parts) as t:  # the segments are intact: all three steps are listed
            assert t.segments == 3 and len(t.entries) == 9
            for e in t.entries:
                try:
                    got = t.read(e)
                except TraceError as err:
                    assert "\n" not in str(err) and e.dataset in str(err)
                    damaged += 1
                    continue
                assert got.tobytes() == step_tensors(e.step)[e.layer][0].tobytes()
    assert damaged > 0  # some mutations hit chunks (most hit HDF5 metadata the reader never uses)


def test_index_row_from_a_summary_matches_the_host_fingerprint(tmp_path) -> None:
    """With a summary the writer takes sum/sumsq from it and reduces only min/max on the bit
    patterns: the index row equals the host fingerprint (sums up to summation order); NaN/Inf,
    even where the summary denies them, fall back to the host moments."""
    from statediff.trace.fingerprint import fingerprint
    from statediff.trace.summary import summarize

    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 50, 40), dtype=np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    neg = -np.abs(f32)
    nan = f32.copy()
    nan[1, 2, 3] = np.nan
    cases = [(f32, "float32"), (bf16, "bfloat16"), (neg.astype(np.float16), "float16"),
             (np.array(-2.5, np.float32), "float32"), (np.zeros((0, 3), np.uint16), "bfloat16"),
             (rng.integers(0, 120, 64).astype(np.uint8), "float8_e4m3fn"), (nan, "float32"),
             (rng.integers(-9, 9, 30).astype(np.int32), "int32")]
    lying = summarize(f32, "float32")  # attached to the NaN tensor below: claims no NaN
    path = tmp_path / "sum.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    for i, (arr, dtype) in enumerate(cases + [(nan, "float32")]):
        w.add(arr, request=0, position=1, layer=i, kind="hidden", role="checkpoint", module="m",
              dtype=dtype, summary=lying if i == len(cases) else summarize(arr, dtype))
    w.close()
    with open_trace(path) as t:
        assert len(t.entries) == len(cases) + 1
        for e in t.entries:
            arr, dtype = (cases + [(nan, "float32")])[e.layer]
            fp = fingerprint(arr, dtype)
            assert (e.hash, e.min, e.max, e.n_nan, e.n_inf) == (
                fp["hash"], fp["min"], fp["max"], fp["n_nan"], fp["n_inf"]), e.label()
            assert e.sum == pytest.approx(fp["sum"], rel=1e-12, abs=1e-12)
            assert e.sumsq == pytest.approx(fp["sumsq"], rel=1e-12, abs=1e-12)
        # the host counted the NaN, whatever the summary said
        assert [e.n_nan for e in t.entries if e.layer in (6, 8)] == [1, 1]


# -- refusing a trace path before anything starts -----------------------------------------

def test_missing_directory(tmp_path) -> None:
    with pytest.raises(TraceError, match=r"directory .*nope does not exist"):
        TraceWriter(tmp_path / "nope" / "t.h5", {})


def test_unwritable_directory(tmp_path) -> None:
    if os.geteuid() == 0:
        target = Path("/sys/statediff-test.h5")  # sysfs refuses new files, even to root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "t.h5"
    with pytest.raises(TraceError, match="is not writable"):
        check_writable(target)
    with pytest.raises(TraceError, match="is not writable"):
        TraceWriter(target, {})
    assert not parts_dir(target).exists()


def test_existing_file_and_leftover_parts(tmp_path) -> None:
    path = tmp_path / "t.h5"
    path.write_bytes(b"old")
    with pytest.raises(TraceError, match="already exists"):
        TraceWriter(path, {})
    assert path.read_bytes() == b"old" and not parts_dir(path).exists()
    path.unlink()
    parts_dir(path).mkdir()
    with pytest.raises(TraceError, match="an earlier recording of .* did not finish"):
        TraceWriter(path, {})
    w = TraceWriter(path, {}, overwrite=True)  # replaces the leftover
    w.close()
    assert open_trace(path).entries == []


def test_path_is_a_directory(tmp_path) -> None:
    with pytest.raises(TraceError, match="it is a directory"):
        check_writable(tmp_path)


def test_not_enough_free_space(tmp_path) -> None:
    with pytest.raises(TraceError, match=r"MiB free on its disk \(need at least"):
        check_writable(tmp_path / "t.h5", min_free=1 << 62)


def test_recover_refuses_what_is_not_a_parts_directory(tmp_path) -> None:
    with pytest.raises(TraceError, match="is not a directory"):
        recover(tmp_path / "missing.h5.parts", tmp_path / "out.h5")


# -- programming errors are raised at the call, I/O errors never are ----------------------

def test_caller_errors_raise_at_the_call(tmp_path) -> None:
    w = TraceWriter(tmp_path / "t.h5", {"engine": "synthetic"})
    with pytest.raises(TypeError, match="is not the storage dtype of bfloat16"):
        w.add(np.zeros(3, np.float32), request=0, position=1, layer=0, kind="attn.k",
              role="kv_block", module="m", dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown kind 'attn.q'"):
        w.add(np.zeros(3, np.float32), request=0, position=1, layer=0, kind="attn.q",
              role="kv_block", module="m", dtype="float32")
    with pytest.raises(ValueError, match="token_start 9"):
        w.add(np.zeros(3, np.float32), request=0, position=4, layer=0, kind="attn.k",
              role="kv_block", module="m", dtype="float32", token_start=9)
    for bad, match in (({"digest": "ABC"}, "is not 32 lowercase hex digits"),
                       ({"digest": "0" * 31 + "G"}, "is not 32 lowercase hex digits"),
                       ({"role": "guess"}, "unknown kind 'attn.k' or role 'guess'"),
                       ({"shape": (1,) * 9}, "invalid shape"),
                       ({"token_start": 9}, "token_start 9")):
        kw = dict(digest="0" * 32, request=0, position=4, layer=0, kind="attn.k", role="resumed",
                  module="m", dtype="bfloat16", shape=(2, 2)) | bad
        with pytest.raises(ValueError, match=match):
            w.add_digest(kw.pop("digest"), **kw)
    with pytest.raises(TraceError, match="unknown logical dtype 'bf16'"):
        w.add_digest("0" * 32, request=0, position=4, layer=0, kind="attn.k", role="resumed",
                     module="m", dtype="bf16", shape=(2,))
    w.begin_request(0, "r", [1, 2], num_cached_tokens=np.int64(32))  # numpy ints are fine
    with pytest.raises(ValueError, match="'chunks' is not a list of"):
        w.update_request(0, chunks=[[5, 2]])
    with pytest.raises(ValueError, match="run field 'mode' is 'warm'"):
        w.update_run(mode="warm")
    w.close()
    with open_trace(tmp_path / "t.h5") as t:
        assert t.requests[0]["num_cached_tokens"] == 32 and t.run["mode"] is None


def test_a_request_record_broken_by_direct_editing_stops_recording(tmp_path) -> None:
    path = tmp_path / "t.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(2))
    w._requests[1]["chunks"].append([40, 8])  # a chunk the public add_chunk refuses: the reader must too
    w.update_request(1)
    w.end_step()
    _record(w, range(2, 4))  # ignored: recording stopped
    with pytest.raises(TraceError, match=r"request 1: 'chunks' is not a list of \[start, end\)"):
        w.close()
    with open_trace(path) as t:
        assert_steps(t, [0, 1])


def test_bad_run_metadata_is_refused_before_anything_is_created(tmp_path) -> None:
    with pytest.raises(ValueError, match="run field 'block_size' is '16'"):
        TraceWriter(tmp_path / "t.h5", {"block_size": "16"})
    assert list(tmp_path.iterdir()) == []


# -- SIGKILL at random points ----------------------------------------------------------------

KILLS = int(os.environ.get("STATEDIFF_CRASH_KILLS", "6"))  # 50+ for a real measurement


def heavy_tensors(step: int) -> list[tuple[np.ndarray, str, str]]:
    """A write-heavy step (~1.3 MB, hardly compressible, finite): kills land inside the writes."""
    rng = np.random.default_rng(step)
    bf16 = (rng.standard_normal((4, 128, 256), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [(rng.standard_normal((4, 128, 256), dtype=np.float32), "float32", "gdn.ssm_state"),
            (bf16, "bfloat16", "attn.k"),
            (np.full((3, 8), step, np.float32), "float32", "gdn.conv_state"),
            (np.array(float(step), np.float32), "float32", "hidden")]


def cheap_summary(arr: np.ndarray, dtype: str):
    """A ``Summary`` with the exact digest and host moments, no sketch (``summarize`` takes ~0.3 s
    a step here: the child would spend its time there instead of in the writes)."""
    from statediff.trace.fingerprint import fingerprint
    from statediff.trace.summary import Summary
    fp = fingerprint(arr, dtype)
    return Summary(digest=digest_array(arr), sum=fp["sum"], sumsq=fp["sumsq"],
                   absmax=max(abs(fp["min"]), abs(fp["max"])), n_nan=fp["n_nan"], n_inf=fp["n_inf"])


RANDOM_CHILD = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_trace_crash import cheap_summary, heavy_tensors
    from statediff.trace import TraceWriter

    path, steps = Path(sys.argv[1]), int(sys.argv[2])
    todo = [[(a, d, k, cheap_summary(a, d)) for a, d, k in heavy_tensors(s)] for s in range(steps)]
    w = TraceWriter(path, {{"engine": "synthetic"}})
    os.write(1, b"READY\\n")
    for step in range(steps):
        w.begin_request(step, f"req-{{step}}", [step])
        for layer, (arr, dtype, kind, summary) in enumerate(todo[step]):
            w.add(arr, request=step, position=step + 1, layer=layer, kind=kind, role="checkpoint",
                  module="m", dtype=dtype, step=step, summary=summary)
        w.end_step()
    while not (w.parts / f"seg-{{steps - 1:08d}}.h5").exists() and w.error is None:
        # close() starts with every step written
        time.sleep(0.001)
    os.write(1, b"CLOSING\\n")
    w.close()
    os.write(1, b"CLOSED\\n")
''')


def _served_steps(t) -> list[int]:
    """The steps a trace holds, each checked bit for bit (hash verified on read)."""
    steps = sorted({e.step for e in t.entries})
    assert sorted((e.step, e.layer) for e in t.entries) == [(s, i) for s in steps for i in range(4)]
    for e in t.entries:
        assert t.read(e).tobytes() == heavy_tensors(e.step)[e.layer][0].tobytes()
        assert e.summary is not None and e.summary.n_nan == 0 and e.summary.digest == digest_array(t.read(e))
    return steps


def test_random_kills_leave_every_completed_step_readable(tmp_path) -> None:
    """SIGKILL at random times, while steps are written or while close() finishes the file.

    Every outcome is one of: the parts directory serves the steps 0..k-1
    (k at least the number of segments that existed just before the kill),
    or the finished trace is complete. Nothing else (an unreadable parts
    directory, a damaged step, a missing completed step) ever happens.
    Even runs are killed while recording 30 steps, odd runs at most 20 ms
    after close() began.
    """
    script = tmp_path / "random_child.py"
    script.write_text(RANDOM_CHILD.format(tests=str(REPO / "tests" / "trace")))
    rng = random.Random(int(os.environ.get("STATEDIFF_CRASH_SEED", "1234")))
    outcomes: dict[str, int] = {}
    for n in range(KILLS):
        path = tmp_path / f"r{n}" / "trace.h5"
        path.parent.mkdir()
        steps = 30 if n % 2 == 0 else 4
        proc = subprocess.Popen([sys.executable, str(script), str(path), str(steps)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            assert proc.stdout.readline() == b"READY\n"
            if n % 2 == 0:
                time.sleep(rng.uniform(0.0, 0.2))
            else:
                assert proc.stdout.readline() == b"CLOSING\n"
                time.sleep(rng.uniform(0.0, 0.02))
            before = len(list(parts_dir(path).glob("seg-*.h5"))) if parts_dir(path).exists() else 0
        finally:
            proc.kill()
            proc.wait(timeout=patience())
        if path.exists():
            with open_trace(path) as t:
                assert not t.partial and _served_steps(t) == list(range(steps))
            kind = "complete trace"
        else:
            with open_trace(parts_dir(path)) as t:
                served = _served_steps(t)
                assert served == list(range(len(served))) and len(served) >= before
                assert t.damage == ""  # the step being written had no segment yet
            out = path.with_name("recovered.h5")
            recover(parts_dir(path), out)
            with open_trace(out) as t:
                assert _served_steps(t) == served
            kind = f"parts, {'all' if len(served) == steps else 'some'} steps"
        outcomes[kind] = outcomes.get(kind, 0) + 1
    print(f"\n{KILLS} random kills: {outcomes}")
