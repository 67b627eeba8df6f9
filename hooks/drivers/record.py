"""One recording, start to end: ``RecordingOptions`` in, ``make_recording``, ``RecordingResult`` out.

``statediff record`` parses its options into a ``RecordingOptions``, calls
``make_recording`` and prints the result; anything else that records
(``ablate`` and the coming ``check`` through ``statediff record``
subprocesses, or in this process) builds the same options record and gets
the same recording. Stages, in the order a user would fix what they find:

1. ``check_options``: the fault spec, the replay source, ``--keep``/``--focus``
   (``refocus.keep_options``), the output path; no model is read.
2. ``read_inputs``: the conversation, the model (a built-in tiny one is built
   on first use, ``tiny.catalog``), the checks that need no engine
   (``precheck``), the focus against the conversation.
3. The engine (``options.engine``): ``replay_on_vllm`` (``vllm.replay``, the
   engine's output in ``OUTPUT.log``, a boundary sweep sized for the engine)
   or ``replay_on_transformers`` (``transformers.adapter``).
4. ``read_back``: what the trace says (hit accounting, what the keep policy
   kept) and, for a focused re-record, the digest check against the earlier trace.

Pure Python at import (no torch): the engine is imported by stage 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.replay.conversation import Turn
from .sweep import BUILTIN_NAME as SWEEP_NAME

#: The conversation's name in a trace (run field ``conversation``) when none is given.
BUILTIN_CONVERSATION = "builtin:demo"


@dataclasses.dataclass(frozen=True)
class RecordingOptions:
    """Everything one recording needs; the fields of ``statediff record``'s options, same names and
    defaults (``statediff record --help`` explains each).

    Attributes:
        output: trace file to write (``.h5``).
        mode: "hit" (normal prefix caching) or "cold" (a unique ``cache_salt`` per request).
        conversation: JSONL replay file; None: the built-in 5-request agent conversation.
        model: model directory or hub id, or ``tiny`` / ``tiny-dense`` (built-in).
        engine: "vllm" or "transformers".
        exact, exact_split, split_like: exact replay, one block per step or split form.
        speculative_config: JSON text for ``vllm.LLM(speculative_config=...)``.
        dtype, block_size (tokens), max_model_len (tokens), max_num_batched_tokens (tokens),
            mamba_ssm_cache_dtype, enforce_eager, seed: engine settings.
        engine_args: more ``vllm.LLM`` arguments, ``KEY=VALUE`` each (VALUE as JSON or text).
        logprobs: top-k logprobs recorded per output token.
        fault: planted-fault spec, "" for none.
        engine_fixes: engine-bug fixes to install (``--engine-fix``; e.g. ``gdn-ragged-drafts``).
        kv: "all" or "none" (K/V captured at all).
        keep: which tensors keep their data: hits, all, none or a byte size.
        focus, focus_check: a focused re-record and the earlier trace to check it against.
        max_tokens: output tokens per request of the built-in conversation.
        num_gpu_blocks_override: blocks in the engine's KV-cache pool (vLLM
            ``num_gpu_blocks_override``), None: the engine's own size. A small pool replays under
            eviction (``statediff.replay.churn``, ``docs/audit.md``).
        concurrency: copies of the conversation replayed side by side (``vllm.replay``: request
            i of every copy in one batch, each copy with its own ``cache_salt``); 1: one copy.
        tensor_parallel_size: vLLM ``tensor_parallel_size``; above 1 each rank records its own
            trace (``vllm.v1.tp``).
        sweep_boundaries, sweep_blocks: replay a boundary sweep instead of a conversation.
        drafter: with the transformers engine, a DFlash drafter directory or ``dflash``.
        activations: also record the residual stream (needs ``enforce_eager``).
        overwrite: replace an existing trace.
        progress: draw a progress bar (in a terminal).
        engine_log: leave the engine's output on the terminal instead of ``OUTPUT.log``.
        record_argv: the command line stored in the trace (run field ``record_argv``, from which
            ``statediff report`` rebuilds the command); None stores none and skips the check
            that a focused re-record replays the earlier trace's arguments.
    """

    output: str
    mode: str
    conversation: str | None = None
    model: str = "tiny"
    engine: str = "vllm"
    exact: bool = False
    exact_split: bool = False
    split_like: str | None = None
    speculative_config: str | None = None
    dtype: str = "bfloat16"
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    mamba_ssm_cache_dtype: str | None = None
    logprobs: int = 5
    enforce_eager: bool = False
    seed: int = 0
    engine_args: tuple[str, ...] = ()
    fault: str = ""
    engine_fixes: tuple[str, ...] = ()
    kv: str = "all"
    keep: str = "hits"
    focus: str | None = None
    focus_check: str | None = None
    max_tokens: int = 16
    num_gpu_blocks_override: int | None = None
    concurrency: int = 1
    tensor_parallel_size: int = 1
    sweep_boundaries: bool = False
    sweep_blocks: int = 2
    drafter: str | None = None
    activations: bool = False
    overwrite: bool = False
    progress: bool = True
    engine_log: bool = False
    record_argv: tuple[str, ...] | None = None

    @property
    def source(self) -> str:
        """The conversation's name in messages and in the trace."""
        if not self.conversation and self.split_like and self.mode == "cold":
            return f"{self.split_like} (its prompts)"
        return self.conversation or BUILTIN_CONVERSATION

    def run_extra(self) -> dict[str, Any]:
        """Run metadata every recording adds: ``conversation`` and, when known, ``record_argv``."""
        extra: dict[str, Any] = {"conversation": self.source}
        if self.record_argv is not None:
            extra["record_argv"] = list(self.record_argv)
        return extra


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the replay sends, checked before any engine starts (``read_inputs``).

    Attributes:
        turns: the conversation (empty for a boundary sweep: generated once the engine is known).
        model_dir: the model directory (a built-in one resolved).
        model: the model's config (``precheck.ModelFiles``).
        prompts: token ids per request (None for a sweep).
        max_model_len: the engine's ``max_model_len`` (tokens; None: not settled).
    """

    turns: list[Turn]
    model_dir: str
    model: Any
    prompts: list[list[int]] | None
    max_model_len: int | None


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What an engine returned (stage 3 of ``make_recording``).

    Attributes:
        summary: the first line (``recorded 5 requests (hit, ...) to OUT in 3.1 s``).
        sweep_lines: a boundary sweep's expected and measured hits (empty otherwise).
        stats: the trace writer's statistics (``tensors``, ``bytes_raw``, ``bytes_file``, ...).
        engine_result: ``vllm.replay.ReplayResult`` or ``transformers.adapter.TransformersResult``.
    """

    summary: str
    sweep_lines: tuple[str, ...]
    stats: dict
    engine_result: Any


