"""Acceptance as evidence: a prefix-cache hit after which the drafter's acceptance falls.

A drafter that reads stale or never-written context after a hit (vLLM #47930: DFlash/DSpark
context K/V of restored tokens never computed) keeps the target's greedy outputs equal, since the
target verifies every draft, but its drafts are rejected: the acceptance of the hit request falls
against its cold twin (the same request in the cold run), or, within one run, against the requests
without a hit. Request field ``acceptance`` (``docs/trace-format.md``, vLLM's
``SpecDecodingStats`` counted per request): ``num_drafts`` (verification steps with drafts),
``num_draft_tokens``, ``num_accepted_tokens``, ``mean_acceptance_length`` (``1 + accepted /
drafts``, tokens per target step).

A fall is a finding when both sides drafted at least ``MIN_DRAFTED`` tokens, the hit side's
acceptance rate (accepted / drafted) is under ``MAX_RATIO`` times the baseline's (a fall worth
naming), and chance is an unlikely explanation: Fisher's exact test, one-sided, on the 2x2 table
(accepted, rejected) x (hit, baseline) gives under ``ALPHA`` (``fall_p_value``). Default replay
moves a few drafts at near-ties (72% -> 52% over 21 drafted tokens: p 0.17, no finding); a context
read from nothing moves most, and a fall to 0 of 33 from 4 of 21 (mean acceptance length 1.00, the
signature of vLLM #47930) is p 0.019 although it is only 19 points absolute, which the former
absolute threshold (25 points) missed (measured on this project's DFlash pair, issue 34). The test
counts drafted tokens as independent, which they are not (a rejection ends its draft: the tokens
after it are rejected with it), so p understates chance; it ranks evidence, ``MAX_RATIO`` and
``MIN_DRAFTED`` bound the effect, and a finding is a place to look, not a proof (the captured
tensors and the audit say why).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["ALPHA", "MAX_RATIO", "MIN_DRAFTED", "AcceptanceFinding", "RequestAcceptance",
           "acceptance_findings", "fall_p_value", "falls", "per_request", "within_run_findings"]

#: Draft tokens each side needs before its rate is compared.
MIN_DRAFTED = 6
#: The hit side's rate must be below this fraction of the baseline's ...
MAX_RATIO = 0.75
#: ... and the one-sided Fisher exact p-value of the fall under this.
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class RequestAcceptance:
    """One request's (or a pool of requests') acceptance.

    Attributes:
        drafts: verification steps with drafts (vLLM ``num_drafts``).
        drafted: draft tokens proposed; accepted: draft tokens accepted.
    """

    drafts: int
    drafted: int
    accepted: int

    @property
    def rate(self) -> float | None:
        """accepted / drafted (None before any draft)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_length(self) -> float | None:
        """Mean acceptance length, ``1 + accepted / drafts`` (tokens per target step), or None."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def text(self) -> str:
        """'11 of 21 drafted tokens accepted (52%), mean acceptance length 2.57'."""
        if not self.drafted:
            return "no drafts"
        return (f"{self.accepted} of {self.drafted} drafted tokens accepted ({100 * self.rate:.0f}%), "
                f"mean acceptance length {self.mean_length:.2f}")


@dataclasses.dataclass(frozen=True)
class AcceptanceFinding:
    """A hit request whose acceptance falls against its baseline.

    Attributes:
        request: the hit request; hit_tokens: its prefix-cache hit (tokens).
        hit: its acceptance; baseline: the cold twin's, or the pooled acceptance of the run's
            requests without a hit; against: "its cold twin" or "the run's requests without a hit".
    """

    request: int
    hit_tokens: int
    hit: RequestAcceptance
    baseline: RequestAcceptance
    against: str

    def text(self) -> str:
        return (f"request {self.request} (prefix-cache hit of {self.hit_tokens} tokens): acceptance falls to "
                f"{self.hit.text()}, against {self.baseline.text()} in {self.against}")

    def to_json(self) -> dict[str, Any]:
        side = lambda a: {"drafts": a.drafts, "drafted": a.drafted, "accepted": a.accepted,  # noqa: E731
                          "rate": a.rate, "mean_acceptance_length": a.mean_length}
        return {"request": self.request, "hit_tokens": self.hit_tokens, "hit": side(self.hit),
                "baseline": side(self.baseline), "against": self.against, "text": self.text()}


def per_request(requests: Mapping[int, Mapping[str, Any]]) -> dict[int, RequestAcceptance]:
    """Each request's acceptance from its ``acceptance`` field (requests without one are left out)."""
    out = {}
    for i, rec in requests.items():
        a = rec.get("acceptance")
        if not isinstance(a, dict):
            continue
        vals = [a.get(k) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
        if all(isinstance(v, int) and v >= 0 for v in vals) and vals[2] <= vals[1]:  # accepted <= drafted
            out[i] = RequestAcceptance(*vals)
    return out


def fall_p_value(hit: RequestAcceptance, base: RequestAcceptance) -> float:
    """Fisher's exact test, one-sided: the probability that ``hit`` accepts ``hit.accepted`` or
    fewer of its drafted tokens if both sides drew from one pool of acceptances (hypergeometric,
    the margins fixed: ``hit.drafted + base.drafted`` tokens of which ``hit.accepted +
    base.accepted`` accepted). 1.0 when either side drafted nothing."""
    n1, n2 = hit.drafted, base.drafted
    if not n1 or not n2:
        return 1.0
    total, accepted = n1 + n2, hit.accepted + base.accepted
    # log space: drafted counts of long runs overflow a float binomial coefficient
    lc = lambda n, k: math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)  # noqa: E731
    denom = lc(total, n1)
    lo, hi = max(0, accepted - n2), min(hit.accepted, accepted, n1)
    return min(1.0, sum(math.exp(lc(accepted, i) + lc(total - accepted, n1 - i) - denom) for i in range(lo, hi + 1)))


