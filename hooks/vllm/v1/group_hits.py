"""Each KV-cache group's final prefix-cache hit, read where vLLM 0.32's scheduler decides it.

Mirrors ``v1/core/kv_cache_manager.py`` (vLLM 0.32.0):
``KVCacheManager.get_computed_blocks(request) -> (KVCacheBlocks, num_computed_tokens,
shared_prefix_boundary)``, where ``KVCacheBlocks.blocks[g]`` is group ``g``'s hit
blocks after the coordinator's cut-backs and the drafter's last-block drop
(``v1/core/kv_cache_coordinator.py`` ``find_longest_cache_hit``; mamba groups in
align mode pad their list with null blocks up to the hit). So group ``g``'s final
hit is ``len(blocks[g]) * block_size_g`` tokens, and in a correct engine every
group's equals ``num_computed_tokens``. (Intermediate lengths inside
``find_longest_cache_hit`` differ legitimately; only these final ones are kept.)

The scheduler runs in the engine-core process; the capture reads ``GROUP_HITS``
in the runner's. In one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how
``statediff record`` runs) it is the same dict; otherwise the runner finds
nothing and the request field is not written. A request's lookup may repeat
(it waits for blocks); the last one wins, and the runner pops it when the
request is first scheduled.
"""

from __future__ import annotations

import functools
from typing import Any

#: request id -> final hit per KV-cache group (tokens), from the last lookup.
GROUP_HITS: dict[str, list[int]] = {}
#: request id -> the group the ``group-shortfall`` fault cut (read by the capture, which notes the fault).
SHORTFALL: dict[str, int] = {}
_fault_state = {"armed": None}
_MAX_PENDING = 4096  # lookups of requests never scheduled (aborted) are dropped past this


def group_hit_tokens(manager: Any, blocks: Any) -> list[int]:
    """Tokens each group's hit blocks cover: ``len(blocks.blocks[g]) * kv_cache_groups[g].kv_cache_spec
    .block_size`` (``manager``: the ``KVCacheManager``)."""
    groups = manager.kv_cache_config.kv_cache_groups
    return [len(b) * int(g.kv_cache_spec.block_size) for b, g in zip(blocks.blocks, groups)]


def wrap_get_computed_blocks(orig: Any) -> Any:
    """Wrapper factory (``plugin``) of ``KVCacheManager.get_computed_blocks``: notes each group's final hit."""
    @functools.wraps(orig)
    def get_computed_blocks(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        out = orig(self, request, *a, **kw)
        try:
            _plant_shortfall(self, request, out[0])
            if len(GROUP_HITS) >= _MAX_PENDING:
                GROUP_HITS.clear()
            GROUP_HITS[request.request_id] = group_hit_tokens(self, out[0])
        except Exception:  # noqa: BLE001 - a reading error never stops the scheduler
            pass
        return out
    return get_computed_blocks


def _armed() -> bool:
    """The ``group-shortfall`` fault is asked for (``STATEDIFF_FAULT``) and has not fired yet."""
    if _fault_state["armed"] is None:
        import os

        from ...recording.faults import parse_fault

        try:
            spec = parse_fault(os.environ.get("STATEDIFF_FAULT") or "")
        except ValueError:
            spec = None
        _fault_state["armed"] = spec is not None and spec.name == "group-shortfall"
    return bool(_fault_state["armed"])


def _plant_shortfall(manager: Any, request: Any, blocks: Any) -> None:
    """The ``group-shortfall`` fault: at the first hit of at least 2 blocks, drop the last block of the
    first full-attention group's hit (vLLM 0.32 ``KVCacheBlocks.blocks[g]``, a list), as a coordinator
    that failed to cut the other groups back would leave it."""
    if not _armed():
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for g, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, FullAttentionSpec) and len(blocks.blocks[g]) >= 2:
            del blocks.blocks[g][-1]
            SHORTFALL[request.request_id] = g
            _fault_state["armed"] = False
            return