@dataclasses.dataclass(frozen=True)
class RecordingResult:
    """A finished recording: what to print, and the exit code.

    Attributes:
        options: what was asked.
        replayed: what the engine returned (``Replayed``).
        hit_lines: measured and expected prefix-cache hit of every request, read back from the
            trace (``statediff.replay.hits.summary_lines``).
        kept: run metadata ``keep`` (what the keep policy kept), or None.
        replay_check: a focused re-record's digest check (``refocus.ReplayCheck``), or None.
    """

    options: RecordingOptions
    replayed: Replayed
    hit_lines: tuple[str, ...]
    kept: dict | None
    replay_check: Any = None

    @property
    def exit_code(self) -> int:
        """0 recorded; 1 a focused re-record whose digests differ from the earlier trace's."""
        return 1 if self.replay_check is not None and not self.replay_check.identical else 0

    def lines(self) -> list[str]:
        """The lines ``statediff record`` prints: the summary, hits, a sweep's check, trace
        size, what was kept and a focused re-record's check."""
        s = self.replayed.stats
        out = [self.replayed.summary, *self.hit_lines, *self.replayed.sweep_lines,
               f"  tensors: {s.get('tensors')}, raw {s.get('bytes_raw', 0) / 1e6:.1f} MB, "
               f"file {s.get('bytes_file', 0) / 1e6:.1f} MB"]
        if s.get("ranks"):  # tensor parallel: one trace per rank (vllm/v1/tp.py)
            out.append(f"  tensor parallel: {len(s['ranks'])} ranks, one trace each: " + ", ".join(
                f"{os.path.basename(r['trace'])} (rank {r['rank']}: {r['tensors']} tensors)" for r in s["ranks"])
                + f"; 'statediff compare' takes {os.path.basename(s['ranks'][0]['trace'])}")
        if self.kept:
            out.append(_kept_line(self.kept) + (" in rank 0's trace" if s.get("ranks") else ""))
        if self.replay_check is not None:
            out.append(self.replay_check.to_text())
        return out


