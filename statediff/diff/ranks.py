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


def exists(path: Path) -> bool:
    """A rank's trace is there: its file, or the ``.parts`` directory of a recording that did not
    finish (a worker killed at shutdown, e.g. by ``vllm serve``'s process manager), which reads as a
    partial trace."""
    return path.is_file() or path.with_name(path.name + ".parts").is_dir()


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
    def verdict(self) -> str:
        """"diverged" when any rank diverged, else "cannot-judge" when any rank cannot be judged, else
        the root rank's ("same" or "near-tie")."""
        verdicts = [r.verdict for r in self.results]
        return next((v for v in ("diverged", "cannot-judge") if v in verdicts), self.root.verdict)

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
            "headline": self.headline(), "exit_code": self.exit_code, "verdict": self.verdict,
            "tensor_parallel": {"world_size": self.world_size, "root_rank": self.root_rank},
            "first": None if root.get("first") is None else root["first"] | {"rank": self.root_rank},
            "ranks": [{"rank": r, "hit": str(h), "cold": str(c), "verdict": res.verdict, "exit_code": res.exit_code,
                       "pairs": res.pairs, "first": None if res.first is None else res.first.to_json()}
                      for r, (res, (h, c)) in enumerate(zip(self.results, self.paths))],
        })


def compare_ranks(hit: Path, cold: Path, hit_run: dict, cold_run: dict,
                  compare_one: Callable[[Path, Path], Any],
                  merged_compare: Callable[[Path, int, Path, str], Any] | None = None) -> Any:
    """Compare two tensor-parallel sets rank by rank; None when neither is one.

    ``compare_one(hit_rank_path, cold_rank_path)`` returns one rank's ``CompareResult``.
    ``merged_compare(set_rank0, world_size, single, side)``: a set against a single trace
    (``side``: which side the set is), its result returned as is; None refuses that pair.

    Raises:
        StatediffError: only one side is a set, the world sizes or the shard layouts differ, or a
            rank's trace is missing.
    """
    hs, cs = rank_set(hit, hit_run), rank_set(cold, cold_run)
    if hs is None and cs is None:
        return None
    if hs is not None and cs is None and not cold_run.get("tensor_parallel") and merged_compare is not None:
        return merged_compare(hit, len(hs), cold, "hit")
    if cs is not None and hs is None and not hit_run.get("tensor_parallel") and merged_compare is not None:
        return merged_compare(cold, len(cs), hit, "cold")
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
        if not exists(p):
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


def unshard(kind: str, arrays: list[Any], layouts: list[dict]) -> Any | None:
    """The unsharded tensor of ``kind`` from every rank's shard (numpy arrays, rank order) and each
    rank's run field ``tensor_parallel.shards``; rank 0's array for a kind no layout names
    (replicated on every rank); None when the layouts do not cover the arrays.

    ``gdn.conv_state``: each rank's q, k and v parts placed where their ``global`` slice says
    (vLLM shards the three sub-projections each on its own: the ranks concatenated are not the
    state). Other kinds: each rank's array placed at its ``slice`` along ``axis``.
    """
    import numpy as np

    shards = [lay.get(kind) for lay in layouts]
    if all(s is None for s in shards):
        return arrays[0]
    if any(s is None for s in shards):
        return None
    axis = shards[0]["axis"]
    if kind == "gdn.conv_state":
        pieces = [[(p["local"], p["global"]) for p in s["parts"]] for s in shards]
        total = max(g[1] for ps in pieces for _, g in ps)
    else:
        pieces = [[([0, s["slice"][1] - s["slice"][0]], s["slice"])] for s in shards]
        total = shards[0]["of"]
    shape = list(arrays[0].shape)
    if axis >= len(shape):
        return None
    shape[axis] = total
    out = np.zeros(shape, dtype=arrays[0].dtype)
    for arr, ps in zip(arrays, pieces):
        for local, glob in ps:
            src, dst = [slice(None)] * len(shape), [slice(None)] * len(shape)
            src[axis], dst[axis] = slice(*local), slice(*glob)
            out[tuple(dst)] = arr[tuple(src)]
    return out


def merge_set(rank0: Path, out: Path) -> dict:
    """Write the unsharded (logical) tensors of the tensor-parallel set whose rank-0 trace is
    ``rank0`` as one trace at ``out``: every key (request, position, layer, kind, role, token
    start) that holds data on every rank, ``unshard``-ed; rank 0's run and request records, with
    run field ``tensor_parallel`` replaced by ``tensor_parallel_merged`` (``world_size``,
    ``traces``, ``merged``: tensors written, ``left_out``: keys without data on some rank, e.g.
    digest-only ones, whose digests cannot be combined).

    Returns:
        the ``tensor_parallel_merged`` field.
    Raises:
        StatediffError: ``rank0`` is not rank 0 of a set; a rank trace is unreadable.
    """
    import contextlib

    from statediff.trace import TraceWriter, open_trace

    with contextlib.ExitStack() as stack:
        first = stack.enter_context(open_trace(rank0))
        paths = rank_set(rank0, first.run)
        if paths is None:
            raise StatediffError(f"{rank0}: not rank 0 of a tensor-parallel set (run field tensor_parallel)")
        traces = [first] + [stack.enter_context(open_trace(p)) for p in paths[1:]]
        layouts = [t.run["tensor_parallel"].get("shards") or {} for t in traces]

        def key(e: Any) -> tuple:
            return (e.request, e.position, e.layer, e.kind, e.role, e.token_start)

        per_rank = [{key(e): e for e in t.entries} for t in traces]
        keys = [k for k in per_rank[0] if all(k in m for m in per_rank[1:])]
        left_out = len(set().union(*per_rank) - set(keys)) + len(first.digests)
        # keep: its counts are rank 0's, not the merged trace's (which holds no digest-only tensor)
        run = {k: v for k, v in first.run.items() if k != "tensor_parallel"} | {"keep": None}
        field = {"world_size": len(paths), "traces": [p.name for p in paths], "merged": 0, "left_out": left_out}
        w = TraceWriter(out, run | {"tensor_parallel_merged": field}, overwrite=True, threads=0)
        try:
            for i in sorted(first.requests):
                rec = dict(first.requests[i])
                prompt, outputs = rec.pop("prompt_token_ids", None) or [], rec.pop("output_token_ids", None) or []
                request_id = rec.pop("request_id", None)
                rec.pop("index", None)
                w.begin_request(i, request_id, prompt, output_token_ids=outputs, **rec)
            for k in sorted(keys, key=lambda k: (per_rank[0][k].step, per_rank[0][k].causal_order)):
                e = per_rank[0][k]
                arr = unshard(e.kind, [t.read(m[k]) for t, m in zip(traces, per_rank)], layouts)
                if arr is None:
                    field["left_out"] += 1
                    continue
                w.add(arr, request=e.request, position=e.position, layer=e.layer, kind=e.kind, role=e.role,
                      module=e.module, dtype=e.dtype, token_start=e.token_start, step=e.step, block=e.block)
                field["merged"] += 1
            w.update_run(tensor_parallel_merged=field)
            w.end_step()
        except BaseException:
            with contextlib.suppress(Exception):
                w.close()
            raise
        w.close()
    return field
