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

    def text(self) -> str:
        """'request 2, step 0 (position 231): hit drafted [5, 9, 9], 1 accepted; cold drafted [5, 9, 4], 3 accepted'."""
        def side(name: str, s: tuple | None) -> str:
            if s is None:
                return f"{name} has no such step"
            ids = "placeholders" if s[0] is None else f"[{', '.join(map(str, s[0]))}]"
            return f"{name} drafted {ids}, {s[1]} accepted"

        return (f"request {self.request}, step {self.step} (position {self.position}): "
                f"{side('hit', self.hit)}; {side('cold', self.cold)}")

    def to_json(self) -> dict:
        def side(s: tuple | None) -> dict | None:
            return None if s is None else {"drafts": None if s[0] is None else list(s[0]), "accepted": s[1]}

        return {"request": self.request, "step": self.step, "position": self.position,
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
