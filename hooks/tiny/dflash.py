"""The anchor-only tiny DFlash drafter for vLLM (``build-tiny-model --kind dflash-anchor-only``): its mask
slots draft the anchor token and give the context K/V no attention, so a stale context changes no draft.

vLLM 0.32 format (``model_executor/models/qwen3_dflash.py``
``DFlashQwen3ForCausalLM``, architecture ``DFlashDraftModel``, ``model_type``
``qwen3``, ``dflash_config`` ``{target_layer_ids, mask_token_id}``; the
proposer is ``v1/spec_decode/dflash.py`` ``DFlashProposer``). It needs real
weights: with ``--load-format dummy`` vLLM 0.32 fails in
``_project_context_kv`` (``size mismatch ... vec (0)``), its fused K/V
buffers being built from loaded weights only.

How DFlash drafts: each step the proposer feeds the drafter ``1 + K`` query
slots per request, the token just sampled (the anchor) and ``K`` copies of
``mask_token_id``; the K mask slots' logits are the K drafts. Their keys and
values attend to the context: the target's tapped hidden states mapped by
``fc`` and ``hidden_norm`` into the drafter's own K/V cache.

Built to be accepted by a target that repeats its last token (``--kind mtp``,
``hooks/tiny/mtp.py``): every mask slot copies the anchor.

- ``embed_tokens`` (own): the target's embedding with dimension 0 set to
  ``+ANCHOR_FLAG`` for every token and ``-ANCHOR_FLAG`` for the mask token.
- Attention: the target's attention shape (4 query and 4 KV heads of 128),
  so the drafter's K/V page is the target's and vLLM puts its layer in the
  target attention's KV cache group and block size (with heads of 64 its
  group got block size 64, and hits shrank to multiples of 64 tokens).
  ``k_proj = u e0^T`` and ``q_proj = -u e0^T`` (``u``: 1 at dimension 63 of
  each head, the lowest RoPE frequency, so positions barely rotate it),
  ``q_norm`` weight ``Q_GAIN``: a mask slot's query scores about
  ``+11.3 * Q_GAIN`` on a real token's key, the negative on a mask slot's,
  0 on the context's (``fc`` row 0 is zero, so a context key is exactly 0):
  attention lands on the anchor.
- ``v_proj = [I; 0]``, ``o_proj = [I 0]``: the attention output is the
  anchor's normalised embedding; the MLP adds N(0, 0.002)-scaled noise.
- ``lm_head`` (own): the target's embedding, so the mask slots' logits peak at the anchor.
- ``fc`` (``[256, 256 * taps]``, N(0, 0.02), row 0 zero) and ``hidden_norm``
  are real: the context K/V are live drafter state (the drafter's cache), they
  only get no attention weight.

Shapes and seeding follow ``statediff_hooks.tiny.model`` (``draw_tensor``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..recording.fields import config_digest
from .draft import _target_config, _write_drafter

__all__ = ["ANCHOR_FLAG", "ARCHITECTURE", "Q_GAIN", "build_tiny_vllm_dflash", "vllm_dflash_config"]

ARCHITECTURE = "DFlashDraftModel"
#: Value of embedding dimension 0 (``+`` real tokens, ``-`` the mask token); the key's sign.
ANCHOR_FLAG = 0.12
#: ``q_norm`` weight: a mask slot's attention logit on the anchor is ``sqrt(128) * Q_GAIN``.
Q_GAIN = 4.0
_HEADS, _HEAD_DIM = 4, 128
_ROPE_DIM = 63  # the lowest-frequency rotary pair (neox style: dims 63 and 127) of each head
_SMALL_STD = 0.002


def vllm_dflash_config(target_cfg: dict[str, Any], *, target_layer_ids: list[int] | None = None,
                       mask_token_id: int | None = None) -> dict[str, Any]:
    """``config.json`` of the tiny vLLM DFlash drafter for a target ``config.json`` dict.

    Args:
        target_layer_ids: tapped target layers (vLLM taps the input of layer ``L + 1``);
            default ``[1, n - 2]`` (distinct).
        mask_token_id: default the target's last vocabulary id (never in the tiny prompts).

    Raises:
        ValueError: the target's hidden size is above ``4 * 128`` or a tapped layer is outside ``[0, n - 1]``.
    """
    n, h = int(target_cfg["num_hidden_layers"]), int(target_cfg["hidden_size"])
    if h > _HEADS * _HEAD_DIM:
        raise ValueError(f"the tiny DFlash drafter needs a hidden size of at most {_HEADS * _HEAD_DIM}, not {h}")
    ids = sorted(set(target_layer_ids)) if target_layer_ids else sorted({1, n - 2})
    if any(not 0 <= i < n for i in ids):
        raise ValueError(f"target layer ids {ids} must lie in [0, {n - 1}] for a {n}-layer target")
    vocab = int(target_cfg["vocab_size"])
    mask = vocab - 1 if mask_token_id is None else int(mask_token_id)
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "dtype": "bfloat16", "torch_dtype": "bfloat16",
        "hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": 1,
        "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "head_dim": _HEAD_DIM,
        "vocab_size": vocab, "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": target_cfg.get("bos_token_id"), "eos_token_id": target_cfg.get("eos_token_id"),
        "block_size": 4,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask},
    }


def vllm_dflash_weights(cfg: dict[str, Any], target_embed: Any, seed: int) -> dict[str, Any]:
    """``{checkpoint name: bf16 tensor}`` for ``cfg`` and the target's ``[vocab, hidden]`` embedding."""
    import torch

    from .model import draw_tensor

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    mask = cfg["dflash_config"]["mask_token_id"]
    emb = target_embed.float().clone()
    emb[:, 0] = ANCHOR_FLAG
    emb[mask, 0] = -ANCHOR_FLAG
    qkv = _HEADS * _HEAD_DIM
    u = torch.zeros(qkv)
    u[_ROPE_DIM::_HEAD_DIM] = 1.0
    e0 = torch.zeros(h)
    e0[0] = 1.0
    fc = draw_tensor("fc.weight", (h, taps * h), "normal", seed)
    fc[0] = 0.0  # context rows have dimension 0 exactly 0: their keys are exactly 0
    w = {
        "embed_tokens.weight": emb,
        "lm_head.weight": target_embed.float().clone(),
        "fc.weight": fc,
        "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h),
        "layers.0.input_layernorm.weight": torch.ones(h),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.self_attn.q_proj.weight": -torch.outer(u, e0),
        "layers.0.self_attn.k_proj.weight": torch.outer(u, e0),
        "layers.0.self_attn.v_proj.weight": torch.eye(qkv, h),
        "layers.0.self_attn.o_proj.weight": torch.eye(h, qkv),
        "layers.0.self_attn.q_norm.weight": torch.full((_HEAD_DIM,), Q_GAIN),
        "layers.0.self_attn.k_norm.weight": torch.ones(_HEAD_DIM),
    }
    for name, shape, std in (("layers.0.mlp.gate_proj.weight", (inter, h), None),
                             ("layers.0.mlp.up_proj.weight", (inter, h), None),
                             ("layers.0.mlp.down_proj.weight", (h, inter), _SMALL_STD)):
        w[name] = draw_tensor(name, shape, "normal", seed) if std is None else draw_tensor(name, shape, "normal",
                                                                                            seed, std)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(w.items())}


