"""Build tiny, random, fully offline drafters for a tiny target model: EAGLE-3 (vLLM) and DFlash
(transformers).

Both write a drafter directory (``config.json``, ``model.safetensors``,
marker) through ``tiny.model.write_model_dir``, keyed on the seed, the
target's config digest and the drafter's own choices (tapped layers, block
size), with weights drawn by ``tiny.model.draw_tensor`` (each tensor from its
own generator seeded by ``sha256(f"{seed}:{name}")``, bfloat16).

EAGLE-3. ``build_tiny_eagle3(out_dir, target_dir, seed=0)`` writes a drafter
that vLLM 0.32 loads with ``speculative_config={"method": "eagle3", "model":
out_dir, ...}``. The format mirrors vLLM 0.32.0:

- ``model_executor/models/llama_eagle3.py`` ``Eagle3LlamaForCausalLM``
  (architecture ``LlamaForCausalLMEagle3``, ``model_type`` ``llama``): one
  decoder layer whose checkpoint prefix is ``midlayer.`` (mapped to
  ``layers.0.``), q/k/v projections over ``2 * hidden`` inputs
  (the input-token embedding next to the projected target features),
  ``hidden_norm``, ``fc`` (``[hidden, n_aux * target_hidden]``) and ``norm``.
  No ``embed_tokens`` and no ``lm_head``: vLLM then shares the target's
  (``v1/spec_decode/llm_base_proposer.py`` ``_maybe_share_embeddings`` /
  ``_maybe_share_lm_head``), and the draft vocabulary is the target's (no
  ``d2t``/``t2d`` tables).
- ``config/speculative.py`` / ``v1/worker/gpu_model_runner.py``
  ``_get_eagle3_aux_layers_from_config``: the tapped target layers come from
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (Model Runner V2,
  ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, reads only the top-level
  ``eagle_aux_hidden_state_layer_ids``: both are written). Layer id ``L`` is the
  target's hidden state plus residual at the *input* of decoder layer ``L``
  (``L == num_hidden_layers``: after the last layer, before the final norm);
  the target concatenates them in ascending layer order.

Weights: so that the drafter's proposals are not pure noise, ``fc`` is the identity on the last
tapped layer (the default ids end with ``num_hidden_layers``, the target's
pre-norm final hidden state) plus N(0, 0.002) on the others, and the layer's
``o_proj``/``down_proj`` are N(0, 0.002): the draft hidden state is then
close to the target's own final hidden state, and with the shared
``lm_head`` the drafter mostly proposes "the token the target just
predicted", which a random target that repeats tokens accepts. Everything
else is N(0, 0.02), norms 1.

DFlash. ``build_tiny_dflash(out_dir, target_dir, seed=0)`` writes a drafter
that transformers 5.19 loads with ``AutoModel.from_pretrained`` as its DFlash
class ``MuseGlimmerAssistantModel`` (``models/muse_glimmer_assistant``,
``model_type`` ``muse_glimmer_assistant``; driven by
``statediff_hooks.transformers.dflash``): one drafter layer over the target's
hidden size (it shares the target's embedding and ``lm_head``), matrices
N(0, 0.02), norms 1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..recording.fields import config_digest
from .model import GENERATOR_VERSION, MAX_POSITIONS, _dump_json, draw_tensor, write_model_dir

__all__ = ["ARCHITECTURE", "DFLASH_ARCHITECTURE", "DFLASH_MODEL_TYPE", "build_tiny_dflash", "build_tiny_eagle3",
           "dflash_config", "eagle3_config"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
#: transformers 5.19's one DFlash drafter class and its ``model_type``.
DFLASH_ARCHITECTURE = "MuseGlimmerAssistantModel"
DFLASH_MODEL_TYPE = "muse_glimmer_assistant"
_SMALL_STD = 0.002


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Tapped target layers for a target of ``num_layers`` layers: [1, n // 2, n] (distinct, sorted)."""
    return sorted({1, num_layers // 2, num_layers})


def eagle3_config(target_cfg: dict[str, Any], aux_layer_ids: list[int]) -> dict[str, Any]:
    """The drafter's ``config.json`` for a target ``config.json`` dict.

    Raises:
        ValueError: an aux layer id outside ``[0, num_hidden_layers]``.
    """
    n = int(target_cfg["num_hidden_layers"])
    if not aux_layer_ids or any(not 0 <= i <= n for i in aux_layer_ids):
        raise ValueError(f"aux layer ids {aux_layer_ids} must lie in [0, {n}] for a {n}-layer target")
    h = int(target_cfg["hidden_size"])
    heads = int(target_cfg["num_attention_heads"])
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "dtype": "bfloat16",
        "hidden_size": h,
        "target_hidden_size": h,
        "intermediate_size": int(target_cfg["intermediate_size"]),
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_cfg.get("num_key_value_heads", heads)),
        "head_dim": int(target_cfg.get("head_dim") or h // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(target_cfg.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target_cfg["vocab_size"]),
        "draft_vocab_size": int(target_cfg["vocab_size"]),
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings", MAX_POSITIONS)),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # Model Runner V2 reads the ids only here (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
    }


def _eagle3_weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """``{checkpoint name: bf16 tensor}``; shapes for the default tiny target (hidden 256)::

        fc.weight                               (256, 768)  [N(0,0.002) | N(0,0.002) | I]
        midlayer.self_attn.q_proj.weight        (256, 512)  input: [embeds, features]
        midlayer.self_attn.k_proj / v_proj      (128, 512)
        midlayer.self_attn.o_proj.weight        (256, 256)  N(0, 0.002)
        midlayer.mlp.gate_proj / up_proj        (512, 256)
        midlayer.mlp.down_proj.weight           (256, 512)  N(0, 0.002)
        midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}, norm   (256,) ones
    """
    import torch

    h, th, inter = cfg["hidden_size"], cfg["target_hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    specs = [
        ("midlayer.self_attn.q_proj.weight", (nh * hd, 2 * h), "normal", None),
        ("midlayer.self_attn.k_proj.weight", (nkv * hd, 2 * h), "normal", None),
        ("midlayer.self_attn.v_proj.weight", (nkv * hd, 2 * h), "normal", None),
        ("midlayer.self_attn.o_proj.weight", (h, nh * hd), "normal", _SMALL_STD),
        ("midlayer.mlp.gate_proj.weight", (inter, h), "normal", None),
        ("midlayer.mlp.up_proj.weight", (inter, h), "normal", None),
        ("midlayer.mlp.down_proj.weight", (h, inter), "normal", _SMALL_STD),
        ("midlayer.input_layernorm.weight", (h,), "ones", None),
        ("midlayer.hidden_norm.weight", (h,), "ones", None),
        ("midlayer.post_attention_layernorm.weight", (h,), "ones", None),
        ("norm.weight", (h,), "ones", None),
    ]
    out = {}
    for name, shape, init, std in specs:
        t = draw_tensor(name, shape, init, seed) if std is None else draw_tensor(name, shape, init, seed, std)
        out[name] = t
    fc = draw_tensor("fc.weight", (h, n_aux * th), "normal", seed, _SMALL_STD)
    fc[:, (n_aux - 1) * th:] = torch.eye(h, th)
    out["fc.weight"] = fc
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(out.items())}


