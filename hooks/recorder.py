"""Engine-neutral recorder: torch tensors in, trace records out.

Engine adapters (``statediff_hooks.vllm.v1``, ``statediff_hooks.transformers``)
decide *what* to read and *when*; this module owns the request numbering,
the summary of every tensor (computed on its device, ``digest.summarize_rows``),
the keep policy (``keep.py``: which tensors also keep their data), the host
copy of those and the hand-off to ``statediff.trace``.
Configuration comes from environment variables so that it reaches vLLM
worker processes unchanged (``RecorderConfig.from_env``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from statediff.replay.hits import HIDDEN_STATE_DRAFTERS, HitLedger
from statediff.trace import TraceWriter

from .digest import summarize_rows
from .faults import FaultSpec, parse_fault
from .keep import KeepPolicy, KeepSpec

# torch dtype -> (logical name, dtype to view as before .numpy())
_TORCH_DTYPES: dict[torch.dtype, tuple[str, torch.dtype]] = {
    torch.float32: ("float32", torch.float32),
    torch.float16: ("float16", torch.float16),
    torch.bfloat16: ("bfloat16", torch.uint16),
    torch.float64: ("float64", torch.float64),
    torch.int64: ("int64", torch.int64),
    torch.int32: ("int32", torch.int32),
    torch.int8: ("int8", torch.int8),
    torch.uint8: ("uint8", torch.uint8),
    torch.bool: ("bool", torch.uint8),
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = (_name, torch.uint8)

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def layer_index(module_name: str) -> int:
    """Decoder layer number in a module name ("model.layers.3.linear_attn" -> 3), -1 if none."""
    m = _LAYER_RE.search(module_name)
    return int(m.group(1)) if m else -1


def logical_dtype(dtype: torch.dtype) -> str:
    """Trace name of a torch dtype ("bfloat16", ...).

    Raises:
        TypeError: a dtype the trace format has no storage form for.
    """
    try:
        return _TORCH_DTYPES[dtype][0]
    except KeyError:
        raise TypeError(f"statediff cannot store tensors of dtype {dtype}") from None


def to_host(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Copy a tensor to host memory in its trace storage form.

    Returns:
        (array, logical dtype): bf16 as uint16 bit patterns, fp8 as uint8;
        the bytes are the engine's, so the round trip is bit-exact.

    Raises:
        TypeError: a dtype the trace format has no storage form for.
    """
    try:
        logical, view = _TORCH_DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"statediff cannot store tensors of dtype {t.dtype}") from None
    host = t.detach().to("cpu", copy=True).contiguous()
    if view is not t.dtype:
        host = host.view(view)
    return host.numpy(), logical