def make_recording(options: RecordingOptions) -> RecordingResult:
    """Record one trace as ``options`` say, from the checks before the engine to the checks after.

    Safe to call more than once in a process (each vLLM replay installs the capture
    anew), or in subprocesses through ``statediff record`` (``cli.record.argv_from_options``).

    Raises:
        StatediffError: one line, before any engine starts where the options, the
            conversation or the model are at fault; otherwise the engine's refusal or
            failure (a replay that failed part way leaves its trace marked incomplete).
    """
    if options.engine != "transformers":  # Model Runner V2 on a CPU: before anything imports Triton
        from ..vllm.replay import prepare_runner

        prepare_runner()
    keep, reference = check_options(options)
    inputs = read_inputs(options, keep)
    if options.engine == "transformers":
        replayed = replay_on_transformers(options, inputs, keep)
    else:
        replayed = replay_on_vllm(options, inputs, keep)
    hit_lines, kept, check = read_back(options, reference)
    return RecordingResult(options, replayed, hit_lines, kept, check)


def check_options(options: RecordingOptions) -> tuple[Any, str | None]:
    """Stage 1: what can be refused from the options alone.

    Returns:
        (``keep.KeepSpec``, the earlier trace a focused re-record is checked against, or None).

    Raises:
        StatediffError: a bad ``--fault``; ``--sweep-boundaries`` with a conversation; bad
            ``--keep``/``--focus``/``--focus-check`` (``refocus.keep_options``); an output
            that exists (without ``overwrite``) or cannot be written.
    """
    from statediff.trace.writer import check_writable
    from ..recording.faults import parse_fault
    from ..recording.refocus import keep_options

    try:
        fault = parse_fault(options.fault)
    except ValueError as e:
        raise StatediffError(f"--fault: {e}") from None
    if fault is not None and options.mode != "hit" and fault.family != "first":  # recycled-slot: no-hit chunks
        raise StatediffError(f"--fault {options.fault}: a planted fault fires on the cache-hit path, which a "
                             "cold run never takes; give it with --mode hit")
    if options.sweep_boundaries and options.conversation:
        raise StatediffError("--sweep-boundaries generates the replay: give it or CONVERSATION, not both")
    check_concurrency(options)
    keep, reference = keep_options(options.keep, options.focus, options.focus_check, mode=options.mode,
                                   output=options.output, record_argv=options.record_argv)
    if not str(options.output).endswith((".h5", ".hdf5")):
        raise StatediffError(f"-o {options.output}: a trace is an HDF5 file; name it OUTPUT.h5")
    check_writable(options.output, overwrite=options.overwrite)  # before the checks that take seconds
    return keep, reference


def read_inputs(options: RecordingOptions, keep: Any) -> Inputs:
    """Stage 2: the conversation and the model, checked without an engine.

    Raises:
        StatediffError: an unreadable conversation line, a bad model directory, a token id
            outside the vocabulary, a request longer than the engine holds, a chat template
            that fails, a ``--focus`` the replay cannot reach.
    """
    from statediff.replay.conversation import load_conversation
    from .demo import builtin_turns, demo_conversation
    from .precheck import check_focus, check_model, precheck
    from ..tiny.catalog import resolve_model

    o = options
    turns = load_conversation(o.conversation) if o.conversation else _split_like_turns(o)
    model_dir = resolve_model(o.model, o.seed)
    if o.engine == "vllm":  # a compressed-tensors format this CPU cannot run: one line, no engine start
        from ..vllm.cpu.nvfp4 import check_checkpoint

        refusal = check_checkpoint(model_dir)
        if refusal:
            raise StatediffError(refusal)
    if turns is None and o.sweep_boundaries:
        turns = demo_conversation(o.max_tokens)
    elif turns is None:  # token ids of plain text when the model has no chat template
        check_model(model_dir)  # its one line before the tokenizer's
        turns = builtin_turns(model_dir, o.max_tokens, lambda s: print(s, file=sys.stderr, flush=True))
    if o.sweep_boundaries:  # generated from the model's vocabulary once the engine config is known
        return Inputs(turns, model_dir, check_model(model_dir), None, o.max_model_len)
    checked = precheck(turns, model_dir, source=o.source, max_model_len=o.max_model_len,
                       block_size=o.block_size, fit_length=o.engine == "vllm")
    check_focus(keep.focus, turns, checked.prompts, o.source, checked.model.config)
    check_fault_site(o.fault, len(turns) * o.concurrency, checked.model.config, copies=o.concurrency)
    return Inputs(turns, model_dir, checked.model, checked.prompts, checked.max_model_len)


