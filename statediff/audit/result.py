"""The audit's records: one ``Finding`` per violated restore, and the ``AuditResult`` of a trace."""

from __future__ import annotations

import dataclasses
from typing import Any

from statediff.trace.layers import layer_text
from statediff.jsonutil import jsonable
from statediff.trace.schema import KINDS

#: Sort rank of a finding that is not about one tensor (a block table row), after every tensor kind
#: at the same (request, position, layer).
_TABLE_RANK = len(KINDS)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One restore that does not read what the run saved.

    Attributes:
        check: "state" (a resumed GDN conv/SSM state against the checkpoint saved at
            that boundary), "kv" (a K/V block read through the runner's block table
            against what was written into the block the scheduler allocated),
            "block_table" (the runner's row against the scheduler's allocation),
            "block_owner" (the block restored from last held another prefix), "initial" (a
            first chunk without a hit that reads its slot, which is not zeros) or
            "first_chunk" (a hit whose first chunk the kernel treats as having no prior state) or
            "group_hit" (KV-cache groups whose final hit lengths disagree; kind "group_hit") or
            "read_before_write" (K/V read at a hit from a block nothing in the run wrote, while
            the run wrote those tokens' K/V elsewhere: "read, never written", any group, drafters'
            included).
        request, position, layer, kind, module: the restored tensor (position in tokens:
            the state's boundary, or the end of the K/V block's token range);
            ``kind`` "block_table" for a block-table finding.
        step: the engine step of the restore (-1: unknown).
        what: one line: what differed.
        expected: where the expected value came from: ``{"request", "position",
            "token_start", "step", "block"}`` of the write, or None.
        diagnosis: what the restored value matches instead (one line), or None.
        drafter_layer: the index of ``layer`` among the drafter's own layers (``trace.layers``), None for
            a target layer; ``where`` then says "drafter layer i (layer L, module)".
    """

    check: str
    request: int
    position: int
    layer: int
    kind: str
    module: str
    step: int
    what: str
    expected: dict[str, Any] | None = None
    diagnosis: str | None = None
    drafter_layer: int | None = None

    @property
    def order(self) -> tuple:
        rank = KINDS.index(self.kind) if self.kind in KINDS else _TABLE_RANK
        return (self.request, self.position, self.layer, rank)

    def where(self) -> str:
        return (f"request {self.request} position {self.position} "
                f"{layer_text(self.layer, self.drafter_layer, self.module or None)} {self.kind}")

    def text(self) -> str:
        out = f"{self.where()}: {self.what}"
        if self.diagnosis:
            out += f"\n    {self.diagnosis}"
        return out

    def report_text(self) -> str:
        """``text()`` and, when known, who wrote the expected value (one more line)."""
        exp = self.expected
        src = (f"\n    expected: written by request {exp['request']} at step {exp['step']} "
               f"into block {exp['block']}" if exp else "")
        return f"{self.text()}{src}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The audit of one trace: every restore checked against what the same run saved.

    Attributes:
        path: the trace audited.
        findings: every violation, in causal order (request, position, layer, kind).
        checked: what was checked, per check: restored tensors ("state", "kv"), block table rows
            ("block_table"), first chunks per GDN layer ("first_chunk"), requests' group hits ("group_hit").
        unchecked: restored tensors whose saved value the trace does not hold, with why
            (first few; ``unchecked_count`` counts them all).
        unchecked_count: how many restored tensors could not be checked.
        hits: requests that resumed from a prefix-cache hit.
        requests: requests in the trace.
        incomplete: why the trace is partial ("" when complete).
        warnings: one line per tensor whose data is damaged under a restore judged equal to its
            saved write by digest (``statediff.trace.damage``); the verdict stands.
    """

    path: str
    findings: tuple[Finding, ...]
    checked: dict[str, int]
    unchecked: tuple[str, ...]
    unchecked_count: int
    hits: int
    requests: int
    incomplete: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def first(self) -> Finding | None:
        """The first finding in causal order, or None."""
        return self.findings[0] if self.findings else None

    @property
    def not_checked(self) -> bool:
        """Requests hit the prefix cache but no restored tensor could be checked (none recorded, or
        every one "not checkable"): the audit vouches for nothing, which is not clean."""
        return bool(self.hits) and not self.findings and not (self.checked.get("state", 0)
                                                               + self.checked.get("kv", 0))

    @property
    def exit_code(self) -> int:
        """1 when a restore does not read what was saved; 2 when nothing restored was checkable
        (``not_checked``: "NOT CHECKED", a verdict, printed as such); else 0 (errors raise before a result)."""
        return 1 if self.findings else 2 if self.not_checked else 0

    @property
    def verdict(self) -> str:
        """"violation", "not_checked" or "clean"."""
        return "violation" if self.findings else "not_checked" if self.not_checked else "clean"

    def headline(self) -> str:
        n = self.checked.get("state", 0) + self.checked.get("kv", 0)
        if self.findings:
            return (f"RESTORE VIOLATION: first at {self.first.where()} "
                    f"({len(self.findings)} finding(s))")
        if self.not_checked:
            return (f"NOT CHECKED: {self.hits} hit(s) restored {self.unchecked_count} tensor(s), none of them "
                    "checkable (the trace holds no write of the values they restore): nothing checkable, "
                    "so not clean")
        if not self.hits:
            return "CLEAN: no request resumed from a prefix-cache hit (nothing restored to audit)"
        return f"CLEAN: {n} restored tensor(s) of {self.hits} hit(s) read exactly what the run saved"

    def to_text(self, limit: int = 20, more: str = "--json lists them all", brief: bool = False) -> str:
        """The audit as text, the one rendering of its findings (``audit``, ``check`` and the check's
        report all print this): why the trace is incomplete, the headline, what was checked, the
        unchecked restores, warnings, then the first ``limit`` findings (``Finding.report_text``) and
        how many more there are (``more``: where to find them).

        ``brief``: without the trace, counts and unchecked lines (``statediff check`` prints the audit
        under its own heading, the headline first)."""
        out = [self.headline()]
        if self.incomplete:
            out.insert(0 if not brief else 1, f"INCOMPLETE: {self.incomplete}")
        if not brief:
            out += [f"trace: {self.path}",
                    f"requests: {self.requests}, hits: {self.hits}; checked: "
                    + ", ".join(f"{k} {v}" for k, v in self.checked.items())]
            if self.unchecked_count:
                out.append(f"not checkable: {self.unchecked_count} restored tensor(s) "
                           "(the trace holds no write of the value they restore)")
                out += [f"  {u}" for u in self.unchecked]
        out += [f"warning: {w}" for w in self.warnings]
        for i, f in enumerate(self.findings[:limit], 1):
            out.append(f"finding {i} ({f.check}): {f.report_text()}")
        if len(self.findings) > limit:
            out.append(f"... {len(self.findings) - limit} more finding(s) ({more})")
        return "\n".join(out)

    def to_json(self) -> dict:
        first = self.first
        return jsonable({
            "statediff": "audit",
            "exit_code": self.exit_code,
            "verdict": self.verdict,
            "headline": self.headline(),
            "trace": self.path,
            "first": None if first is None else {
                "request": first.request, "position": first.position, "layer": first.layer,
                "kind": first.kind, "module": first.module, "check": first.check, "what": first.what,
                "diagnosis": first.diagnosis, "expected": first.expected},
            "findings": [f.to_json() for f in self.findings],
            "checked": dict(self.checked),
            "unchecked": list(self.unchecked),
            "unchecked_count": self.unchecked_count,
            "hits": self.hits,
            "requests": self.requests,
            "incomplete": self.incomplete,
            "warnings": list(self.warnings),
        })
