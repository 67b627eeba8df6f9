"""The tiny hybrid as a compressed-tensors FP8 or NVFP4 target (``build-tiny-model --kind
hybrid-fp8|hybrid-nvfp4``, ``--model tiny-fp8|tiny-nvfp4``; the MTP hybrid likewise: ``--kind
mtp-fp8|mtp-nvfp4``, ``--model tiny-mtp-fp8|tiny-mtp-nvfp4``, its MTP head bf16), quantised
offline without llmcompressor.

The reported failure runs a compressed-tensors NVFP4 target (W4A4) of a hybrid model, and an
FP8 target of it passes. These builders write the same checkpoint layout for the tiny hybrid of
``tiny.model`` (same config, tokenizer and bf16 weights for the seed, so a format is the only
difference from ``--model tiny``), using only ``compressed_tensors`` (installed with vLLM):
its preset schemes (``FP8_DYNAMIC``, ``NVFP4``), ``calculate_qparams`` / ``generate_gparam``
for the scales and its registered compressors (``float-quantized``, ``nvfp4-pack-quantized``)
for the stored tensors. Read by vLLM 0.32
``model_executor/layers/quantization/compressed_tensors/`` (``CompressedTensorsW8A8Fp8``,
``CompressedTensorsW4A4Fp4``).

What is quantised (``targets: ["Linear"]``) and what is not (``ignore``, as in the reported
checkpoint and real NVFP4/FP8 checkpoints of Qwen3-Next, plus the routed experts):

- quantised: full attention ``q_proj``/``k_proj``/``v_proj``/``o_proj``, the dense MLPs'
  ``gate_proj``/``up_proj``/``down_proj`` and the shared expert's projections;
- left bf16: ``lm_head``, every Gated DeltaNet module (``re:.*linear_attn.*``), the router
  (``re:.*mlp.gate$``), the shared-expert gate (``re:.*mlp.shared_expert_gate$``) and the
  routed experts (``re:.*mlp.experts.*``). vLLM 0.32 has no CPU path for quantised routed
  experts: NVFP4 experts stop in ``fused_moe/oracle/nvfp4.py:select_nvfp4_moe_backend`` (the
  only emulation there is Triton) and FP8 experts in ``fused_moe/oracle/fp8.py`` (the CPU FP8
  expert paths need 128-block FP8 and AMX).

Scales:

- FP8_DYNAMIC: per output channel, ``amax / 448`` (bf16, shape ``(out, 1)``), weights
  ``float8_e4m3fn``; activations are quantised per token at run time (no calibration).
- NVFP4: groups of 16 along the input dimension, FP8 group scales under an FP32 global scale
  ``448 * 6 / amax`` (compressed-tensors' divisor form); the projections vLLM fuses (q/k/v,
  gate/up) share one global scale (the smallest), as llmcompressor writes them, since vLLM
  0.32 keeps only one per fused layer. The activation global scale
  (``input_global_scale``) is a fixed choice instead of a calibration pass:
  ``NVFP4_INPUT_GLOBAL_SCALE`` = 6, i.e. an assumed activation amax of 448, which makes each
  16-value group's FP8 scale its own amax / 6 * 6 = amax: every group with amax in
  [2**-6, 448] gets a normal FP8 scale (the tiny model's activations stay far inside).

Weights are packed 2 per byte (``weight_packed`` uint8), as the format prescribes; checkpoint
sizes, tiny hybrid seed 0: bf16 7.1 MB, FP8 4.7 MB, NVFP4 3.6 MB (embeddings, lm_head, GDN
and experts stay bf16).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["FORMATS", "IGNORE", "NVFP4_INPUT_GLOBAL_SCALE", "build_tiny_quantized_model", "quantization_config"]

#: Target formats of the tiny hybrid: name -> compressed-tensors preset scheme (None: bf16).
FORMATS = {"bf16": None, "fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4"}

#: compressed-tensors ``ignore`` list: the reported checkpoint's plus the routed experts.
IGNORE = ["lm_head", "re:.*linear_attn.*", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$",
          "re:.*mlp.experts.*"]

#: NVFP4 activation global scale (divisor form, ``448 * 6 / amax``): a fixed amax of 448.
NVFP4_INPUT_GLOBAL_SCALE = 6.0

# Projections vLLM fuses into one layer (qkv_proj, gate_up_proj): one NVFP4 global scale each.
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def quantization_config(fmt: str, ignore: list[str] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for ``fmt`` ("fp8" or "nvfp4"): one
    config group ``group_0`` (the preset scheme on ``Linear``), format, ``ignore`` (default ``IGNORE``),
    status ``compressed``.

    Raises:
        KeyError: an unknown or unquantised format.
    """
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme(FORMATS[fmt], ["Linear"])
    qfmt = "float-quantized" if fmt == "fp8" else "nvfp4-pack-quantized"
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, format=qfmt, ignore=list(ignore or IGNORE),
                             quantization_status=QuantizationStatus.COMPRESSED)
    return json.loads(cfg.model_dump_json())


