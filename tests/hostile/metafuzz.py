"""The metadata fuzz tier: mutate the bytes libhdf5 parses and look for files that hang, crash or
go over a bound.

Each case takes one of the base traces (``BASES``: compact links and root
attributes in a global heap; dense links, a fixed-array chunk index and
dense attribute storage; a recording's segment file), mutates 1-4 places
in its metadata (``h5layout.blocks``): superblock fields, object header
prefixes and messages (attribute, link, link info, attribute info,
continuation, layout, datatype, dataspace, filter pipeline), global heap
objects, B-tree nodes, fractal heap and free-space blocks. A mutation flips
bits, writes an interesting integer, points an address at another block
(or back at its own: cycles), or copies bytes from elsewhere; checksums
are then recomputed (most cases), so libhdf5 parses the mutated structure
instead of refusing it by checksum. The case is read as statediff reads a
stranger's trace (``open_trace`` through the read guard, then every
tensor) and must end in a read or a one-line ``TraceError``; any other
exception is a bug in the reader.

A case where libhdf5 broke a bound (``guard.GuardBreach``: time, CPU,
memory, crash) is a finding: the file is kept in ``FOUND`` (the hostile
corpus, ``tests/hostile/found/``, gzip-compressed: ``<bound>-<sha256 of the
file, 12 digits>.h5.gz``) with a JSON note of the bound it broke, the seed
and case number that made it, and the h5py/libhdf5 versions.
``test_found_files_are_refused_in_one_line`` keeps every one refused.

Seeds change between runs unless given (the seed is printed first, so a
failure replays with ``--seed``). CI runs a fixed budget of seconds
(``tests/trace/test_trace_hostile.py``, ``STATEDIFF_FUZZ_SECONDS``); a longer
run by hand::

    .venv/bin/python tests/hostile/metafuzz.py --seconds 3600 [--seed N] [--bound 10]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from hostile import h5layout  # noqa: E402
from hostile.corpus import _parts, write_valid  # noqa: E402
from statediff.errors import TraceError  # noqa: E402
from statediff.trace import TraceWriter, guard, open_trace  # noqa: E402

FOUND = HERE / "found"
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 0x7FFF, 0x8000,
               0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, (1 << 64) - 1)
MESSAGE_WEIGHTS = {0x0C: 6, 0x06: 5, 0x02: 3, 0x15: 3, 0x10: 4, 0x08: 3, 0x03: 3, 0x01: 3, 0x0B: 2, 0x0A: 2,
                   0x05: 1, 0x00: 1}


# -- bases ---------------------------------------------------------------------------------------


def _dense(path: Path) -> Path:
    """Dense links (24 tensors under /tensors: fractal heap and v2 B-tree name index), a tensor of
    2 chunks (fixed-array chunk index) and a /run attribute over 64 KiB (dense attribute storage)."""
    w = TraceWriter(path, {"engine": "synthetic", "mode": "cold", "block_size": 16, "created_unix": 1764460800,
                           "notes": "n" * 70_000}, threads=0)
    w.begin_request(0, "r0", list(range(40)))
    for i in range(24):
        w.add(np.full((4, 8), i, np.float32), request=0, position=16 * (i + 1), layer=i % 3,
              kind="gdn.ssm_state", role="checkpoint", module="m", dtype="float32")
    w.add(np.zeros((2, 1 << 18), np.float32), request=0, position=400, layer=0, kind="hidden",
          role="activation", module="m", dtype="float32")
    w.end_step()
    w.close()
    return path


def _segment(path: Path) -> Path:
    """A parts directory of two steps (a killed recording); its second segment file is mutated."""
    parts = _parts(path.parent, "seg")
    return parts / "seg-00000001.h5"


BASES: dict[str, Callable[[Path], Path]] = {
    "compact": lambda p: write_valid(p / "compact.h5"),
    "dense": lambda p: _dense(p / "dense.h5"),
    "segment": _segment,
}


@dataclasses.dataclass
class Base:
    name: str
    path: Path  # the file a case mutates (for "segment": inside its parts directory)
    opened: Path  # what a case opens (the file, or the parts directory)
    data: bytes
    blocks: list


def make_bases(d: Path) -> list[Base]:
    out = []
    for name, build in BASES.items():
        sub = d / name
        sub.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stderr(io.StringIO()):  # the killed recording says so on stderr
            path = build(sub)
        opened = path.parent if name == "segment" else path
        data = path.read_bytes()
        out.append(Base(name, path, opened, data, h5layout.blocks(data)))
    return out


# -- mutations ----------------------------------------------------------------------------------


def _target(rng: random.Random, base: Base) -> tuple[str, int, int, object]:
    """(description, lo, hi, block) of the byte range one mutation hits."""
    blocks = base.blocks
    pick = rng.random()
    if pick < 0.12:
        sb = blocks[0]
        return "superblock", 8, sb.checksum or 44, sb
    headers = [b for b in blocks if b.messages]
    if pick < 0.55 and headers:
        msgs = [(b, m) for b in headers for m in b.messages]
        b, m = rng.choices(msgs, weights=[MESSAGE_WEIGHTS.get(m.type, 1) for _, m in msgs])[0]
        if rng.random() < 0.2:
            return f"{b.sig} {m.name} message header", m.header, m.data, b
        return f"{b.sig} {m.name} message", m.data, m.data + max(m.size, 1), b
    if pick < 0.62 and headers:
        b = rng.choice([b for b in headers if b.sig == "OHDR"] or headers)
        return f"{b.sig} prefix", b.start + 4, b.messages[0].header if b.messages else b.start + 8, b
    gcol = [b for b in blocks if b.sig == "GCOL"]
    if pick < 0.77 and gcol:
        b = gcol[0]
        objs = h5layout.gcol_objects(base.data, b)
        if objs and rng.random() < 0.7:
            at, idx, size = rng.choice(objs)
            if rng.random() < 0.6:
                return f"GCOL object {idx} header", at, at + 16, b
            return f"GCOL object {idx} data", at + 16, min(at + 16 + max(size, 1), b.end), b
        return "GCOL header", b.start + 4, b.start + 16, b
    others = [b for b in blocks if b.sig not in ("superblock", "OHDR", "OCHK", "GCOL")]
    if pick < 0.95 and others:
        b = rng.choice(others)
        return f"{b.sig} block", b.start + 4, b.checksum or b.end, b
    b = rng.choice(blocks)
    return f"{b.sig} anywhere", b.start, b.end, b


def mutate(rng: random.Random, base: Base) -> tuple[bytes, list[str]]:
    """One case: the mutated bytes and what was done (one line per mutation)."""
    buf = bytearray(base.data)
    notes, touched = [], []
    for _ in range(rng.choices((1, 2, 3, 4), weights=(60, 25, 10, 5))[0]):
        what, lo, hi, block = _target(rng, base)
        hi = max(hi, lo + 1)
        op = rng.random()
        if op < 0.25:
            pos, bit = rng.randrange(lo, hi), rng.randrange(8)
            buf[pos] ^= 1 << bit
            notes.append(f"{what}: flip bit {bit} at {pos}")
        elif op < 0.55:
            width = rng.choice((1, 2, 4, 8))
            pos = rng.randrange(lo, max(lo + 1, hi - width + 1))
            value = rng.choice(INTERESTING + (len(buf), len(buf) - 1, rng.getrandbits(8 * width)))
            value = (value + rng.choice((0, 0, 0, 1, -1))) % (1 << (8 * width))
            buf[pos:pos + width] = value.to_bytes(width, "little")
            notes.append(f"{what}: {width}-byte {value} at {pos}")
        elif op < 0.75:  # an address pointing elsewhere, or back at this very block: cycles
            target = rng.choice(base.blocks)
            value = block.start if rng.random() < 0.3 else target.start + rng.choice((0, 0, 4, 8, 16))
            pos = rng.randrange(lo, max(lo + 1, hi - 7))
            buf[pos:pos + 8] = value.to_bytes(8, "little")
            notes.append(f"{what}: address {value} at {pos}")
        elif op < 0.9:
            pos = rng.randrange(lo, hi)
            buf[pos] = rng.choice((0, 0xFF, rng.randrange(256)))
            notes.append(f"{what}: byte {buf[pos]} at {pos}")
        else:
            n = rng.randrange(1, 17)
            src = rng.randrange(0, max(1, len(buf) - n))
            pos = rng.randrange(lo, hi)
            buf[pos:pos + n] = base.data[src:src + n]
            notes.append(f"{what}: {n} bytes copied from {src} to {pos}")
        touched.append(block)
    if rng.random() < 0.9:
        for b in {id(b): b for b in touched}.values():
            b.fix(buf)
    else:
        notes.append("checksums left as they are")
    return bytes(buf[:len(base.data)]), notes


# -- running ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    kind: str  # "read", "refused", or the bound broken: "time", "cpu", "memory", "crash"
    seconds: float
    message: str = ""


def run_case(opened: Path) -> Outcome:
    """Read a case as statediff reads a stranger's trace; raises anything but TraceError."""
    t0 = time.monotonic()
    try:
        with open_trace(opened) as t:
            for e in t.entries:
                t.read(e)
                for _ in t.iter_blocks(e, block_bytes=max(64, t.nbytes(e) // 8)):
                    pass
            t.storage_bytes()
        if t.breach:  # a parts directory serves the steps before a segment that broke a bound
            return Outcome(t.breach, time.monotonic() - t0, t.damage)
        return Outcome("read", time.monotonic() - t0)
    except guard.GuardBreach as e:
        return Outcome(e.bound, time.monotonic() - t0, str(e))
    except TraceError as e:
        msg = str(e)
        if not msg or "\n" in msg:
            raise AssertionError(f"not one line: {msg!r}") from None
        return Outcome("refused", time.monotonic() - t0, msg)


def baseline_seconds(bases: list[Base], reps: int = 3) -> float:
    """The slowest of the bases' median times to map their files in the guard's child, unmutated."""
    worst = 0.0
    for b in bases:
        times = []
        for _ in range(reps):
            t0 = time.monotonic()
            guard.map_file(b.path)
            times.append(time.monotonic() - t0)
        worst = max(worst, sorted(times)[len(times) // 2])
    return worst


def keep_finding(data: bytes, outcome: Outcome, meta: dict, found: Path = FOUND, opened: Path | None = None) -> Path:
    """Save a file that broke a bound into the hostile corpus, with a JSON note (kept once)."""
    found.mkdir(parents=True, exist_ok=True)
    name = f"{outcome.kind}-{hashlib.sha256(data).hexdigest()[:12]}"
    path = found / f"{name}.h5.gz"
    if not path.exists():
        path.write_bytes(gzip.compress(data, mtime=0))
        message = outcome.message.replace(str(opened), f"{name}.h5") if opened is not None else outcome.message
        note = meta | {"bound": outcome.kind, "message": message, "seconds": round(outcome.seconds, 2),
                       "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version,
                       "found": time.strftime("%Y-%m-%d")}
        (found / f"{name}.json").write_text(json.dumps(note, indent=1) + "\n")
    return path


@dataclasses.dataclass
class Report:
    seed: int
    bound: float
    cases: int = 0
    outcomes: dict = dataclasses.field(default_factory=dict)
    slowest: tuple[float, str] = (0.0, "")
    findings: list = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (f"metadata fuzz: seed {self.seed}, {self.cases} cases, outcomes {self.outcomes}, slowest "
                f"{self.slowest[0]:.2f} s ({self.slowest[1]}), bound {self.bound:g} s, "
                f"findings {len(self.findings)}")


def fuzz(seconds: float, seed: int | None = None, bound: float | None = None, found: Path = FOUND,
         max_cases: int | None = None, log: Callable[[str], None] | None = None) -> Report:
    """Run cases for ``seconds`` (or ``max_cases``); returns the report. Seeded runs replay exactly.

    ``bound``: the read guard's time bound per case (default: 10 s, or 100 times the bases' read
    time on this machine if that is longer: the bound only has to tell a loop from a slow machine).
    """
    seed = random.SystemRandom().randrange(1 << 32) if seed is None else seed
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="statediff-metafuzz-") as tmp:
        bases = make_bases(Path(tmp) / "bases")
        if bound is None:
            bound = max(10.0, 100 * baseline_seconds(bases))
        report = Report(seed, bound)
        if log:
            log(f"metadata fuzz: seed {seed} (replay with --seed {seed}), bound {bound:g} s per case")
        saved = guard.READ_SECONDS
        guard.READ_SECONDS = bound
        end = time.monotonic() + seconds
        work = Path(tmp) / "case"
        try:
            while time.monotonic() < end and (max_cases is None or report.cases < max_cases):
                n = report.cases
                base = rng.choice(bases)
                data, notes = mutate(rng, base)
                if work.exists():
                    shutil.rmtree(work)
                shutil.copytree(base.path.parent, work)
                case = work / base.path.name
                case.write_bytes(data)
                opened = work if base.name == "segment" else case
                outcome = run_case(opened)
                report.cases += 1
                report.outcomes[outcome.kind] = report.outcomes.get(outcome.kind, 0) + 1
                if outcome.seconds > report.slowest[0]:
                    report.slowest = (outcome.seconds, f"case {n}, {base.name}: {'; '.join(notes)} -> {outcome.kind}")
                if outcome.kind not in ("read", "refused"):
                    path = keep_finding(data, outcome, {"seed": seed, "case": n, "base": base.name,
                                                        "mutations": notes}, found, case)
                    report.findings.append(str(path))
                    if log:
                        log(f"FOUND case {n} ({base.name}): {outcome.kind} after {outcome.seconds:.1f} s: "
                            f"{'; '.join(notes)} -> {path}")
                if log and report.cases % 500 == 0:
                    log(report.line())
        finally:
            guard.READ_SECONDS = saved
    return report


DOC_HEADING = "## Metadata fuzz"


def doc_section(report: "Report", seconds: float, command: str) -> str:
    """The docs/performance.md section of a run: cases tried, outcomes, the slowest case, findings."""
    n = report.cases
    found = sorted({Path(p).name for p in report.findings})
    kinds = {k: v for k, v in sorted(report.outcomes.items())}
    lines = [DOC_HEADING, "",
             f"Measured by `{command}` ({seconds / 60:.0f} minutes) on {os.cpu_count()} CPUs shared with other "
             f"work (h5py {h5py.version.version}, libhdf5 {h5py.version.hdf5_version}); seed {report.seed}; "
             f"read guard bound {report.bound:.1f} s per case (10 s, or 100 times the bases' map time on the "
             "machine if longer).", "",
             f"**{n:,} cases tried**: " + ", ".join(f"{v:,} {k}" for k, v in kinds.items())
             + f" ({100 * sum(v for k, v in kinds.items() if k not in ('read', 'refused')) / max(n, 1):.1f}% "
               "broke a bound: libhdf5 looped until the guard killed it, or crashed).",
             f"**Slowest case**: {report.slowest[0]:.1f} s (the guard stops a hang at its bound, then kills "
             f"and reaps the child): {report.slowest[1]}.", "",
             f"Files kept in `tests/hostile/found/` from this run: {len(found)} (`<bound>-<sha256>.h5.gz`, each "
             "with a JSON note: the bound it broke, the mutations that made it, seed and case, versions).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--bound", type=float, default=None, help="read guard time bound per case (s)")
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--found", type=Path, default=FOUND)
    ap.add_argument("--report", type=Path, default=None, help="also write the report as JSON here")
    ap.add_argument("--doc", type=Path, default=None, help="put the run's figures in this performance.md")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    report = fuzz(args.seconds, args.seed, args.bound, args.found, args.cases,
                  log=lambda s: print(s, flush=True))
    print(report.line(), flush=True)
    if args.report:
        args.report.write_text(json.dumps(dataclasses.asdict(report), indent=1) + "\n")
    if args.doc:
        sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
        from perfdoc import replace_section

        command = ".venv/bin/python tests/hostile/metafuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
        replace_section(DOC_HEADING, doc_section(report, time.monotonic() - t0, command) + "\n", args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
