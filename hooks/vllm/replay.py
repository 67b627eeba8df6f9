"""Replay a conversation on a fresh in-process vLLM engine and record it.

``--mode hit`` replays with normal prefix caching; ``--mode cold`` gives
every request a unique ``cache_salt`` (prefix caching stays on, so block
size, mamba cache mode and chunking are those of the hit run, but nothing
is reused). ``--exact`` schedules one block per step (of the block size the
engine runs with, set inside the started engine after vLLM raised it for a
hybrid), so a fault-free hit run and its cold run chunk every prefill at
the same token boundaries and are bit-identical; ``--exact-split`` splits
the cold run where the hit run's state was computed instead.

``concurrency`` N > 1 replays N copies of the conversation side by side:
copy k's requests carry ``cache_salt`` ``SALT/k`` (hit; ``cold_salt`` of it
per request in a cold run), and request i of all N copies goes in one
``generate`` call, so their prefills share the engine's steps and each copy
hits only its own earlier requests. The engine schedules a batch's new
requests in arrival order (FCFS), so trace request ``i * N + k`` is copy k's
request i (request fields ``copy``, ``copy_request``; checked after each batch).

``replay`` runs these stages, each usable alone: ``plan_replay`` (checks,
prompts, split plan: a frozen ``ReplayPlan``, no engine) ->
``engine_environment`` (the ``STATEDIFF_*`` variables the engine's
processes read) -> ``install_capture`` (plugin in place) -> ``start_engine``
-> ``send_requests`` (one at a time, in order: ``Outputs``) ->
``finish_trace`` (close; the planted fault fired?).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError, first_line
from statediff.replay.conversation import Turn
from ..recording.keep import KeepSpec
from ..recording.config import RecorderConfig
from ..recording.fields import conversation_digest, load_tokenizer, render_prompts
from . import plugin, surface
from .limits import check_known_limits, check_logprobs
from .v1.sched import EXACT_ENV, ExactReplayError, cold_salt

# In-process engine core: start ~2 s instead of ~15 s on CPU, and the recorder
# lives in this process so it can be closed deterministically.
# VLLM_CPU_KVCACHE_SPACE (GiB) only matters to CPU builds; the default would
# reserve most of the machine's memory. A user's own setting wins.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What a replay produced (tokens per request, hit lengths, trace stats); ``trace`` None when
    nothing was recorded."""

    trace: str | None
    block_size: int
    max_num_batched_tokens: int | None
    num_cached_tokens: list[int]
    output_token_ids: list[list[int]]
    output_logprobs: list[list[float]]
    output_topk_ids: list[list[list[int]]]  # per request, per output token: the top-k ids, best first
    output_topk_logprobs: list[list[list[float]]]
    stats: dict
    seconds: float  # engine start + replay + trace close
    replay_seconds: float = 0.0  # the requests alone (what recording overhead is measured on)


def engine_kwargs(model: str, *, dtype: str = "bfloat16", block_size: int | None = None,
                  max_model_len: int | None = None, enforce_eager: bool = False,
                  seed: int = 0, max_num_batched_tokens: int | None = None,
                  mamba_ssm_cache_dtype: str | None = None, extra: dict | None = None) -> dict:
    """Keyword arguments for ``vllm.LLM`` (prefix caching always on).

    ``mamba_ssm_cache_dtype`` (``"auto"``, ``"float32"``, ``"bfloat16"``,
    ``"float16"``; None: the engine's choice) pins the SSM state dtype:
    vllm-cpu 0.32 keeps ``"auto"`` as the model dtype on CPUs without
    AVX-512 BF16 and float32 on those with it (``platforms/cpu.py``).
    """
    kw: dict[str, Any] = {"model": model, "dtype": dtype, "enable_prefix_caching": True,
                          "enforce_eager": enforce_eager, "seed": seed}
    if mamba_ssm_cache_dtype:
        kw["mamba_ssm_cache_dtype"] = mamba_ssm_cache_dtype
    if block_size:
        kw["block_size"] = block_size
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    kw.update(extra or {})
    return kw