#: Options a concurrent replay (``--concurrency`` > 1) does not take, and how each counts as given.
_NOT_CONCURRENT = (
    ("--exact", lambda o: o.exact),
    ("--exact-split", lambda o: o.exact_split or o.split_like),
    ("--sweep-boundaries", lambda o: o.sweep_boundaries),
    ("--focus", lambda o: o.focus or o.focus_check),
    ("--engine transformers", lambda o: o.engine != "vllm"),
)


def check_concurrency(options: RecordingOptions) -> None:
    """``concurrency`` is an integer >= 1, and above 1 only with the options a concurrent replay takes
    (vLLM, the engine's own chunking, a conversation: not exact replay, a sweep or a focused re-record).

    Raises:
        StatediffError: one line naming the value or the option.
    """
    n = options.concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StatediffError(f"--concurrency {n!r}: expected an integer >= 1 (copies of the conversation)")
    if n == 1:
        return
    for opt, given in _NOT_CONCURRENT:
        if given(options):
            raise StatediffError(f"--concurrency {n} replays the copies with the engine's own chunking; "
                                 f"{opt} is not supported with it")


def check_fault_site(fault: str, num_requests: int, config: dict | None, copies: int = 1) -> None:
    """A ``--fault ...:layer=L:request=R`` the model and the conversation hold (``L`` below the
    model's ``num_hidden_layers``, ``R`` below the number of requests, ``copies`` copies of the
    conversation counted; a drafter fault's layer is the drafter's and is not checked here).

    Raises:
        StatediffError: ``L`` or ``R`` out of range, one line naming the range.
    """
    from ..recording.faults import family, parse_fault

    spec = parse_fault(fault)
    if spec is None:
        return
    cfg = config or {}
    n_layers = cfg.get("num_hidden_layers", (cfg.get("text_config") or {}).get("num_hidden_layers"))
    if (spec.layer is not None and family(spec.kind) != "drafter" and isinstance(n_layers, int)
            and not 0 <= spec.layer < n_layers):
        raise StatediffError(f"--fault {fault}: the model has layers 0..{n_layers - 1}")
    if spec.request is not None and not 0 <= spec.request < num_requests:
        raise StatediffError(f"--fault {fault}: the conversation has requests 0..{num_requests - 1}" + (
            f" ({copies} copies of {num_requests // copies} side by side)" if copies > 1 else ""))


def _split_like_turns(options: RecordingOptions) -> list[Turn] | None:
    """Without a conversation, a split-form cold run (``--split-like TRACE``) replays the trace's own
    prompts and sampling (``conversation.turns_of_trace``): a deployment's plugin trace needs no
    conversation file. None otherwise (the built-in conversation).

    Raises:
        StatediffError: the trace cannot be read or holds no replayable request.
    """
    if not (options.split_like and options.mode == "cold"):
        return None
    from statediff.replay.conversation import turns_of_trace
    from statediff.trace import open_trace

    with open_trace(options.split_like) as t:
        return turns_of_trace(t.requests, options.split_like)