def build_tiny_eagle3(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                      aux_layer_ids: list[int] | None = None, overwrite: bool = False) -> Path:
    """Write a tiny EAGLE-3 drafter for the model in ``target_dir``; return its path.

    Args:
        out_dir: drafter directory (created; same caching and atomic-write
            rules as ``tinymodel.build_tiny_model``, keyed also on the target's
            config digest and the aux layer ids).
        target_dir: a tiny target (e.g. ``build_tiny_dense_model``); only its
            ``config.json`` is read (sizes, vocabulary, layer count).
        seed: weight seed (same seed -> byte-identical weights).
        aux_layer_ids: tapped target layers; default ``[1, n // 2, n]``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``target_dir``.
        FileExistsError: ``out_dir`` is non-empty and holds something else.
        ValueError: aux layer ids outside the target's ``[0, n]``.
    """
    target_cfg = _target_config(target_dir)
    ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(int(target_cfg["num_hidden_layers"]))
    cfg = eagle3_config(target_cfg, ids)
    target_digest = config_digest(target_cfg)
    arch = f"{ARCHITECTURE}:{target_digest[:16]}:{','.join(map(str, ids))}"
    return _write_drafter(out_dir, cfg, lambda: _eagle3_weights(cfg, seed), seed=seed, architecture=arch,
                          marker={"generator": "statediff_hooks.tinydraft", "target_config_sha256": target_digest,
                                  "aux_layer_ids": ids}, overwrite=overwrite)


def dflash_config(target_cfg: dict[str, Any], *, target_layer_ids: list[int] | None = None,
                  block_size: int = 4, mask_token_id: int | None = None) -> dict[str, Any]:
    """``config.json`` of a tiny DFlash drafter for a target ``config.json`` dict.

    One drafter layer (4 query heads, 2 KV heads of dim 64), the target's
    hidden size (the drafter shares the target's embedding and ``lm_head``).

    Args:
        target_layer_ids: tapped target layers (default ``[1, n - 1]``: the
            outputs of the first layer and of the second-to-last one).
        block_size: noise positions per draft call; ``block_size - 1`` draft tokens.
        mask_token_id: default the target's ``pad_token_id`` (the tiny
            tokenizer has no mask token; a drafter with random weights does not care).

    Raises:
        ValueError: a tapped layer outside ``[0, n - 1]``, or ``block_size < 2``.
    """
    n = int(target_cfg["num_hidden_layers"])
    ids = sorted(set(target_layer_ids)) if target_layer_ids else [1, n - 1]
    if any(not 0 <= i < n for i in ids):
        raise ValueError(f"target layer ids {ids} must lie in [0, {n - 1}] for a {n}-layer target")
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: a DFlash block needs the anchor and at least one mask")
    h = int(target_cfg["hidden_size"])
    max_pos = int(target_cfg.get("max_position_embeddings", 4096))
    mask = target_cfg.get("pad_token_id", 0) if mask_token_id is None else mask_token_id
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": DFLASH_MODEL_TYPE,
        "dtype": "bfloat16",
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": float(target_cfg.get("rms_norm_eps", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": max_pos,
        "sliding_window": max_pos,
        "layer_types": ["full_attention"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "block_size": block_size,
        "mask_token_id": int(mask),
        "target_layer_ids": ids,
    }


