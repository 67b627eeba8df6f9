"""Compare throughput, time to the first divergence and peak memory of ``statediff compare``.

Three measurements, side by side in one run, on synthetic traces with the
tensor shapes of a 27B-class hybrid (64 layers: 48 Gated DeltaNet layers
with SSM state (48, 128, 128) fp32 and conv state (3, 10240) bf16, and 16
full-attention layers, every fourth, with K and V blocks (4, 64, 256) bf16),
recorded at every 64-token boundary of a multi-turn conversation in which
each request resumes from the previous request's last boundary:

1. throughput: a pair of ``--small-gb`` GiB per trace in which every tensor
   differs by one ULP (hashes all differ, so compare reads everything; all
   within the dtype-default tolerances). ``compare()`` against a bare loop
   that only decompresses each tensor pair and takes
   ``np.abs(a.astype(f64) - b.astype(f64)).max()``, both in process, warm
   page cache, interleaved, median of ``--repeats``;
2. time to the first divergence: a pair of ``--gb`` GiB per trace with a
   planted fault at request 0's second boundary in one layer (the SSM state
   recorded there is the one of the boundary before) and everything causally
   after it differing beyond tolerance; ``statediff compare`` (full) against
   ``statediff compare --first``, each a subprocess;
3. peak RSS of those subprocesses (GNU ``/usr/bin/time -f %M``).

Traces are written with ``TraceWriter`` under ``--dir`` and deleted at the
end (``--keep`` keeps them and reuses them on the next run with the same
sizes). The machine may be shared: the load average is reported next to
every timing. Prints a Markdown table and writes it to docs/performance.md
under the heading below (only that section is replaced).

    python benchmarks/bench_compare.py                 # ~22 GB of traces on disk; 10-30 min on 2 cores
    python benchmarks/bench_compare.py --gb 0.5 --small-gb 0.3 --requests 1 --repeats 1 --no-doc  # ~2 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  registers the Zstandard filter for the bare h5py loop
import numpy as np

from statediff.diff.compare import compare
from statediff.trace import TraceWriter, open_trace

from perfdoc import DOC, replace_section  # benchmarks/perfdoc.py (this script's folder)

HEADING = "## Compare throughput, time to first divergence, memory"
GiB = 1 << 30

# -- the model: shapes of a 27B-class hybrid (Qwen3-Next-like layer pattern) ---------------

N_LAYERS = 64
ATTN_EVERY = 4  # layers 3, 7, ..., 63 are full attention (16); the other 48 are GDN
BLOCK = 64  # tokens between recorded boundaries (and per KV block)
SSM_SHAPE, CONV_SHAPE, KV_SHAPE = (48, 128, 128), (3, 10240), (4, BLOCK, 256)
FAULT_LAYER = 9  # a GDN layer: the planted fault's layer
OUTPUT_TOKENS = 8
KIND_ID = {"gdn.conv_state": 1, "gdn.ssm_state": 2, "attn.k": 3, "attn.v": 4}


def is_attention(layer: int) -> bool:
    return layer % ATTN_EVERY == ATTN_EVERY - 1


def kinds(layer: int) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(kind, shape, logical dtype) recorded for one layer at one boundary."""
    if is_attention(layer):
        return (("attn.k", KV_SHAPE, "bfloat16"), ("attn.v", KV_SHAPE, "bfloat16"))
    return (("gdn.conv_state", CONV_SHAPE, "bfloat16"), ("gdn.ssm_state", SSM_SHAPE, "float32"))


def module(layer: int) -> str:
    return f"model.layers.{layer}." + ("self_attn" if is_attention(layer) else "linear_attn")