def replay_on_vllm(options: RecordingOptions, inputs: Inputs, keep: Any) -> Replayed:
    """Stage 3 on vLLM: engine arguments, then the replay (``vllm.replay.replay``) with the engine's
    output in ``OUTPUT.log`` (or on the terminal with ``engine_log``).

    Raises:
        StatediffError: ``--drafter`` (transformers only), ``--activations`` without
            ``--enforce-eager``, bad ``--engine-arg`` or ``--speculative-config``, an
            unwritable engine log, or what the replay raises.
    """
    from ..vllm import replay as vllm_replay

    o = options
    if o.drafter:
        raise StatediffError("--drafter is for --engine transformers; vLLM takes --speculative-config")
    if o.activations and not o.enforce_eager:
        raise StatediffError("--activations needs --enforce-eager: forward hooks never run under torch.compile")
    kw = engine_arguments(o, inputs.model_dir, inputs.max_model_len)
    turns, prompts, run_extra, sweep = inputs.turns, inputs.prompts, o.run_extra(), None
    with engine_console(o.output, o.engine_log, progress=o.progress) as console:
        if o.sweep_boundaries:  # statediff/replay/sweep.py, sized for this engine (hooks/drivers/sweep.py)
            sweep, kw = _boundary_sweep(o, inputs, kw)
            turns, prompts = sweep.turns, [list(t.prompt_token_ids) for t in sweep.turns]
            run_extra |= {"conversation": SWEEP_NAME, "sweep": sweep.to_json()}
        res = vllm_replay.replay(
            turns, kw, prompts=prompts, console=console, progress=o.progress, trace=o.output, mode=o.mode,
            exact=o.exact, exact_split=o.exact_split, split_like=o.split_like, fault=o.fault, kv=o.kv,
            engine_fixes=tuple(o.engine_fixes), overwrite=o.overwrite, activations=o.activations,
            logprobs=o.logprobs, keep=keep, run_extra=run_extra, concurrency=o.concurrency)
    form = "exact, one block per step" if o.exact else "exact, split form" if o.exact_split else "default"
    copies = f", {o.concurrency} copies side by side" if o.concurrency > 1 else ""
    summary = (f"recorded {len(turns) * o.concurrency} requests ({o.mode}, {form} chunking{copies}, "
               f"block size {res.block_size}) to {o.output} in {res.seconds:.1f} s")
    lines: tuple[str, ...] = ()
    if sweep is not None:
        from .sweep import summary as sweep_summary

        lines = tuple(sweep_summary(sweep, res.num_cached_tokens, o.mode, res.block_size))
    return Replayed(summary, lines, res.stats, res)


def _boundary_sweep(options: RecordingOptions, inputs: Inputs, kw: dict) -> tuple[Any, dict]:
    """The boundary sweep for this engine, and ``kw`` with the ``max_model_len`` that fits it."""
    from .sweep import engine_sweep
    from .precheck import fit_max_model_len

    sweep = engine_sweep(kw, blocks=options.sweep_blocks, max_tokens=options.max_tokens, seed=options.seed)
    prompts = [list(t.prompt_token_ids) for t in sweep.turns]
    mml = fit_max_model_len(sweep.turns, prompts, max_model_len=options.max_model_len,
                            limit=inputs.model.length_limit(), block_size=options.block_size, source=SWEEP_NAME)
    return sweep, kw | {"max_model_len": mml}


def engine_arguments(options: RecordingOptions, model_dir: str, max_model_len: int | None) -> dict:
    """``vllm.LLM`` keyword arguments of ``options`` (``vllm.replay.engine_kwargs``; a built-in
    drafter named in ``--speculative-config`` resolved, and built on first use).

    Raises:
        StatediffError: an ``--engine-arg`` that is not ``KEY=VALUE``, a ``--num-gpu-blocks-override``
            below 1 or also given as an ``--engine-arg``, or a ``--speculative-config`` that is not a
            JSON object with ``method`` or ``model``.
    """
    from ..vllm.replay import engine_kwargs

    o = options
    extra = parse_engine_args(o.engine_args)
    if o.num_gpu_blocks_override is not None:
        n = o.num_gpu_blocks_override
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise StatediffError(f"--num-gpu-blocks-override {n!r}: expected an integer >= 1 (KV-cache blocks)")
        if "num_gpu_blocks_override" in extra:
            raise StatediffError("--num-gpu-blocks-override and --engine-arg num_gpu_blocks_override=...: give one")
        extra["num_gpu_blocks_override"] = n
    kw = engine_kwargs(model_dir, dtype=o.dtype, block_size=o.block_size, max_model_len=max_model_len,
                       enforce_eager=o.enforce_eager, seed=o.seed, max_num_batched_tokens=o.max_num_batched_tokens,
                       mamba_ssm_cache_dtype=o.mamba_ssm_cache_dtype, extra=extra)
    spec = parse_speculative_config(o.speculative_config, o.seed)
    if spec is not None:
        kw["speculative_config"] = spec
    tp = tensor_parallel_arguments(o, extra)
    if tp:
        check_model_splits(model_dir, tp["tensor_parallel_size"])
    return kw | tp


#: config.json head/expert counts vLLM splits across tensor-parallel ranks (Qwen3-Next names).
SPLIT_COUNTS = ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads")


