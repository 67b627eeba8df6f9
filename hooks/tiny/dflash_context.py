"""A tiny vLLM DFlash drafter whose drafts come from its context K/V (``build-tiny-model --kind dflash``).

vLLM 0.32 format (``model_executor/models/qwen3_dflash.py`` ``DFlashQwen3ForCausalLM``,
architecture ``DFlashDraftModel``, ``model_type`` ``qwen3``, ``dflash_config``
``{target_layer_ids, mask_token_id}``; V1 proposer ``v1/spec_decode/dflash.py``). Each step the
proposer writes the context K/V (``precompute_and_store_context_kv``: the target's tapped hidden
states through ``fc``, ``hidden_norm``, the K/V projection, ``k_norm`` and RoPE) of every token the
target just ran into the drafter's KV cache, then runs ``1 + K`` query slots per request (the
anchor, the token just sampled, at position ``n + 1``, and ``K`` mask slots after it) whose
attention spans the whole sequence, context and query slots. Its drafts are the mask slots' logits.

Built so that the drafts are read from the context, as a real DFlash drafter's are, and so that
the tiny MTP hybrid (``--kind mtp``, which leans to repeating its last token) accepts them:

- Keys (``attention_bias``): ``k = k_norm(b u + W x)`` with ``u`` the first component of the
  rotary pairs ``RECENCY_PAIRS`` of each head. A context row has input dimension 0 exactly 0
  (``fc`` row 0 is zero), so its key is ``+u``; a query slot's input is the drafter's embedding,
  dimension 0 only (``-EMBED_FLAG``), so its key is ``-u``. Queries are the constant ``+u``.
- RoPE turns ``u . u`` into a recency kernel: the score of a key ``d`` positions back is
  ``sqrt(head_dim) * QK_GAIN**2 * mean_i cos(theta_i d)`` over those pairs, which falls by more
  than 0.1 of its peak from one context position to any farther one within the ``K <= 3`` draft
  window (``recency_margin``): about 20 nats at head_dim 128, 13 at 64. So every mask slot
  attends to the newest context row (the last token the target verified), and the query slots
  (scores about ``-sqrt(head_dim) * QK_GAIN**2``) get none.
- Values and output: ``v_proj`` copies the context row (``hidden_norm(fc(tap))``), ``o_proj``
  passes it on; the MLP is N(0, 0.002)-scaled noise; ``norm`` and ``lm_head`` are the target's
  final norm and ``lm_head``; ``fc`` is the identity on the tapped layer (default: the input of
  the target's last layer). A draft is then the target's own next-token prediction from its
  newest hidden state less its last layer: the token just sampled, which the repeating target
  mostly samples again.
- Context K/V zeroed, stale or never written: the context's scores become 0 or wrong, the value
  read is zeros or another token's row, and the drafts change (acceptance falls); the anchor-only
  drafter (``tiny.dflash``) cannot show this, its context keys being exactly zero.

``head_dim=64`` (4 KV heads of 64) gives the drafter a KV page unlike the target's: on the hybrid
it gets its own KV-cache group and vLLM unifies page sizes (the target attention's block size
doubles). ``sliding_window`` makes its layer a sliding-window (causal) layer: its own group on any
target. Shapes and seeding follow ``statediff_hooks.tiny.model`` (``draw_tensor``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..recording.fields import config_digest
from .draft import _target_config, _write_drafter

__all__ = ["ARCHITECTURE", "EMBED_FLAG", "QK_GAIN", "RECENCY_PAIRS", "build_tiny_vllm_dflash_context",
           "dflash_context_config", "dflash_context_weights", "recency_margin"]

ARCHITECTURE = "DFlashDraftModel"
#: ``q_norm`` and ``k_norm`` weights: the score scale is ``sqrt(head_dim) * QK_GAIN**2``.
QK_GAIN = 4.0
#: Magnitude of the drafter embedding's dimension 0 (the same row for every token, the mask's too).
EMBED_FLAG = 0.1
#: Rotary pairs ``[a, b)`` of a head that carry the recency key, per head_dim (searched for the
#: widest margin between the nearest context row and any farther one, ``recency_margin``).
RECENCY_PAIRS = {128: (3, 26), 64: (2, 16)}
_HEADS = 4
_SMALL_STD = 0.002
_ROPE_THETA = 10000.0


def recency_margin(head_dim: int, k: int = 3, horizon: int = 4096) -> float:
    """Smallest gap (in units of the peak score) between the kernel at the newest context row and at
    any farther row, for mask slots ``1..k`` (the newest row is ``j + 1`` positions back)."""
    import numpy as np

    a, b = RECENCY_PAIRS[head_dim]
    theta = _ROPE_THETA ** (-np.arange(head_dim // 2) * 2 / head_dim)[a:b]
    kern = np.cos(np.outer(np.arange(horizon + 1), theta)).mean(1)
    return float(min(kern[j + 1] - kern[j + 2:].max() for j in range(1, k + 1)))


def dflash_context_config(target_cfg: dict[str, Any], *, head_dim: int = 128, sliding_window: int | None = None,
                          target_layer_ids: list[int] | None = None) -> dict[str, Any]:
    """``config.json`` of the context-reading DFlash drafter for a target ``config.json`` dict.

    Args:
        head_dim: 128 (the tiny targets' attention shape: one KV-cache group with them) or 64.
        sliding_window: tokens, or None (full attention).
        target_layer_ids: one tapped layer (vLLM taps the input of layer ``L + 1``); default
            ``[n - 2]``, the input of the last layer.

    Raises:
        ValueError: head_dim not 64 or 128, a hidden size above ``4 * head_dim``, or a tapped
            layer outside ``[0, n - 2]``.
    """
    if head_dim not in RECENCY_PAIRS:
        raise ValueError(f"head_dim must be one of {sorted(RECENCY_PAIRS)}, not {head_dim}")
    n, h = int(target_cfg["num_hidden_layers"]), int(target_cfg["hidden_size"])
    if h > _HEADS * head_dim:
        raise ValueError(f"the tiny DFlash drafter needs a hidden size of at most {_HEADS * head_dim}, not {h}")
    ids = list(target_layer_ids) if target_layer_ids else [n - 2]
    if len(ids) != 1 or not 0 <= ids[0] <= n - 2:
        raise ValueError(f"one tapped layer in [0, {n - 2}] for a {n}-layer target, not {ids}")
    vocab = int(target_cfg["vocab_size"])
    cfg = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "dtype": "bfloat16", "torch_dtype": "bfloat16",
        "hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": 1,
        "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": _ROPE_THETA},
        "bos_token_id": target_cfg.get("bos_token_id"), "eos_token_id": target_cfg.get("eos_token_id"),
        "block_size": 4,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": vocab - 1},
    }
    if sliding_window:
        cfg.update(layer_types=["sliding_attention"], sliding_window=int(sliding_window), use_sliding_window=True)
    return cfg


def dflash_context_weights(cfg: dict[str, Any], target: dict[str, Any], target_model_type: str,
                           seed: int) -> dict[str, Any]:
    """``{checkpoint name: bf16 tensor}`` for ``cfg``; ``target`` holds the target's
    ``lm_head.weight`` ``[vocab, hidden]`` and ``model.norm.weight`` ``[hidden]`` (Qwen3-Next's
    norm is 0-centred, ``1 + w``; the drafter's is ``w``)."""
    import torch

    from .model import draw_tensor

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = _HEADS * hd
    a, b = RECENCY_PAIRS[hd]
    u = torch.zeros(_HEADS, hd)
    u[:, a:b] = 1.0  # neox rotary layout: pair i is (i, i + hd / 2); the first components carry u
    u = u.reshape(-1)
    emb = torch.zeros(cfg["vocab_size"], h)
    emb[:, 0] = -EMBED_FLAG
    k_w = torch.zeros(qkv, h)
    # a query slot's normed input is -sqrt(h) at dimension 0: its key b u - (2 / sqrt(h)) sqrt(h) u = -u
    k_w[:, 0] = u * (2.0 / h ** 0.5)
    v_w = torch.eye(qkv, h)
    v_w[:, 0] = 0.0  # the flag dimension carries nothing
    fc = torch.eye(h)
    fc[0] = 0.0  # context rows: dimension 0 exactly 0, so their key is +u
    norm = target["model.norm.weight"].float()
    w = {
        "embed_tokens.weight": emb,
        "lm_head.weight": target["lm_head.weight"].float().clone(),
        "fc.weight": fc,
        "hidden_norm.weight": torch.ones(h),
        "norm.weight": norm + 1.0 if target_model_type == "qwen3_next" else norm.clone(),
        "layers.0.input_layernorm.weight": torch.ones(h),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.self_attn.q_proj.weight": torch.zeros(qkv, h),
        "layers.0.self_attn.q_proj.bias": u.clone(),
        "layers.0.self_attn.k_proj.weight": k_w,
        "layers.0.self_attn.k_proj.bias": u.clone(),
        "layers.0.self_attn.v_proj.weight": v_w,
        "layers.0.self_attn.v_proj.bias": torch.zeros(qkv),
        "layers.0.self_attn.o_proj.weight": torch.eye(h, qkv),
        "layers.0.self_attn.o_proj.bias": torch.zeros(h),
        "layers.0.self_attn.q_norm.weight": torch.full((hd,), QK_GAIN),
        "layers.0.self_attn.k_norm.weight": torch.full((hd,), QK_GAIN),
    }
    for name, shape, std in (("layers.0.mlp.gate_proj.weight", (inter, h), None),
                             ("layers.0.mlp.up_proj.weight", (inter, h), None),
                             ("layers.0.mlp.down_proj.weight", (h, inter), _SMALL_STD)):
        w[name] = draw_tensor(name, shape, "normal", seed) if std is None else draw_tensor(name, shape, "normal",
                                                                                            seed, std)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(w.items())}


def build_tiny_vllm_dflash_context(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                                   head_dim: int = 128, sliding_window: int | None = None,
                                   overwrite: bool = False) -> Path:
    """Write the context-reading tiny vLLM DFlash drafter for the model in ``target_dir``; return its path.

    Reads the target's ``config.json`` and its ``lm_head.weight`` and ``model.norm.weight``
    (``model.safetensors``). Same caching and atomic-write rules as ``tiny.draft.build_tiny_eagle3``.
    Run it with ``--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": K}'``
    (``K <= 3``: the recency kernel is sized for it).

    Raises:
        FileNotFoundError: no ``config.json`` or ``model.safetensors`` in ``target_dir``.
        FileExistsError: ``out_dir`` is non-empty and holds something else.
        ValueError: a target the drafter does not fit (``dflash_context_config``).
    """
    from safetensors import safe_open

    target_cfg = _target_config(target_dir)
    cfg = dflash_context_config(target_cfg, head_dim=head_dim, sliding_window=sliding_window)
    weights_path = Path(target_dir) / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: the DFlash drafter copies the target's lm_head and final norm")
    digest = config_digest(target_cfg)
    arch = (f"{ARCHITECTURE}:context:{digest[:16]}:{cfg['dflash_config']['target_layer_ids'][0]}:{head_dim}:"
            f"{sliding_window or 0}")

    def weights() -> dict[str, Any]:
        with safe_open(str(weights_path), framework="pt") as f:
            target = {k: f.get_tensor(k) for k in ("lm_head.weight", "model.norm.weight")}
        return dflash_context_weights(cfg, target, str(target_cfg.get("model_type")), seed)

    return _write_drafter(out_dir, cfg, weights, seed=seed, architecture=arch,
                          marker={"generator": "statediff_hooks.tiny.dflash_context",
                                  "target_config_sha256": digest, "head_dim": head_dim,
                                  "sliding_window": sliding_window,
                                  "target_layer_ids": cfg["dflash_config"]["target_layer_ids"]},
                          overwrite=overwrite)