def _dflash_weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """``{checkpoint name: bf16 tensor}``; shapes for the tiny target (hidden 256, 2 taps)::

        encoder.fc.weight                        (256, 512)
        encoder.output_norm_enc.weight, norm.weight        (256,) ones
        layers.0.self_attn.q_proj / o_proj       (256, 256)
        layers.0.self_attn.k_proj / v_proj       (128, 256)
        layers.0.self_attn.q_norm / k_norm       (64,) ones
        layers.0.mlp.gate_proj / up_proj         (512, 256); down_proj (256, 512)
        layers.0.input_layernorm / post_attention_layernorm   (256,) ones
    """
    import torch

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    specs = [("encoder.fc.weight", (h, len(cfg["target_layer_ids"]) * h), "normal"),
             ("encoder.output_norm_enc.weight", (h,), "ones"), ("norm.weight", (h,), "ones")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        specs += [(f"{p}.self_attn.{name}.weight", shape, init) for name, shape, init in (
            ("q_proj", (nh * hd, h), "normal"), ("k_proj", (nkv * hd, h), "normal"),
            ("v_proj", (nkv * hd, h), "normal"), ("o_proj", (h, nh * hd), "normal"),
            ("q_norm", (hd,), "ones"), ("k_norm", (hd,), "ones"))]
        specs += [(f"{p}.{name}.weight", shape, init) for name, shape, init in (
            ("mlp.gate_proj", (inter, h), "normal"), ("mlp.up_proj", (inter, h), "normal"),
            ("mlp.down_proj", (h, inter), "normal"), ("input_layernorm", (h,), "ones"),
            ("post_attention_layernorm", (h,), "ones"))]
    return {name: draw_tensor(name, shape, init, seed).to(torch.bfloat16).contiguous()
            for name, shape, init in sorted(specs)}


def build_tiny_dflash(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                      target_layer_ids: list[int] | None = None, block_size: int = 4,
                      overwrite: bool = False) -> Path:
    """Write a tiny random DFlash drafter for the model in ``target_dir``; return its path.

    The directory loads with ``AutoModel.from_pretrained`` as
    ``MuseGlimmerAssistantModel``; the same seed gives byte-identical weights.
    A directory already holding the same drafter (seed, target config, taps,
    block size) is returned untouched.

    Args:
        out_dir: drafter directory (created).
        target_dir: the target model directory; only its ``config.json`` is read.
        seed: weight seed.
        target_layer_ids, block_size: see ``dflash_config``.
        overwrite: rewrite even if ``out_dir`` holds a matching drafter.

    Raises:
        FileNotFoundError: no ``config.json`` in ``target_dir``.
        FileExistsError: ``out_dir`` is non-empty and holds something else.
        ValueError: bad tapped layers or block size.
    """
    target_cfg = _target_config(target_dir)
    cfg = dflash_config(target_cfg, target_layer_ids=target_layer_ids, block_size=block_size)
    target_digest = config_digest(target_cfg)
    arch = (f"{DFLASH_ARCHITECTURE}:{target_digest[:16]}:{','.join(map(str, cfg['target_layer_ids']))}"
            f":b{block_size}")
    return _write_drafter(out_dir, cfg, lambda: _dflash_weights(cfg, seed), seed=seed, architecture=arch,
                          marker={"generator": "statediff_hooks.dflash", "target_config_sha256": target_digest,
                                  "target_layer_ids": cfg["target_layer_ids"], "block_size": block_size},
                          overwrite=overwrite)


def _target_config(target_dir: str | Path) -> dict[str, Any]:
    """The target's ``config.json`` (FileNotFoundError when there is none)."""
    return json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))


def _write_drafter(out_dir: str | Path, cfg: dict[str, Any], weights: Callable[[], dict[str, Any]], *,
                   seed: int, architecture: str, marker: dict[str, Any], overwrite: bool) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (``weights()``) with a marker of ``marker``'s
    fields plus the generator version, seed, architecture, weights digest and torch version."""

    def files(tmp: Path) -> str:
        from safetensors.torch import save_file

        save_file(weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump_json(tmp / "config.json", cfg)
        return hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()

    def marker_of(digest: str) -> dict[str, Any]:
        import torch

        return {"generator": marker["generator"], "generator_version": GENERATOR_VERSION, "seed": seed,
                "architecture": architecture, "weights_sha256": digest,
                **{k: v for k, v in marker.items() if k != "generator"}, "torch_version": torch.__version__}

    return write_model_dir(out_dir, files, marker_of, seed=seed, architecture=architecture, overwrite=overwrite)
