"""Replay a conversation on a fresh in-process vLLM engine and record it.

``--mode hit`` replays with normal prefix caching; ``--mode cold`` gives
every request a unique ``cache_salt`` (prefix caching stays on, so block
size, mamba cache mode and chunking are those of the hit run, but nothing
is reused). ``--replay exact`` schedules one block per step
(``max_num_batched_tokens`` = the engine's actual block size, read from the
engine config after vLLM raised it for hybrids), so a fault-free hit run
and its cold run chunk every prefill at the same token boundaries and are
bit-identical.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from statediff.replay.conversation import Turn
from statediff.errors import StatediffError, first_line

from ..keep import KeepSpec
from ..recorder import RecorderConfig
from . import plugin
from .sched_v1 import EXACT_ENV, ExactReplayError, cold_salt

# In-process engine core: start ~2 s instead of ~15 s on CPU, and the recorder
# lives in this process so it can be closed deterministically.
# VLLM_CPU_KVCACHE_SPACE (GiB) only matters to CPU builds; the default would
# reserve most of the machine's memory. A user's own setting wins.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclasses.dataclass
class ReplayResult:
    """What a replay produced (tokens per request, hit lengths, trace stats)."""

    trace: str
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


def actual_block_size(kw: dict) -> int:
    """Block size of the engine config built from ``kw``, without starting an engine.

    Not necessarily the size the engine runs with: vLLM 0.32 raises a hybrid
    model's attention block size at engine start, after the model is built
    (``Platform.update_block_size_for_backend``), which this does not apply.
    Exact replay therefore sets its budget inside the started engine
    (``sched_v1.one_block_per_step``); the run metadata records the real size.
    """
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(**kw).create_engine_config()
    return int(cfg.cache_config.block_size)


def check_known_limits(kw: dict) -> None:
    """Refuse, before any engine starts, a combination the installed engine cannot run.

    vllm-cpu 0.32: a hybrid target (recurrent/mamba-style layers) with any
    speculative method and prefix caching fails in the first step, in
    ``precopy_mamba_align_fused_kernel`` (``v1/worker/mamba_utils.py``), a
    Triton kernel with no CPU backend. Reads only the target's config.

    Raises:
        StatediffError: one sentence naming the cause.
    """
    if not kw.get("speculative_config") or not kw.get("enable_prefix_caching", True):
        return
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not str(getattr(vllm, "__version__", "")).startswith("0.32."):
        return
    from vllm.engine.arg_utils import EngineArgs

    keys = ("model", "dtype", "trust_remote_code", "revision", "hf_overrides", "tokenizer")
    try:
        mc = EngineArgs(**{k: kw[k] for k in keys if k in kw}).create_model_config()
    except Exception:  # noqa: BLE001 - a bad model is reported by the engine start itself
        return
    if mc.is_hybrid:
        spec = kw["speculative_config"]
        method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
        arch = (mc.hf_config.architectures or [type(mc.hf_config).__name__])[0]
        raise StatediffError(
            f"hybrid target {arch} with speculative decoding ({method or 'speculative_config'}) and prefix "
            "caching does not run on vllm-cpu 0.32: its mamba-state copy for speculative decoding "
            "(precopy_mamba_align_fused_kernel) is a Triton kernel with no CPU backend (use a dense "
            "target, drop --speculative-config, or record on a GPU)")


def render_prompts(turns: list[Turn], model: str) -> list[list[int]]:
    """Token ids per turn; chat turns go through the model's chat template."""
    tok = None
    out = []
    for t in turns:
        if t.prompt_token_ids is not None:
            out.append(list(t.prompt_token_ids))
            continue
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model)
        ids = tok.apply_chat_template(t.messages, tools=t.tools, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        out.append([int(x) for x in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def replay(turns: list[Turn], kw: dict, *, trace: str | None, mode: str, exact: bool = False,
           fault: str = "", kv: str = "all", overwrite: bool = False,
           progress: bool = True, run_extra: dict | None = None,
           exact_split: bool = False, split_like: str | None = None,
           activations: bool = False, prompts: list[list[int]] | None = None,
           console: Any = None, logprobs: int = 5, keep: KeepSpec | None = None) -> ReplayResult:
    """Replay ``turns`` in order on a fresh engine, recording to ``trace``.

    ``trace=None`` replays without recording (the no-perturbation baseline):
    nothing is captured (the plugin is installed only for exact replay's
    scheduler budget or split plan).

    ``prompts``: the token ids of ``turns`` when the caller rendered them already
    (``statediff_hooks.precheck``); ``console``: where the engine status line and
    the progress bar go (``statediff_hooks.enginelog.Console``; default: stderr).

    ``logprobs``: every request asks the engine for the logprob of each sampled
    token and its ``logprobs`` best alternatives (``SamplingParams.logprobs``;
    greedy tokens do not change); the runner's values are recorded (request
    datasets ``output_logprobs``, ``output_topk_*``), run metadata ``logprobs_k``.

    ``keep``: which captured tensors keep their data (``statediff_hooks.keep``;
    default ``hits``); every one is summarized. Passed to the engine as
    ``STATEDIFF_KEEP`` / ``STATEDIFF_FOCUS``.

    Exact replay has two forms. ``exact``: one block per step in both runs,
    of the block size the engine runs with (read inside the started engine by
    ``sched_v1.one_block_per_step``, after vLLM raised it for a hybrid).
    ``exact_split``: the hit run keeps the engine's chunking, and the cold run
    (``split_like`` = that hit trace) splits each prefill at the chunk ends
    the hit run's state went through (``statediff.replay.splitplan``), so long
    prompts do not pay one step per block.

    Raises:
        StatediffError: bad mode, the engine refused to start (message from vLLM),
            or a known engine limitation (e.g. hybrid + speculative decoding on CPU).
    """
    import time

    from statediff.trace.writer import check_writable

    if mode not in ("hit", "cold"):
        raise StatediffError(f"--mode must be 'hit' or 'cold', not {mode!r}")
    if trace is not None:
        check_writable(Path(trace), overwrite=overwrite)
    for key, val in ENGINE_ENV.items():
        os.environ.setdefault(key, val)
    kw = dict(kw)
    check_known_limits(kw)
    if exact and exact_split:
        raise StatediffError("choose one exact replay form: --exact or --exact-split")
    _check_logprobs(logprobs, kw)
    if prompts is None:
        prompts = render_prompts(turns, kw["model"])
    splits = {}
    if exact_split and mode == "cold":
        if not split_like:
            raise StatediffError("--exact-split in cold mode needs --split-like HIT.h5 (the hit run's trace)")
        splits = _split_plan(split_like, prompts)
    elif split_like:
        raise StatediffError("--split-like is for the cold run of --exact-split")
    conv_digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    cfg = RecorderConfig(
        trace=trace or "", mode=mode, activations=activations, replay="exact" if exact or exact_split else "default", kv=kv,
        fault=None, overwrite=overwrite, keep=keep or KeepSpec(),
        run_extra={"conversation_digest": conv_digest, "sampling": turns[0].sampling,
                   "num_requests": len(turns),
                   "exact_form": "block" if exact else "split" if exact_split else None,
                   "split_plan": {str(k): v for k, v in splits.items()} or None,
                   "logprobs_k": logprobs,
                   **(run_extra or {})},
    )
    env = cfg.to_env()
    for key in [k for k in os.environ if k.startswith("STATEDIFF_") and k != "STATEDIFF_DEBUG"]:
        del os.environ[key]  # nothing from an earlier replay in this process may leak in
    if fault:
        env["STATEDIFF_FAULT"] = fault
    plugin.unregister()
    plugin.reset()
    if splits:
        env["STATEDIFF_SPLITS"] = json.dumps({str(k): v for k, v in splits.items()})
    if exact:  # one block per step, set inside the started engine (sched_v1.py)
        env[EXACT_ENV] = "1"
    if trace is not None or splits or exact:
        os.environ.update(env if trace is not None else
                          {k: env[k] for k in ("STATEDIFF_SPLITS", EXACT_ENV) if k in env})
        plugin.register()

    from vllm import LLM, SamplingParams

    from statediff_hooks.enginelog import plain_console

    console = console or plain_console(progress)
    t0 = time.perf_counter()
    try:
        with console.status(_engine_status(kw)) as st:
            llm = LLM(**kw)
            st["note"] = f"block size {llm.llm_engine.vllm_config.cache_config.block_size}"
    except StatediffError:
        raise
    except (plugin.UnsupportedEngine, plugin.RecordingRefused, ExactReplayError) as e:
        raise StatediffError(str(e)) from None
    except Exception as e:  # vLLM raises many types for bad engine arguments
        log = f" (engine log: {console.log_path})" if console.log_path else ""
        raise StatediffError(f"the engine failed to start: {type(e).__name__}: {str(e).splitlines()[0]}{log}") from None
    t_replay = time.perf_counter()
    salt_base = uuid.uuid4().hex[:12]
    cached, outputs, lps, topk_ids, topk_lps = [], [], [], [], []
    bar = console.replay_bar(f"record {mode}", len(turns),
                             sum(len(ids) + int(t.sampling.get("max_tokens", 16)) for t, ids in zip(turns, prompts)))
    i = 0
    try:
        for i, (turn, ids) in enumerate(zip(turns, prompts)):
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if mode == "cold":
                prompt["cache_salt"] = cold_salt(salt_base, i)
            # logprob of each sampled token and its best `logprobs` alternatives (the runner's values
            # are recorded by the capture; these front-end ones are the same numbers)
            sp = SamplingParams(**(turn.sampling | {"logprobs": logprobs}))
            res = llm.generate([prompt], sp, use_tqdm=False)[0]
            cached.append(int(res.num_cached_tokens or 0))
            comp = res.outputs[0]
            outputs.append([int(t) for t in comp.token_ids])
            per_token = list(comp.logprobs or [])
            lps.append([float(lp[t].logprob) for t, lp in zip(comp.token_ids, per_token)])
            top = [sorted((v.rank, tid, float(v.logprob)) for tid, v in lp.items() if 1 <= v.rank <= logprobs)
                   for lp in per_token]
            topk_ids.append([[tid for _, tid, _ in row] for row in top])
            topk_lps.append([[x for _, _, x in row] for row in top])
            plugin.annotate_request(i, num_cached_tokens=cached[-1], cache_salt=prompt.get("cache_salt"))
            bar.request_done(len(ids) + int(turn.sampling.get("max_tokens", 16)))
    except BaseException as e:  # an engine error, a bad request, Ctrl-C: the trace says where it stopped
        bar.close()
        note = _stop_recording(trace, i, turns[i] if i < len(turns) else None, e)
        if not isinstance(e, Exception):
            raise
        where = f"request {i} (line {turns[i].line})" if i < len(turns) else f"request {i}"
        raise StatediffError(f"{where} failed: {first_line(e)} ({type(e).__name__}); {note}") from None
    bar.close()
    replay_seconds = time.perf_counter() - t_replay
    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    budget = _step_budget(llm)
    fired = plugin.fault_fired()
    stats = plugin.close()
    if fault and trace is not None and not fired and not stats.get("error"):
        raise StatediffError(
            f"--fault {fault} never fired (no request resumed from a prefix-cache hit deep enough, "
            f"or no such layer or request): {trace} holds a fault-free run")
    if stats.get("error"):
        raise StatediffError(f"recording failed: {stats['error']}")
    del llm
    return ReplayResult(trace=trace, block_size=block, max_num_batched_tokens=budget,
                        num_cached_tokens=cached, output_token_ids=outputs,
                        output_logprobs=lps, output_topk_ids=topk_ids, output_topk_logprobs=topk_lps,
                        stats=stats,
                        seconds=time.perf_counter() - t0, replay_seconds=replay_seconds)


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


def _check_logprobs(k: int, kw: dict) -> None:
    """Refuse a ``--logprobs`` the trace or the engine cannot hold, before any engine starts.

    Raises:
        StatediffError: ``k`` < 0, above ``schema.MAX_LOGPROBS_K``, or above the
            engine's ``max_logprobs`` (vLLM 0.32 ``EngineArgs.max_logprobs``, default
            20; vLLM would refuse the first request).
    """
    from statediff.trace.schema import MAX_LOGPROBS_K
    from vllm.engine.arg_utils import EngineArgs

    if not 0 <= k <= MAX_LOGPROBS_K:
        raise StatediffError(f"--logprobs must be in 0..{MAX_LOGPROBS_K}, not {k}")
    max_lp = kw.get("max_logprobs", EngineArgs.max_logprobs)
    if isinstance(max_lp, int) and 0 <= max_lp < k:
        raise StatediffError(f"--logprobs {k} exceeds the engine's max_logprobs {max_lp} "
                             f"(pass --engine-arg max_logprobs={k})")


def _step_budget(llm: Any) -> int | None:
    """Tokens the engine's scheduler issues per step, read from the started engine.

    vLLM 0.32 in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    ``llm.llm_engine.engine_core`` (``InprocClient``) ``.engine_core.scheduler
    .max_num_scheduled_tokens``; otherwise (engine core in another process)
    None: the trace's run metadata has the engine's own value.
    """
    sched = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None),
                    "scheduler", None)
    budget = getattr(sched, "max_num_scheduled_tokens", None)
    return int(budget) if budget is not None else None


def _split_plan(hit_trace: str, prompts: list[list[int]]) -> dict[int, list[int]]:
    """Cold-run split points from the hit trace; its prompts must be this replay's."""
    from statediff.replay.splitplan import cold_splits
    from statediff.trace import open_trace

    with open_trace(hit_trace) as t:
        reqs = t.requests
        if t.run.get("mode") != "hit":
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
