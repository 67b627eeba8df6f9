"""Engine-neutral recorder: torch tensors in, trace records out.

Engine adapters (``statediff_hooks.vllm.v1``, ``statediff_hooks.transformers``)
decide *what* to read and *when*; this module owns the request numbering,
the host copy of each tensor and the hand-off to ``statediff.trace``.
Configuration comes from environment variables so that it reaches vLLM
worker processes unchanged (``RecorderConfig.from_env``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import numpy as np
import torch

from statediff.replay.hits import HitLedger
from statediff.trace import TraceWriter

from .faults import FaultSpec, parse_fault

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
    STATEDIFF_KV: "all" (every completed K/V block, default) or "none".
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
        return cls(
            trace=trace,
            mode=env.get("STATEDIFF_MODE") or None,
            replay=env.get("STATEDIFF_REPLAY") or None,
            kv=kv,
            fault=parse_fault(env.get("STATEDIFF_FAULT") or ""),
            run_extra=extra if isinstance(extra, dict) else {},
            overwrite=env.get("STATEDIFF_OVERWRITE") == "1",
            activations=env.get("STATEDIFF_ACTIVATIONS") == "1",
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
        return env


class Recorder:
    """Numbers requests in order of first scheduling and writes their tensors.

    The request index (0, 1, ...) is the alignment id: a replay sends
    requests one at a time in file order, so hit and cold runs number them
    identically even though the engine's request ids differ.
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

    def begin_request(self, engine_id: str, prompt_token_ids: list[int], **fields: Any) -> int:
        """Register a newly scheduled request; returns its index.

        Also records ``expected_hit_tokens`` / ``expected_hit_source``: the
        longest prefix (whole blocks) it shares with the prompts and sampled
        tokens of earlier requests that finished before it began.
        """
        idx = len(self.index)
        self.index[engine_id] = idx
        if self.hits is not None:
            for j in sorted(self._hits_running):
                rec = self.writer.requests[j]
                if rec.get("finished"):
                    self.hits.add(j, rec["prompt_token_ids"], rec.get("output_token_ids") or [])
                    self._hits_running.discard(j)
            exp = self.hits.expect(prompt_token_ids)
            fields = {"expected_hit_tokens": exp.tokens, "expected_hit_source": exp.source} | fields
        self.writer.begin_request(idx, engine_id, prompt_token_ids, **fields)
        if self.hits is not None:
            self.hits.add(idx, prompt_token_ids)
            self._hits_running.add(idx)
        return idx

    def tensor(self, t: torch.Tensor, *, request: int, position: int, layer: int, kind: str,
               role: str, module: str, token_start: int | None = None, block: int = -1) -> None:
        """Copy ``t`` to host now (the engine may overwrite it next step) and queue it."""
        arr, logical = to_host(t)
        self.writer.add(arr, request=request, position=position, layer=layer, kind=kind,
                        role=role, module=module, dtype=logical, token_start=token_start,
                        step=self.step, block=block)

    def digest(self, digest: str, t: torch.Tensor, *, request: int, position: int, layer: int,
               kind: str, role: str, module: str, token_start: int | None = None,
               block: int = -1) -> None:
        """Queue a digest-only record of ``t`` (a ``/digests`` row; nothing is copied to host).

        ``digest`` is ``statediff_hooks.digest`` of ``t``, computed by the
        caller on the device (batched); ``t`` gives the dtype and shape.
        """
        self.writer.add_digest(digest, request=request, position=position, layer=layer, kind=kind,
                               role=role, module=module, dtype=logical_dtype(t.dtype),
                               shape=tuple(t.shape), token_start=token_start, step=self.step,
                               block=block)

    def end_step(self) -> None:
        self.writer.end_step()
        self.step += 1

    def note_fault(self, **where: Any) -> None:
        """Record where the planted fault was applied (run metadata ``fault``)."""
        assert self.config.fault is not None
        self.writer.update_run(fault={"spec": self.config.fault.spec, **where})

    def close(self) -> dict:
        """Finish the trace file; safe to call twice."""
        if self.closed:
            return {}
        self.closed = True
        for idx, rec in self.writer.requests.items():
            if not rec.get("finished"):
                self.writer.update_request(idx)
        return self.writer.close()