def check_model_splits(model_dir: str, n: int) -> None:
    """Refuse, before the engine starts, a local model whose heads or routed experts cannot be
    split across ``n`` tensor-parallel ranks (vLLM would fail each worker at load, e.g.
    "Tensor parallel size 2 is greater than the number of experts 1"). A hub id or a
    config.json that cannot be read is left to the engine.

    Raises:
        StatediffError: one line naming the count and ``--model tiny-tp``.
    """
    from ..vllm.limits import text_field

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(cfg, dict):
        return
    counts = {k: text_field(cfg, k) for k in SPLIT_COUNTS}
    bad = [f"{k} = {v}" for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool) and v % n]
    experts = text_field(cfg, "num_experts")
    if isinstance(experts, int) and 0 < experts < n:
        bad.append(f"num_experts = {experts}")
    if bad:
        raise StatediffError(f"--tensor-parallel-size {n}: {model_dir} cannot be split across {n} ranks "
                             f"({', '.join(bad)}); the built-in model for it is --model tiny-tp")


def tensor_parallel_arguments(options: RecordingOptions, extra: dict) -> dict:
    """``tensor_parallel_size`` for ``vllm.LLM`` ({} for 1), checked before the engine starts; on a CPU
    ``VLLM_CPU_OMP_THREADS_BIND`` set (when unset) to the usable cores split into N groups.

    Raises:
        StatediffError: also given as ``--engine-arg``, pipeline parallelism, an unverified vLLM
            version, fewer usable cores than ranks, a fault ``rank=K`` outside ``0..N-1``.
    """
    from ..recording.faults import parse_fault
    from ..vllm.v1.tp import check_supported

    n = options.tensor_parallel_size
    if "tensor_parallel_size" in extra and n > 1:
        raise StatediffError("--tensor-parallel-size and --engine-arg tensor_parallel_size=...: give one")
    n = int(extra.get("tensor_parallel_size") or n)
    try:
        fault = parse_fault(options.fault or "")
    except ValueError:
        fault = None  # refused with its own message where the fault is checked
    if fault is not None and fault.rank is not None and fault.rank >= n:
        raise StatediffError(f"--fault {options.fault}: rank {fault.rank} does not exist with tensor parallel "
                             f"size {n} (ranks 0..{n - 1})")
    pp = int(extra.get("pipeline_parallel_size") or 1)
    why = None
    if n > 1 or pp > 1:
        from ..vllm.surface import installed_version  # imports vLLM: only when parallel

        why = check_supported(installed_version().split("+")[0], n, pp)
    if why:
        raise StatediffError(why)
    if n == 1:
        return {}
    _clear_rank_traces(options.output, n, options.overwrite)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        if len(cores) < n:
            raise StatediffError(f"--tensor-parallel-size {n}: only {len(cores)} usable CPU cores; a CPU engine "
                                 "binds each rank's threads to its own cores (VLLM_CPU_OMP_THREADS_BIND)")
        per = len(cores) // n
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(n))
    return {"tensor_parallel_size": n}


