"""One way from two traces to a verdict: ``check_pair`` audits the cache-hit trace on its own
(``statediff.audit``), compares it with its cold trace (``statediff.diff.pair.compare_pair``),
builds the incident record (``statediff.incident.record.build_report``) and returns one frozen
``PairVerdict`` whose title and exit code are decided there, once.

``statediff check`` records the two runs (``statediff_hooks``) and calls it; nothing on the engine
side assembles an audit, a comparison or a report itself. Offline: numpy and h5py, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from statediff.diff.pair import CompareOptions, compare_pair

#: Audit findings ``PairVerdict.to_text`` shows (``audit.json`` and the report list more).
AUDIT_FINDINGS_SHOWN = 3

#: Where the findings ``PairVerdict.to_text`` leaves out are listed.
MORE_IN = "audit.json lists them all"


@dataclasses.dataclass(frozen=True)
class PairVerdict:
    """The verdict on a cache-hit trace: its own audit and, given a cold trace, the comparison.

    Attributes:
        audit: the ``statediff.audit.AuditResult`` of the hit trace alone.
        compare: the ``statediff.diff.result.CompareResult`` of hit against cold (None: no cold
            trace, the audit alone decides).
        report: the ``statediff.incident.record.IncidentReport`` with the audit's section; its
            ``title`` and ``exit_code`` are the verdict's (None without ``compare``).
        options: the ``CompareOptions`` that judged the pair.
    """

    audit: Any
    compare: Any
    report: Any
    options: CompareOptions = CompareOptions()

    @property
    def exit_code(self) -> int:
        """0 the audit is clean and compare finds no divergence; 1 either finds one (a restore
        violation, a divergence); else 2 when either cannot vouch for the pair (the audit NOT
        CHECKED, compare CANNOT JUDGE). Decided by ``build_report`` (``incident.record.exit_code``)."""
        if self.report is not None:
            return self.report.exit_code
        return self.audit.exit_code

    @property
    def title(self) -> str:
        """One line: the report's title, or without a cold trace the audit's headline."""
        if self.report is not None:
            return self.report.title
        return f"statediff: the one-run audit of the cache-hit run: {self.audit.headline()}"

    def audit_lines(self, limit: int = AUDIT_FINDINGS_SHOWN) -> list[str]:
        """``audit of the hit run: <headline>`` and, indented, the audit's brief text (its first
        ``limit`` findings, ``AuditResult.to_text``)."""
        head, *rest = self.audit.to_text(limit=limit, more=MORE_IN, brief=True).splitlines()
        return [f"audit of the hit run: {head}", *(f"  {line}" for line in rest)]

    def verdict_line(self) -> str:
        """After a comparison that found no divergence while the audit found a restore violation:
        the line that says the check's answer is the audit's; '' otherwise."""
        c = self.compare
        if c is None or self.audit.exit_code != 1 or c.exit_code == 1:
            return ""
        says = ("says only that no pair stands out of the rounding noise" if c.verdict == "cannot-judge" else
                "says only that the hit and cold runs agree within tolerance")
        word = {"cannot-judge": "CANNOT JUDGE", "near-tie": "NEAR-TIE"}.get(c.verdict, "SAME")
        return f"check: RESTORE VIOLATION (exit 1): the audit above names it; compare's {word} {says}"

    def to_text(self) -> str:
        """The audit of the hit run (``audit_lines``), compare's text report, and ``verdict_line``."""
        out = self.audit_lines()
        if self.compare is not None:
            out.append(self.compare.to_text())
        out += [line for line in (self.verdict_line(),) if line]
        return "\n".join(out)

    def files(self) -> dict[str, str]:
        """What ``statediff check`` writes, by file name: ``audit.json`` (what ``audit --json``
        prints), ``compare.json`` (what ``compare --json`` prints) and ``report.md`` (what
        ``report`` writes, with the audit's section); the last two only with a comparison."""
        out = {"audit.json": json.dumps(self.audit.to_json(), indent=2) + "\n"}
        if self.compare is not None:
            out["compare.json"] = json.dumps(self.compare.to_json(), indent=2) + "\n"
            out["report.md"] = self.report.to_markdown()
        return out


def check_pair(hit: str | os.PathLike, cold: str | os.PathLike | None = None,
               options: CompareOptions = CompareOptions(), *, audit: Any = None, progress: bool = False,
               warn: Callable[[str], None] | None = None) -> PairVerdict:
    """Audit ``hit``, compare it with ``cold``, build the record: the verdict, decided once.

    Args:
        hit: the cache-hit trace (a file or a ``.parts`` directory).
        cold: its cold trace; None: no comparison, the audit alone decides (``statediff check
            --concurrency N`` records no cold run).
        options: the options that judge the pair (``compare``'s; default: the default policy).
        audit: the hit trace's ``AuditResult`` when it was audited already (``statediff check``
            audits the hit run before it records the cold one, through ``check_pair(hit)``);
            None: audited here.
        progress: a progress bar on stderr while comparing.
        warn: receives ``compare_pair``'s one-line warning (default: stderr).
    Returns:
        the ``PairVerdict``.
    Raises:
        TraceError: a trace is missing, unreadable or damaged.
        StatediffError: a pair ``compare`` refuses (one line), as ``compare_pair``.
    """
    from statediff.audit import audit_trace
    from statediff.incident.record import build_report

    if audit is None:
        audit = audit_trace(hit)
    if cold is None:
        return PairVerdict(audit, None, None, options)
    kw = {} if warn is None else {"warn": warn}
    result = compare_pair(hit, cold, options, progress=progress, **kw)
    return PairVerdict(audit, result, build_report(result, options, audit=audit), options)
