"""Build a tiny, random, fully offline EAGLE-3 drafter for a tiny target model.

``build_tiny_eagle3(out_dir, target_dir, seed=0)`` writes a drafter
directory (``config.json``, ``model.safetensors``, marker) that vLLM 0.32
loads with ``speculative_config={"method": "eagle3", "model": out_dir, ...}``.
The format mirrors vLLM 0.32.0:

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
  ``eagle_config.eagle_aux_hidden_state_layer_ids``. Layer id ``L`` is the
  target's hidden state plus residual at the *input* of decoder layer ``L``
  (``L == num_hidden_layers``: after the last layer, before the final norm);
  the target concatenates them in ascending layer order.

Weights: each tensor from its own generator seeded by
``sha256(f"{seed}:{name}")`` (as in ``tinymodel``), bfloat16. So that the
drafter's proposals are not pure noise, ``fc`` is the identity on the last
tapped layer (the default ids end with ``num_hidden_layers``, the target's
pre-norm final hidden state) plus N(0, 0.002) on the others, and the layer's
``o_proj``/``down_proj`` are N(0, 0.002): the draft hidden state is then
close to the target's own final hidden state, and with the shared
``lm_head`` the drafter mostly proposes "the token the target just
predicted", which a random target that repeats tokens accepts. Everything
else is N(0, 0.02), norms 1.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from statediff_hooks.tiny.model import GENERATOR_VERSION, MAX_POSITIONS, _dump_json, draw_tensor, write_model_dir

__all__ = ["ARCHITECTURE", "build_tiny_eagle3", "eagle3_config"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
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
    }


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
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
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(int(target_cfg["num_hidden_layers"]))
    cfg = eagle3_config(target_cfg, ids)
    target_digest = hashlib.sha256(json.dumps(target_cfg, sort_keys=True).encode()).hexdigest()
    arch = f"{ARCHITECTURE}:{target_digest[:16]}:{','.join(map(str, ids))}"

    def files(tmp: Path) -> str:
        from safetensors.torch import save_file

        save_file(_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump_json(tmp / "config.json", cfg)
        return hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()

    def marker(digest: str) -> dict[str, Any]:
        import torch

        return {"generator": "statediff_hooks.tinydraft", "generator_version": GENERATOR_VERSION,
                "seed": seed, "architecture": arch, "weights_sha256": digest,
                "target_config_sha256": target_digest, "aux_layer_ids": ids,
                "torch_version": torch.__version__}

    return write_model_dir(out_dir, files, marker, seed=seed, architecture=arch, overwrite=overwrite)
