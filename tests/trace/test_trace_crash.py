"""Crash safety and the write path under pressure.

A child process records a trace step by step and is killed (SIGKILL) or
interrupted (SIGINT) at chosen points; every leftover opens as a partial
trace listing exactly the tensors of the completed steps. Write failures
(disk full, file too large) stop recording without raising into the
caller, and close() names the cause.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

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

    def say(msg):  # one write: lines from the writer thread and the main thread never mix
        os.write(1, (msg + "\\n").encode())

    def park():
        time.sleep(600)

    def wait_segment(n):
        while not (parts / f"seg-{{n:08d}}.h5").exists():
            time.sleep(0.002)

    if scenario == "kill_in_segment":  # block inside the writer thread while step 3 is written
        real_encode = W.encode
        def encode(array, logical, clevel):
            if array.shape == (2, 70_000) and array[0, 1] == 3:
                say("WRITING 3")
                park()
            return real_encode(array, logical, clevel)
        W.encode = encode
    if scenario == "kill_in_merge":
        real_copy = W._copy_raw
        def copy_raw(*args):
            real_copy(*args)
            say("MERGING")
            park()
        W._copy_raw = copy_raw
    if scenario == "kill_before_cleanup":
        def rmtree(*args, **kwargs):
            say("MERGED")
            park()
        W.shutil.rmtree = rmtree
    if scenario.startswith("sigint"):  # steps 3 and 4 stay queued until the interrupt
        real_encode = W.encode
        def encode(array, logical, clevel):
            if array.shape == (2, 70_000) and array[0, 1] == 3:
                time.sleep(0.3)
            return real_encode(array, logical, clevel)
        W.encode = encode
    if scenario.startswith("file_too_large"):  # a real write error from the OS: EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = 1_000_000 if scenario == "file_too_large_in_step" else 1_500_000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

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
        try:
            w.close()
        except Exception as e:
            say(f"CLOSE FAILED {{type(e).__name__}}: {{e}}")
            sys.exit(3)
        say("CLOSED")
''')


class Child:
    """The recording child process; ``wait_for`` waits (at most 60 s) for a line of its stdout."""

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

    def wait_for(self, line: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {line!r} from the child within {timeout} s: {self.lines}") from None
            if got is None:
                self.proc.wait(timeout=60)
                raise AssertionError(f"child ended before {line!r}: {self.lines} {self.stderr}")
            self.lines.append(got)
            if got == line:
                return

    @property
    def stderr(self) -> str:
        return "\n".join(x for x in self._err if x is not None)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        self._err_thread.join(timeout=10)
        return rc

    def finish(self) -> int:
        rc = self.proc.wait(timeout=120)
        while (got := self._out.get(timeout=10)) is not None:
            self.lines.append(got)
        self._err_thread.join(timeout=10)
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


def test_kill_while_a_segment_is_written_ignores_the_unfinished_one(child) -> None:
    c = child("kill_in_segment")
    c.wait_for("WRITING 3")
    c.kill()
    parts = parts_dir(c.path)
    assert (parts / "seg-00000003.h5.tmp").exists()  # the half-written step
    with open_trace(parts) as t:
        assert_steps(t, [0, 1, 2])


def test_kill_during_merge_keeps_the_parts_and_recover_finishes_the_file(child, tmp_path) -> None:
    c = child("kill_in_merge")
    c.wait_for("MERGING")
    c.kill()
    assert not c.path.exists()
    assert c.path.with_name("trace.h5.tmp").exists()  # the unfinished merge, never read
    with open_trace(c.path) as t:  # served from trace.h5.parts
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


def test_normal_run_merges_and_removes_the_parts(child) -> None:
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
    assert "No space left on device (errno 28)" in msg and "seg-00000002.h5.tmp" in msg
    assert f"partial trace kept in {parts_dir(path)}" in msg and "\n" not in msg
    assert w.error is not None and "statediff: recording stopped" in capsys.readouterr().err
    assert not path.exists()
    assert sorted(p.name for p in parts_dir(path).iterdir()) == [
        "run.json", "seg-00000000.h5", "seg-00000001.h5"]  # no *.tmp left
    with open_trace(path) as t:
        assert t.partial
        assert_steps(t, [0, 1])


def test_disk_full_during_merge_keeps_the_parts(tmp_path, monkeypatch) -> None:
    def copy_raw(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "_copy_raw", copy_raw)
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
    assert len(stopped) == 1 and "seg-00000003.h5.tmp" in stopped[0]
    assert "File too large" in stopped[0]
    closed = [line for line in c.lines if line.startswith("CLOSE FAILED")]
    assert closed and "TraceError: recording of" in closed[0] and "stopped early" in closed[0]
    assert not any(p.suffix == ".tmp" for p in parts_dir(c.path).iterdir())
    with open_trace(c.path) as t:
        assert t.partial
        assert_steps(t, [0, 1, 2])


def test_file_too_large_while_merging_keeps_the_parts(child) -> None:
    c = child("file_too_large_in_merge")  # every step fits; the merged file does not
    assert c.finish() == 3
    closed = [line for line in c.lines if line.startswith("CLOSE FAILED")]
    assert closed and "cannot write trace" in closed[0] and "File too large" in closed[0]
    assert len(closed[0]) < 600
    assert not c.path.exists() and not c.path.with_name("trace.h5.tmp").exists()
    with open_trace(c.path) as t:
        assert_steps(t, list(range(STEPS)))


def test_close_refuses_to_drop_a_step_it_wrote(tmp_path) -> None:
    path = tmp_path / "lost.h5"
    w = TraceWriter(path, {"engine": "synthetic"}, threads=0)
    _record(w, range(3))
    while not (parts_dir(path) / "seg-00000002.h5").exists():
        time.sleep(0.002)
    (parts_dir(path) / "seg-00000001.h5").write_bytes(b"damaged")
    with pytest.raises(TraceError, match=r"3 steps were written but 1 are readable \(segment "
                                         r"seg-00000001.h5 is damaged"):
        w.close()
    assert not path.exists()
    with open_trace(path) as t:  # what is left is still served
        assert_steps(t, [0])


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
    w.requests[1]["chunks"].append([40, 8])  # the engine hooks append chunks in place
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
