"""DFlash drafters with transformers' own classes: a tiny random one, a proposer, acceptance.

transformers 5.19.0 has one DFlash drafter class, ``MuseGlimmerAssistantModel``
(``models/muse_glimmer_assistant``, ``model_type`` ``muse_glimmer_assistant``,
loadable with ``AutoModel``), driven by
``generation/candidate_generator.py`` ``DFlashTokenCandidateGenerator``
(``generate(..., assistant_model=..., speculation_type="dflash")``) with its
``cache_utils.DFlashCache``. Mirrored facts:

- The drafter reads the target's hidden states at ``config.target_layer_ids``
  (index ``i`` of the target's ``output_hidden_states`` tuple: the input of
  decoder layer ``i``, i.e. the output of layer ``i - 1``; 0 is the token
  embedding), concatenated on the last axis, projected by ``encoder.fc``
  (``[hidden, n_taps * hidden]``) and normalised; they become extra K/V rows
  of every drafter layer (kept in the ``DFlashCache``).
- Each draft call feeds ``block_size`` "noise" positions: the last token the
  target produced (the anchor, whose features do not exist yet) and
  ``block_size - 1`` copies of ``mask_token_id``, embedded with the *target's*
  input embedding; the drafter's outputs at the mask positions go through
  the *target's* ``lm_head``: ``block_size - 1`` draft tokens per call.
- ``generate`` refuses assisted generation for stateful targets ("assisted
  generation is not supported with stateful models, such as
  Qwen3NextForCausalLM"; ``generation/utils.py``): a GDN state cannot be
  rolled back to a partial acceptance. So the verify loop lives in the
  adapter (``transformers_adapter``), and this module only wraps the
  candidate generator's ``get_candidates`` (the drafter forward itself is
  transformers' code, unchanged).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from statediff.errors import StatediffError

__all__ = ["MODEL_TYPE", "Acceptance", "DFlashProposer", "build_tiny_dflash", "dflash_config",
           "greedy_accepted", "load_drafter"]

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"


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
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
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


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """``{checkpoint name: bf16 tensor}``; shapes for the tiny target (hidden 256, 2 taps)::

        encoder.fc.weight                        (256, 512)
        encoder.output_norm_enc.weight, norm.weight        (256,) ones
        layers.0.self_attn.q_proj / o_proj       (256, 256)
        layers.0.self_attn.k_proj / v_proj       (128, 256)
        layers.0.self_attn.q_norm / k_norm       (64,) ones
        layers.0.mlp.gate_proj / up_proj         (512, 256); down_proj (256, 512)
        layers.0.input_layernorm / post_attention_layernorm   (256,) ones
    """
    from statediff_hooks.tiny.model import draw_tensor

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    specs = [("encoder.fc.weight", (h, len(cfg["target_layer_ids"]) * h), "normal"),
             ("encoder.output_norm_enc.weight", (h,), "ones"), ("norm.weight", (h,), "ones")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        specs += [
            (f"{p}.self_attn.q_proj.weight", (nh * hd, h), "normal"),
            (f"{p}.self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (f"{p}.self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (f"{p}.self_attn.o_proj.weight", (h, nh * hd), "normal"),
            (f"{p}.self_attn.q_norm.weight", (hd,), "ones"),
            (f"{p}.self_attn.k_norm.weight", (hd,), "ones"),
            (f"{p}.mlp.gate_proj.weight", (inter, h), "normal"),
            (f"{p}.mlp.up_proj.weight", (inter, h), "normal"),
            (f"{p}.mlp.down_proj.weight", (h, inter), "normal"),
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
        ]
    return {name: draw_tensor(name, shape, init, seed).to(torch.bfloat16).contiguous()
            for name, shape, init in sorted(specs)}


def build_tiny_dflash(out_dir: str | Path, target_dir: str | Path, seed: int = 0, *,
                      target_layer_ids: list[int] | None = None, block_size: int = 4,
                      overwrite: bool = False) -> Path:
    """Write a tiny random DFlash drafter for the model in ``target_dir``; return its path.

    The directory (``config.json``, ``model.safetensors``, marker) loads with
    ``AutoModel.from_pretrained`` as ``MuseGlimmerAssistantModel``. Each
    weight is drawn from its own generator seeded by ``sha256(f"{seed}:{name}")``
    (``tinymodel.draw_tensor``: matrices N(0, 0.02), norms 1), bfloat16, so the
    same seed gives byte-identical weights. A directory already holding the
    same drafter (seed, target config, taps, block size) is returned untouched.

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
    from statediff_hooks.tiny.model import GENERATOR_VERSION, _dump_json, write_model_dir

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    cfg = dflash_config(target_cfg, target_layer_ids=target_layer_ids, block_size=block_size)
    target_digest = hashlib.sha256(json.dumps(target_cfg, sort_keys=True).encode()).hexdigest()
    arch = (f"{ARCHITECTURE}:{target_digest[:16]}:{','.join(map(str, cfg['target_layer_ids']))}"
            f":b{block_size}")

    def files(tmp: Path) -> str:
        from safetensors.torch import save_file

        save_file(_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump_json(tmp / "config.json", cfg)
        return hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()

    def marker(digest: str) -> dict[str, Any]:
        return {"generator": "statediff_hooks.dflash", "generator_version": GENERATOR_VERSION,
                "seed": seed, "architecture": arch, "weights_sha256": digest,
                "target_config_sha256": target_digest, "target_layer_ids": cfg["target_layer_ids"],
                "block_size": block_size, "torch_version": torch.__version__}

    return write_model_dir(out_dir, files, marker, seed=seed, architecture=arch, overwrite=overwrite)


def load_drafter(path: str | Path, target: Any) -> Any:
    """Load a DFlash drafter directory for ``target`` (bfloat16, eval mode).

    Raises:
        StatediffError: not loadable, not a DFlash drafter, a hidden size
            other than the target's, or tapped layers the target does not have.
    """
    from transformers import AutoConfig, AutoModel

    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises OSError/ValueError/... for bad directories
        raise StatediffError(f"cannot load drafter config from {path}: {str(e).splitlines()[0]}") from None
    if cfg.model_type != MODEL_TYPE:
        raise StatediffError(f"drafter {path} has model_type {cfg.model_type!r}; the transformers adapter "
                             f"drives DFlash drafters ({MODEL_TYPE!r}, transformers' DFlash class)")
    tcfg = target.config.get_text_config(decoder=True)
    if cfg.hidden_size != tcfg.hidden_size:
        raise StatediffError(f"drafter {path} has hidden size {cfg.hidden_size}, the target {tcfg.hidden_size}")
    if any(not 0 <= i < tcfg.num_hidden_layers for i in cfg.target_layer_ids):
        raise StatediffError(f"drafter {path} taps layers {cfg.target_layer_ids}; the target has "
                             f"{tcfg.num_hidden_layers}")
    model = AutoModel.from_pretrained(str(path), dtype=torch.bfloat16)
    return model.eval()


def drafter_digest(drafter: Any) -> str:
    """sha256 of the drafter's canonical config JSON (same rule as the target's config digest)."""
    return hashlib.sha256(json.dumps(drafter.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


class DFlashProposer:
    """One request's DFlash drafter: transformers' ``DFlashTokenCandidateGenerator``.

    A new proposer (and so a new ``DFlashCache``) per request. Call
    ``propose`` after each committed target step.

    Args:
        drafter: a loaded DFlash drafter (``load_drafter``).
        target: the target causal LM (its input embedding and ``lm_head`` are shared).
        max_length: longest sequence the candidate generator may draft into.
    """

    def __init__(self, drafter: Any, target: Any, max_length: int) -> None:
        from transformers import GenerationConfig
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

        self.layer_ids = list(drafter.config.target_layer_ids)
        self.num_speculative_tokens = int(drafter.config.block_size) - 1
        self.generator = DFlashTokenCandidateGenerator(
            drafter, target.get_input_embeddings(), target.get_output_embeddings(),
            GenerationConfig(max_length=max_length, do_sample=False), logits_processor=None)

    def propose(self, tokens: list[int], features: dict[int, torch.Tensor],
                accepted: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft the tokens after ``tokens``.

        Args:
            tokens: the request's tokens so far: ``n`` tokens the target has
                committed (features computed) plus the anchor (the target's
                last sampled token), ``n + 1`` in all.
            features: tapped layer id -> ``[1, m, hidden]``, the target
                features of the tokens committed since the previous call
                (all ``n`` on the first call; ``accepted + 1`` later).
            accepted: draft tokens the target accepted at the previous call (0 on the first).

        Returns:
            (draft token ids, ``num_speculative_tokens`` of them, or none when
            the sequence is at ``max_length``; the draft logits
            ``[num_speculative_tokens, vocab]`` in the target's dtype, or None).
        """
        from transformers.modeling_outputs import ModelOutput

        n = len(tokens) - 1
        hidden = tuple(features.get(i) for i in range(max(self.layer_ids) + 1))
        ids = torch.tensor([tokens], dtype=torch.long)
        kwargs = {"position_ids": torch.arange(n + 1)[None], "attention_mask": None}
        with torch.no_grad():
            cand, logits = self.generator.get_candidates(
                ids, kwargs, ModelOutput(hidden_states=hidden), is_first_iteration=False,
                n_last_matches=accepted)
        if logits is None:
            return [], None
        return [int(t) for t in cand[0, n + 1:]], logits[0]


def greedy_accepted(drafts: list[int], target_tokens: list[int]) -> int:
    """How many leading drafts the target's greedy tokens confirm.

    ``target_tokens[j]`` is the target's greedy token after the anchor and the
    first ``j`` drafts (``len(drafts) + 1`` of them).
    """
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]:
        a += 1
    return a


@dataclasses.dataclass
class Acceptance:
    """Per-request acceptance counters, as vLLM's ``SpecDecodingStats`` counts them.

    Every draft token the target confirmed counts, also one cut from the
    output by ``max_tokens`` or an end-of-sequence token.

    Attributes:
        num_speculative_tokens: drafts per call (K).
        num_drafts: draft calls verified.
        num_draft_tokens: draft tokens proposed.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_position: ``[K]``, how often draft position i was accepted.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def add(self, proposed: int, accepted: int) -> None:
        """Count one verified draft of ``proposed`` tokens of which the first ``accepted`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens per target step); None before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_json(self) -> dict:
        """The request record's ``acceptance`` (the fields ``vllm/spec_v1.py`` writes)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length}
