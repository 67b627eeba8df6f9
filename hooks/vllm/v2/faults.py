"""Planted faults on Model Runner V2: ``faults.RestoreTarget``s over vLLM 0.32 V2 state.

What each fault does is ``hooks/faults.py``; this module reaches V2's state,
mirroring vLLM 0.32.0 (``v2/surface.py`` names the reads):

- GDN (``v1/worker/gpu/model_states/mamba_hybrid.py`` ``preprocess_state``,
  mamba cache mode ``align``): right after the restore copy, a hit request's
  running state block ``block_tables[g].gpu[slot, _mamba_state_idx_gpu[slot]]``
  of each GDN layer's ``.kv_cache = (conv, ssm)`` is what the kernels read; the
  V1 target ``GdnSlot`` (``hooks/vllm/v1/faults.py``) edits that block (V2 has no
  host copy in between).
- Attention (``v1/worker/gpu/block_table.py``): V2 keeps no host block rows;
  the request's row of ``block_tables[g].gpu`` (by request slot, on the device)
  is what ``GPUModelRunner.prepare_attn`` computes the slot mappings from and
  gathers into the batch-ordered tables the attention kernels read.
  ``DeviceBlockTableRow`` edits that row *before* ``prepare_attn``: this step's
  tables and slot mappings, and every later step of the request (the row is
  written again only for new blocks, ``append_block_ids(overwrite=False)``),
  read through the edited mapping, while KV memory and the scheduler's
  allocation stay intact. One table serves every layer of a KV-cache group.
"""

from __future__ import annotations

from typing import Any

import torch

from ..v1.faults import BlockTableRow, _Target
from . import surface as v2


class DeviceBlockTableRow(BlockTableRow):
    """``RestoreTarget`` of a hit request's row in V2's device block table of one KV-cache group:
    V1's ``BlockTableRow`` edits (zero, remap, unwritten blocks) on V2's row.

    Must be used before ``GPUModelRunner.prepare_attn`` of the request's first step (the plugin's
    wrapper of it). ``cache``: the layer's KV cache ``[num_blocks, ...]`` (``drafter-kv-zero``);
    ``own_group``: no target layer reads through this group's table (``drafter-kv-unwritten``).

    Raises:
        KeyError: the request has no slot.
    """

    def __init__(self, runner: Any, group: int, req_id: str, cache: torch.Tensor | None = None,
                 own_group: bool = False) -> None:  # noqa: super().__init__ reads V1's host rows
        slot = v2.request_slot(runner, req_id)
        if slot is None:
            raise KeyError(req_id)
        self.row = v2.block_table(runner, group)[slot]  # a view of the device table
        self.cache = cache
        self.own_group = own_group
