"""What the read guard costs: libhdf5 maps each trace in a bounded child (``statediff.trace.guard``).

Measures, with the guard on and off (``STATEDIFF_READ_GUARD=0``: libhdf5 in
the reader's own process, no bound), interleaved, best and median of
``--reps`` runs:

1. mapping one file (``guard.map_file`` against ``h5map.map_file`` in
   process): the 27B-class digest-only traces of the five-request
   conversation (bench_digest.py section 5: 40,480 and 18,784 ``/digests``
   rows) and a trace of 4,000 small tensors with data (the per-dataset part
   of a map: one header and chunk index each);
2. ``compare()`` of the digest-only pair in this process;
3. ``statediff compare --json`` of that pair as a subprocess (interpreter start included).

Writes its section of docs/performance.md (``--write``).

    .venv/bin/python benchmarks/bench_guard.py [--reps 5] [--write docs/performance.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_digest import BIG, Conversation, write_digest_trace  # noqa: E402
from perfdoc import replace_section  # noqa: E402

from statediff.trace import TraceWriter, guard, h5map  # noqa: E402

HEADING = "## Read guard"


def many_tensors(path: Path, n: int = 4000) -> Path:
    w = TraceWriter(path, {"engine": "synthetic", "mode": "cold", "block_size": 16}, threads=0)
    w.begin_request(0, "r0", [1, 2, 3])
    for i in range(n):
        w.add(np.full((16, 64), i, np.float32), request=0, position=16 * (i + 1), layer=0, kind="gdn.ssm_state",
              role="checkpoint", module="m", dtype="float32")
        if i % 100 == 99:
            w.end_step()
    w.end_step()
    w.close()
    return path


def _cpu() -> float:
    """CPU seconds of this process and of its children that ended (the guard's children, a CLI run)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def interleaved(fns: dict[str, callable], reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Each function once per round, ``reps`` rounds (so machine load hits every column alike):
    per function, its wall times and its CPU times (own and children's)."""
    got = {k: ([], []) for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t, c = time.perf_counter(), _cpu()
            fn()
            got[k][0].append(time.perf_counter() - t)
            got[k][1].append(_cpu() - c)
    return got


def with_guard(enabled: bool, fn):
    def run():
        saved = guard.ENABLED
        guard.ENABLED = enabled
        try:
            fn()
        finally:
            guard.ENABLED = saved
    return run


def cli(paths: tuple[Path, Path], enabled: bool) -> None:
    env = dict(os.environ, STATEDIFF_READ_GUARD="1" if enabled else "0")
    p = subprocess.run([sys.executable, "-m", "statediff", "compare", "--json", *map(str, paths)],
                       capture_output=True, env=env)
    if p.returncode not in (0, 1):
        raise SystemExit(p.stderr.decode()[-2000:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args(argv)
    from statediff.diff.compare import compare

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as tmp:
        d = Path(tmp)
        conv = Conversation(BIG.block)
        cold, hit = d / "cold.h5", d / "hit.h5"
        rows = {p: write_digest_trace(p, BIG, conv, mode)["rows"] for p, mode in ((cold, "cold"), (hit, "hit"))}
        many = many_tensors(d / "many.h5")
        maps = {}
        for name, p in (("digest-only cold trace", cold), ("digest-only hit trace", hit),
                        ("4,000 tensors with data", many)):
            got = interleaved({"guarded": lambda: guard.map_file(p), "in process": lambda: h5map.map_file(p)},
                              args.reps)
            maps[name] = (p.stat().st_size, got)
        cmp = interleaved({"guard on": with_guard(True, lambda: compare(hit, cold)),
                           "guard off": with_guard(False, lambda: compare(hit, cold))}, args.reps)
        clis = interleaved({"guard on": lambda: cli((hit, cold), True), "guard off": lambda: cli((hit, cold), False)},
                           args.reps)
    load1 = os.getloadavg()[0]

    def ms(got: tuple[list[float], list[float]]) -> str:
        wall, cpu = got
        return f"{min(wall) * 1000:.0f} / {statistics.median(wall) * 1000:.0f} / {min(cpu) * 1000:.0f}"

    def cost(a: tuple, b: tuple) -> str:
        return (f"{(min(a[0]) - min(b[0])) * 1000:+.0f} ms wall, "
                f"{(statistics.median(a[1]) - statistics.median(b[1])) * 1000:+.0f} ms CPU")

    lines = [HEADING, "",
             f"Measured by `.venv/bin/python benchmarks/bench_guard.py --reps {args.reps}` on {os.cpu_count()} CPUs "
             f"({platform.machine()}, Python {platform.python_version()}, h5py {h5py.version.version}, "
             f"libhdf5 {h5py.version.hdf5_version}); 1-minute load average {load0:.1f} before, {load1:.1f} after "
             "(the machine was shared with other work: wall times move with it; CPU times, of the process and "
             "its children, much less). Each cell: best wall / median wall / best CPU, in ms; the columns of "
             "a row alternate within each round. Cost: the difference of the best wall times and of the "
             "median CPU times.", "",
             "The guard forks a child of the reader (nothing to import), which maps the file with libhdf5 "
             "(attributes, links, table headers, chunk locations; no data; `/tensors` by name only when "
             "`/frames` locates the tensors) under `RLIMIT_AS` and `RLIMIT_CPU` and sends the map back as "
             "JSON; the reader then reads the tables and tensors itself by byte range (it did before too, "
             "through h5py). Bounds: "
             f"{guard.bounds_text()} per file (`STATEDIFF_READ_SECONDS`, `STATEDIFF_READ_MEMORY`).", "",
             "| map of | file | guarded (fork + map + JSON) | in process | cost of the guard |",
             "|---|---:|---:|---:|---:|"]
    for name, (size, got) in maps.items():
        lines.append(f"| {name} | {size / 1e6:.2f} MB | {ms(got['guarded'])} | {ms(got['in process'])} | "
                     f"{cost(got['guarded'], got['in process'])} |")
    lines += ["", f"Pair: the digest-only 27B-class traces ({rows[cold]:,} and {rows[hit]:,} rows).", "",
              "| compare of the pair | guard on | guard off | cost of the guard |", "|---|---:|---:|---:|",
              f"| `compare()` in process | {ms(cmp['guard on'])} | {ms(cmp['guard off'])} | "
              f"{cost(cmp['guard on'], cmp['guard off'])} |",
              f"| `statediff compare --json` (subprocess) | {ms(clis['guard on'])} | {ms(clis['guard off'])} | "
              f"{cost(clis['guard on'], clis['guard off'])} |", ""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(HEADING, text + "\n", args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
