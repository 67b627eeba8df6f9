"""CLI commands that need the engine side (registered via the
``statediff.commands`` entry-point group, so ``statediff`` never imports this).

Each command parses options, calls one library function and exits; errors
are ``StatediffError`` (one stderr line, exit 2, printed by statediff's CLI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from statediff.conversation import load_conversation
from statediff.errors import StatediffError

TINY = "tiny"


def tiny_model_dir(seed: int = 0) -> Path:
    """Where the built-in tiny model lives ($STATEDIFF_HOME or ~/.cache/statediff)."""
    home = Path(os.environ.get("STATEDIFF_HOME") or Path.home() / ".cache" / "statediff")
    return home / f"tiny-qwen3next-seed{seed}"


def resolve_model(model: str, seed: int = 0) -> str:
    """``tiny`` -> the built-in model's directory (built on first use); else unchanged."""
    if model != TINY:
        return model
    from .tinymodel import build_tiny_model

    return str(build_tiny_model(tiny_model_dir(seed), seed=seed))


def _parse_engine_args(pairs: tuple[str, ...]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise StatediffError(f"--engine-arg {pair!r}: expected KEY=VALUE (VALUE as JSON or text)")
        try:
            out[key.replace("-", "_")] = json.loads(val)
        except ValueError:
            out[key.replace("-", "_")] = val
    return out


@click.command("record")
@click.argument("conversation", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write (.h5).")
@click.option("--mode", type=click.Choice(["hit", "cold"]), required=True,
              help="hit: normal prefix caching. cold: a unique cache_salt per request (prefix caching stays on).")
@click.option("--exact/--default-chunking", "exact", default=False,
              help="Exact replay: prefill one block per step (max_num_batched_tokens = actual block size), "
                   "so a fault-free hit/cold pair is bit-identical.")
@click.option("--exact-split", is_flag=True,
              help="Exact replay, split form: the hit run keeps the engine's chunking; the cold run "
                   "(with --split-like HIT.h5) splits each prefill where the hit run's state was computed.")
@click.option("--split-like", type=click.Path(dir_okay=False), default=None, metavar="HIT.h5",
              help="With --mode cold --exact-split: the hit trace whose chunk boundaries to reproduce.")
@click.option("--model", default=TINY, show_default=True, help="Model directory, or 'tiny' for the built-in tiny hybrid.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--block-size", type=int, default=None, help="Requested KV-cache block size in tokens (vLLM may raise it for hybrids).")
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=None, help="Ignored with --exact.")
@click.option("--enforce-eager", is_flag=True, help="Disable torch.compile/CUDA graphs (capture works either way).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Any other vllm.LLM argument, e.g. --engine-arg gpu_memory_utilization=0.5 (repeatable).")
@click.option("--fault", default="", metavar="SPEC",
              help="Planted-fault self-check on the cache-hit path: ssm-wrong-block, conv-zero, kv-swap, "
                   "ssm-bf16 or ssm-nan, optionally ':layer=N' and ':request=N'.")
@click.option("--kv", type=click.Choice(["all", "none"]), default="all", show_default=True,
              help="Record the K/V of every completed block, or none.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Output tokens per request of the built-in conversation.")
@click.option("--overwrite", is_flag=True, help="Replace an existing trace.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def record(conversation, output, mode, exact, exact_split, split_like, model, dtype, block_size, max_model_len,
           max_num_batched_tokens, enforce_eager, seed, engine_args, fault, kv, max_tokens,
           overwrite, no_progress):
    """Replay CONVERSATION (JSONL; default: the built-in 5-request agent conversation)
    on a fresh vLLM engine and record a trace.

    To record an unmodified program instead (an LLM(...) script or `vllm serve`),
    install statediff next to vLLM and set STATEDIFF_TRACE=path.h5 in its environment.
    """
    from .faults import parse_fault
    from .demo import demo_conversation
    from .vllm.replay import engine_kwargs, replay

    try:
        parse_fault(fault)
    except ValueError as e:
        raise StatediffError(f"--fault: {e}") from None
    turns = load_conversation(conversation) if conversation else demo_conversation(max_tokens)
    model_dir = resolve_model(model, seed)
    kw = engine_kwargs(model_dir, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, seed=seed,
                       max_num_batched_tokens=max_num_batched_tokens, extra=_parse_engine_args(engine_args))
    res = replay(turns, kw, trace=output, mode=mode, exact=exact, fault=fault, kv=kv,
                 overwrite=overwrite, progress=not no_progress, exact_split=exact_split,
                 split_like=split_like,
                 run_extra={"conversation": conversation or "builtin:demo"})
    form = "exact, one block per step" if exact else "exact, split form" if exact_split else "default"
    click.echo(f"recorded {len(turns)} requests ({mode}, {form} chunking, "
               f"block size {res.block_size}) to {output} in {res.seconds:.1f} s")
    click.echo(f"  prefix-cache hit tokens per request: {res.num_cached_tokens}")
    click.echo(f"  tensors: {res.stats.get('tensors')}, raw {res.stats.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {res.stats.get('bytes_file', 0) / 1e6:.1f} MB")


@click.command("build-tiny-model")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Directory (default: the built-in model cache).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True)
def build_tiny_model_cmd(output, seed, overwrite):
    """Write the built-in tiny Qwen3-Next hybrid (random weights, offline tokenizer)."""
    from .tinymodel import build_tiny_model

    out = build_tiny_model(output or tiny_model_dir(seed), seed=seed, overwrite=overwrite)
    click.echo(str(out))
