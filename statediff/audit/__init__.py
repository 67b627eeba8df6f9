"""``statediff audit``: every restore of one run checked against what the same run saved.

A prefix-cache hit copies, and copies are exact; so one trace holds the
ground truth of its own restores (``checks``): a resumed state against the
checkpoint saved at that boundary, K/V read at a hit against what was
written into the allocated block, the runner's block table against the
scheduler's allocation, and the state a first chunk without a hit starts
from (zeros, whenever the kernel reads it). Everything is a digest comparison (``ledger``), so a
``--keep none`` trace is enough, whatever the chunking. ``audit_trace`` is a
plain function (``statediff check`` calls it); the CLI is ``statediff.cli.audit``.
"""

from __future__ import annotations

import dataclasses

import os

from statediff.trace.layers import drafter_index
from statediff.trace import Trace, open_trace

from statediff.trace.damage import DamageCheck

from .checks import (Context, block_table_findings, check_restore, expected_write, first_chunk_findings,
                     group_hit_findings)
from .ledger import rec_from
from .result import AuditResult, Finding

__all__ = ["AuditResult", "Finding", "audit_trace"]

#: Unchecked restores named in a result (all are counted).
MAX_UNCHECKED_LISTED = 5
_RESTORED_FAMILIES = ("gdn.", "attn.")


def audit_trace(trace: Trace | str | os.PathLike) -> AuditResult:
    """Audit every restore of one trace (a hit run) against what the same run saved.

    Args:
        trace: an open ``Trace`` (left open) or a path (opened and closed here).

    Returns:
        ``AuditResult``: findings in causal order (request, position, layer, kind),
        ``exit_code`` 1 with a finding, else 0.

    Raises:
        TraceError: the path is not a readable trace (``open_trace``).
    """
    if isinstance(trace, Trace):
        return _audit(trace)
    with open_trace(trace) as t:
        return _audit(t)


def _audit(t: Trace) -> AuditResult:
    entries = [*t.entries, *t.digests]
    recs = [rec_from(e) for e in entries]
    entry_of = {id(r): e for r, e in zip(recs, entries)}
    damage = DamageCheck()
    ctx = Context(t.run, t.requests, recs)
    restored = sorted((r for r in recs if r.role == "resumed" and r.kind.startswith(_RESTORED_FAMILIES)),
                      key=lambda r: (r.request, r.position, r.layer, r.kind))
    findings: list[Finding] = []
    unchecked: list[str] = []
    checked = {"state": 0, "kv": 0}
    hit_steps: dict[int, int] = {}
    for r in restored:
        hit_steps[r.request] = r.step if r.request not in hit_steps else min(hit_steps[r.request], r.step)
        found, why = check_restore(ctx, r)
        if why is not None:
            unchecked.append(why)
            continue
        checked["state" if r.is_state else "kv"] += 1
        if found is not None:
            findings.append(found)
            continue
        w = expected_write(ctx, r)[0]  # equal digests: is the data under them intact?
        if w is not None and id(w) in entry_of:
            damage.check_pair(t, entry_of[id(r)], t, entry_of[id(w)])
    table, rows = block_table_findings(ctx, hit_steps)
    checked["block_table"] = rows
    findings += table
    hits = {r.request for r in restored} | {i for i, rec in t.requests.items()
                                             if (rec.get("num_cached_tokens") or 0) > 0}
    first, checked["first_chunk"] = first_chunk_findings(ctx, [r for r in recs if r.role == "initial"], hits)
    findings += first
    groups, checked["group_hit"] = group_hit_findings(ctx, t.run)
    findings += groups
    # a restore in a layer of the drafter (MTP, EAGLE) is named as the drafter's (trace.layers)
    findings = [dataclasses.replace(f, drafter_layer=drafter_index(t.run, f.layer, f.kind)) for f in findings]
    return AuditResult(
        path=str(t.path), findings=tuple(sorted(findings, key=lambda f: f.order)), checked=checked,
        unchecked=tuple(unchecked[:MAX_UNCHECKED_LISTED]), unchecked_count=len(unchecked),
        hits=len(hits), requests=len(t.requests), incomplete=t.partial_reason if t.partial else "",
        warnings=tuple(damage.warnings()))