def _clear_rank_traces(output: str, n: int, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, remove) rank traces ``STEM.rankR.h5`` an earlier recording left
    at ``output``: a rank whose worker failed must not leave the old file to be read as this run's.

    Raises:
        StatediffError: such a file exists without ``overwrite``.
    """
    from ..vllm.v1.tp import rank_trace_path

    for r in range(1, n):
        p = rank_trace_path(output, r)
        if os.path.lexists(p):
            if not overwrite:
                raise StatediffError(f"{p} exists (rank {r}'s trace of -o {output}); --overwrite replaces it")
            os.unlink(p)


def parse_speculative_config(text: str | None, seed: int) -> dict | None:
    """``--speculative-config`` JSON -> dict for ``vllm.LLM(speculative_config=...)`` (a built-in
    drafter name such as ``tiny-eagle3`` resolved to its directory).

    Raises:
        StatediffError: invalid JSON, or not an object with ``method`` and/or ``model``.
    """
    from ..tiny.catalog import resolve_model

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


def parse_engine_args(pairs: tuple[str, ...]) -> dict:
    """``--engine-arg KEY=VALUE`` words -> ``{key: value}`` (dashes in KEY as underscores; VALUE
    parsed as JSON, else kept as text).

    Raises:
        StatediffError: a word without ``=`` or without a key.
    """
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


@contextlib.contextmanager
def engine_console(output: str, show: bool, *, progress: bool) -> Iterator[Any]:
    """The engine's output to OUTPUT.log (``enginelog.engine_output``), or, with ``show``
    (``--engine-log``), left on the terminal; yields the ``enginelog.Console`` for statediff's lines.

    Raises:
        StatediffError: the log file cannot be written.
    """
    from ..vllm.enginelog import engine_output, plain_console

    if show:
        yield plain_console(progress)
        return
    log = f"{output}.log"
    try:
        open(log, "a").close()
    except OSError as e:
        raise StatediffError(f"cannot write the engine log {log}: {e.strerror or e}") from None
    try:
        with engine_output(log, progress=progress) as console:
            yield console
    except BaseException:
        with contextlib.suppress(OSError):  # a refusal before the engine wrote anything leaves no log
            if os.path.getsize(log) == 0:
                os.unlink(log)
        raise


#: Options the transformers engine does not take, and how each counts as given.
_NOT_FOR_TRANSFORMERS = (
    ("--speculative-config", lambda o: o.speculative_config),
    ("--sweep-boundaries", lambda o: o.sweep_boundaries),
    ("--engine-arg", lambda o: o.engine_args),
    ("--num-gpu-blocks-override", lambda o: o.num_gpu_blocks_override is not None),
    ("--activations", lambda o: o.activations),
    ("--tensor-parallel-size", lambda o: o.tensor_parallel_size > 1),
    # transformers keeps GDN state in float32 always
    ("--mamba-ssm-cache-dtype", lambda o: o.mamba_ssm_cache_dtype not in (None, "float32")),
)


def replay_on_transformers(options: RecordingOptions, inputs: Inputs, keep: Any) -> Replayed:
    """Stage 3 on transformers (``transformers.adapter.record_transformers``, the same trace format).

    Raises:
        StatediffError: an option the transformers engine does not take, ``--exact-split``,
            or what the adapter raises.
    """
    o = options
    for opt, given in _NOT_FOR_TRANSFORMERS:
        if given(o):
            raise StatediffError(f"{opt} is not supported with --engine transformers")
    if o.exact_split:
        raise StatediffError("--exact-split is vLLM-only; the transformers engine chunks hit and cold alike "
                             "(use --exact for one block per chunk)")
    from ..transformers.adapter import record_transformers as run

    res = run(inputs.turns, inputs.model_dir, trace=o.output, mode=o.mode, exact=o.exact, fault=o.fault,
              drafter=o.drafter, block_size=o.block_size or 32, overwrite=o.overwrite, kv=o.kv, seed=o.seed,
              dtype=o.dtype, threads=1, progress=o.progress, keep=keep, run_extra=o.run_extra())
    summary = (f"recorded {len(inputs.turns)} requests (transformers, {o.mode}, "
               f"{'exact' if o.exact else 'default'} chunking, block size {res.block_size}) to {o.output} "
               f"in {res.seconds:.1f} s")
    return Replayed(summary, (), res.stats, res)


def read_back(options: RecordingOptions, reference: str | None) -> tuple[tuple[str, ...], dict | None, Any]:
    """Stage 4: the written trace's hit accounting and keep record, and a focused re-record's
    digest check against ``reference``.

    Returns:
        (hit lines, run metadata ``keep`` or None, ``refocus.ReplayCheck`` or None).

    Raises:
        StatediffError: the trace (or the reference) cannot be read.
    """
    from statediff.replay.hits import account_run, summary_lines
    from statediff.trace import open_trace
    from ..recording.refocus import check_replay

    with open_trace(options.output) as t:
        hits = tuple(summary_lines(account_run(t.run, t.requests), options.mode))
        kept = t.run.get("keep") or None
    return hits, kept, None if reference is None else check_replay(options.output, reference)


def _kept_line(k: dict) -> str:
    """``  kept: 12 tensors with data (3.1 MB raw), 200 digest only (--keep hits)``."""
    from ..recording.keep import Focus

    focus = f", focus {Focus.from_json(k['focus']).spec}" if k.get("focus") else ""
    return (f"  kept: {k.get('kept_tensors')} tensors with data ({k.get('kept_bytes', 0) / 1e6:.1f} MB "
            f"raw), {k.get('digest_only_tensors')} digest only (--keep {k.get('policy')}{focus})")
