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

from statediff.replay.conversation import load_conversation
from statediff.errors import StatediffError

from statediff_hooks.provenance import record_argv

TINY = "tiny"
TINY_DENSE = "tiny-dense"
TINY_EAGLE3 = "tiny-eagle3"
_TINY_DIRS = {"hybrid": "tiny-qwen3next", "dense": "tiny-qwen2", "eagle3": "tiny-eagle3-for-qwen2"}


def tiny_model_dir(seed: int = 0, kind: str = "hybrid") -> Path:
    """Where a built-in tiny model lives ($STATEDIFF_HOME or ~/.cache/statediff).

    ``kind``: "hybrid" (Qwen3-Next), "dense" (Qwen2) or "eagle3" (the drafter for "dense").
    """
    home = Path(os.environ.get("STATEDIFF_HOME") or Path.home() / ".cache" / "statediff")
    return home / f"{_TINY_DIRS[kind]}-seed{seed}"


def build_tiny(kind: str, out: str | Path | None = None, seed: int = 0, *, target: str | None = None,
               overwrite: bool = False) -> Path:
    """Build (or reuse) a built-in tiny model of ``kind``; the eagle3 drafter's target
    defaults to the built-in dense model."""
    from statediff_hooks.tiny.model import build_tiny_dense_model, build_tiny_model

    out = out or tiny_model_dir(seed, kind)
    if kind == "hybrid":
        return build_tiny_model(out, seed=seed, overwrite=overwrite)
    if kind == "dense":
        return build_tiny_dense_model(out, seed, overwrite=overwrite)
    from statediff_hooks.tiny.draft import build_tiny_eagle3

    return build_tiny_eagle3(out, target or build_tiny("dense", seed=seed), seed, overwrite=overwrite)


def resolve_model(model: str, seed: int = 0) -> str:
    """``tiny`` / ``tiny-dense`` / ``tiny-eagle3`` -> the built-in model's directory
    (built on first use); anything else unchanged."""
    kind = {TINY: "hybrid", TINY_DENSE: "dense", TINY_EAGLE3: "eagle3"}.get(model)
    return model if kind is None else str(build_tiny(kind, seed=seed))


def _parse_speculative_config(text: str | None, seed: int) -> dict | None:
    """``--speculative-config`` JSON -> dict for ``vllm.LLM(speculative_config=...)``."""
    if not text:
        return None
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise StatediffError(f"--speculative-config: invalid JSON ({e})") from None
    if not isinstance(spec, dict) or not (spec.get("method") or spec.get("model")):
        raise StatediffError("--speculative-config: expected a JSON object with 'method' and/or 'model', "
                             'e.g. \'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}\'')
    if isinstance(spec.get("model"), str):
        spec["model"] = resolve_model(spec["model"], seed)
    return spec


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
@click.option("--model", default=TINY, show_default=True,
              help="Model directory, or 'tiny' (built-in tiny hybrid) or 'tiny-dense' (built-in tiny Qwen2).")
@click.option("--speculative-config", "speculative_config", default=None, metavar="JSON",
              help='Speculative decoding, passed to vllm.LLM(speculative_config=...), e.g. '
                   '\'{"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3}\' '
                   "('tiny-eagle3': the built-in drafter for --model tiny-dense).")
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
                   "ssm-bf16, ssm-nan or drafter-perturb (with --speculative-config), optionally "
                   "':layer=N' and ':request=N'.")
@click.option("--kv", type=click.Choice(["all", "none"]), default="all", show_default=True,
              help="Record the K/V of every completed block, or none.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Output tokens per request of the built-in conversation.")
@click.option("--sweep-boundaries", is_flag=True,
              help="Instead of a conversation, replay a boundary sweep (statediff/sweep.py): prompts of "
                   "n*B-1, n*B, n*B+3, n*B+1 and n*B+K+1 tokens for the engine's actual block size B and K "
                   "speculative tokens, sharing one prefix so every request after the first hits.")
@click.option("--sweep-blocks", type=click.IntRange(1), default=2, show_default=True,
              help="With --sweep-boundaries: straddle the boundaries 2B .. (N+1)B.")
@click.option("--engine", type=click.Choice(["vllm", "transformers"]), default="vllm", show_default=True,
              help="transformers: a CPU/GPU reference for hybrids, a prefix-cache hit = resuming from a stored "
                   "copy of transformers' own cache (hooks/transformers_adapter.py).")
@click.option("--drafter", default=None, metavar="DIR|dflash",
              help="With --engine transformers: a DFlash drafter directory, or 'dflash' for the built-in tiny one.")
@click.option("--activations", is_flag=True,
              help="Also record the residual stream after every layer at block-boundary rows, through "
                   "forward hooks. Needs --enforce-eager and PERTURBS numerics (eager != compiled); off by default.")