def _quantised(name: str, ignore: list[str]) -> bool:
    """True for a Linear weight (``...proj.weight``) the ``ignore`` list does not cover."""
    if not name.endswith("_proj.weight") and not name.endswith(".shared_expert_gate.weight"):
        return False
    module = name[: -len(".weight")]
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return False
        elif module == pat:
            return False
    return True


def _compress(weights: dict[str, Any], fmt: str, ignore: list[str]) -> dict[str, Any]:
    """Quantise and compress the ``_quantised`` weights of a bf16 state dict for ``fmt``."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(FORMATS[fmt], ["Linear"])
    qargs = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(
        "float-quantized" if fmt == "fp8" else "nvfp4-pack-quantized")
    targets = [n for n in weights if _quantised(n, ignore)]
    gscale: dict[str, Any] = {}
    if fmt == "nvfp4":  # one global scale per fused group: the smallest (largest amax) wins
        for n in targets:
            module, proj = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
            key = f"{module}.{_FUSED.get(proj, proj)}"
            w = weights[n].float()
            g = generate_gparam(w.min(), w.max())
            gscale[key] = g if key not in gscale else torch.minimum(gscale[key], g)
    out = dict(weights)
    for n in targets:
        w = weights[n]
        module, proj = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
        prefix = n[: -len("weight")]
        sd: dict[str, Any] = {"weight": w}
        if fmt == "fp8":  # per output channel
            scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), qargs)
            sd["weight_scale"] = scale.to(w.dtype)
        else:  # groups of 16 along the input dimension, under the fused group's global scale
            g = gscale[f"{module}.{_FUSED.get(proj, proj)}"]
            grouped = w.float().reshape(w.shape[0], -1, qargs.group_size)
            scale, _ = calculate_qparams(grouped.amin(dim=2), grouped.amax(dim=2), qargs, global_scale=g)
            sd["weight_scale"] = scale
            sd["weight_global_scale"] = g
            sd["input_global_scale"] = torch.tensor([NVFP4_INPUT_GLOBAL_SCALE], dtype=torch.float32)
        del out[n]
        for k, v in compressor.compress(sd, scheme).items():
            out[prefix + k] = v.contiguous().clone()  # fused shards share a global scale tensor
    return out


def build_tiny_quantized_model(out_dir: str | Path, fmt: str, *, seed: int = 0, overwrite: bool = False,
                               mtp: bool = False) -> Path:
    """Write the tiny hybrid (``tiny.model.tiny_config``, seed ``seed``) as a compressed-tensors
    ``fmt`` checkpoint ("fp8" or "nvfp4") and return its directory.

    ``mtp``: the tiny MTP hybrid instead (``tiny.mtp``, ``--model tiny-mtp``), its MTP head
    left bf16 too (``ignore`` gains ``re:.*mtp.*``): the target is quantised, the drafter is not.
    Same tokenizer, caching and atomic-write rules as ``tiny.model.build_tiny_model``; the
    bf16 weights it quantises are those the bf16 model draws for the seed.

    Raises:
        KeyError: ``fmt`` is not "fp8" or "nvfp4".
        FileExistsError: ``out_dir`` is non-empty and holds something else.
    """
    from .model import _build_target, _make_weights, _param_specs, tiny_config

    if FORMATS.get(fmt) is None:
        raise KeyError(f"no quantised tiny format {fmt!r}; choose fp8 or nvfp4")
    if mtp:
        from .mtp import mtp_weights, tiny_mtp_config

        cfg, ignore = tiny_mtp_config(), IGNORE + ["re:.*mtp.*"]

        def draw() -> dict[str, Any]:
            return mtp_weights(tiny_mtp_config(), seed)
    else:
        cfg, ignore = tiny_config(), list(IGNORE)
        specs = _param_specs(cfg)

        def draw() -> dict[str, Any]:
            return _make_weights(specs, seed)
    cfg["quantization_config"] = quantization_config(fmt, ignore)
    return _build_target(out_dir, cfg, None, seed=seed, overwrite=overwrite,
                         weights=lambda: _compress(draw(), fmt, ignore))
