"""Planted faults on vLLM's V1 runner: ``faults.RestoreTarget``s over vLLM 0.32 state.

What each fault does is ``hooks/recording/faults.py``; this module only reaches the
state, mirroring vLLM 0.32.0:

- GDN (``v1/worker/mamba_utils.py`` ``preprocess_mamba``, mamba cache mode
  ``align``): right after the restore copy, a hit request's running state
  slot ``block_ids[g][mamba_state_idx[req]]`` of each GDN layer's
  ``.kv_cache = (conv, ssm)`` is what the kernel reads (``GdnSlot``).
- Attention (``v1/worker/block_table.py``, ``gpu_model_runner.py``
  ``_prepare_inputs``): the kernel reads K/V through the runner's block
  table ``input_batch.block_table[g]``, whose host rows ``block_table.np``
  ``_update_states`` builds from the request's block ids and
  ``commit_block_table`` copies to the device at the start of
  ``_prepare_inputs``; slot mappings are computed from it next.
  ``BlockTableRow`` edits the host row *before* that commit, so the
  device table, this step's attention metadata and every later step of the
  request (the row persists in the persistent batch) read through the
  edited mapping, while KV memory and the scheduler's allocation
  (``NewRequestData.block_ids``, ``runner.requests[req].block_ids``) stay
  intact. One table serves every layer of a KV-cache group, so a KV fault
  affects all attention layers of that group.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .. import surface


class _Target:
    """A ``faults.RestoreTarget`` with none of the states: subclasses expose theirs."""

    def _none(self, what: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no {what}")

    def conv_state(self) -> torch.Tensor:
        return self._none("conv state")

    def ssm_state(self) -> torch.Tensor:
        return self._none("SSM state")

    def ssm_state_one_block_earlier(self) -> torch.Tensor | None:
        return self._none("SSM state")

    def remap_kv_blocks(self, mapping: dict[int, int]) -> None:
        self._none("KV blocks")

    def recycle_slot(self) -> bool:
        return self._none("first-chunk state slot")

    def drafter_rows(self) -> torch.Tensor:
        return self._none("drafter rows")

    def logits_row(self) -> torch.Tensor:
        return self._none("logits")


class GdnSlot(_Target):
    """``RestoreTarget`` of one GDN layer's running state slot after ``preprocess_mamba``.

    Args:
        conv, ssm: the layer's cache tensors ``[num_blocks, ...]``.
        slot: the physical block the kernel reads this step.
        earlier: the SSM state one block before the hit (``EarlierSsm.get``), or None.
    """

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, slot: int,
                 earlier: torch.Tensor | None) -> None:
        self.conv, self.ssm, self.slot, self.earlier = conv, ssm, slot, earlier

    def conv_state(self) -> torch.Tensor:
        return self.conv[self.slot]

    def ssm_state(self) -> torch.Tensor:
        return self.ssm[self.slot]

    def ssm_state_one_block_earlier(self) -> torch.Tensor | None:
        return self.earlier


class RecycledSlot(_Target):
    """``RestoreTarget`` of a first chunk without a hit, inside the forward (the recycled-slot fault).

    ``recycle_slot`` sets the row's ``has_initial_state`` in the layer's GDN metadata
    (``surface.set_prior_state``) and copies another request's state ``src`` (conv, ssm)
    into the slot the kernel reads (``v1/attention/backends/gdn_attn.py``, vLLM 0.32).

    Args:
        md: the layer's ``GDNAttentionMetadata`` of this forward; row: the request's batch row.
        conv, ssm: the layer's cache tensors; slot: the row's state slot.
        src: another request's (conv, ssm) state, or None (unknown: the fault waits).
    """

    def __init__(self, md: Any, row: int, conv: torch.Tensor, ssm: torch.Tensor, slot: int,
                 src: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.md, self.row, self.conv, self.ssm, self.slot, self.src = md, row, conv, ssm, slot, src

    def recycle_slot(self) -> bool:
        if self.src is None:
            return False
        surface.set_prior_state(self.md, self.row)
        self.conv[self.slot].copy_(self.src[0])
        self.ssm[self.slot].copy_(self.src[1])
        return True


class BlockTableRow(_Target):
    """``RestoreTarget`` of a hit request's row in the runner's block table of one KV-cache group.

    Must be used after ``_update_states`` and before ``commit_block_table``
    (the plugin's wrapper of ``GPUModelRunner._prepare_inputs``).
    """

    def __init__(self, runner: Any, group: int, req_id: str, cache: torch.Tensor | None = None,
                 own_group: bool = False) -> None:
        self.row = surface.host_block_row(runner, group, req_id)  # a view: edits reach the table
        self.cache = cache  # the layer's KV cache [num_blocks, ...] (drafter-kv-zero)
        self.own_group = own_group  # no target layer reads through this group's table

    def unwritten_kv_blocks(self, n: int) -> list[int] | None:
        """Point logical blocks ``0 .. n-1`` at the pool's last blocks: the block pool hands out
        free blocks from the front of its queue (``v1/core/block_pool.py``), so in a short run
        nothing is ever written there. None when a target layer shares this group's table."""
        if not self.own_group or self.cache is None:
            return None
        top = int(self.cache.shape[0]) - 1
        got = [top - j for j in range(n)]
        for j, b in enumerate(got):
            self.row[j] = b
        return got

    def zero_kv_blocks(self, blocks: range) -> None:
        for b in blocks:  # one physical block holds the layer's K and V of its tokens
            self.cache[int(self.row[b])].zero_()

    def remap_kv_blocks(self, mapping: dict[int, int]) -> None:
        before = {b: int(self.row[b]) for b in mapping.values()}
        for a, b in mapping.items():
            self.row[a] = before[b]


class FeatureRows(_Target):
    """``RestoreTarget`` of drafter-input rows ``feats[offset:offset + n]`` (``v1/spec.py``)."""

    def __init__(self, feats: torch.Tensor, offset: int, n: int) -> None:
        self.rows = feats[offset:offset + n]

    def drafter_rows(self) -> torch.Tensor:
        return self.rows


class LogitsRow(_Target):
    """``RestoreTarget`` of one request's row of the logits ``GPUModelRunner._sample`` receives.

    vLLM 0.32 ``gpu_model_runner.py``: without speculative decoding the
    logits are ``[num_reqs, vocab]`` in persistent-batch order (row
    ``input_batch.req_id_to_index[req_id]``); the sampler reads them next
    (logprobs are computed from these raw logits). Outside every captured
    state: the ``logits`` fault edits it.
    """

    def __init__(self, logits: torch.Tensor, row: int) -> None:
        self.row = logits[row]

    def logits_row(self) -> torch.Tensor:
        return self.row


def _prefix_key(tokens: list[int]) -> bytes:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=16).digest()


class EarlierSsm:
    """Copies of SSM checkpoints by (token prefix, layer), kept only for ``ssm-wrong-block``.

    The engine keeps only some checkpoint blocks (align mode frees the
    others, and the block pool is shared by all groups), so "the state one
    block earlier" must be kept by statediff. Cleared once the fault fired.
    """

    def __init__(self) -> None:
        self.states: dict[tuple[bytes, int], torch.Tensor] = {}

    def keep(self, tokens: list[int], layer: int, ssm_block: torch.Tensor) -> None:
        self.states[(_prefix_key(tokens), layer)] = ssm_block.clone()

    def get(self, tokens: list[int], layer: int) -> torch.Tensor | None:
        return self.states.get((_prefix_key(tokens), layer))

    def clear(self) -> None:
        self.states.clear()