def falls(hit: RequestAcceptance, base: RequestAcceptance) -> bool:
    """``hit``'s acceptance falls against ``base`` (module docstring: ``MIN_DRAFTED``, ``MAX_RATIO``, ``ALPHA``)."""
    if hit.drafted < MIN_DRAFTED or base.drafted < MIN_DRAFTED:
        return False
    return hit.rate < MAX_RATIO * base.rate and fall_p_value(hit, base) < ALPHA


def _hit_len(rec: Mapping[str, Any]) -> int:
    n = rec.get("num_cached_tokens")
    return n if isinstance(n, int) else 0


def acceptance_findings(hit_requests: Mapping[int, Mapping[str, Any]],
                        cold_requests: Mapping[int, Mapping[str, Any]]) -> tuple[AcceptanceFinding, ...]:
    """Hit requests (``num_cached_tokens > 0`` in the hit run) whose acceptance falls against their
    cold twin (same index in the cold run); requests without a twin's acceptance are compared with
    the hit run's requests without a hit (``within_run_findings``). In request order."""
    hit_acc, cold_acc = per_request(hit_requests), per_request(cold_requests)
    out, no_twin = [], {}
    for i in sorted(hit_acc):
        if _hit_len(hit_requests[i]) <= 0:
            continue
        if i in cold_acc:
            if falls(hit_acc[i], cold_acc[i]):
                out.append(AcceptanceFinding(i, _hit_len(hit_requests[i]), hit_acc[i], cold_acc[i], "its cold twin"))
        else:
            no_twin[i] = hit_requests[i]
    if no_twin:
        out += [f for f in within_run_findings(hit_requests) if f.request in no_twin]
    return tuple(sorted(out, key=lambda f: f.request))


def within_run_findings(requests: Mapping[int, Mapping[str, Any]]) -> tuple[AcceptanceFinding, ...]:
    """One run alone (``audit``, the live audit): hit requests whose acceptance falls against the
    pooled acceptance of the same run's requests without a hit (none: nothing to compare)."""
    acc = per_request(requests)
    cold = [a for i, a in acc.items() if _hit_len(requests[i]) <= 0]
    if not cold:
        return ()
    pool = RequestAcceptance(sum(a.drafts for a in cold), sum(a.drafted for a in cold),
                             sum(a.accepted for a in cold))
    return tuple(AcceptanceFinding(i, _hit_len(requests[i]), a, pool, "the run's requests without a hit")
                 for i, a in sorted(acc.items()) if _hit_len(requests[i]) > 0 and falls(a, pool))
