"""The crash tests on a busy machine: every core kept busy by another process while they run.

CI machines are shared: a hang guard must not fail a healthy run because
other work took the cores. This script starts one spinning process per CPU
(``--busy N`` to choose), runs ``pytest tests/trace/test_trace_crash.py``
meanwhile, and reports the outcome, the wall time, the load average and the
slowest tests; ``--write docs/performance.md`` puts the result in its
section there. Exit code: pytest's.

    .venv/bin/python benchmarks/bench_busy.py [--busy 2] [--write docs/performance.md] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perfdoc import replace_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    sum(i * i for i in range(10000))\n"
HEADING = "## Crash tests with every core busy"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes (default: one per CPU)")
    ap.add_argument("--write", type=Path, default=None, help="put the result in this performance.md")
    ap.add_argument("pytest_args", nargs="*", default=["tests/trace/test_trace_crash.py"])
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=3600)]) for _ in range(args.busy)]
    try:
        time.sleep(2)  # let them take the cores
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
                            *args.pytest_args], cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        load_during = os.getloadavg()
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    out = p.stdout + p.stderr
    print(out[-4000:])
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "?")
    slow = [line.strip() for line in out.splitlines() if re.match(r"\s*\d+\.\d+s call", line)][:5]
    print(f"busy processes {args.busy}, wall {wall:.0f} s, load {load_before[0]:.1f} before, "
          f"{load_during[0]:.1f} at the end: {summary}")
    if args.write:
        body = "\n".join([
            HEADING, "",
            f"Measured by `.venv/bin/python benchmarks/bench_busy.py --busy {args.busy} --write docs/performance.md` "
            f"on {os.cpu_count()} CPUs: {args.busy} processes spin in pure Python (one per core) while "
            f"`pytest {' '.join(args.pytest_args)}` runs; 1-minute load average {load_before[0]:.1f} before, "
            f"{load_during[0]:.1f} at the end (other work shared the machine too).", "",
            f"Result: **{summary.strip('= ')}**, {wall:.0f} s wall. Slowest tests:", "",
            *[f"- `{line}`" for line in slow], "",
            "The crash tests' hang guards wait `patience()`: 100 times a child's measured start "
            "(interpreter and imports), at least 5 minutes; the SIGINT children install Python's "
            "interrupt handler themselves, whatever their parent ignores. Before, the guards were 60 s, "
            "and a 2-core machine busy with other work failed the two SIGINT cases (issue 21).", ""])
        replace_section(HEADING, body, args.write)
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
