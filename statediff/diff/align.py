"""Pair the tensors of two traces by (request, position, layer, kind).

Alignment never uses engine steps: a hit run skips the cached steps, so step
numbers do not line up, while the absolute token position does. The plan
lists the pairs in causal order and keeps what did not pair (hit-only,
cold-only), so a report can say what had no counterpart instead of
dropping it silently. When a key occurs more than once on one side, the
occurrences pair up in step order and the surplus is listed as unpaired.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from statediff.errors import MismatchError
from statediff.trace.reader import Trace
from statediff.trace.schema import IDENTITY_KEYS, TensorEntry


@dataclasses.dataclass(frozen=True)
class Pair:
    """One aligned pair: the hit run's tensor and the cold run's, same key."""

    hit: TensorEntry
    cold: TensorEntry

    @property
    def key(self) -> tuple[int, int, int, str]:
        return self.cold.key

    @property
    def same_layout(self) -> bool:
        """Same logical dtype and shape (metrics need both)."""
        return self.hit.dtype == self.cold.dtype and self.hit.shape == self.cold.shape


@dataclasses.dataclass(frozen=True)
class Plan:
    """How two traces were paired (plain data; shown in reports).

    Attributes:
        pairs: aligned pairs in causal order (request, position, layer, kind).
        hit_only, cold_only: entries without a counterpart, in causal order.
    """

    pairs: tuple[Pair, ...]
    hit_only: tuple[TensorEntry, ...]
    cold_only: tuple[TensorEntry, ...]


def align(hit: list[TensorEntry], cold: list[TensorEntry]) -> Plan:
    """Pair two traces' index entries by key.

    Args:
        hit, cold: ``Trace.entries`` of each side (any order).
    Returns:
        the plan, pairs sorted in causal order.
    """
    by_key: dict[tuple, list[TensorEntry]] = defaultdict(list)
    for e in sorted(cold, key=lambda e: e.step):
        by_key[e.key].append(e)
    pairs, hit_only = [], []
    for e in sorted(hit, key=lambda e: e.step):
        bucket = by_key.get(e.key)
        if bucket:
            pairs.append(Pair(e, bucket.pop(0)))
        else:
            hit_only.append(e)
    cold_only = [e for bucket in by_key.values() for e in bucket]
    order = lambda e: e.causal_order  # noqa: E731
    return Plan(
        pairs=tuple(sorted(pairs, key=lambda p: p.cold.causal_order)),
        hit_only=tuple(sorted(hit_only, key=order)),
        cold_only=tuple(sorted(cold_only, key=order)),
    )


def check_comparable(a: Trace, b: Trace, *, allow_engine_mismatch: bool = False,
                     names: tuple[str, str] = ("hit", "cold")) -> list[str]:
    """Refuse two traces that cannot be compared; return warnings for the report.

    Refuses when both traces know a value of ``schema.IDENTITY_KEYS`` and the
    values differ (different model or config), unless
    ``allow_engine_mismatch``; and always when their ``replay`` modes differ.
    A value known on one side only is a warning, not a refusal.

    Raises:
        MismatchError: one line naming the first differing key and both values.
    """
    warnings = []
    for key in IDENTITY_KEYS:
        va, vb = a.run.get(key), b.run.get(key)
        if va is None or vb is None:
            if va != vb:
                side = names[0] if va is None else names[1]
                warnings.append(f"{key} is unknown in the {side} trace: cannot check it matches")
            continue
        if va != vb:
            if not allow_engine_mismatch:
                raise MismatchError(
                    f"traces differ in {key} ({names[0]} {va!r}, {names[1]} {vb!r}): "
                    "different model or config (use --allow-engine-mismatch to compare anyway)"
                )
            warnings.append(f"engine mismatch allowed: {key} differs ({names[0]} {va!r}, {names[1]} {vb!r})")
    ra, rb = a.run.get("replay"), b.run.get("replay")
    if ra != rb:
        raise MismatchError(
            f"traces were replayed differently ({names[0]} replay={ra!r}, {names[1]} replay={rb!r}): "
            "record both with the same replay mode"
        )
    for t, name in ((a, names[0]), (b, names[1])):
        if t.partial:
            warnings.append(f"the {name} trace is partial (recording did not finish)")
    return warnings


def both_exact(a: Trace, b: Trace) -> bool:
    """Both traces replayed with identical chunking (a clean pair is bit-identical)."""
    return a.run.get("replay") == "exact" and b.run.get("replay") == "exact"


def fed_same_tokens(ra: dict[int, dict], rb: dict[int, dict], request: int, position: int) -> bool:
    """Both runs fed request ``request`` the same first ``position`` tokens (prompt + outputs).

    A state at position p summarises tokens [0, p); once the runs' token
    streams part, states past that point differ because their inputs do.
    ``ra``/``rb`` are ``Trace.requests`` of each run. A request missing
    on either side cannot be judged here and counts as the same.
    """
    x, y = ra.get(request), rb.get(request)
    if x is None or y is None:
        return True  # no token record: cannot tell, keep the pair

    def toks(r: dict) -> list[int]:
        return list(r.get("prompt_token_ids") or []) + list(r.get("output_token_ids") or [])

    return toks(x)[:position] == toks(y)[:position]
