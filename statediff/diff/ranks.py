"""Compare two tensor-parallel trace sets rank by rank (``docs/trace-format.md``, "Tensor parallel").

A tensor-parallel recording is one trace per rank: rank 0's trace (the path ``record -o``
named) carries the run field ``tensor_parallel`` (``rank``, ``world_size``, ``traces``: every
rank's file name, rank order, in the same directory; ``shards``: how this rank's tensors sit
in the unsharded ones). ``compare_ranks`` compares rank r of HIT with rank r of COLD (the same
shards: both sets must have the same world size and shard layout), one ``CompareResult`` per
rank, and names the root: the earliest first divergence over all ranks in causal order
(request, position, layer, kind); a fault in one rank's shard reaches the other ranks only
through the collective after that layer, so their first divergences come later.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from statediff.errors import StatediffError
from statediff.jsonutil import jsonable

__all__ = ["RankedResult", "compare_ranks", "rank_set"]


def rank_set(path: str | Path, run: dict) -> list[Path] | None:
    """Every rank's trace of the tensor-parallel set whose rank-0 trace is ``path`` (run metadata
    ``run``), rank order; None when ``path`` is not rank 0 of a set (a plain trace, or one rank's
    own trace, which compares as any trace).

    Raises:
        StatediffError: a malformed ``tensor_parallel`` field.
    """
    tp = run.get("tensor_parallel")
    if not isinstance(tp, dict) or tp.get("world_size") in (None, 1) or tp.get("rank") != 0:
        return None
    names, size = tp.get("traces"), tp.get("world_size")
    if not (isinstance(size, int) and isinstance(names, list) and len(names) == size
            and all(isinstance(n, str) and n and "/" not in n and "\\" not in n and n not in (".", "..")
                    for n in names)):
        raise StatediffError(f"{path}: run field tensor_parallel is malformed (traces: one plain file name per rank)")
    return [Path(path).with_name(n) for n in names]


@dataclasses.dataclass(frozen=True)
class RankedResult:
    """One ``CompareResult`` per rank (``results[r]`` compares rank r's traces) and the root rank.

    ``root_rank``: the rank whose first divergence comes first in causal order (None: no rank
    diverged). ``exit_code``: 1 when any rank diverged, else 2 when any cannot judge, else 0.
    """

    world_size: int
    paths: list[tuple[Path, Path]]
    results: list[Any]
    root_rank: int | None

    @property
    def exit_code(self) -> int:
        codes = [r.exit_code for r in self.results]
        return 1 if 1 in codes else 2 if 2 in codes else 0

    @property
    def root(self) -> Any:
        """The root rank's ``CompareResult`` (rank 0's when none diverged)."""
        return self.results[self.root_rank or 0]

    def headline(self) -> str:
        """The verdict line, naming the rank of a divergence."""
        res, r = self.root, self.root_rank
        head = res.headline()
        if r is None:
            return f"{head} (every rank of {self.world_size}, shard by shard)"
        if res.first is not None:
            return f"DIVERGED: first divergence at rank {r} of {self.world_size}, {res.first.where()}"
        return f"{head} (rank {r} of {self.world_size})"

    def to_text(self) -> str:
        out = [self.headline(), f"tensor parallel: {self.world_size} ranks, each rank's shards compared with the "
                                "same rank's (rank r of HIT vs rank r of COLD)"]
        for r, (res, (h, c)) in enumerate(zip(self.results, self.paths)):
            first = (f"; first divergence at {res.first.where()}" if res.first is not None else
                     f" ({res.cause} only)" if res.cause not in (None, "tensor") else "")
            out.append(f"  rank {r}: {h.name} vs {c.name}: {res.verdict.upper()}, {res.pairs} pairs{first}")
        r = self.root_rank or 0
        out += ["", f"rank {r} of {self.world_size} ({self.paths[r][0].name} vs {self.paths[r][1].name}):",
                self.root.to_text()]
        return "\n".join(out)

    def to_json(self) -> dict:
        root = self.root.to_json()
        return jsonable(root | {
            "headline": self.headline(), "exit_code": self.exit_code,
            "tensor_parallel": {"world_size": self.world_size, "root_rank": self.root_rank},
            "first": None if root.get("first") is None else root["first"] | {"rank": self.root_rank},
            "ranks": [{"rank": r, "hit": str(h), "cold": str(c), "verdict": res.verdict, "exit_code": res.exit_code,
                       "pairs": res.pairs, "first": None if res.first is None else res.first.to_json()}
                      for r, (res, (h, c)) in enumerate(zip(self.results, self.paths))],
        })


def compare_ranks(hit: Path, cold: Path, hit_run: dict, cold_run: dict,
                  compare_one: Callable[[Path, Path], Any]) -> RankedResult | None:
    """Compare two tensor-parallel sets rank by rank; None when neither is one.

    ``compare_one(hit_rank_path, cold_rank_path)`` returns one rank's ``CompareResult``.

    Raises:
        StatediffError: only one side is a set, the world sizes or the shard layouts differ, or a
            rank's trace is missing.
    """
    hs, cs = rank_set(hit, hit_run), rank_set(cold, cold_run)
    if hs is None and cs is None:
        return None
    if hs is None or cs is None or len(hs) != len(cs):
        def size(s: list | None, run: dict) -> str:
            tp = run.get("tensor_parallel")
            if s is None and isinstance(tp, dict):
                return f"rank {tp.get('rank')} of a {tp.get('world_size')}-rank set; give the set's rank-0 trace"
            return "tensor parallel size 1" if s is None else f"tensor parallel size {len(s)}"
        raise StatediffError(f"{hit} ({size(hs, hit_run)}) and {cold} ({size(cs, cold_run)}): shard-by-shard compare needs both "
                             "recorded with the same --tensor-parallel-size (a compare of unsharded tensors "
                             "across sizes is not built yet)")
    hl, cl = hit_run["tensor_parallel"].get("shards"), cold_run["tensor_parallel"].get("shards")
    if hl != cl:
        raise StatediffError(f"{hit} and {cold}: the shard layouts differ (run field tensor_parallel.shards): "
                             "rank r of one does not hold the same slices as rank r of the other")
    for p in hs + cs:
        if not p.is_file():
            raise StatediffError(f"{p}: rank trace missing (named by the set's run field tensor_parallel.traces)")
    results = [compare_one(h, c) for h, c in zip(hs, cs)]
    return RankedResult(len(hs), list(zip(hs, cs)), results, _root_rank(results))


def _root_rank(results: list[Any]) -> int | None:
    from statediff.trace.schema import KINDS

    def order(res: Any) -> tuple:
        d = res.first
        return (d.request, d.position, d.layer, KINDS.index(d.kind) if d.kind in KINDS else len(KINDS))

    tensor = [(order(res), r) for r, res in enumerate(results) if res.first is not None]
    if tensor:
        return min(tensor)[1]
    return next((r for r, res in enumerate(results) if res.exit_code != 0), None)