@dataclasses.dataclass
class RecorderConfig:
    """What to record, read from ``STATEDIFF_*`` environment variables.

    STATEDIFF_TRACE: trace path (recording is off when unset).
    STATEDIFF_MODE: "hit" or "cold" (how the run was driven; metadata).
    STATEDIFF_REPLAY: "default" or "exact" (chunking policy; metadata).
    STATEDIFF_KV: "all" (every completed K/V block, default) or "none" (no K/V captured at all).
    STATEDIFF_KEEP: which captured tensors keep their data: "hits" (default), "all",
        "none" or a byte budget in bytes (``keep.KeepSpec``); every one gets a summary.
    STATEDIFF_FOCUS: a focused re-record, JSON ``{"request": R, "position": P, "layers": [..] | null}``.
    STATEDIFF_FAULT: planted-fault spec (see ``faults.parse_fault``).
    STATEDIFF_RUN_JSON: extra run metadata (JSON object) from the front end.
    STATEDIFF_OVERWRITE: "1" to replace an existing trace.
    STATEDIFF_ACTIVATIONS: "1" for eager-mode hidden-state hooks (perturbs numerics).
    """

    trace: str
    mode: str | None = None
    replay: str | None = None
    kv: str = "all"
    fault: FaultSpec | None = None
    run_extra: dict = dataclasses.field(default_factory=dict)
    overwrite: bool = False
    activations: bool = False
    keep: KeepSpec = dataclasses.field(default_factory=KeepSpec)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RecorderConfig | None":
        env = os.environ if env is None else env
        trace = env.get("STATEDIFF_TRACE")
        if not trace:
            return None
        kv = env.get("STATEDIFF_KV", "all")
        if kv not in ("all", "none"):
            raise ValueError(f"STATEDIFF_KV={kv!r}: expected 'all' or 'none'")
        extra = json.loads(env.get("STATEDIFF_RUN_JSON") or "{}")
        keep = KeepSpec.from_env(env)
        return cls(
            trace=trace,
            mode=env.get("STATEDIFF_MODE") or None,
            replay=env.get("STATEDIFF_REPLAY") or None,
            kv=kv,
            fault=parse_fault(env.get("STATEDIFF_FAULT") or ""),
            run_extra=extra if isinstance(extra, dict) else {},
            overwrite=env.get("STATEDIFF_OVERWRITE") == "1",
            activations=env.get("STATEDIFF_ACTIVATIONS") == "1",
            keep=keep,
        )

    def to_env(self) -> dict[str, str]:
        """The environment that makes ``from_env`` return this config."""
        env = {"STATEDIFF_TRACE": self.trace, "STATEDIFF_KV": self.kv,
               "STATEDIFF_RUN_JSON": json.dumps(self.run_extra, default=str)}
        if self.mode:
            env["STATEDIFF_MODE"] = self.mode
        if self.replay:
            env["STATEDIFF_REPLAY"] = self.replay
        if self.fault:
            env["STATEDIFF_FAULT"] = self.fault.spec
        if self.overwrite:
            env["STATEDIFF_OVERWRITE"] = "1"
        if self.activations:
            env["STATEDIFF_ACTIVATIONS"] = "1"
        env.update(self.keep.to_env())
        return env


