"""Overhead of the live audit under ``vllm serve``: tokens/s with the plugin off and with
``STATEDIFF_LIVE_AUDIT`` on, repetitions interleaved (off, on, off, on, ...).

Two servers of the built-in tiny hybrid model on CPU run side by side (one without any
``STATEDIFF_*`` variable, one with the live audit); each repetition sends, to one server
at a time, a request that fills a new 400-token prefix (untimed) and then 8 concurrent
requests extending it (each hits 384 tokens and generates ``--max-tokens`` tokens), timed.
Interleaving puts both arms under the same background load; the result is the mean and
spread of each arm's generated tokens/s and the overhead of the mean.

    .venv/bin/python benchmarks/bench_live_audit.py MODEL_DIR [--reps 8] [--max-tokens 64] [--write docs/performance.md]

MODEL_DIR: ``statediff build-tiny-model -o MODEL_DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))
from perfdoc import replace_section  # noqa: E402
from serve_helper import Server, shared_prefix_prompts  # noqa: E402

HEADING = "## Live audit under vllm serve"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def one_round(server: Server, rep: int, max_tokens: int, n: int = 8) -> float:
    """Generated tokens/s of ``n`` concurrent hits on a prefix new to this round."""
    shift = 97 * (rep + 1)
    prefix, prompts = shared_prefix_prompts(n)
    prefix = [10 + (t - 10 + shift) % 990 for t in prefix]
    prompts = [[10 + (t - 10 + shift) % 990 for t in p] for p in prompts]
    server.complete(prefix + [7, 8, 9], max_tokens=1)
    t0 = time.perf_counter()
    out = server.concurrent(prompts, max_tokens)
    dt = time.perf_counter() - t0
    return sum(o["usage"]["completion_tokens"] for o in out) / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--reps", type=int, default=8, help="rounds per arm (default 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write", type=Path, default=None, help="put the result in this performance.md")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_live_"))
    inc = tmp / "incidents.jsonl"
    servers = {"off": Server(args.model, ENV | {"STATEDIFF_DISABLE": "1"}, tmp / "off.log"),
               "on": Server(args.model, ENV | {"STATEDIFF_LIVE_AUDIT": str(inc)}, tmp / "on.log")}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for s in servers.values():
            s.start(timeout=900)
        for name, s in servers.items():  # warm-up round each, not counted
            one_round(s, 1000 + len(name), args.max_tokens)
        for rep in range(args.reps):
            for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                rates[name].append(one_round(servers[name], 2 * rep + (name == "on"), args.max_tokens))
                print(f"rep {rep} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    mean = {k: statistics.mean(v) for k, v in rates.items()}
    sd = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in rates.items()}
    overhead = 100 * (mean["off"] - mean["on"]) / mean["off"]
    incidents = len(inc.read_text().splitlines()) if inc.exists() else 0
    text = (f"{args.reps} interleaved rounds per arm, 8 concurrent requests of 440 tokens (384 of them a "
            f"prefix-cache hit) generating {args.max_tokens} tokens each, tiny hybrid on CPU:\n\n"
            f"| arm | generated tokens/s (mean +- sd) |\n|---|---|\n"
            f"| plugin off (`STATEDIFF_DISABLE=1`) | {mean['off']:.1f} +- {sd['off']:.1f} |\n"
            f"| live audit (`STATEDIFF_LIVE_AUDIT`) | {mean['on']:.1f} +- {sd['on']:.1f} |\n\n"
            f"overhead {overhead:+.1f}% of the mean; incidents written: {incidents}")
    print(text)
    if args.write:
        replace_section(HEADING, f"{HEADING}\n\n`benchmarks/bench_live_audit.py` (machine shared with other "
                        f"work, so noisy). {text}\n", args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
