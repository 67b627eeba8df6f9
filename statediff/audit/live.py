"""Live audit: every restore of a serving engine checked as it happens, from digests alone.

``statediff audit TRACE`` checks a recorded run after the fact; under ``vllm serve`` the
plugin (``statediff_hooks.vllm.plugin``, ``STATEDIFF_LIVE_AUDIT=incidents.jsonl``) feeds the
same captured summaries to a ``LiveAuditor`` instead of a trace file. No tensor data and
no trace are kept: the auditor holds a ``LiveLedger`` (the last write into each cache
block, by layer and kind) and the token streams of running requests, and runs the
offline audit's checks (``checks.check_restore``, ``block_table_findings``,
``first_chunk_findings``, ``group_hit_findings``) at the end of every engine step.

At the first violation of a request: one line on the ``statediff`` logger and one JSON
line appended to the incident file (``incident``: request id, step, position, layer,
kind, what differed, the expected digest and who wrote it, the got digest, the
diagnosis, and the request's prompt as a digest and a length: ``prompt_digest``; its token ids
only with ``STATEDIFF_LIVE_AUDIT_PROMPTS=1``, an operator's choice, since they are users' data),
enough to find the request in a replay and rerun it with ``statediff record ... --focus``.

Memory bound: the ledger keeps one write per (layer, kind, physical block), replaced when
the block is written again (a block freed and reused for another prefix is overwritten
before anything can restore from it), so at most ``(2 x GDN layers + 2 x attention layers)
x cache blocks`` entries of about 0.5 KiB; plus, per running request, its token ids and
the prefix hashes of its block boundaries, dropped when it finishes. Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from statediff.trace.acceptance import AcceptanceFinding, RequestAcceptance, falls, per_request

from .checks import (Context, block_table_findings, check_restore, expected_write, first_chunk_findings,
                     group_hit_findings)
from .ledger import WRITE_ROLES, Ledger, Rec, rec_from_summary
from .result import Finding

__all__ = ["LIVE_ENV", "PROMPTS_ENV", "LiveAuditor", "LiveConfig", "LiveLedger", "MAX_INCIDENTS", "prompt_digest"]

#: The incident file (JSONL, appended to); setting it turns the live audit on.
LIVE_ENV = "STATEDIFF_LIVE_AUDIT"
#: "1": incidents carry the request's prompt token ids (default "0": its digest and length only).
PROMPTS_ENV = "STATEDIFF_LIVE_AUDIT_PROMPTS"
#: Incidents written per engine process; later ones are counted and logged once.
MAX_INCIDENTS = 1000
_RESTORED_FAMILIES = ("gdn.", "attn.")

log = logging.getLogger("statediff")


@dataclasses.dataclass(frozen=True)
class LiveConfig:
    """The live audit ``STATEDIFF_LIVE_AUDIT*`` asks for.

    Attributes:
        incidents: path of the JSONL incident file (appended to; created at the first incident).
        prompts: incidents carry the request's prompt token ids (else ``prompt_digest`` and the length).
    """

    incidents: str
    prompts: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LiveConfig | None":
        """The live audit ``env`` (default: this process's environment) asks for; None when
        ``STATEDIFF_LIVE_AUDIT`` is unset or empty.

        Raises:
            ValueError: one line: ``STATEDIFF_LIVE_AUDIT_PROMPTS`` not 0 or 1, the incident
                file's directory missing, the path a directory or another non-regular file
                (FIFO, device), not writable, or ``STATEDIFF_TRACE`` set too.
        """
        env = os.environ if env is None else env
        path = env.get(LIVE_ENV) or ""
        prompts = env.get(PROMPTS_ENV, "0")
        if not path:
            if env.get(PROMPTS_ENV):
                raise ValueError(f"{PROMPTS_ENV} is set but {LIVE_ENV} is not (name the incident file)")
            return None
        if prompts not in ("0", "1"):
            raise ValueError(f"{PROMPTS_ENV}={prompts!r}: expected 1 (incidents carry the prompt token ids) or 0 "
                             "(the default: a digest of the prompt and its length)")
        if env.get("STATEDIFF_TRACE"):
            raise ValueError(f"{LIVE_ENV} and STATEDIFF_TRACE are both set: audit live or record a trace, not both")
        p = Path(path)
        parent = p.parent if str(p.parent) else Path(".")
        if p.is_dir():
            raise ValueError(f"{LIVE_ENV}={path}: is a directory (name a file to append incidents to)")
        if not parent.is_dir():
            raise ValueError(f"{LIVE_ENV}={path}: directory {parent} does not exist")
        if p.exists() and not p.is_file():  # a FIFO would block the engine at the first incident
            raise ValueError(f"{LIVE_ENV}={path}: not a regular file (name a file to append incidents to)")
        if not os.access(p if p.exists() else parent, os.W_OK):
            raise ValueError(f"{LIVE_ENV}={path}: cannot be written (permissions)")
        return cls(incidents=path, prompts=prompts == "1")


def prompt_digest(token_ids: Any) -> str:
    """The digest an incident gives of a prompt (field ``prompt.digest``): BLAKE2b, 16 bytes, hex,
    of the token ids as little-endian int64, nothing else (no cache_salt). The same ids give the same
    digest in any process, so a replay's request is found by computing it over each prompt.

    Args:
        token_ids: a sequence of ints (any integer dtype).
    Returns:
        32 lowercase hex characters.
    """
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


class LiveLedger(Ledger):
    """``Ledger`` of a live engine: only the last write into each (layer, kind, block).

    ``put`` replaces the block's previous write (and its index entries), so the size is
    bounded by the cache's blocks, whatever the traffic.
    """

    def __init__(self) -> None:
        super().__init__([])

    def put(self, w: Rec) -> None:
        """Record ``w`` (a write with ``block >= 0``) as the last write into its block."""
        key = (w.layer, w.kind, w.block)
        old = self.by_block.get(key)
        if old:
            for o in old:
                _remove(self.by_key, (o.layer, o.kind, o.position, o.token_start), o)
                _remove(self.by_digest, (o.layer, o.kind, o.scheme, o.digest), o)
        self.by_block[key] = [w]
        self._steps[key] = [w.step]
        self.by_key[(w.layer, w.kind, w.position, w.token_start)].append(w)
        self.by_digest[(w.layer, w.kind, w.scheme, w.digest)].append(w)

    def __len__(self) -> int:
        return len(self.by_block)


def _remove(index: dict[tuple, list[Rec]], key: tuple, w: Rec) -> None:
    got = index.get(key)
    if got is None:
        return
    got[:] = [x for x in got if x is not w]
    if not got:
        del index[key]


class LiveContext(Context):
    """``checks.Context`` over running requests: prefixes compared by hash (a write's request
    may have finished long ago; its ``Rec.prefix`` remembers what it held)."""

    def __init__(self, run: dict[str, Any], auditor: "LiveAuditor") -> None:
        self.requests = auditor.requests
        self.ledger = LiveLedger()
        self._auditor = auditor
        self.read_layers(run)

    def same_prefix(self, r: Rec, w: Rec, n: int) -> bool:
        return bool(w.prefix) and n == w.position and w.prefix == self._auditor.prefix_of(r.request, n)


class LiveAuditor:
    """The sink a live ``Recorder`` writes to in place of a ``TraceWriter`` (same methods).

    Requests are numbered by the recorder; ``request_id`` is the engine's. Call
    ``extend_output`` with each request's sampled tokens (a decode-written block's prefix),
    ``end_step`` after every engine step (the checks run there, before the step's own writes
    join the ledger: a restore reads what earlier steps wrote).
    """

    def __init__(self, run: dict[str, Any], config: LiveConfig) -> None:
        self.run = dict(run)
        self.config = config
        self.requests: dict[int, dict[str, Any]] = {}
        self.tokens: dict[int, list[int]] = {}
        self._prefix: dict[tuple[int, int], str] = {}
        self._initial: dict[int, list[Rec]] = defaultdict(list)
        self._restores: list[Rec] = []
        self._writes: list[Rec] = []
        self._touched: set[int] = set()
        self._done: dict[int, set[str]] = defaultdict(set)
        self._reported: set[int] = set()
        self._pool = [0, 0, 0]  # drafts, drafted, accepted of finished requests without a hit
        self.ctx = LiveContext(self.run, self)
        self.stats = {"restores_checked": 0, "not_checkable": 0, "fields_checked": 0, "incidents": 0,
                      "incidents_dropped": 0}
        # by label, for the engine's metrics (statediff_hooks.vllm.metrics): check -> restores or
        # request fields checked / not checkable; (check, kind) -> violations reported (one per request)
        self.checked: Counter[str] = Counter()
        self.not_checkable: Counter[str] = Counter()
        self.violations: Counter[tuple[str, str]] = Counter()

    # -- the TraceWriter surface the Recorder uses ------------------------------

    def begin_request(self, index: int, request_id: str, prompt_token_ids: list[int], **fields: Any) -> None:
        prompt = [int(x) for x in prompt_token_ids]
        self.requests[index] = {**fields, "request_id": request_id, "prompt_token_ids": prompt}
        self.tokens[index] = list(prompt)
        self._touched.add(index)

    def update_request(self, index: int, **fields: Any) -> None:
        if index not in self.requests:
            return
        if "finished" in fields:  # nothing of it is checked any more: forget it (bounded memory)
            self._acceptance(index, fields.get("acceptance", self.requests[index].get("acceptance")))
            self._forget(index)
            return
        self.requests[index].update(fields)
        self._touched.add(index)

    def extend_output(self, index: int, tokens: list[int]) -> None:
        """Sampled tokens of request ``index`` (its stream grows: blocks written in decode)."""
        if index in self.tokens:
            self.tokens[index].extend(int(x) for x in tokens)

    def add_chunk(self, index: int, start: int, end: int) -> None:
        pass

    def has_request(self, index: int) -> bool:
        return index in self.requests

    def request_indices(self) -> list[int]:
        return list(self.requests)

    def request_field(self, index: int, key: str, default: Any = None) -> Any:
        return self.requests[index].get(key, default)

    def run_field(self, key: str, default: Any = None) -> Any:
        return self.run.get(key, default)

    def update_run(self, **fields: Any) -> None:
        self.run.update(fields)
        if "layers" in fields or "effective" in fields:
            self.ctx.read_layers(self.run)

    def add(self, array: Any, *, summary: Any, dtype: str = "", **key: Any) -> None:
        self._queue(summary, key)

    def add_digest(self, digest: Any, *, dtype: str = "", shape: tuple = (), **key: Any) -> None:
        if isinstance(digest, str):
            return  # a bare digest has no moments; the capture always gives a Summary
        self._queue(digest, key)

    def close(self) -> dict:
        """Stats of this process's audit (restores checked, incidents written, ledger size)."""
        return {**self.stats, "ledger_entries": len(self.ctx.ledger), "live": True}

    # -- the audit -------------------------------------------------------------

    def _queue(self, s: Any, key: dict[str, Any]) -> None:
        role, kind = key["role"], key["kind"]
        if role not in WRITE_ROLES and role not in ("resumed", "initial"):
            return
        ts = key.get("token_start")
        r = rec_from_summary(s, request=key["request"], position=key["position"],
                             token_start=key["position"] if ts is None else ts, layer=key["layer"], kind=kind,
                             role=role, module=key["module"], step=key.get("step", -1), block=key.get("block", -1))
        if role in WRITE_ROLES:
            if r.block >= 0:
                self._writes.append(r)
        elif role == "initial":
            self._initial[r.request].append(r)
        elif kind.startswith(_RESTORED_FAMILIES):
            self._restores.append(r)

    def end_step(self) -> None:
        """Check this step's restores and request fields, then add its writes to the ledger."""
        hit_step: dict[int, int] = {}
        for r in sorted(self._restores, key=lambda r: (r.request, r.position, r.layer, r.kind)):
            hit_step.setdefault(r.request, r.step)
            if r.request in self._reported or r.request not in self.requests:
                continue
            found, why = check_restore(self.ctx, r)
            self.stats["not_checkable" if why else "restores_checked"] += 1
            (self.not_checkable if why else self.checked)["state" if r.is_state else "kv"] += 1
            if found is not None:
                self._report(found, r)
        for idx in sorted(self._touched):
            if idx in self.requests and idx not in self._reported:
                self._check_fields(idx, hit_step)
        for w in self._writes:
            if w.request in self.requests:
                self.ctx.ledger.put(dataclasses.replace(w, prefix=self.prefix_of(w.request, w.position),
                                                        origin=self.requests[w.request]["request_id"]))
        self._restores, self._writes = [], []
        self._touched.clear()

    def _check_fields(self, idx: int, hit_step: dict[int, int]) -> None:
        rec, done = self.requests[idx], self._done[idx]
        found: list[Finding] = []
        all_requests, self.ctx.requests = self.ctx.requests, {idx: rec}
        try:
            if "hit_block_table" in rec and "block_table" not in done:
                done.add("block_table")
                got, n = block_table_findings(self.ctx, {idx: hit_step.get(idx, -1)})
                found += got
                self.stats["fields_checked"] += n
                self.checked["block_table"] += n
            if "first_chunk" in rec and "first_chunk" not in done:
                done.add("first_chunk")
                hits = {idx} if (rec.get("num_cached_tokens") or 0) > 0 else set()
                got, n = first_chunk_findings(self.ctx, self._initial.pop(idx, []), hits)
                found += got
                self.stats["fields_checked"] += n
                self.checked["first_chunk"] += n
            if "group_hit_tokens" in rec and "group_hit" not in done:
                done.add("group_hit")
                got, n = group_hit_findings(self.ctx, self.run)
                found += got
                self.stats["fields_checked"] += n
                self.checked["group_hit"] += n
        finally:
            self.ctx.requests = all_requests
        if found:
            self._report(min(found, key=lambda f: f.order), None)

    def prefix_of(self, index: int, n: int) -> str:
        """A hash of request ``index``'s first ``n`` tokens and its cache_salt; "" when unknown
        (not running, or fewer tokens known)."""
        got = self._prefix.get((index, n))
        if got is not None:
            return got
        toks = self.tokens.get(index)
        if toks is None or n > len(toks):
            return ""
        h = hashlib.blake2b(repr(self.requests[index].get("cache_salt")).encode(), digest_size=16)
        h.update(np.asarray(toks[:n], dtype=np.int64).tobytes())
        got = self._prefix[(index, n)] = h.hexdigest()
        return got

    def _acceptance(self, index: int, acc: Any) -> None:
        """A finished request's drafter acceptance: pooled when it had no prefix-cache hit; reported
        (check "acceptance") when it had one and its acceptance falls against that pool
        (``statediff.trace.acceptance``; three counters kept, whatever the traffic)."""
        got = per_request({index: {"acceptance": acc}}).get(index)
        hit = self.requests[index].get("num_cached_tokens") or 0
        if got is None:
            return
        if not hit:
            self._pool = [a + b for a, b in zip(self._pool, (got.drafts, got.drafted, got.accepted))]
        elif falls(got, pool := RequestAcceptance(*self._pool)):
            text = AcceptanceFinding(index, hit, got, pool, "the engine's requests without a hit").text()
            self._report(Finding("acceptance", index, hit, -1, "acceptance", "", -1,
                                 text.split(": ", 1)[1]), None)

    def _forget(self, index: int) -> None:
        for d in (self.requests, self.tokens, self._initial, self._done):
            d.pop(index, None)
        self._reported.discard(index)
        self._touched.discard(index)
        for key in [k for k in self._prefix if k[0] == index]:
            del self._prefix[key]

    def incident(self, f: Finding, r: Rec | None) -> dict[str, Any]:
        """The JSON object of finding ``f`` (``r``: the restored tensor, when the finding is one)."""
        rec = self.requests[f.request]
        out: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "request_id": rec["request_id"], "check": f.check, "step": f.step, "position": f.position,
            "layer": f.layer, "kind": f.kind, "module": f.module, "what": f.what, "diagnosis": f.diagnosis,
            "num_cached_tokens": rec.get("num_cached_tokens"), "cache_salt": rec.get("cache_salt"),
        }
        if r is not None:
            w = expected_write(self.ctx, r)[0]
            out["got"] = {"digest": r.digest, "block": r.block}
            out["expected"] = None if w is None else {
                "digest": w.digest, "request_id": w.origin, "step": w.step, "block": w.block,
                "position": w.position, "token_start": w.token_start}
        prompt = rec["prompt_token_ids"]
        out["prompt"] = {"digest": prompt_digest(prompt), "tokens": len(prompt)}
        if self.config.prompts:
            out["prompt_token_ids"] = prompt
        return out

    def _report(self, f: Finding, r: Rec | None) -> None:
        self._reported.add(f.request)
        self.violations[(f.check, f.kind)] += 1
        inc = self.incident(f, r)
        where = f"request {inc['request_id']} step {f.step} position {f.position} layer {f.layer} {f.kind}"
        line = f"live audit: {where}: {f.what}" + (f"; {f.diagnosis}" if f.diagnosis else "")
        if self.stats["incidents"] >= MAX_INCIDENTS:
            self.stats["incidents_dropped"] += 1
            if self.stats["incidents_dropped"] == 1:
                log.warning("statediff live audit: %d incidents written to %s; later ones are only counted",
                            MAX_INCIDENTS, self.config.incidents)
            return
        try:
            with open(self.config.incidents, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(inc, default=str) + "\n")
            self.stats["incidents"] += 1
            log.warning("statediff %s (incident appended to %s)", line, self.config.incidents)
        except OSError as e:
            log.warning("statediff %s (incident NOT written: %s)", line, e)