def boundary_bytes() -> int:
    """Raw bytes recorded at one boundary (all layers): ~158 MB."""
    dt = {"float32": 4, "bfloat16": 2}
    return sum(math.prod(s) * dt[d] for layer in range(N_LAYERS) for _, s, d in kinds(layer))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A multi-turn conversation: request r resumes at ``hits[r]`` and records ``per_request`` boundaries after it.

    Request 0 records positions BLOCK .. n*BLOCK; request r >= 1 records its
    resumed state at hits[r] = r*n*BLOCK and the n boundaries after it, so
    request r's prompt extends request r-1's prompt + output and a corrupted
    state of request 0 reaches every later request through the cache.
    """

    requests: int
    per_request: int

    def hit(self, r: int) -> int:
        return r * self.per_request * BLOCK

    def positions(self, r: int) -> list[int]:
        first = BLOCK if r == 0 else self.hit(r)
        return list(range(first, (r + 1) * self.per_request * BLOCK + 1, BLOCK))

    def prompt_len(self, r: int) -> int:
        return (r + 1) * self.per_request * BLOCK

    @property
    def boundaries(self) -> int:
        return sum(len(self.positions(r)) for r in range(self.requests))

    @property
    def raw_bytes(self) -> int:
        return self.boundaries * boundary_bytes()

    @classmethod
    def of_size(cls, gib: float, requests: int) -> "Scenario":
        """The smallest scenario of ``requests`` requests holding at least ``gib`` GiB per trace."""
        need = math.ceil(gib * GiB / boundary_bytes())
        n = max(3, math.ceil((need - (requests - 1)) / requests))
        return cls(requests, n)


# -- deterministic, cheap tensor data --------------------------------------------------------

class Data:
    """Tensor contents as a function of the key only, so both traces agree byte for byte.

    A few random base arrays per shape (standard normal: compresses like real
    state, i.e. barely), copied per tensor with a key-dependent head so that
    every tensor has its own hash.
    """

    POOL = 4

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.base: dict[str, list[np.ndarray]] = {}
        for kind, shape, dtype in {k[:3] for layer in range(N_LAYERS) for k in kinds(layer)}:
            arrs = []
            for _ in range(self.POOL):
                x = rng.standard_normal(shape, dtype=np.float32) * (0.1 if dtype == "float32" else 0.5)
                arrs.append(x if dtype == "float32" else bf16_bits(x))
            self.base[kind] = arrs

    def cold(self, position: int, layer: int, kind: str) -> np.ndarray:
        base = self.base[kind][(position // BLOCK + layer) % self.POOL]
        arr = base.copy()
        # finite values that differ for every (position, layer, kind), also in bfloat16
        head = np.array([position / 1e4, layer / 100, KIND_ID[kind] / 10], dtype=np.float32)
        arr.reshape(-1)[:3] = head if arr.dtype == np.float32 else bf16_bits(head)
        return arr


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def perturbed(arr: np.ndarray, beyond: bool) -> np.ndarray:
    """The same tensor, every element changed: by one ULP (within the dtype-default
    tolerances), or by ~2^-10 (fp32) / ~2^-4 (bf16) relative (beyond them)."""
    if arr.dtype == np.float32:
        return (arr.view(np.uint32) ^ np.uint32(1 << 13 if beyond else 1)).view(np.float32)
    return arr ^ np.uint16(1 << 3 if beyond else 1)


def run_meta(mode: str) -> dict:
    return dict(engine="synthetic", engine_version="0", model="synthetic-27b-hybrid",
                architecture="Qwen3NextForCausalLM", config_digest="bench", dtype="bfloat16",
                quantization=None, block_size=BLOCK, mamba_block_size=BLOCK, mamba_cache_mode="align",
                prefix_caching=True, mode=mode, cold_policy="cache_salt" if mode == "cold" else None,
                replay="default", seed=0,
                layers=[{"layer": i, "module": module(i), "type": "attention" if is_attention(i) else "gdn"}
                        for i in range(N_LAYERS)])


def write_trace(path: Path, mode: str, sc: Scenario, data: Data, *, change: str) -> None:
    """Write one trace.

    Args:
        mode: "cold" or "hit".
        change: for the hit trace: "all" (every tensor one ULP off, within
            tolerance) or "fault" (request 0's second boundary, layer
            FAULT_LAYER, SSM state = the state one boundary earlier; every
            tensor causally after it beyond tolerance; the rest identical).
    """
    fault = (0, 2 * BLOCK, FAULT_LAYER)
    w = TraceWriter(path, run_meta(mode), overwrite=True)
    # request r's prompt is request r-1's prompt + output + new tokens
    tokens = np.random.default_rng(1).integers(3, 50_000, sc.prompt_len(sc.requests) + OUTPUT_TOKENS).tolist()
    for r in range(sc.requests):
        hit = sc.hit(r) if mode == "hit" else 0
        w.begin_request(r, f"req-{r}", tokens[:sc.prompt_len(r)], num_cached_tokens=hit)
        for p in sc.positions(r):
            for layer in range(N_LAYERS):
                for kind, _, dtype in kinds(layer):
                    arr = data.cold(p, layer, kind)
                    if mode == "hit" and change == "all":
                        arr = perturbed(arr, beyond=False)
                    elif mode == "hit" and (p, layer) > fault[1:]:
                        arr = perturbed(arr, beyond=True)
                    elif mode == "hit" and (r, p, layer, kind) == (*fault, "gdn.ssm_state"):
                        arr = data.cold(p - BLOCK, layer, kind)  # a stale state: one block earlier
                    attn = is_attention(layer)
                    role = "kv_block" if attn else ("resumed" if mode == "hit" and r and p == hit else "checkpoint")
                    w.add(arr, request=r, position=p, layer=layer, kind=kind, role=role, module=module(layer),
                          dtype=dtype, token_start=p - BLOCK if attn else p, step=r * 100_000 + p // BLOCK)
            w.end_step()
        w.update_request(r, output_token_ids=tokens[sc.prompt_len(r):sc.prompt_len(r) + OUTPUT_TOKENS],
                         finished=True)
        w.end_step()
    w.close()


def ensure_pair(d: Path, name: str, sc: Scenario, change: str, data: Data) -> tuple[Path, Path, float]:
    """Write (or, with a matching params file from --keep, reuse) one hit/cold pair; returns (hit, cold, s)."""
    hit, cold, params = d / f"{name}-hit.h5", d / f"{name}-cold.h5", d / f"{name}.json"
    want = json.dumps({"scenario": dataclasses.asdict(sc), "change": change, "version": 2})
    if hit.exists() and cold.exists() and params.exists() and params.read_text() == want:
        return hit, cold, 0.0
    params.unlink(missing_ok=True)
    t = time.perf_counter()
    write_trace(cold, "cold", sc, data, change=change)
    write_trace(hit, "hit", sc, data, change=change)
    params.write_text(want)
    return hit, cold, time.perf_counter() - t


# -- 1. throughput: compare() vs a bare decompress-and-subtract loop ---------------------------

def decode64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def bare_h5py(hit: Path, cold: Path) -> float:
    """Decompress every pair with HDF5's own Zstandard filter (hdf5plugin), max |a - b| in float64."""
    with open_trace(hit) as th, open_trace(cold) as tc:
        cold_by_key = {e.key: e for e in tc.entries}
        pairs = [(e, cold_by_key[e.key]) for e in th.entries]
    worst = 0.0
    with h5py.File(hit, "r") as fh, h5py.File(cold, "r") as fc:
        gh, gc = fh["tensors"], fc["tensors"]
        for he, ce in pairs:
            a, b = gh[he.dataset][()], gc[ce.dataset][()]
            worst = max(worst, float(np.abs(decode64(a, he.dtype) - decode64(b, ce.dtype)).max()))
    return worst


