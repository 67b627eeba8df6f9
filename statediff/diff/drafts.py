"""Speculative drafts as outputs of an exact replay: the first verification step whose drafts differ.

In exact replay a fault-free hit run and its cold run are bit-identical, the
drafter's work included: the same draft token ids are proposed and the same
number accepted at every verification step. Drafts that differ while the
sampled tokens agree are therefore a divergence (the drafter saw different
inputs or state: a bug the sampled tokens hide, since rejection sampling
corrects the drafts), never SAME.

Read from each request's ``spec_steps`` (request record, written by the
engine adapters: ``[[first draft position, [draft token ids] or null,
accepted], ...]``, one entry per verification step, in order). Steps are
paired by their index; a step whose draft ids are null on a side (the
scheduler held only placeholders) is judged by its position and acceptance.

Also from ``draft_calls`` (vLLM adapter, since issue 18: ``[[position, [draft
token ids], discarded], ...]``, one entry per drafter call, including the calls
on a non-final prefill chunk whose drafts the scheduler discards; ``position``:
the tokens whose rows were verified when the drafter ran). Calls are paired by
position: a hit run makes none inside its cached prefix, so only positions
both runs have are judged. A fault in the drafter's context may change only
these (the first step after a hit is a prefill chunk in exact replay).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .align import Pair


@dataclasses.dataclass(frozen=True)
class DraftDiff:
    """The first verification step of one request whose drafts differ between the runs.

    Attributes:
        request: request index.
        step: the step's index among the request's verification steps (0 = its first).
        position: absolute token position of the step's first draft (the cold run's; the hit
            run's when the cold run has no such step).
        hit, cold: ``(draft token ids or None, accepted)`` of the step on each side, None where
            that run has no such step.
    """

    request: int
    step: int
    position: int
    hit: tuple[tuple[int, ...] | None, int] | None
    cold: tuple[tuple[int, ...] | None, int] | None
    call: str | None = None

    def text(self) -> str:
        """'request 2, step 0 (position 231): hit drafted [5, 9, 9], 1 accepted; cold drafted [5, 9, 4], 3 accepted';
        for a drafter call (``call`` "discarded" or "used"): 'request 1, drafter call at position 128 (drafts
        discarded by the scheduler: a prefill chunk): hit drafted [...]; cold drafted [...]'."""
        def side(name: str, s: tuple | None) -> str:
            if s is None:
                return f"{name} has no such step"
            ids = "placeholders" if s[0] is None else f"[{', '.join(map(str, s[0]))}]"
            return f"{name} drafted {ids}" + ("" if self.call else f", {s[1]} accepted")

        if self.call:
            why = " (drafts discarded by the scheduler: a prefill chunk)" if self.call == "discarded" else ""
            return (f"request {self.request}, drafter call at position {self.position}{why}: "
                    f"{side('hit', self.hit)}; {side('cold', self.cold)}")
        return (f"request {self.request}, step {self.step} (position {self.position}): "
                f"{side('hit', self.hit)}; {side('cold', self.cold)}")

    def to_json(self) -> dict:
        def side(s: tuple | None) -> dict | None:
            return None if s is None else {"drafts": None if s[0] is None else list(s[0]), "accepted": s[1]}

        return {"request": self.request, "step": self.step, "position": self.position, "call": self.call,
                "hit": side(self.hit), "cold": side(self.cold), "text": self.text()}


def _steps(record: Mapping[str, Any] | None) -> list[tuple[int, tuple[int, ...] | None, int]] | None:
    """``spec_steps`` as (position, draft ids or None, accepted) tuples; None when not recorded or malformed."""
    raw = (record or {}).get("spec_steps")
    if not isinstance(raw, list):
        return None
    out = []
    for s in raw:
        if not (isinstance(s, (list, tuple)) and len(s) == 3):
            return None
        pos, ids, acc = s
        out.append((int(pos), None if ids is None else tuple(int(t) for t in ids), int(acc)))
    return out


def first_draft_diff(records: Pair[Mapping[str, Any] | None], request: int) -> DraftDiff | None:
    """The first verification step of ``request`` whose position, draft ids or acceptance differ, or None
    (also None when either run did not record ``spec_steps``).

    Draft ids are compared only where both sides know them (not placeholders).
    """
    h, c = _steps(records.hit), _steps(records.cold)
    if h is None or c is None:
        return None
    for i in range(max(len(h), len(c))):
        hs, cs = (h[i] if i < len(h) else None), (c[i] if i < len(c) else None)
        if hs is not None and cs is not None:
            same_ids = hs[1] is None or cs[1] is None or hs[1] == cs[1]
            if hs[0] == cs[0] and same_ids and hs[2] == cs[2]:
                continue
        elif any((r or {}).get("finished") is False for r in records):
            return None  # a run that stopped early has fewer steps: nothing to judge past its end
        pos = (cs or hs)[0]
        return DraftDiff(request, i, pos, None if hs is None else hs[1:], None if cs is None else cs[1:])
    return None


def _calls(record: Mapping[str, Any] | None) -> dict[int, tuple[tuple[int, ...], bool]] | None:
    """``draft_calls`` as position -> (draft ids, discarded), the first call at a position; None when not
    recorded or malformed."""
    raw = (record or {}).get("draft_calls")
    if not isinstance(raw, list):
        return None
    out: dict[int, tuple[tuple[int, ...], bool]] = {}
    for c in raw:
        if not (isinstance(c, (list, tuple)) and len(c) == 3 and isinstance(c[1], list)):
            return None
        out.setdefault(int(c[0]), (tuple(int(t) for t in c[1]), bool(c[2])))
    return out


def first_call_diff(records: Pair[Mapping[str, Any] | None], request: int) -> DraftDiff | None:
    """The first drafter call of ``request`` (by position, among the positions both runs have) whose draft
    ids differ, or None (also None when either run did not record ``draft_calls``). ``step`` is the call's
    index among the hit run's calls."""
    h, c = _calls(records.hit), _calls(records.cold)
    if h is None or c is None:
        return None
    for i, pos in enumerate(sorted(h)):
        if pos in c and h[pos][0] != c[pos][0]:
            return DraftDiff(request, i, pos, (h[pos][0], 0), (c[pos][0], 0),
                             call="discarded" if c[pos][1] else "used")
    return None


def first_drafts_diff(records: Pair[Mapping[str, Any] | None], request: int) -> DraftDiff | None:
    """The earlier (by position) of ``first_draft_diff`` and ``first_call_diff`` of ``request``, or None."""
    found = [d for d in (first_call_diff(records, request), first_draft_diff(records, request)) if d is not None]
    return min(found, key=lambda d: d.position) if found else None
