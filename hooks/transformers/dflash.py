"""DFlash drafters with transformers' own classes: loading one, and a proposer for one request.

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
  adapter (``statediff_hooks.transformers.adapter``), and this module only
  wraps the candidate generator's ``get_candidates`` (the drafter forward
  itself is transformers' code, unchanged).

A tiny random DFlash drafter for tests is built by ``statediff_hooks.tiny.draft``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from statediff.errors import StatediffError
from ..tiny.draft import DFLASH_MODEL_TYPE as MODEL_TYPE

__all__ = ["MODEL_TYPE", "DFlashProposer", "greedy_accepted", "load_drafter"]


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