def bare_reader(hit: Path, cold: Path) -> float:
    """The same through ``Trace.read(verify=False)`` (statediff's checked chunk decoder, no hash)."""
    worst = 0.0
    with open_trace(hit) as th, open_trace(cold) as tc:
        cold_by_key = {e.key: e for e in tc.entries}
        for he in th.entries:
            ce = cold_by_key[he.key]
            a, b = th.read(he, verify=False), tc.read(ce, verify=False)
            worst = max(worst, float(np.abs(decode64(a, he.dtype) - decode64(b, ce.dtype)).max()))
    return worst


def read_and_hash(hit: Path, cold: Path) -> None:
    """What compare does besides the metrics: stream both sides with ``Trace.iter_blocks`` (hash checked)."""
    with open_trace(hit) as th, open_trace(cold) as tc:
        cold_by_key = {e.key: e for e in tc.entries}
        for he in th.entries:
            for _ in th.iter_blocks(he, 2 << 20):
                pass
            for _ in tc.iter_blocks(cold_by_key[he.key], 2 << 20):
                pass


def throughput(hit: Path, cold: Path, repeats: int) -> dict:
    """Median seconds of each loop (interleaved), the load average around them, and sanity checks."""
    runs: dict[str, list[float]] = {"compare": [], "h5py": [], "reader": [], "stream": []}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # CPU time of all threads of this process
    result = None
    load = [os.getloadavg()[0]]
    bare_h5py(hit, cold)  # warm the page cache and the imports
    for _ in range(repeats):
        for name in runs:
            t, c = time.perf_counter(), time.process_time()
            if name == "compare":
                result = compare(hit, cold)
            elif name == "h5py":
                worst = bare_h5py(hit, cold)
            elif name == "reader":
                bare_reader(hit, cold)
            else:
                read_and_hash(hit, cold)
            runs[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
        load.append(os.getloadavg()[0])
    assert result is not None and result.exit_code == 0 and result.identical == 0, result.summary()
    assert worst > 0
    return {"median": {k: statistics.median(v) for k, v in runs.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()}, "all": runs, "load": load, "pairs": result.pairs}


# -- 2 and 3. the CLI as a subprocess: wall time, peak RSS ---------------------------------------

def cli_run(hit: Path, cold: Path, *extra: str) -> dict:
    """Run ``python -m statediff compare --json [extra] HIT COLD``; wall s, peak RSS (MB), result.

    Peak RSS comes from GNU time (``/usr/bin/time -f %M``), which forks the
    compare from its own small process: the ``ru_maxrss`` of a child forked
    from this (large) process would include this process's RSS at the fork.
    """
    cmd = [sys.executable, "-m", "statediff", "compare", "--json", *extra, str(hit), str(cold)]
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        rss_file = Path(d) / "rss"
        t = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", "-o", str(rss_file), *cmd],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        rss_kb, user, system = rss_file.read_text().split()[-3:]  # a first line may say "exited with 1"
    if p.returncode not in (0, 1):
        raise SystemExit(f"bench_compare: {' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return {"wall": wall, "rss_mb": int(rss_kb) * 1024 / 1e6, "cpu": float(user) + float(system),
            "code": p.returncode, "json": json.loads(p.stdout),
            "load": (load0, os.getloadavg()[0]), "cmd": " ".join(["statediff", *cmd[3:]])}


def first_divergence(hit: Path, cold: Path, repeats: int) -> dict:
    """Full compare once, ``--first`` ``repeats`` times (the first run right after the full one)."""
    full = cli_run(hit, cold)
    firsts = [cli_run(hit, cold, "--first") for _ in range(repeats)]
    t = time.perf_counter()
    lib = compare(hit, cold, stop_at_first=True)
    lib_s = time.perf_counter() - t
    root_full, root_first = full["json"]["roots"][0], firsts[0]["json"]["roots"][0]
    key = lambda d: (d["request"], d["position"], d["layer"], d["kind"])  # noqa: E731
    assert key(root_full) == key(root_first) == lib.first.key == (0, 2 * BLOCK, FAULT_LAYER, "gdn.ssm_state")
    return {"full": full, "firsts": firsts, "lib_s": lib_s,
            "first_median": statistics.median(f["wall"] for f in firsts)}


# -- report -------------------------------------------------------------------------------------

def table(sc_small: Scenario, tp: dict, sc_big: Scenario | None, fd: dict | None,
          sizes: dict[str, int]) -> str:
    raw = 2 * sc_small.raw_bytes  # both sides decompressed
    med, cpu = tp["median"], tp["cpu"]
    mbs = {k: raw / v / 1e6 for k, v in med.items()}
    base = max(mbs["h5py"], mbs["reader"])
    ratio = mbs["compare"] / base
    lines = [
        f"Throughput pair: {sc_small.raw_bytes / GiB:.2f} GiB raw per trace "
        f"({sizes['small'] / GiB:.2f} GiB on disk), {tp['pairs']} pairs, every tensor one ULP off "
        "(all read in full, all within tolerance); MB/s = decompressed bytes of both traces / wall "
        f"time; median of {len(tp['all']['compare'])}; load average {min(tp['load']):.1f}-{max(tp['load']):.1f}.",
        "",
        "| loop | wall s | CPU s (all threads) | MB/s | vs fastest bare loop |",
        "|---|---:|---:|---:|---:|",
        f"| `compare()` (hash check, float64 metrics, tolerance) | {med['compare']:.1f} | "
        f"{cpu['compare']:.1f} | {mbs['compare']:.0f} | {mbs['compare'] / base:.2f}x |",
        f"| bare: h5py + hdf5plugin read, `np.abs(a.astype(f64) - b.astype(f64)).max()` | "
        f"{med['h5py']:.1f} | {cpu['h5py']:.1f} | {mbs['h5py']:.0f} | {mbs['h5py'] / base:.2f}x |",
        f"| bare: `Trace.read(verify=False)`, same subtraction | {med['reader']:.1f} | "
        f"{cpu['reader']:.1f} | {mbs['reader']:.0f} | {mbs['reader'] / base:.2f}x |",
        f"| (part of compare) `Trace.iter_blocks` of both sides, hash checked, no arithmetic | "
        f"{med['stream']:.1f} | {cpu['stream']:.1f} | {mbs['stream']:.0f} | {mbs['stream'] / base:.2f}x |",
        "",
        f"Target: compare >= 0.8x the bare loop: **{'met' if ratio >= 0.8 else 'not met'}** ({ratio:.2f}x). "
        "The gap between the last row and compare is the float64 metric arithmetic "
        "(`statediff.diff.metrics.Accumulator`)."
        + (f" compare used {cpu['compare'] / med['compare']:.1f}x its wall time in CPU: numpy's OpenBLAS "
           "threads (`np.dot` in the metrics) spin on the other core without speeding it up."
           if cpu["compare"] > 1.2 * med["compare"] else ""),
    ]
    if fd is not None:
        full, firsts = fd["full"], fd["firsts"]
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        j = full["json"]
        lines += [
            "",
            f"Fault pair: {sc_big.raw_bytes / GiB:.1f} GiB raw per trace ({sizes['big_hit'] / GiB:.1f} and "
            f"{sizes['big_cold'] / GiB:.1f} GiB on disk; {ram / GiB:.0f} GiB of RAM), {j['pairs']} pairs "
            f"({sc_big.requests} requests, {sc_big.boundaries} boundaries); planted fault at request 0, "
            f"position {2 * BLOCK}, layer {FAULT_LAYER} (stale SSM state), everything causally after it "
            "beyond tolerance. Each run is a `statediff compare --json` subprocess (interpreter start "
            "included); peak RSS from GNU `/usr/bin/time -f %M`.",
            "",
            "| run | wall s | CPU s (user+sys) | vs full (wall) | peak RSS MB | divergent reported "
            "| load avg before-after |",
            "|---|---:|---:|---:|---:|---:|---|",
            f"| full compare | {full['wall']:.1f} | {full['cpu']:.1f} | 1 | {full['rss_mb']:.0f} | {j['divergent']} "
            f"({len(j['roots'])} root) | {full['load'][0]:.1f}-{full['load'][1]:.1f} |",
        ]
        for i, f in enumerate(firsts):
            lines.append(
                f"| `--first`, run {i + 1}{' (right after the full run)' if i == 0 else ''} | {f['wall']:.2f} | "
                f"{f['cpu']:.2f} | "
                f"{f['wall'] / full['wall']:.2%} | {f['rss_mb']:.0f} | {f['json']['divergent']} | "
                f"{f['load'][0]:.1f}-{f['load'][1]:.1f} |")
        lines += [
            f"| `compare(..., stop_at_first=True)` in process | {fd['lib_s']:.2f} | "
            f"- | {fd['lib_s'] / full['wall']:.2%} | - | 1 | - |",
        ]
        share = fd["first_median"] / full["wall"]
        rss = max([full["rss_mb"]] + [f["rss_mb"] for f in firsts])
        root = j["roots"][0]
        lines += [
            "",
            f"Both name the same root (checked): request {root['request']}, position {root['position']}, "
            f"layer {root['layer']}, {root['kind']}; \"{j['diagnosis']['text']}\". `--first` reports "
            f"\"{firsts[0]['json']['judged']} of {j['pairs']} pairs judged\" and `stopped_early: true`.",
            f"Targets: `--first` under 1% of a full compare: **{'met' if share < 0.01 else 'not met'}** "
            f"(median {fd['first_median']:.2f} s = {share:.2%}); peak RSS under 300 MB: "
            f"**{'met' if rss < 300 else 'not met'}** ({rss:.0f} MB at most).",
        ]
    return "\n".join(lines)


def section(text: str, args) -> str:
    cmd = "python benchmarks/bench_compare.py" + ("" if args.gb == 10 and args.small_gb == 1.5
                                                    else f" --gb {args.gb} --small-gb {args.small_gb}")
    return "\n".join([
        HEADING,
        "",
        f"Measured by `{cmd}` on {os.cpu_count()} CPUs ({platform.machine()}, Python "
        f"{platform.python_version()}, numpy {np.__version__}, h5py {h5py.__version__}), "
        "a machine shared with other work (load averages given per row). Synthetic traces with "
        "the tensor shapes of a 27B-class hybrid (48 GDN layers: SSM state (48, 128, 128) fp32, "
        "conv state (3, 10240) bf16; 16 attention layers: K/V blocks (4, 64, 256) bf16), every "
        f"64-token boundary of a conversation (2 requests for the throughput pair, {args.requests} for the "
        "fault pair).",
        "",
        text,
        "",
        "",  # a blank line before the next section
    ])


def write_doc(body: str) -> None:
    replace_section(HEADING, body, DOC)


def file_size(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=10.0, help="GiB per trace of the fault pair (0: skip it)")
    ap.add_argument("--small-gb", type=float, default=1.5, help="GiB per trace of the throughput pair")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/sd-bench-big"))
    ap.add_argument("--keep", action="store_true", help="keep the traces (and reuse them next time)")
    ap.add_argument("--no-doc", action="store_true", help=f"do not update {DOC}")
    args = ap.parse_args()
    small = Scenario.of_size(args.small_gb, 2)  # two requests: the smallest 4-request pair is 2.2 GiB
    big = Scenario.of_size(args.gb, args.requests) if args.gb > 0 else None
    need = 2.2 * (small.raw_bytes + (big.raw_bytes if big else 0)) + (big.raw_bytes if big else 0)
    args.dir.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(args.dir).free < need:
        raise SystemExit(f"bench_compare: needs {need / GiB:.0f} GiB free in {args.dir} "
                         "(both traces, plus one trace's segments while it is merged)")
    try:
        data = Data()
        sizes: dict[str, int] = {}
        hit, cold, gen = ensure_pair(args.dir, "small", small, "all", data)
        sizes["small"] = file_size(hit, cold) // 2
        print(f"throughput pair: {small.raw_bytes / GiB:.2f} GiB per trace, written in {gen:.0f} s", flush=True)
        tp = throughput(hit, cold, args.repeats)
        print(json.dumps(tp["median"]), flush=True)
        fd = None
        if big is not None:
            if not args.keep:  # make room
                for p in (hit, cold):
                    p.unlink()
            bhit, bcold, gen = ensure_pair(args.dir, "big", big, "fault", data)
            sizes["big_hit"], sizes["big_cold"] = file_size(bhit), file_size(bcold)
            print(f"fault pair: {big.raw_bytes / GiB:.1f} GiB per trace, written in {gen:.0f} s", flush=True)
            fd = first_divergence(bhit, bcold, args.repeats)
        text = table(small, tp, big, fd, sizes)
        print(text)
        if not args.no_doc:
            write_doc(section(text, args))
            print(f"\nwritten to {DOC}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
