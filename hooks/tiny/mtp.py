"""The tiny hybrid with an MTP head whose drafts the target accepts (``--model tiny-mtp``).

A random drafter is almost never accepted (measured: DFlash 0 of 1341 drafts),
which leaves the multi-token accept path after a prefix-cache hit untested. This
target is built so that its own MTP head drafts what it will sample:

- The target (``tiny_config`` otherwise) repeats itself: ``lm_head = R + 0.6 E``
  (``R`` random, ``E`` the embedding matrix), so the residual stream's copy of
  the current token's embedding pulls the next token towards it.
- The MoE layer is layer 0 (``mlp_only_layers`` 1-3): vLLM 0.32 builds the MTP
  layer with layer index 0 (``qwen3_next_mtp.py``: prefix ``mtp.layers.0``) and
  ``Qwen3NextForCausalLM.set_moe_parameters`` needs a MoE layer; layer 0 MoE
  makes the MTP layer MoE too.
- MTP (``num_nextn_predict_layers`` 1): ``mtp.fc = [0 | I]`` passes the target's
  hidden state through and ignores the token embedding; the MTP decoder layer
  (full attention + MoE, real random weights, its own K/V) has its output
  projections scaled by ``MTP_OUT_SCALE``, so its drafts are mostly the target's
  own prediction from that hidden state (the token just sampled), and its
  attention still moves the draft a little (its K/V are live state).

Shapes and seeding are those of ``statediff_hooks.tiny.model`` (vLLM 0.32 CPU
facts there); one MTP layer adds K/V of 4 heads x 128 per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .model import _build_target, _make_weights, _param_specs, tiny_config

__all__ = ["LM_HEAD_EMBED_MIX", "MTP_OUT_SCALE", "build_tiny_mtp_model", "tiny_mtp_config"]

#: ``lm_head = R + LM_HEAD_EMBED_MIX * embed``: how strongly the target repeats its last token.
LM_HEAD_EMBED_MIX = 0.6
#: Scale of the MTP layer's output projections (attention ``o_proj``, experts' ``down_proj``).
MTP_OUT_SCALE = 0.1


def tiny_mtp_config() -> dict[str, Any]:
    """``config.json`` of the tiny MTP hybrid: ``tiny_config`` with MoE layer 0 and one MTP layer."""
    cfg = tiny_config()
    cfg["mlp_only_layers"] = list(range(1, cfg["num_hidden_layers"]))
    cfg["num_nextn_predict_layers"] = 1
    return cfg


def _mtp_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of the MTP head: a full-attention MoE decoder layer, ``fc`` and three norms."""
    h = cfg["hidden_size"]
    one = dict(cfg, layer_types=["full_attention"], mlp_only_layers=[])
    layer = [("mtp.layers.0." + n.removeprefix("model.layers.0."), shape, init)
             for n, shape, init in _param_specs(one) if n.startswith("model.layers.0.")]
    return layer + [("mtp.fc.weight", (h, 2 * h), "zeros")] + [
        (f"mtp.{n}.weight", (h,), "zeros") for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")]


def mtp_weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """All bfloat16 tensors of the tiny MTP hybrid (target and MTP head), by checkpoint name."""
    import torch

    w = _make_weights(_param_specs(cfg) + _mtp_specs(cfg), seed)
    mixed = w["lm_head.weight"].float() + LM_HEAD_EMBED_MIX * w["model.embed_tokens.weight"].float()
    w["lm_head.weight"] = mixed.to(torch.bfloat16).contiguous()
    h = cfg["hidden_size"]
    fc = torch.zeros(h, 2 * h)
    fc[:, h:] = torch.eye(h)  # [embedding | hidden]: the hidden state passes through
    w["mtp.fc.weight"] = fc.to(torch.bfloat16)
    for name in [n for n in w if n.startswith("mtp.layers.0.") and n.endswith(("o_proj.weight", "down_proj.weight"))]:
        w[name] = (w[name].float() * MTP_OUT_SCALE).to(torch.bfloat16).contiguous()
    return w


def build_tiny_mtp_model(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny MTP hybrid's model directory and return its path.

    Same tokenizer, chat template, seeding, caching and atomic-write rules as
    ``statediff_hooks.tiny.model.build_tiny_model`` (``FileExistsError`` likewise).
    Run it with ``--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'``.
    """
    cfg = tiny_mtp_config()
    return _build_target(out_dir, cfg, None, seed=seed, overwrite=overwrite,
                         weights=lambda: mtp_weights(cfg, seed))
