"""Bundle selection: which tensors of a compared pair still show its root divergence.

Kept, on both sides: the root (first divergent tensor); the root layer's
tensors of the root's kind and its sibling kinds (conv with SSM state, K
with V) at the root position and ``neighbours`` boundaries on each side of
it in that request (positions from both traces: the boundary before a hit
often exists only in the cold trace); and the cold tensor the diagnosis
says the wrong hit tensor matches. Tensors recorded as a digest only
(``/digests`` rows) are selected by the same rules and travel as digest
rows: the extracted pair then judges and diagnoses them from their
summaries as the full pair did. Pure functions over index and digest entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from statediff.diff.result import CompareResult
from statediff.errors import StatediffError
from statediff.trace.schema import DigestEntry, TensorEntry

Entry = TensorEntry | DigestEntry


@dataclasses.dataclass(frozen=True)
class Kept:
    """One tensor kept in the bundle: which trace it is from (``"hit"``/``"cold"``) and why
    (``entry`` is a digest row when that trace holds only its digest)."""

    side: str
    entry: Entry
    why: str

    def to_json(self) -> dict:
        e = self.entry
        return {"side": self.side, "request": e.request, "position": e.position, "layer": e.layer,
                "kind": e.kind, "role": e.role, "module": e.module, "dtype": e.dtype,
                "shape": list(e.shape), "hash": getattr(e, "hash", None), "digest": e.digest_value,
                "data": isinstance(e, TensorEntry), "why": self.why}


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a bundle keeps of each trace: the root key (request, position, layer, kind) and the tensors,
    hit side first, each side in causal order."""

    root: tuple[int, int, int, str]
    kept: tuple[Kept, ...]

    def entries(self, side: str) -> list[Entry]:
        return [k.entry for k in self.kept if k.side == side]


def select(result: CompareResult, hit_entries: Sequence[Entry], cold_entries: Sequence[Entry], *,
           neighbours: int = 1, siblings: bool = True) -> Selection:
    """Choose the tensors a bundle keeps for ``result``'s first (root) divergence.

    Args:
        result: ``compare`` of the two traces (with a divergence).
        hit_entries, cold_entries: the traces' index entries and digest rows
            (``Trace.entries`` + ``Trace.digests``).
        neighbours: boundaries kept on each side of the root position (0: none).
        siblings: keep the layer's other kinds (conv with SSM, V with K).

    Raises:
        StatediffError: ``result`` has no divergence.
    """
    root = result.first
    if root is None:
        raise StatediffError("no divergence: nothing to extract")
    r, p, layer, kind = root.key
    sides = (("hit", hit_entries), ("cold", cold_entries))

    def scope(e: Entry) -> bool:
        return e.request == r and e.layer == layer and (siblings or e.kind == kind)

    kinds = {e.kind for _, entries in sides for e in entries if scope(e)}
    positions = sorted({e.position for _, entries in sides for e in entries if scope(e)})
    i = positions.index(p) if p in positions else 0
    near = set(positions[max(0, i - neighbours): i + neighbours + 1]) | {p}
    g = result.diagnosis_for(root.key)
    match = (g.match_request, g.match_position, g.layer, g.kind) if g and g.match_request is not None else None
    kept = []
    for side, entries in sides:
        for e in entries:
            if e.key == root.key:
                why = "root divergence"
            elif side == "cold" and e.key == match:
                why = "what the diagnosis says the wrong hit tensor matches"
            elif scope(e) and e.kind in kinds and e.position in near:
                what = "same kind" if e.kind == kind else "sibling kind"
                where = "at the root position" if e.position == p else (
                    f"{abs(e.position - p)} tokens {'before' if e.position < p else 'after'} the root")
                why = f"{what}, {where}"
            else:
                continue
            kept.append(Kept(side, e, why))
    kept.sort(key=lambda k: (k.side != "hit", k.entry.causal_order, k.entry.step))
    return Selection(root.key, tuple(kept))
