"""Trace write throughput vs raw Zstandard on the same bytes and the same cores, side by side.

For each workload (realistic tensor shapes of one engine step, repeated for
several steps) this measures, interleaved and repeated:

- raw: ``zstandard.ZstdCompressor(level).compress`` of each tensor, nothing
  written to disk, on one thread and on ``threads + 1`` threads (a pool
  compressing tensors in parallel);
- trace writer: ``TraceWriter`` from its creation to ``close()`` returning
  (fingerprints, compression, every step written once into the data file,
  per-step segment files, the finish that turns the data file into the
  trace), with ``threads=0`` (everything on the writer thread, one core)
  and with ``threads`` pool threads (plus the writer thread: ``threads + 1``
  cores), each tensor given with its summary as the recorder gives it, and
  with ``threads=0`` without summaries (the host then computes the moments);
- engine side: the time the caller spends in ``add()``/``end_step()``.

Prints a Markdown table and writes it to docs/performance.md under the
heading "Trace write throughput" (only that section is replaced).

    python benchmarks/bench_write.py              # ~1 min on 2 cores
    python benchmarks/bench_write.py --no-doc --repeats 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zstandard

from statediff.trace import TraceWriter
from statediff.trace.digest import digest_array
from statediff.trace.fingerprint import fingerprint
from statediff.trace.summary import Summary
from statediff.trace.writer import default_threads

from perfdoc import replace_section

DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
HEADING = "## Trace write throughput"


Step = list[tuple[np.ndarray, str, str]]


def workloads(layers: int, steps: int) -> dict[str, list[Step]]:
    """Each workload's steps, each a list of (array in storage dtype, logical dtype, kind).

    Every step has its own arrays, as an engine's steps do: the bytes come
    from memory, not from a CPU cache warmed by the previous step (a 12 MB
    step fits in a 32 MB L3 and would flatter whoever reads it second).
    """
    rng = np.random.default_rng(0)

    def bf16(shape, scale=1.0):
        x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
        return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even

    out: dict[str, list[Step]] = {}
    for _ in range(steps):
        ssm = [(rng.standard_normal((48, 128, 128), dtype=np.float32) * 0.05, "float32",
                "gdn.ssm_state") for _ in range(layers)]
        kv = [(bf16((4, 256, 256)), "bfloat16", kind) for _ in range(layers)
              for kind in ("attn.k", "attn.v")]
        conv = [(bf16((3, 8192), 0.5), "bfloat16", "gdn.conv_state") for _ in range(layers)]
        out.setdefault("GDN SSM state fp32 (48,128,128)", []).append(ssm)
        out.setdefault("KV blocks bf16 (4,256,256)", []).append(kv)
        out.setdefault("mixed step: SSM + conv (3,8192) bf16 + K/V", []).append(ssm + conv + kv)
    return out


def summaries(step: Step) -> list[Summary]:
    """What the recorder hands ``add()`` with each tensor (computed on its device, so not timed).

    The exact digest and the float64 moments; the sketch is left out (the
    writer only stores it; the numpy reference takes seconds per step here).
    """
    out = []
    for arr, dtype, _ in step:
        fp = fingerprint(arr, dtype)
        out.append(Summary(digest=digest_array(arr), sum=fp["sum"], sumsq=fp["sumsq"],
                           absmax=max(abs(fp["min"]), abs(fp["max"])), n_nan=fp["n_nan"],
                           n_inf=fp["n_inf"]))
    return out


def raw_zstd(steps: list[Step], level: int, threads: int = 1) -> tuple[float, float, int]:
    """(wall s, CPU s, compressed bytes) of compressing every tensor once on ``threads`` threads."""
    local = threading.local()

    def one(arr: np.ndarray) -> int:
        cctx = getattr(local, "cctx", None)
        if cctx is None:
            cctx = local.cctx = zstandard.ZstdCompressor(level=level)
        return len(cctx.compress(arr))

    todo = [arr for step in steps for arr, _, _ in step]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):  # threads started before the clock
            pool.submit(time.sleep, 0.001)
        t, c = time.perf_counter(), time.process_time()
        n = sum(pool.map(one, todo)) if threads > 1 else sum(map(one, todo))
        return time.perf_counter() - t, time.process_time() - c, n


def trace_writer(steps: list[Step], sums: list[list[Summary]] | None, level: int, threads: int,
                 d: Path) -> tuple[float, float, float, int]:
    """(wall s, CPU s of all threads, engine-side s, file bytes) of recording every step."""
    path = d / "bench.h5"
    if path.exists():
        path.unlink()  # freeing the old file's pages is not the writer's cost
    t, c = time.perf_counter(), time.process_time()
    w = TraceWriter(path, {"engine": "synthetic"}, clevel=level, threads=threads)
    engine = 0.0
    for s, step in enumerate(steps):
        t0 = time.perf_counter()
        for layer, (arr, dtype, kind) in enumerate(step):
            w.add(arr, request=0, position=s, layer=layer, kind=kind, role="checkpoint",
                  module=f"layers.{layer}", dtype=dtype, summary=sums[s][layer] if sums else None)
        w.end_step()
        engine += time.perf_counter() - t0
    stats = w.close()
    return time.perf_counter() - t, time.process_time() - c, engine, stats["bytes_file"]


def components(step: Step, sums: list[Summary], level: int) -> dict[str, float]:
    """Single-thread MB/s of each piece of the writer's work on one step's tensors."""
    from statediff.trace.fingerprint import Extremes, Fingerprint, new_hasher
    from statediff.trace.storage import encode

    nbytes = sum(a.nbytes for a, _, _ in step)

    def rate(fn) -> float:
        best = min(_timed(fn) for _ in range(5))  # the least disturbed run
        return nbytes / best / 1e6

    def moments():
        for a, dtype, _ in step:
            fp = Fingerprint(dtype)
            fp.hasher = _NoHash()  # moments alone
            fp.update(a.reshape(-1))
            fp.result()

    def extremes():
        for a, dtype, _ in step:
            ex = Extremes(dtype)
            ex.update(a.reshape(-1))
            ex.result()

    def hashing():
        for a, _, _ in step:
            h = new_hasher()
            h.update(memoryview(a.reshape(-1)).cast("B"))

    cctx = zstandard.ZstdCompressor(level=level)
    return {
        "zstd": rate(lambda: [cctx.compress(a) for a, _, _ in step]),
        "xxh3": rate(hashing),
        "moments": rate(moments),
        "extremes": rate(extremes),
        "encode": rate(lambda: [encode(a, dt, level, s) for (a, dt, _), s in zip(step, sums)]),
        "encode_host": rate(lambda: [encode(a, dt, level) for a, dt, _ in step]),
    }


class _NoHash:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


KEYS = ("raw", "raw_cpu", "rawT", "w0", "w0_cpu", "wN", "wN_cpu", "host", "eng")


def measure(args) -> list[dict]:
    rows = []
    cores = args.threads + 1  # the pool and the writer thread
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for name, steps in workloads(args.layers, args.steps).items():
            sums = [summaries(step) for step in steps]
            raw_bytes = sum(a.nbytes for step in steps for a, _, _ in step)
            runs: dict[str, list[float]] = {k: [] for k in KEYS}
            for _ in range(args.repeats):  # interleaved: load changes hit all alike
                dt, cpu, zbytes = raw_zstd(steps, args.level)
                runs["raw"].append(dt)
                runs["raw_cpu"].append(cpu)
                runs["rawT"].append(raw_zstd(steps, args.level, cores)[0])
                dt, cpu, _, fbytes = trace_writer(steps, sums, args.level, 0, Path(d))
                runs["w0"].append(dt)
                runs["w0_cpu"].append(cpu)
                dt, cpu, eng, _ = trace_writer(steps, sums, args.level, args.threads, Path(d))
                runs["wN"].append(dt)
                runs["wN_cpu"].append(cpu)
                runs["eng"].append(eng / args.steps)
                runs["host"].append(trace_writer(steps, None, args.level, 0, Path(d))[0])
            med = {k: statistics.median(v) for k, v in runs.items()}
            rate = {k: raw_bytes / med[k] / 1e6 for k in ("raw", "rawT", "w0", "wN", "host")}
            rows.append({
                "workload": name, "mb": raw_bytes / 1e6, **rate,
                "cpu_ratio": med["raw_cpu"] / med["w0_cpu"],
                "eng_us": med["eng"] * 1e6,
                "zratio": zbytes / raw_bytes, "fratio": fbytes / raw_bytes,
                "parts": components(steps[0], sums[0], args.level),
            })
    return rows


def table(rows: list[dict], args) -> str:
    t = args.threads + 1
    lines = [
        f"| workload | raw MB | zstd-{args.level} MB/s, 1 thread | writer MB/s, threads=0 "
        f"| **writer / zstd, 1 core** | zstd-{args.level} MB/s, {t} threads "
        f"| writer MB/s, threads={args.threads} | **writer / zstd, {t} cores** "
        "| writer / zstd, CPU time | writer MB/s, threads=0, no summaries | file / raw bytes "
        "| zstd alone / raw bytes | engine-side per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['mb']:.0f} | {r['raw']:.0f} | {r['w0']:.0f} "
            f"| **{r['w0'] / r['raw']:.2f}x** | {r['rawT']:.0f} | {r['wN']:.0f} "
            f"| **{r['wN'] / r['rawT']:.2f}x** | {r['cpu_ratio']:.2f}x | {r['host']:.0f} "
            f"| {r['fratio']:.3f} | {r['zratio']:.3f} | {r['eng_us']:.0f} us |")
    lines += [
        "",
        "Single-thread throughput of each piece of the writer's work, same tensors (MB/s):",
        "",
        "| workload | zstd compress | xxh3-128 hash | float64 moments | min/max on bit patterns "
        "| encode with a summary (hash, min/max, zstd) | encode without (hash, moments, zstd) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["parts"]
        lines.append(f"| {r['workload']} | {p['zstd']:.0f} | {p['xxh3']:.0f} | {p['moments']:.0f} "
                     f"| {p['extremes']:.0f} | {p['encode']:.0f} | {p['encode_host']:.0f} |")
    return "\n".join(lines)


def section(text: str, args, load: tuple[float, float]) -> str:
    t = args.threads + 1
    return "\n".join([
        HEADING,
        "",
        "Reproduce with `python benchmarks/bench_write.py` (about a minute). "
        f"Median of {args.repeats} interleaved runs ({args.steps} steps x {args.layers} "
        "layers per workload, Zstandard level "
        f"{args.level}) on {os.cpu_count()} CPUs ({platform.machine()}, Python "
        f"{platform.python_version()}, zstandard {zstandard.__version__}); load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after (other work on the machine slows "
        "every column alike).",
        "",
        "Writer time runs from `TraceWriter(...)` to `close()` returning: xxh3-128 hash of "
        "every tensor, min/max (or, without a summary, the float64 moments), Zstandard "
        "compression of ~1 MiB chunks, each step's tensors written once into the data file "
        "plus a small segment file per step, and the finish that adds the index and renames "
        "the data file to the trace. Each tensor comes with its summary, as the recorder "
        "passes it (computed on the engine's device, not timed here), except in the "
        "\"no summaries\" column. zstd is compression alone, in memory, of the same "
        f"tensors: on one thread against the writer with `threads=0` (one core), on {t} "
        f"threads against the writer with `threads={args.threads}` (its pool plus the "
        f"writer thread: {t} cores). CPU time compares the writer's `threads=0` run with "
        "one-thread zstd. Engine-side is what the recording thread pays in "
        "`add()`/`end_step()` (the work is queued).",
        "",
        text,
        "",
        "Reading the numbers. The writer writes each tensor byte once: compressed chunks go "
        "straight into `<trace>.parts/data.h5`, and `close()` adds the index, digests, "
        "request records and run metadata to that file and renames it to the trace, so "
        "nothing is copied. Each step also gets a small segment file recording where its "
        "chunks lie in the data file; after a kill the parts directory is read through "
        "those offsets (docs/trace-format.md, \"Crash safety\"). Before issue 13 each step "
        "was its own segment file, and `close()` copied them all into the trace, so every "
        "byte was written twice. The writer also decoded every tensor to compute float64 "
        "moments. Now `sum`/`sumsq` come from the summary the recorder computes anyway, and "
        "only min/max are reduced here, on the bit patterns. The old writer, measured with "
        "this script on the same machine (threads=0, wall): 0.56x (SSM), 0.29x (K/V), "
        "0.49x (mixed). What remains beyond compression, per MB of tensor on this machine: "
        "the kernel's copy of the compressed bytes into the page cache (~0.25 ms: fresh "
        "pages are slow in this VM), the hash and min/max (~0.1 ms), ~30 us of HDF5 "
        "metadata per tensor, and ~1.5 ms per step for the segment file. K/V blocks "
        "compress fastest and are the smallest tensors, so these costs weigh most there "
        "(~0.6x). The page-cache copy alone would cap K/V at ~0.8x even if everything else "
        "were free. The one-core columns are the strict comparison. With `threads=N` the pool "
        "compresses while the writer thread writes. On a machine with a free core the "
        "writer's throughput then approaches N times its one-thread encode rate, to be "
        "set against N-thread zstd. On this shared "
        "2-core machine the other load leaves no second core free (2-thread zstd is no "
        "faster than 1-thread), so those columns show no gain. The engine pays only the "
        "engine-side column: `end_step()` queues the step and returns, and waits only when 8 "
        "steps are already queued.",
        "",
    ])


def write_doc(body: str) -> None:
    replace_section(HEADING, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    ap.add_argument("--no-doc", action="store_true", help=f"do not update {DOC}")
    args = ap.parse_args()
    if shutil.disk_usage(args.dir or tempfile.gettempdir()).free < 4 << 30:
        raise SystemExit("bench_write: needs 4 GiB free in the temp dir")
    load0 = os.getloadavg()[0]
    rows = measure(args)
    text = table(rows, args)
    print(text)
    if not args.no_doc:
        write_doc(section(text, args, (load0, os.getloadavg()[0])))
        print(f"\nwritten to {DOC}")


if __name__ == "__main__":
    main()