class Recorder:
    """Numbers requests in order of first scheduling and writes their tensors.

    The request index (0, 1, ...) is the alignment id: a replay sends
    requests one at a time in file order, so hit and cold runs number them
    identically even though the engine's request ids differ.

    Every tensor gets a summary (a ``/digests`` row); the keep policy
    (``config.keep``, ``keep.KeepPolicy``) decides which also keep their
    data. Run metadata ``keep`` (written at ``close``): the policy and what
    it kept (``KeepPolicy.to_json``).
    """

    def __init__(self, config: RecorderConfig, run: dict[str, Any]) -> None:
        self.config = config
        meta = dict(run) | dict(config.run_extra)
        meta.update(mode=config.mode or meta.get("mode"), replay=config.replay or meta.get("replay"),
                    fault=None, capture={"kv": config.kv, "activations": config.activations})
        if meta.get("mode") == "cold":
            meta["cold_policy"] = meta.get("cold_policy") or "cache_salt"
        self.writer = TraceWriter(config.trace, meta, overwrite=config.overwrite)
        self.index: dict[str, int] = {}
        self.step = 0
        self.closed = False
        # hit accounting (statediff/replay/hits.py): the hit a perfect prefix cache could give
        bs = self.writer.run.get("block_size")
        self.hits = HitLedger(bs) if isinstance(bs, int) and bs > 0 else None
        self._hits_running: set[int] = set()  # requests whose sampled tokens are not in the ledger yet
        self.keep = KeepPolicy(config.keep, bs if isinstance(bs, int) else None)
        # vLLM drops the last matched block of a hit for these drafters: the hit run resumes a
        # block before the expected hit, so both runs also anchor there
        self._drop_block = meta.get("speculative_method") in HIDDEN_STATE_DRAFTERS

    def begin_request(self, engine_id: str, prompt_token_ids: list[int], **fields: Any) -> int:
        """Register a newly scheduled request; returns its index.

        Also records ``expected_hit_tokens`` / ``expected_hit_source``: the
        longest prefix (whole blocks) it shares with the prompts and sampled
        tokens of earlier requests that finished before it began. The keep
        policy's anchors of the request: ``num_cached_tokens`` (a field the
        adapter gives), the expected hit and its align-mode value (and each
        minus one block with a drafter that drops the last matched block).
        """
        idx = len(self.index)
        self.index[engine_id] = idx
        anchors = [fields.get("num_cached_tokens")]
        if self.hits is not None:
            for j in sorted(self._hits_running):
                rec = self.writer.requests[j]
                if rec.get("finished"):
                    self.hits.add(j, rec["prompt_token_ids"], rec.get("output_token_ids") or [])
                    self._hits_running.discard(j)
            exp = self.hits.expect(prompt_token_ids)
            fields = {"expected_hit_tokens": exp.tokens, "expected_hit_source": exp.source} | fields
            anchors += [exp.tokens, exp.align]
            if self._drop_block:
                anchors += [exp.tokens - self.hits.block_size, exp.align - self.hits.block_size]
        self.keep.begin_request(idx, anchors)
        self.writer.begin_request(idx, engine_id, prompt_token_ids, **fields)
        if self.hits is not None:
            self.hits.add(idx, prompt_token_ids)
            self._hits_running.add(idx)
        return idx

    def tensor(self, t: torch.Tensor, *, request: int, position: int, layer: int, kind: str,
               role: str, module: str, token_start: int | None = None, block: int = -1,
               copy: bool = False) -> None:
        """Summarize ``t`` on its device and queue it, with its data when the keep policy keeps it.

        The data is copied to host now (the engine may overwrite it next
        step). ``copy``: a tensor another request recorded already (see
        ``KeepPolicy.keep``). Raises TypeError for a dtype the trace cannot store.
        """
        self.tensors(t.unsqueeze(0), [dict(request=request, position=position, layer=layer, kind=kind,
                                            role=role, module=module, token_start=token_start,
                                            block=block, copy=copy)])

    def tensors(self, x: torch.Tensor, keys: Sequence[Mapping[str, Any]]) -> None:
        """Queue each row ``x[b]`` under ``keys[b]``: one summary pass over the batch on the device
        (``digest.summarize_rows``: one device-to-host transfer) and one gather and host copy of
        the rows the keep policy keeps.

        Args:
            x: ``[B, ...]`` on any device, a dtype the trace can store.
            keys: ``B`` mappings with the keyword arguments of ``tensor``
                (request, position, layer, kind, role, module; token_start, block, copy optional).

        Raises:
            ValueError: ``len(keys) != B``.
            TypeError: a dtype the trace format has no storage form for.
        """
        if len(keys) != x.shape[0]:
            raise ValueError(f"{len(keys)} keys for {x.shape[0]} rows")
        logical = logical_dtype(x.dtype)
        sums = summarize_rows(x)
        shape = tuple(x.shape[1:])
        nbytes = int(x[0].numel() * x.element_size()) if len(keys) else 0
        kept = [self.keep.keep(request=k["request"], position=k["position"], layer=k["layer"], kind=k["kind"],
                               role=k["role"], token_start=k.get("token_start"), nbytes=nbytes,
                               copy=bool(k.get("copy"))) for k in keys]
        rows = [b for b, ok in enumerate(kept) if ok]
        host = None
        if rows:  # one gather and one transfer for the kept rows
            sel = x if len(rows) == len(keys) else x.index_select(0, torch.tensor(rows, device=x.device))
            host, _ = to_host(sel)
        where = {b: i for i, b in enumerate(rows)}
        for b, k in enumerate(keys):
            common = dict(request=k["request"], position=k["position"], layer=k["layer"], kind=k["kind"],
                          role=k["role"], module=k["module"], token_start=k.get("token_start"),
                          step=self.step, block=k.get("block", -1))
            if kept[b]:
                self.writer.add(host[where[b]], dtype=logical, summary=sums[b], **common)
            else:
                self.writer.add_digest(sums[b], dtype=logical, shape=shape, **common)

    def end_step(self) -> None:
        self.writer.end_step()
        self.step += 1

    def note_fault(self, **where: Any) -> None:
        """Record where the planted fault was applied (run metadata ``fault``)."""
        assert self.config.fault is not None
        self.writer.update_run(fault={"spec": self.config.fault.spec, **where})

    def close(self) -> dict:
        """Finish the trace file (run metadata ``keep`` first); safe to call twice."""
        if self.closed:
            return {}
        self.closed = True
        for idx, rec in self.writer.requests.items():
            if not rec.get("finished"):
                self.writer.update_request(idx)
        self.writer.update_run(keep=self.keep.to_json())
        return self.writer.close()
