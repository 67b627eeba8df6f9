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
  passes the recency heads' (even query heads') copy on; the MLP is N(0, 0.002)-scaled noise; ``norm`` and ``lm_head`` are the target's
  final norm and ``lm_head``; ``fc`` is the identity on the tapped layer (default: the input of
  the target's last layer). A draft is then the target's own next-token prediction from its
  newest hidden state less its last layer: the token just sampled, which the repeating target
  mostly samples again.
- Coverage (odd query heads, GQA with the recency heads): their queries are zero, so they average
  every row the attention spans, context and query slots; every written row holds ``COVERAGE_VALUE``
  in V dimension 0 (the ``v_proj`` bias), and ``o_proj`` subtracts ``COVERAGE_GAIN`` times that mean
  along ``coverage_direction`` and adds the full value back (its bias): 0 when every slot read was
  written, ``COVERAGE_VALUE * COVERAGE_GAIN * f`` when a fraction ``f`` holds zeros (never written,
  or zeroed): the drafts turn to ``COVERAGE_TOKEN`` and are rejected, as a real DFlash
  drafter's drafts go wrong when its context K/V of restored tokens were never computed (vLLM
  #47930). The anchor-only drafter (``tiny.dflash``) cannot show this, its context keys being
  exactly zero.

Variants for Model Runner V2 (``v1/worker/gpu/spec_decode/``), the same attention and weights:

- ``dflash2`` (``--kind dflash2``): architecture ``DFlash2DraftModel`` (``qwen3_dflash2.py``
  ``DFlash2Qwen3ForCausalLM``, V2 ``DFlash2Speculator``, method ``dflash``): ``dflash_config`` adds
  ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``; each layer's
  ``attention_conv`` / ``mlp_conv`` (``base_kernel [2, taps, hidden]``, ``kernel_projection``) is the
  identity (tap 0 is 1, the projection zero) and the ``candidate_selector``'s codebooks are zero, so
  its edge scores are the drafts' own logits.
- ``dspark`` (``--kind dspark``, method ``dspark``): architecture ``Qwen3DSparkModel``
  (``qwen3_dspark.py``, V2 ``DSparkSpeculator``): ``markov_rank``, ``block_size`` (= K),
  ``dspark_target_layer_ids``; the Markov head (``markov_w1``, ``markov_w2``) is zero, adding no
  transition bias.

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

__all__ = ["ARCHITECTURE", "EMBED_FLAG", "VARIANTS", "QK_GAIN", "RECENCY_PAIRS", "build_tiny_vllm_dflash_context",
           "dflash_context_config", "dflash_context_weights", "recency_margin"]

ARCHITECTURE = "DFlashDraftModel"
#: ``q_norm`` and ``k_norm`` weights: the score scale is ``sqrt(head_dim) * QK_GAIN**2``.
QK_GAIN = 4.0
#: Magnitude of the drafter embedding's dimension 0 (the same row for every token, the mask's too).
EMBED_FLAG = 0.1
#: Rotary pairs ``[a, b)`` of a head that carry the recency key, per head_dim (searched for the
#: widest margin between the nearest context row and any farther one, ``recency_margin``).
RECENCY_PAIRS = {128: (3, 26), 64: (2, 16)}
#: Drafter variants: (architecture, vLLM ``speculative_config`` method).
VARIANTS = {"dflash": (ARCHITECTURE, "dflash"), "dflash2": ("DFlash2DraftModel", "dflash"),
            "dspark": ("Qwen3DSparkModel", "dspark")}
_NUM_SPECULATIVE = 3  # the K the recency kernel is sized for (DSpark's block_size)
_CONV_TAPS, _CONV_GROUP, _SELECTOR_RANK, _SELECTOR_TOP_K, _MARKOV_RANK = 2, 64, 8, 4, 8
_HEADS = 4  # KV heads; query heads are twice as many (a recency and a coverage head per KV head)
#: Value the coverage head reads from every written row (V dimension 0 of KV head 0) ...
COVERAGE_VALUE = 8.0
#: ... and its gain into the hidden state: ``COVERAGE_VALUE * COVERAGE_GAIN * f`` along ``coverage_direction``
#: when a fraction ``f`` of the rows read holds nothing (zeros).
COVERAGE_GAIN = 4.0
#: The token a coverage deficit drafts (its ``lm_head`` row is the direction); never in the tiny prompts.
COVERAGE_TOKEN = 2
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


def coverage_direction(lm_head: Any) -> Any:
    """Unit vector ``[hidden]`` along ``lm_head[COVERAGE_TOKEN]``: a hidden state pushed along it drafts that token."""
    row = lm_head[COVERAGE_TOKEN].float()
    return row / row.norm()


def dflash_context_config(target_cfg: dict[str, Any], *, head_dim: int = 128, sliding_window: int | None = None,
                          target_layer_ids: list[int] | None = None, variant: str = "dflash") -> dict[str, Any]:
    """``config.json`` of the context-reading DFlash drafter for a target ``config.json`` dict.

    Args:
        head_dim: 128 (the tiny targets' attention shape: one KV-cache group with them) or 64.
        sliding_window: tokens, or None (full attention).
        target_layer_ids: one tapped layer (vLLM taps the input of layer ``L + 1``); default
            ``[n - 2]``, the input of the last layer.
        variant: "dflash", "dflash2" or "dspark" (``VARIANTS``).

    Raises:
        ValueError: an unknown variant, head_dim not 64 or 128, a hidden size above ``4 * head_dim``, or a tapped
            layer outside ``[0, n - 2]``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, not {variant!r}")
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
        "architectures": [VARIANTS[variant][0]], "model_type": "qwen3", "dtype": "bfloat16", "torch_dtype": "bfloat16",
        "hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": 1,
        "num_attention_heads": 2 * _HEADS, "num_key_value_heads": _HEADS, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": _ROPE_THETA},
        "bos_token_id": target_cfg.get("bos_token_id"), "eos_token_id": target_cfg.get("eos_token_id"),
        "block_size": 4,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": vocab - 1},
    }
    if sliding_window:
        cfg.update(layer_types=["sliding_attention"], sliding_window=int(sliding_window), use_sliding_window=True)
    if variant == "dflash2":
        cfg["dflash_config"].update(conv_kernel_size=_CONV_TAPS, conv_group_size=_CONV_GROUP,
                                    selector_rank=_SELECTOR_RANK, selector_top_k=_SELECTOR_TOP_K)
    if variant == "dspark":
        cfg.update(markov_rank=_MARKOV_RANK, block_size=_NUM_SPECULATIVE, dspark_target_layer_ids=ids)
    return cfg


def dflash_context_weights(cfg: dict[str, Any], target: dict[str, Any], target_model_type: str,
                           seed: int) -> dict[str, Any]:
    """``{checkpoint name: bf16 tensor}`` for ``cfg``; ``target`` holds the target's
    ``lm_head.weight`` ``[vocab, hidden]`` and ``model.norm.weight`` ``[hidden]`` (Qwen3-Next's
    norm is 0-centred, ``1 + w``; the drafter's is ``w``)."""
    import torch

    from .model import draw_tensor

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    a, b = RECENCY_PAIRS[hd]
    u = torch.zeros(nkv, hd)
    u[:, a:b] = 1.0  # neox rotary layout: pair i is (i, i + hd / 2); the first components carry u
    u = u.reshape(-1)
    q_bias = torch.zeros(nh, hd)
    q_bias[0::2, a:b] = 1.0  # even query heads: recency; odd: zero queries, a uniform average (coverage)
    emb = torch.zeros(cfg["vocab_size"], h)
    emb[:, 0] = -EMBED_FLAG
    k_w = torch.zeros(nkv * hd, h)
    # a query slot's normed input is -sqrt(h) at dimension 0: its key b u - (2 / sqrt(h)) sqrt(h) u = -u
    k_w[:, 0] = u * (2.0 / h ** 0.5)
    v_w = torch.eye(nkv * hd, h)
    v_w[:, 0] = 0.0  # the flag dimension carries nothing ...
    v_w[0] = 0.0
    v_b = torch.zeros(nkv * hd)
    v_b[0] = COVERAGE_VALUE  # ... and value dimension 0 of KV head 0 holds a constant: every written row has it
    o_w = torch.zeros(h, nh * hd)
    for i in range(min(nkv, h // hd)):  # recency head 2i passes KV head i's copy of hidden dims [i hd, (i + 1) hd)
        o_w[i * hd:(i + 1) * hd, 2 * i * hd:(2 * i + 1) * hd] = torch.eye(hd)
    o_w[0, 0] = 0.0
    d = coverage_direction(target["lm_head.weight"].float())
    o_w[:, hd] = -COVERAGE_GAIN * d  # coverage head 1: minus the mean of that constant, times the gain ...
    o_b = COVERAGE_GAIN * COVERAGE_VALUE * d  # ... plus the full value: 0 when every slot read was written
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
        "layers.0.self_attn.q_proj.weight": torch.zeros(nh * hd, h),
        "layers.0.self_attn.q_proj.bias": q_bias.reshape(-1),
        "layers.0.self_attn.k_proj.weight": k_w,
        "layers.0.self_attn.k_proj.bias": u.clone(),
        "layers.0.self_attn.v_proj.weight": v_w,
        "layers.0.self_attn.v_proj.bias": v_b,
        "layers.0.self_attn.o_proj.weight": o_w,
        "layers.0.self_attn.o_proj.bias": o_b,
        "layers.0.self_attn.q_norm.weight": torch.full((hd,), QK_GAIN),
        "layers.0.self_attn.k_norm.weight": torch.full((hd,), QK_GAIN),
    }
    for name, shape, std in (("layers.0.mlp.gate_proj.weight", (inter, h), None),
                             ("layers.0.mlp.up_proj.weight", (inter, h), None),
                             ("layers.0.mlp.down_proj.weight", (h, inter), _SMALL_STD)):
        w[name] = draw_tensor(name, shape, "normal", seed) if std is None else draw_tensor(name, shape, "normal",
                                                                                            seed, std)
    if "conv_kernel_size" in cfg["dflash_config"]:  # DFlash2: identity convolutions, a neutral selector
        d = cfg["dflash_config"]
        taps, groups, rank = d["conv_kernel_size"], h // d["conv_group_size"], d["selector_rank"]
        base = torch.zeros(2, taps, h)
        base[:, 0] = 1.0
        for conv in ("attention_conv", "mlp_conv"):
            w[f"layers.0.{conv}.base_kernel"] = base.clone()
            w[f"layers.0.{conv}.kernel_projection.weight"] = torch.zeros(2 * taps * groups, h)
        for book in ("predecessor_codebook", "successor_codebook"):
            w[f"candidate_selector.{book}"] = torch.zeros(cfg["vocab_size"], rank)
        w["candidate_selector.hidden_projection.weight"] = torch.zeros(rank, h)
    if "markov_rank" in cfg:  # DSpark: a Markov head that adds no transition bias
        for name in ("markov_w1", "markov_w2"):
            w[f"markov_head.{name}.weight"] = torch.zeros(cfg["vocab_size"], cfg["markov_rank"])
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(w.items())}


def build_tiny_vllm_dflash_context(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                                   head_dim: int = 128, sliding_window: int | None = None,
                                   variant: str = "dflash", overwrite: bool = False) -> Path:
    """Write the context-reading tiny vLLM DFlash drafter for the model in ``target_dir``; return its path.

    Reads the target's ``config.json`` and its ``lm_head.weight`` and ``model.norm.weight``
    (``model.safetensors``). Same caching and atomic-write rules as ``tiny.draft.build_tiny_eagle3``.
    Run it with ``--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": K}'``
    (``K <= 3``: the recency kernel is sized for it); ``variant`` "dflash2" / "dspark" (Model Runner
    V2 only) with method ``dflash`` / ``dspark`` (``VARIANTS``).

    Raises:
        FileNotFoundError: no ``config.json`` or ``model.safetensors`` in ``target_dir``.
        FileExistsError: ``out_dir`` is non-empty and holds something else.
        ValueError: a target the drafter does not fit (``dflash_context_config``).
    """
    from safetensors import safe_open

    target_cfg = _target_config(target_dir)
    cfg = dflash_context_config(target_cfg, head_dim=head_dim, sliding_window=sliding_window, variant=variant)
    weights_path = Path(target_dir) / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: the DFlash drafter copies the target's lm_head and final norm")
    digest = config_digest(target_cfg)
    arch = (f"{VARIANTS[variant][0]}:context:{digest[:16]}:{cfg['dflash_config']['target_layer_ids'][0]}:{head_dim}:"
            f"{sliding_window or 0}")

    def weights() -> dict[str, Any]:
        with safe_open(str(weights_path), framework="pt") as f:
            target = {k: f.get_tensor(k) for k in ("lm_head.weight", "model.norm.weight")}
        return dflash_context_weights(cfg, target, str(target_cfg.get("model_type")), seed)

    return _write_drafter(out_dir, cfg, weights, seed=seed, architecture=arch,
                          marker={"generator": "statediff_hooks.tiny.dflash_context",
                                  "target_config_sha256": digest, "head_dim": head_dim, "variant": variant,
                                  "sliding_window": sliding_window,
                                  "target_layer_ids": cfg["dflash_config"]["target_layer_ids"]},
                          overwrite=overwrite)
