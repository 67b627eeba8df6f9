"""Engine-neutral recorder: torch tensors in, trace records out.

Engine adapters (``statediff_hooks.vllm.v1.capture``, ``statediff_hooks.transformers``)
decide *what* to read and *when*; this module owns the request numbering,
the summary of every tensor (computed on its device, ``digest.summarize_rows``),
the keep policy (``keep.py``: which tensors also keep their data), the host
copy of those and the hand-off to ``statediff.trace``.
Configuration comes from environment variables so that it reaches vLLM
worker processes unchanged (``config.RecorderConfig.from_env``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from statediff.audit.live import LiveAuditor
from statediff.replay.hits import HitLedger, drops_last_block, hash_lookahead
from statediff.trace import TraceWriter

from .digest import summarize_rows
from .keep import KeepPolicy
from .config import RecorderConfig

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


class Recorder:
    """Numbers requests in order of first scheduling and writes their tensors.

    The request index (0, 1, ...) is the alignment id: a replay sends
    requests one at a time in file order, so hit and cold runs number them
    identically even though the engine's request ids differ. A concurrent
    replay (run field ``concurrency`` N) sends request i of N copies in one
    batch: request ``i * N + k`` is copy k's, with a hit ledger per copy.

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
        # a concurrent replay (run field concurrency N: request i*N + k is copy k's, each copy with its own
        # cache_salt, so copies never share blocks): in effective too, and one hit ledger per copy
        self.copies = meta.get("concurrency") if isinstance(meta.get("concurrency"), int) else 1
        if self.copies > 1 and isinstance(meta.get("effective"), dict):
            meta["effective"] = {**meta["effective"], "concurrency": self.copies}
        # a live audit (STATEDIFF_LIVE_AUDIT, statediff/audit/live.py) takes the writer's place: no trace
        self.live = config.live is not None
        self._writer = (LiveAuditor(meta, config.live) if config.live is not None
                        else TraceWriter(config.trace, meta, overwrite=config.overwrite))
        self.index: dict[str, int] = {}
        self._count = 0  # requests begun (a live audit forgets finished ones from ``index``)
        self.step = 0
        self.closed = False
        # hit accounting (statediff/replay/hits.py): the hit a perfect prefix cache could give
        bs = self._writer.run_field("block_size")
        self._ledgers = ([HitLedger(bs, hash_lookahead(meta)) for _ in range(max(self.copies, 1))]
                         if isinstance(bs, int) and bs > 0 and not self.live else None)
        self._hits_running: set[int] = set()  # requests whose sampled tokens are not in the ledger yet
        self.keep = KeepPolicy(config.keep, bs if isinstance(bs, int) else None)
        # vLLM drops the last matched block of a hit for these drafters: the hit run resumes a
        # block before the expected hit, so both runs also anchor there
        self._drop_block = drops_last_block(meta)

    def begin_request(self, engine_id: str, prompt_token_ids: list[int], **fields: Any) -> int:
        """Register a newly scheduled request; returns its index.

        Also records ``expected_hit_tokens`` / ``expected_hit_source``: the
        longest prefix (whole blocks) it shares with the prompts and sampled
        tokens of earlier requests that finished before it began. The keep
        policy's anchors of the request: ``num_cached_tokens`` (a field the
        adapter gives), the expected hit and its align-mode value (and each
        minus one block with a drafter that drops the last matched block).
        """
        idx = self._count
        self._count += 1
        self.index[engine_id] = idx
        anchors = [fields.get("num_cached_tokens")]
        hits = self._ledger(idx)
        if hits is not None:
            for j in sorted(self._hits_running):
                if self._writer.request_field(j, "finished"):
                    self._ledger(j).add(j, self._writer.request_field(j, "prompt_token_ids"),
                                        self._writer.request_field(j, "output_token_ids") or [])
                    self._hits_running.discard(j)
            exp = hits.expect(prompt_token_ids)
            fields = {"expected_hit_tokens": exp.tokens, "expected_hit_source": exp.source} | fields
            anchors += [exp.tokens, exp.align]
            if self._drop_block:
                anchors += [exp.tokens - hits.block_size, exp.align - hits.block_size]
        if not self.live:  # nothing is kept live: no anchors to remember
            self.keep.begin_request(idx, anchors)
        self._writer.begin_request(idx, engine_id, prompt_token_ids, **fields)
        if hits is not None:
            hits.add(idx, prompt_token_ids)
            self._hits_running.add(idx)
        return idx

    def _ledger(self, idx: int) -> HitLedger | None:
        """The hit ledger of request ``idx``'s copy (None: the block size is unknown)."""
        return None if self._ledgers is None else self._ledgers[idx % len(self._ledgers)]

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

    def tensors(self, x: torch.Tensor, keys: Sequence[Mapping[str, Any]]) -> list:
        """Queue each row ``x[b]`` under ``keys[b]``: one summary pass over the batch on the device
        (``digest.summarize_rows``: one device-to-host transfer) and one gather and host copy of
        the rows the keep policy keeps.

        Args:
            x: ``[B, ...]`` on any device, a dtype the trace can store.
            keys: ``B`` mappings with the keyword arguments of ``tensor``
                (request, position, layer, kind, role, module; token_start, block, copy optional).

        Returns:
            the ``B`` summaries (``statediff.trace.summary.Summary``).

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
                self._writer.add(host[where[b]], dtype=logical, summary=sums[b], **common)
            else:
                self._writer.add_digest(sums[b], dtype=logical, shape=shape, **common)
        return sums

    def known(self, summary: Any, **key: Any) -> None:
        """Live audit only: queue a tensor whose ``Summary`` was computed this step already (the
        same physical block read by another request); ``key`` as ``tensor``'s keywords.

        Raises:
            RuntimeError: not a live audit (a trace would need the tensor's dtype, shape and data).
        """
        if not self.live:
            raise RuntimeError("Recorder.known is for a live audit only")
        self._writer.add_digest(summary, step=self.step, **key)

    # -- request and run records (adapters use these, never the writer) -------

    def add_chunk(self, request: int, start: int, end: int) -> None:
        """Request ``request`` computed tokens ``[start, end)`` in the step now ending."""
        self._writer.add_chunk(request, start, end)

    def set_request(self, request: int, **fields: Any) -> None:
        """Set fields of a recorded request (``docs/trace-format.md``, request records).

        Raises:
            KeyError: ``request`` was never begun (``begin_request``).
            ValueError: a documented field has the wrong type.
        """
        if self.live and "finished" in fields and self._writer.has_request(request):
            self.index.pop(self._writer.request_field(request, "request_id"), None)  # bounded under serve
        self._writer.update_request(request, **fields)

    def output_tokens(self, request: int, tokens: Any) -> None:
        """Tokens request ``request`` sampled this step (a live audit's token streams; a trace
        gets them at the end, as ``output_token_ids``)."""
        if self.live:
            self._writer.extend_output(request, [int(x) for x in tokens])

    def set_run(self, **fields: Any) -> None:
        """Merge fields into the run metadata (``/run``).

        Raises:
            ValueError: a documented field has the wrong type.
        """
        self._writer.update_run(**fields)

    def has_request(self, request: int) -> bool:
        """Whether request ``request`` has been begun in this recording."""
        return self._writer.has_request(request)

    def request_field(self, request: int, key: str, default: Any = None) -> Any:
        """A field of request ``request`` as recorded so far (a copy).

        Raises:
            KeyError: ``request`` was never begun.
        """
        return self._writer.request_field(request, key, default)

    def run_field(self, key: str, default: Any = None) -> Any:
        """A run-metadata field as recorded so far (a copy)."""
        return self._writer.run_field(key, default)

    @property
    def auditor(self) -> LiveAuditor | None:
        """The live audit this recorder feeds (None when it writes a trace)."""
        return self._writer if self.live else None

    def end_step(self) -> None:
        self._writer.end_step()
        self.step += 1

    def note_fault(self, **where: Any) -> None:
        """Record where the planted fault was applied (run metadata ``fault``)."""
        assert self.config.fault is not None
        self.set_run(fault={"spec": self.config.fault.spec, **where})

    def close(self) -> dict:
        """Finish the trace file (run metadata ``keep`` first); safe to call twice.
        A live audit: its stats (``LiveAuditor.close``)."""
        if self.closed:
            return {}
        self.closed = True
        if self.live:
            return self._writer.close()
        for idx in self._writer.request_indices():
            if not self._writer.request_field(idx, "finished"):
                self._writer.update_request(idx)
        self._writer.update_run(keep=self.keep.to_json())
        return self._writer.close()