def build_tiny_vllm_dflash(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                           overwrite: bool = False) -> Path:
    """Write the tiny vLLM DFlash drafter for the model in ``target_dir``; return its path.

    Reads the target's ``config.json`` and its ``model.embed_tokens.weight``
    (``model.safetensors``). Same caching and atomic-write rules as
    ``tiny.draft.build_tiny_eagle3``. Run it with ``--speculative-config
    '{"method": "dflash", "model": DIR, "num_speculative_tokens": K}'``; its
    drafts are accepted when the target repeats its last token (``--kind mtp``).

    Raises:
        FileNotFoundError: no ``config.json`` or ``model.safetensors`` in ``target_dir``.
        FileExistsError: ``out_dir`` is non-empty and holds something else.
        ValueError: a target the drafter does not fit (see ``vllm_dflash_config``).
    """
    from safetensors import safe_open

    target_cfg = _target_config(target_dir)
    cfg = vllm_dflash_config(target_cfg)
    weights_path = Path(target_dir) / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: the DFlash drafter copies the target's embedding")
    digest = config_digest(target_cfg)
    arch = f"{ARCHITECTURE}:{digest[:16]}:{','.join(map(str, cfg['dflash_config']['target_layer_ids']))}"

    def weights() -> dict[str, Any]:
        with safe_open(str(weights_path), framework="pt") as f:
            embed = f.get_tensor("model.embed_tokens.weight")
        return vllm_dflash_weights(cfg, embed, seed)

    return _write_drafter(out_dir, cfg, weights, seed=seed, architecture=arch,
                          marker={"generator": "statediff_hooks.tiny.dflash", "target_config_sha256": digest,
                                  "target_layer_ids": cfg["dflash_config"]["target_layer_ids"]},
                          overwrite=overwrite)