@dataclasses.dataclass(frozen=True)
class ReplaySpec:
    """How to replay and what to record (everything but the conversation and the engine arguments).

    Attributes:
        trace: trace file to write; None replays without recording (the no-perturbation
            baseline: nothing is captured; the plugin is installed only for exact replay's
            scheduler budget or split plan).
        mode: "hit" (normal prefix caching) or "cold" (a unique ``cache_salt`` per request).
        exact: exact replay, one block per step in both runs, of the block size the engine
            runs with (read inside the started engine by ``v1.sched.one_block_per_step``,
            after vLLM raised it for a hybrid).
        exact_split: exact replay, split form: the hit run keeps the engine's chunking, and
            the cold run (``split_like`` = that hit trace) splits each prefill at the chunk ends
            the hit run's state went through (``statediff.replay.splitplan``).
        split_like: the hit trace of an ``exact_split`` cold run.
        fault: planted-fault spec (``faults.parse_fault``), "" for none.
        engine_fixes: engine-bug fixes the engine's processes install (``STATEDIFF_ENGINE_FIX``,
            comma-separated; ``plugin.install_engine_patches``), e.g. ``("gdn-ragged-drafts",)``.
        kv: "all" (K/V of every completed block) or "none".
        overwrite: replace an existing trace.
        activations: also record the residual stream (eager only; perturbs numerics).
        logprobs: every request asks for the logprob of each sampled token and its ``logprobs``
            best alternatives (``SamplingParams.logprobs``; greedy tokens do not change); the
            runner's values are recorded (request datasets ``output_logprobs``, ``output_topk_*``),
            run metadata ``logprobs_k``.
        keep: which captured tensors keep their data (``statediff_hooks.recording.keep``; None: ``hits``);
            passed to the engine as ``STATEDIFF_KEEP`` / ``STATEDIFF_FOCUS``.
        run_extra: more run metadata (e.g. ``conversation``, ``record_argv``).
        concurrency: copies of the conversation side by side (module docstring); 1: one copy.
    """

    trace: str | None
    mode: str
    exact: bool = False
    exact_split: bool = False
    split_like: str | None = None
    fault: str = ""
    engine_fixes: tuple[str, ...] = ()
    kv: str = "all"
    overwrite: bool = False
    activations: bool = False
    logprobs: int = 5
    keep: KeepSpec | None = None
    run_extra: dict | None = None
    concurrency: int = 1


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """A replay checked and planned, before any engine starts (``plan_replay``).

    Attributes:
        turns: the conversation.
        prompts: token ids per request.
        kw: ``vllm.LLM`` keyword arguments.
        spec: how to replay (``ReplaySpec``).
        splits: an exact-split cold run's split points per request (token counts), else empty.
        recorder: what the engine's recorder records (``RecorderConfig``; reaches the engine as
            ``STATEDIFF_*`` variables, ``engine_environment``).
    """

    turns: list[Turn]
    prompts: list[list[int]]
    kw: dict
    spec: ReplaySpec
    splits: dict[int, list[int]]
    recorder: RecorderConfig


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What the engine returned per request (``send_requests``).

    Attributes:
        num_cached_tokens: prefix-cache hit per request (tokens).
        token_ids: output token ids per request.
        logprobs: the sampled tokens' logprobs per request.
        topk_ids, topk_logprobs: per request, per output token: the top-k alternatives, best first.
        seconds: the requests alone (what recording overhead is measured on).
    """

    num_cached_tokens: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    topk_ids: list[list[list[int]]]
    topk_logprobs: list[list[list[float]]]
    seconds: float


def replay(turns: list[Turn], kw: dict, *, prompts: list[list[int]] | None = None, console: Any = None,
           progress: bool = True, **how: Any) -> ReplayResult:
    """Replay ``turns`` in order on a fresh in-process engine, recording as ``how`` says.

    The stages, each usable alone: ``plan_replay`` (checks, prompts, split plan;
    no engine), ``engine_environment`` and ``install_capture`` (what the engine's
    processes record), ``start_engine``, ``send_requests``, ``finish_trace``.

    Args:
        turns: the conversation.
        kw: ``vllm.LLM`` keyword arguments (``engine_kwargs``).
        prompts: the token ids of ``turns`` when the caller rendered them already
            (``statediff_hooks.drivers.precheck``); else rendered with the model's tokenizer.
        console: where the engine status line and the progress bar go
            (``statediff_hooks.vllm.enginelog.Console``; default: stderr).
        progress: draw a progress bar (in a terminal) when no console is given.
        how: the fields of ``ReplaySpec`` (``trace`` and ``mode`` required).

    Raises:
        StatediffError: bad options, the engine refused to start (message from vLLM),
            a known engine limitation (e.g. ngram on a hybrid target on CPU), a
            request that failed (the trace then holds the requests before it, marked
            incomplete), a planted fault that never fired, or a failed recording.
    """
    import time

    from .enginelog import plain_console

    plan = plan_replay(turns, kw, ReplaySpec(**how), prompts=prompts)
    install_capture(engine_environment(plan))
    console = console or plain_console(progress)
    t0 = time.perf_counter()
    llm = start_engine(plan.kw, console)
    out = send_requests(llm, plan, console)
    block, budget = surface.engine_block_size(llm), surface.step_budget(llm)
    tp = int(plan.kw.get("tensor_parallel_size") or 1)
    if tp > 1 and plan.spec.trace is not None:  # the workers record: stop them, then read their traces
        stats = finish_rank_traces(plan, llm, tp)
    else:
        stats = finish_trace(plan)
    del llm
    return ReplayResult(trace=plan.spec.trace, block_size=block, max_num_batched_tokens=budget,
                        num_cached_tokens=out.num_cached_tokens, output_token_ids=out.token_ids,
                        output_logprobs=out.logprobs, output_topk_ids=out.topk_ids,
                        output_topk_logprobs=out.topk_logprobs, stats=stats,
                        seconds=time.perf_counter() - t0, replay_seconds=out.seconds)


def plan_replay(turns: list[Turn], kw: dict, spec: ReplaySpec, *,
                prompts: list[list[int]] | None = None) -> ReplayPlan:
    """Check a replay and plan it, before any engine starts.

    Sets ``ENGINE_ENV``'s defaults in this process's environment first (they must
    be in place before vLLM is imported), then checks in the order a user would
    fix them: mode, the trace path, the engine's known limits, the exact form,
    ``logprobs``; renders the prompts unless given; reads the split plan of an
    exact-split cold run from its hit trace.

    Raises:
        StatediffError: bad mode, an unwritable trace, a combination the engine cannot
            run (``vllm.limits``), both exact forms, a ``logprobs`` out of range,
            ``split_like`` missing or misplaced or not this conversation's hit trace.
    """
    from statediff.trace.writer import check_writable

    if spec.mode not in ("hit", "cold"):
        raise StatediffError(f"--mode must be 'hit' or 'cold', not {spec.mode!r}")
    if spec.trace is not None:
        check_writable(Path(spec.trace), overwrite=spec.overwrite)
    for key, val in ENGINE_ENV.items():
        os.environ.setdefault(key, val)
    prepare_runner()
    kw = dict(kw)
    check_known_limits(kw, engine_fixes=spec.engine_fixes)
    if spec.exact and spec.exact_split:
        raise StatediffError("choose one exact replay form: --exact or --exact-split")
    n = spec.concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StatediffError(f"--concurrency {n!r}: expected an integer >= 1 (copies of the conversation)")
    if n > 1 and (spec.exact or spec.exact_split):
        raise StatediffError(f"--concurrency {n} replays the copies with the engine's own chunking; "
                             "exact replay is not supported with it")
    check_logprobs(spec.logprobs, kw)
    if prompts is None:  # the tokenizer only for chat turns
        chat = any(t.prompt_token_ids is None for t in turns)
        prompts = render_prompts(turns, load_tokenizer(kw["model"]) if chat else None)
    splits = {}
    if spec.exact_split and spec.mode == "cold":
        if not spec.split_like:
            raise StatediffError("--exact-split in cold mode needs --split-like HIT.h5 (the hit run's trace)")
        splits = _split_plan(spec.split_like, prompts)
    elif spec.split_like:
        raise StatediffError("--split-like is for the cold run of --exact-split")
    return ReplayPlan(turns, prompts, kw, spec, splits, _recorder_config(turns, prompts, spec, splits))


def prepare_runner() -> None:
    """Model Runner V2 on a CPU (``VLLM_USE_V2_MODEL_RUNNER=1`` on vllm-cpu): Triton's interpreter set up in
    this process and in every engine process, before Triton and vLLM are imported (``cpu/triton_interpreter.py``;
    ``recording.make_recording`` calls it first, ``plan_replay`` again). Idempotent.

    Raises:
        StatediffError: the interpreter route cannot run here (one line).
    """
    from .cpu import triton_interpreter

    try:
        triton_interpreter.prepare_process()
    except triton_interpreter.InterpreterRefused as e:
        raise StatediffError(str(e)) from None


def _recorder_config(turns: list[Turn], prompts: list[list[int]], spec: ReplaySpec,
                     splits: dict[int, list[int]]) -> RecorderConfig:
    """The engine recorder's configuration; the run metadata a replay adds to the engine's
    (``concurrency`` only above 1: absent means one copy)."""
    copies = {"concurrency": spec.concurrency} if spec.concurrency > 1 else {}
    return RecorderConfig(
        trace=spec.trace or "", mode=spec.mode, activations=spec.activations,
        replay="exact" if spec.exact or spec.exact_split else "default", kv=spec.kv,
        fault=None, overwrite=spec.overwrite, keep=spec.keep or KeepSpec(),
        run_extra={"conversation_digest": conversation_digest(prompts), "sampling": turns[0].sampling,
                   "num_requests": len(turns) * spec.concurrency, **copies,
                   "exact_form": "block" if spec.exact else "split" if spec.exact_split else None,
                   "split_plan": {str(k): v for k, v in splits.items()} or None,
                   "logprobs_k": spec.logprobs,
                   **(spec.run_extra or {})},
    )


def engine_environment(plan: ReplayPlan) -> dict[str, str]:
    """The ``STATEDIFF_*`` variables that make the engine's processes do what ``plan`` asks.

    With a trace: the recorder's (``RecorderConfig.to_env``), the planted fault, the
    split plan and exact replay's one block per step. Without one: only the latter two
    (nothing is captured). Empty: the plugin stays out of the engine.
    """
    env = plan.recorder.to_env()
    if plan.spec.fault:
        env["STATEDIFF_FAULT"] = plan.spec.fault
    if plan.splits:
        env["STATEDIFF_SPLITS"] = json.dumps({str(k): v for k, v in plan.splits.items()})
    if plan.spec.exact:  # one block per step, set inside the started engine (v1/sched.py)
        env[EXACT_ENV] = "1"
    env[plugin.ENGINE_PATCHES_ENV] = "1"  # e.g. hybrid + drafter + prefix caching on a CPU (cpu/mamba_align.py)
    from .cpu import triton_interpreter

    if os.environ.get(triton_interpreter.ENV) == "1":  # Model Runner V2 on a CPU (prepare_runner)
        env[triton_interpreter.ENV] = "1"
    if plan.spec.engine_fixes:  # asked for only (--engine-fix): they change the engine's computation
        env[plugin.ENGINE_FIX_ENV] = ",".join(plan.spec.engine_fixes)
    if plan.spec.trace is None:
        env = {k: env[k] for k in ("STATEDIFF_SPLITS", EXACT_ENV, plugin.ENGINE_PATCHES_ENV, plugin.ENGINE_FIX_ENV,
                                   triton_interpreter.ENV) if k in env}
    return env


def install_capture(env: dict[str, str]) -> None:
    """Put ``env`` in this process's environment, replacing every ``STATEDIFF_*`` variable an
    earlier replay left (``STATEDIFF_DEBUG`` and ``STATEDIFF_ALLOW_UNVERIFIED`` excepted), and
    (re)install the plugin for it: the engine about to start in this process then records as
    ``env`` says.

    Raises:
        UnsupportedEngine: the installed vLLM is not verified (``surface.check_version``), before
            any engine starts: a ``StatediffError``, one line.
    """
    user = ("STATEDIFF_DEBUG", surface.ALLOW_UNVERIFIED_ENV)  # the user's own switches stay
    for key in [k for k in os.environ if k.startswith("STATEDIFF_") and k not in user]:
        del os.environ[key]  # nothing from an earlier replay in this process may leak in
    plugin.unregister()
    plugin.reset()
    if env:
        os.environ.update(env)
        plugin.register()


def start_engine(kw: dict, console: Any) -> Any:
    """A started ``vllm.LLM(**kw)``, with a status line on ``console`` (``enginelog.Console``).

    Raises:
        StatediffError: statediff refused the engine or recording (one line), or the engine
            failed to start (its exception's first line, and where the engine log is).
    """
    from vllm import LLM

    try:
        with console.status(_engine_status(kw)) as st:
            llm = LLM(**kw)
            st["note"] = f"block size {surface.engine_block_size(llm)}"
    except StatediffError:
        raise
    except (plugin.UnsupportedEngine, plugin.RecordingRefused, ExactReplayError) as e:
        raise StatediffError(str(e)) from None
    except Exception as e:  # vLLM raises many types for bad engine arguments
        log = f" (engine log: {console.log_path})" if console.log_path else ""
        n = kw.get("num_gpu_blocks_override")
        if n is not None and "at least one request" in str(e):  # vLLM 0.32 kv_cache_utils' admission check
            raise StatediffError(
                f"--num-gpu-blocks-override {n}: the KV-cache pool cannot hold one request of the engine's max "
                f"model len ({kw.get('max_model_len') or 'its default'} tokens) in every KV-cache group; give "
                f"more blocks{log}") from None
        raise StatediffError(f"the engine failed to start: {type(e).__name__}: {str(e).splitlines()[0]}{log}") from None
    return llm


def send_requests(llm: Any, plan: ReplayPlan, console: Any) -> Outputs:
    """Send the requests one at a time, in order (a cold run salts each one), or with
    ``concurrency`` N request i of the N copies in one batch; collect the outputs (in trace
    request order).

    Raises:
        StatediffError: a request failed (an engine error, a bad request): the trace is
            closed marked incomplete where it stopped (``_stop_recording``); a batch the engine
            did not schedule in arrival order.
        KeyboardInterrupt: likewise marked, then re-raised.
    """
    import time

    t0 = time.perf_counter()
    turns, prompts, mode, n = plan.turns, plan.prompts, plan.spec.mode, plan.spec.concurrency
    salt_base = uuid.uuid4().hex[:12]
    rows: list[tuple] = []
    bar = console.replay_bar(f"record {mode}", len(turns) * n,
                             n * sum(len(ids) + int(t.sampling.get("max_tokens", 16)) for t, ids in zip(turns, prompts)))
    i = 0
    try:
        for i, (turn, ids) in enumerate(zip(turns, prompts)):
            if n == 1:
                salt = cold_salt(salt_base, i) if mode == "cold" else None
                rows.append(_one_request(llm, turn, ids, salt, plan.spec.logprobs))
                plugin.annotate_request(i, num_cached_tokens=rows[-1][0], cache_salt=salt)
            else:
                rows += _one_batch(llm, turn, ids, i, [copy_salt(salt_base, k, i, mode) for k in range(n)],
                                   plan.spec.logprobs)
            for _ in range(n):
                bar.request_done(len(ids) + int(turn.sampling.get("max_tokens", 16)))
    except BaseException as e:  # an engine error, a bad request, Ctrl-C: the trace says where it stopped
        bar.close()
        note = _stop_recording(plan.spec.trace, i * n, turns[i] if i < len(turns) else None, e)
        if not isinstance(e, Exception):
            raise
        where = f"request {i} (line {turns[i].line})" if i < len(turns) else f"request {i}"
        if n > 1:
            where += f", trace requests {i * n}..{i * n + n - 1} ({n} copies)"
        raise StatediffError(f"{where} failed: {first_line(e)} ({type(e).__name__}); {note}") from None
    bar.close()
    cols = list(zip(*rows)) or [()] * 5
    return Outputs(*(list(c) for c in cols), seconds=time.perf_counter() - t0)


def copy_salt(run_id: str, copy: int, index: int, mode: str) -> str:
    """The ``cache_salt`` of copy ``copy``'s request ``index`` in a concurrent replay: ``RUN/k`` in a hit
    run (the copy's requests share it, so each copy hits only its own earlier requests), that salted
    per request (``cold_salt``) in a cold run."""
    salt = f"{run_id}/{copy}"
    return cold_salt(salt, index) if mode == "cold" else salt


def _one_batch(llm: Any, turn: Turn, ids: list[int], index: int, salts: list[str], logprobs: int) -> list[tuple]:
    """Request ``index`` of every copy (one salt each) in one ``generate`` call; its rows (``_one_request``'s)
    in copy order, each request annotated with ``copy``, ``copy_request`` and ``cache_salt``.

    Raises:
        StatediffError: the engine numbered the batch's requests out of arrival order (a
            scheduling policy other than FCFS): trace request ``index * N + k`` would not be copy k's.
    """
    from vllm import SamplingParams

    n = len(salts)
    sp = SamplingParams(**(turn.sampling | {"logprobs": logprobs}))
    results = llm.generate([{"prompt_token_ids": ids, "cache_salt": s} for s in salts], sp, use_tqdm=False)
    rows = []
    for k, (res, salt) in enumerate(zip(results, salts)):
        row = _row(res, logprobs)
        got = plugin.request_index(res.request_id)
        if got is not None and got != index * n + k:
            raise StatediffError(f"copy {k} of request {index} was recorded as request {got}, not {index * n + k}: "
                                 "the engine did not schedule the batch in arrival order (--concurrency needs "
                                 "the fcfs scheduling policy)")
        plugin.annotate_request(index * n + k, num_cached_tokens=row[0], cache_salt=salt, copy=k,
                                copy_request=index)
        rows.append(row)
    return rows


def _one_request(llm: Any, turn: Turn, ids: list[int], salt: str | None, logprobs: int) -> tuple:
    """(hit tokens, output ids, their logprobs, top-k ids, top-k logprobs) of one request."""
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    # logprob of each sampled token and its best `logprobs` alternatives (the runner's values
    # are recorded by the capture; these front-end ones are the same numbers)
    sp = SamplingParams(**(turn.sampling | {"logprobs": logprobs}))
    return _row(llm.generate([prompt], sp, use_tqdm=False)[0], logprobs)


def _row(res: Any, logprobs: int) -> tuple:
    """(hit tokens, output ids, their logprobs, top-k ids, top-k logprobs) of one ``RequestOutput``."""
    comp = res.outputs[0]
    per_token = list(comp.logprobs or [])
    top = [sorted((v.rank, tid, float(v.logprob)) for tid, v in lp.items() if 1 <= v.rank <= logprobs)
           for lp in per_token]
    return (int(res.num_cached_tokens or 0), [int(t) for t in comp.token_ids],
            [float(lp[t].logprob) for t, lp in zip(comp.token_ids, per_token)],
            [[tid for _, tid, _ in row] for row in top], [[x for _, _, x in row] for row in top])


def finish_trace(plan: ReplayPlan) -> dict:
    """Close this process's trace (``plugin.close``); return the writer's stats ({} without a trace).

    Raises:
        StatediffError: the planted fault never fired (the trace holds a fault-free run),
            or the recording failed.
    """
    fired = plugin.fault_fired()
    stats = plugin.close()
    fault, trace = plan.spec.fault, plan.spec.trace
    if fault and trace is not None and not fired and not stats.get("error"):
        raise StatediffError(
            f"--fault {fault} never fired (no request resumed from a prefix-cache hit deep enough, "
            f"or no such layer or request): {trace} holds a fault-free run")
    if stats.get("error"):
        raise StatediffError(f"recording failed: {stats['error']}")
    return stats


def finish_rank_traces(plan: ReplayPlan, llm: Any, size: int) -> dict:
    """With tensor parallel size ``size``: stop the engine (each worker closes its rank's trace,
    ``v1.tp``), check every rank's trace and whether the planted fault fired on some rank.

    Raises:
        StatediffError: a rank's trace is missing or unfinished, or the planted fault never fired.
    """
    from .v1 import tp as tp_v1

    tp_v1.shutdown_engine(llm)
    try:
        stats = tp_v1.finish_rank_traces(plan.spec.trace, size)
    except (RuntimeError, OSError, StatediffError) as e:
        raise StatediffError(f"recording failed: {first_line(e)}") from None
    if plan.spec.fault and not stats["fault"]:
        raise StatediffError(
            f"--fault {plan.spec.fault} never fired on any rank (no request resumed from a prefix-cache hit "
            f"deep enough, or no such layer, request or rank): {plan.spec.trace} holds a fault-free run")
    return stats


def _stop_recording(trace: str | None, index: int, turn: Turn | None, err: BaseException) -> str:
    """Record where the replay stopped (run metadata ``stopped``) and close the trace as incomplete.

    Returns the end of the one-line error: where the incomplete trace is, or why there is none.
    """
    plugin.mark_stopped(index, f"{type(err).__name__}: {first_line(err)}" if str(err) else type(err).__name__,
                        **({"line": turn.line, "id": turn.id} if turn is not None else {}))
    try:
        stats = plugin.close()
    except Exception as e:  # noqa: BLE001 - the replay's own error is the one to report
        return f"the trace could not be finished either: {first_line(e)}"
    if trace is None:
        return "nothing was recorded"
    if not stats:
        return f"no trace written ({trace}: the engine stopped before its first step)"
    return f"{trace} holds the requests before it and is marked incomplete"


def _split_plan(hit_trace: str, prompts: list[list[int]]) -> dict[int, list[int]]:
    """Cold-run split points from the hit trace; its prompts must be this replay's."""
    from statediff.replay.splitplan import cold_splits
    from statediff.trace import open_trace

    with open_trace(hit_trace) as t:
        reqs = t.requests
        if t.run.get("mode") not in ("hit", None):  # None: a plugin trace of a deployment (prefix caching on)
            raise StatediffError(f"--split-like {hit_trace}: not a hit-mode trace")
    got = [reqs[i].get("prompt_token_ids") for i in sorted(reqs)]
    if got != prompts:
        raise StatediffError(f"--split-like {hit_trace}: its prompts are not this conversation's")
    return cold_splits(reqs)


def _engine_status(kw: dict) -> str:
    """``starting vLLM engine (model ~/m, block size 32, max model len 1024)``."""
    model = str(kw.get("model"))
    home = str(Path.home())
    model = "~" + model[len(home):] if model.startswith(home + os.sep) else model
    parts = [f"model {model}", f"block size {kw['block_size']}" if kw.get("block_size") else "default block size"]
    if kw.get("max_model_len"):
        parts.append(f"max model len {kw['max_model_len']}")
    return f"starting vLLM engine ({', '.join(parts)})"