@click.option("--overwrite", is_flag=True, help="Replace an existing trace.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def record(conversation, output, mode, exact, exact_split, split_like, model, speculative_config, dtype,
           block_size, max_model_len, max_num_batched_tokens, enforce_eager, seed, engine_args, fault, kv, max_tokens,
           sweep_boundaries, sweep_blocks, engine, drafter, activations, overwrite, no_progress):
    """Replay CONVERSATION (JSONL; default: the built-in 5-request agent conversation)
    on a fresh vLLM engine and record a trace.

    To record an unmodified program instead (an LLM(...) script or `vllm serve`),
    install statediff next to vLLM and set STATEDIFF_TRACE=path.h5 in its environment.
    """
    from statediff_hooks.faults import parse_fault
    from statediff_hooks.drivers.demo import demo_conversation
    from statediff_hooks.vllm.replay import engine_kwargs, replay

    try:
        parse_fault(fault)
    except ValueError as e:
        raise StatediffError(f"--fault: {e}") from None
    if sweep_boundaries and conversation:
        raise StatediffError("--sweep-boundaries generates the replay: give it or CONVERSATION, not both")
    turns = load_conversation(conversation) if conversation else demo_conversation(max_tokens)
    model_dir = resolve_model(model, seed)
    if engine == "transformers":
        return _record_transformers(turns, model_dir, output=output, mode=mode, exact=exact,
                                    exact_split=exact_split, fault=fault, drafter=drafter,
                                    block_size=block_size, overwrite=overwrite, kv=kv, seed=seed, dtype=dtype,
                                    progress=not no_progress, conversation=conversation,
                                    unsupported={"--speculative-config": speculative_config,
                                                 "--sweep-boundaries": sweep_boundaries,
                                                 "--engine-arg": engine_args, "--activations": activations})
    if drafter:
        raise StatediffError("--drafter is for --engine transformers; vLLM takes --speculative-config")
    if activations and not enforce_eager:
        raise StatediffError("--activations needs --enforce-eager: forward hooks never run under torch.compile")
    kw = engine_kwargs(model_dir, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, seed=seed,
                       max_num_batched_tokens=max_num_batched_tokens, extra=_parse_engine_args(engine_args))
    spec = _parse_speculative_config(speculative_config, seed)
    if spec is not None:
        kw["speculative_config"] = spec
    run_extra = {"conversation": conversation or "builtin:demo",
                 "record_argv": record_argv(click.get_current_context())}
    sweep = None
    if sweep_boundaries:  # statediff/sweep.py, sized for this engine (hooks/sweep.py)
        from statediff_hooks.drivers.sweep import BUILTIN_NAME, engine_sweep

        sweep = engine_sweep(kw, blocks=sweep_blocks, max_tokens=max_tokens, seed=seed)
        turns = sweep.turns
        run_extra |= {"conversation": BUILTIN_NAME, "sweep": sweep.to_json()}
    res = replay(turns, kw, trace=output, mode=mode, exact=exact, fault=fault, kv=kv,
                 overwrite=overwrite, progress=not no_progress, exact_split=exact_split,
                 split_like=split_like, run_extra=run_extra, activations=activations)
    form = "exact, one block per step" if exact else "exact, split form" if exact_split else "default"
    click.echo(f"recorded {len(turns)} requests ({mode}, {form} chunking, "
               f"block size {res.block_size}) to {output} in {res.seconds:.1f} s")
    click.echo(f"  prefix-cache hit tokens per request: {res.num_cached_tokens}")
    if sweep is not None:
        from statediff_hooks.drivers.sweep import summary

        click.echo("\n".join(summary(sweep, res.num_cached_tokens, mode)))
    click.echo(f"  tensors: {res.stats.get('tensors')}, raw {res.stats.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {res.stats.get('bytes_file', 0) / 1e6:.1f} MB")


def _record_transformers(turns, model_dir, *, output, mode, exact, exact_split, fault, drafter, block_size,
                         overwrite, kv, seed, dtype, progress, conversation, unsupported) -> None:
    """`record --engine transformers`: hooks/transformers_adapter.py on the same trace format."""
    for opt, val in unsupported.items():
        if val:
            raise StatediffError(f"{opt} is not supported with --engine transformers")
    if exact_split:
        raise StatediffError("--exact-split is vLLM-only; the transformers engine chunks hit and cold alike "
                             "(use --exact for one block per chunk)")
    from statediff_hooks.transformers.adapter import record_transformers

    res = record_transformers(turns, model_dir, trace=output, mode=mode, exact=exact, fault=fault,
                              drafter=drafter, block_size=block_size or 32, overwrite=overwrite, kv=kv,
                              seed=seed, dtype=dtype, threads=1, progress=progress,
                              run_extra={"conversation": conversation or "builtin:demo",
                                         "record_argv": record_argv(click.get_current_context())})
    click.echo(f"recorded {len(turns)} requests (transformers, {mode}, {'exact' if exact else 'default'} "
               f"chunking, block size {res.block_size}) to {output} in {res.seconds:.1f} s")
    click.echo(f"  prefix-cache hit tokens per request: {res.num_cached_tokens}")
    click.echo(f"  tensors: {res.stats.get('tensors')}, raw {res.stats.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {res.stats.get('bytes_file', 0) / 1e6:.1f} MB")


@click.command("build-tiny-model")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Directory (default: the built-in model cache).")
@click.option("--kind", type=click.Choice(["hybrid", "dense", "eagle3"]), default="hybrid", show_default=True,
              help="hybrid: Qwen3-Next (GDN + attention); dense: Qwen2; eagle3: an EAGLE-3 drafter for --target.")
@click.option("--target", type=click.Path(file_okay=False, exists=True), default=None,
              help="Target model directory of an eagle3 drafter (default: the built-in dense model).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True)
def build_tiny_model_cmd(output, kind, target, seed, overwrite):
    """Write a built-in tiny model (random weights, offline tokenizer)."""
    if target and kind != "eagle3":
        raise StatediffError("--target is only for --kind eagle3")
    try:
        out = build_tiny(kind, output, seed, target=target, overwrite=overwrite)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        raise StatediffError(str(e)) from None
    click.echo(str(out))
