"""``inspect``: what a trace holds, without reading any tensor data.

Everything here comes from the trace's index and digest tables, run
metadata and request records, plus the stored sizes; tensors are never
decompressed, so their data is not verified (``statediff verify`` reads
and checks every tensor; ``data_verified`` is False here). A tensor either has data (an index entry) or is a digest only
(a ``/digests`` row without data: its summary, format version 3, or its
digest, version 2); both are counted per kind.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from statediff.trace.layers import drafter_layers
from statediff.jsonutil import jsonable
from statediff.trace.patches import describe_patches
from statediff.trace.reader import open_trace
from statediff.trace.schema import FORMAT_NAME, KIND_RANK, RUN_KEYS, TensorEntry

MAX_POSITIONS_LISTED = 8


@dataclasses.dataclass
class InspectResult:
    """Summary of one trace (``to_text``/``to_json``; ``exit_code`` is always 0).

    Attributes:
        tensors: tensors with data (index entries).
        data_verified: always False: inspect reads metadata only (``statediff verify`` reads the data).
        digest_only: tensors recorded as a digest only (no data).
        by_kind, by_role, by_layer: tensors with data, per kind / role / layer.
        kinds: per kind, ``{"data": n, "digest_only": m}`` (every captured kind).
        keep: the run's keep policy (run key ``keep``: ``policy``, ``budget_bytes``,
            ``focus``, ...), or None when the trace does not record one (before version 3).
        sizes: ``raw_bytes`` (decompressed tensor bytes), ``stored_bytes``
            (the tensor datasets on disk), ``file_bytes`` (the file or parts
            directory), ``ratio`` (raw / stored).
        ranks: a tensor-parallel trace's set (run field ``tensor_parallel``): one
            ``{"rank", "trace", "present", "shards"}`` per rank, rank order (``shards``: that rank's
            layout, read from its own trace; None when it is missing or unreadable); else empty.
    """

    path: str
    format_version: int
    partial: bool
    run: dict[str, Any]
    requests: list[dict[str, Any]]
    tensors: int
    by_kind: dict[str, int]
    by_role: dict[str, int]
    by_layer: dict[int, int]
    positions: dict[int, list[int]]
    sizes: dict[str, float]
    exit_code: int = 0
    incomplete_reason: str = ""  # why the trace is incomplete (partial), "" when complete
    hit_findings: list[str] = dataclasses.field(default_factory=list)  # statediff.replay.hits
    digest_only: int = 0
    kinds: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    keep: dict[str, Any] | None = None
    data_verified: bool = False  # inspect reads no tensor data: 'statediff verify' does
    verify_target: str = ""  # what 'statediff verify' is given to check this trace ("": path)
    ranks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        doc = dataclasses.asdict(self) | {"format": FORMAT_NAME}
        doc.pop("verify_target")
        return jsonable(doc)

    def to_text(self) -> str:
        state = "partial (recording did not finish; read up to its last completed step)" \
            if self.partial else "complete"
        if self.partial and self.run.get("stopped"):  # the replay stopped early, the file was closed
            state = "incomplete (the replay stopped early: see the first line)"
        out = [f"INCOMPLETE: {self.incomplete_reason or 'the recording did not finish'}"] if self.partial else []
        if self.run.get("adapter") == "unverified":  # STATEDIFF_ALLOW_UNVERIFIED=1 at record time
            out.append(f"UNVERIFIED ADAPTER: {self.run.get('engine')} {self.run.get('engine_version')} was recorded "
                       f"with the adapter verified on {self.run.get('adapter_version')}")
        if self.run.get("adapter") == "reviewed":  # a version statediff read from source, never ran
            out.append(f"REVIEWED ADAPTER: {self.run.get('engine')} {self.run.get('engine_version')} was recorded "
                       "with an adapter checked against its source only (statediff engine-surface)")
        out += [f"trace: {self.path}", f"format: {FORMAT_NAME} v{self.format_version}, {state}"]
        tp = self.run.get("tensor_parallel")
        if isinstance(tp, dict) and isinstance(tp.get("traces"), list) and tp["traces"]:
            out.append(f"tensor parallel: rank {tp.get('rank')} of {tp.get('world_size')}: this rank's shards only "
                       f"(the set: {', '.join(map(str, tp['traces']))}; 'statediff compare' takes {tp['traces'][0]})")
        for r in self.ranks:
            where = "this trace" if r["rank"] == tp.get("rank") else r["trace"] if r["present"] else \
                f"{r['trace']} (missing)"
            out.append(f"  rank {r['rank']}: {where}" + (f"; {_layout_text(r['shards'])}" if r["shards"] else ""))
        out.append("run:")
        out += [f"  {k:<22} {_value(k, v, self.run)}" for k, v in self.run.items()]
        if (retention := retention_line(self.run.get("effective"))) is not None:
            out.append(f"  {'prefix retention':<22} {retention}")
        out += [f"requests ({len(self.requests)}):",
                f"  {'request':>7}  {'prompt':>6}  {'cached':>6}  {'expected':>8}  {'outputs':>7}  id"]
        for r in self.requests:
            cached = "unknown" if r["num_cached_tokens"] is None else r["num_cached_tokens"]
            # expected: the hit a perfect prefix cache could give (statediff.replay.hits)
            exp = "?" if r.get("expected_hit_tokens") is None else r["expected_hit_tokens"]
            out.append(f"  {r['index']:>7}  {r['prompt_len']!s:>6}  {cached!s:>6}  {exp!s:>8}  "
                       f"{r['outputs']:>7}  {r['request_id']}")
        out += [f"hit finding: {f}" for f in self.hit_findings]
        if self.digest_only:
            out.append(f"captured: {self.tensors + self.digest_only} tensors, {self.tensors} with data, "
                       f"{self.digest_only} digest only")
            out.append("  by kind, with data + digest only: " + ", ".join(
                f"{k} {c['data']} + {c['digest_only']}" for k, c in self.kinds.items()))
        else:
            out.append(f"captured: {self.tensors} tensors")
        out.append(f"keep policy: {_keep(self.keep)}")
        for name, counts in (("kind", self.by_kind), ("role", self.by_role), ("layer", self.by_layer)):
            with_data = " with data" if self.digest_only else ""
            out.append(f"  by {name}{with_data}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        out.append("  positions:")
        out += [f"    request {r}: {_positions(ps)}" for r, ps in self.positions.items()]
        s = self.sizes
        out.append(f"sizes: raw {_mib(s['raw_bytes'])}, on disk {_mib(s['stored_bytes'])} "
                   f"(compression ratio {s['ratio']:.2f}x), file {_mib(s['file_bytes'])}")
        out.append(f"data: not verified (metadata only; 'statediff verify {self.verify_target or self.path}' "
                   "reads every tensor "
                   "and checks its hash and summary)")
        return "\n".join(out)


def _value(key: str, v: Any, run: dict[str, Any] | None = None) -> str:
    if key == "engine_patches":
        return describe_patches(v)
    if key in ("quantization", "speculative_method"):  # the same words as 'statediff report'
        from statediff.incident.record import quantization_text, speculative_text

        return (quantization_text if key == "quantization" else speculative_text)(run or {})
    if v is None:
        return _known_none(key, run or {})
    if key == "layers" and isinstance(v, list):
        own = drafter_layers(run or {})
        return f"{len(v)}: " + ", ".join(
            f"{d.get('layer')} {d.get('type')}" + (f" (drafter layer {own[d['layer']]})" if d.get("drafter")
                                                   and d.get("layer") in own else "")
            if isinstance(d, dict) else str(d) for d in v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def _known_none(key: str, run: dict[str, Any]) -> str:
    """What an empty run field means where the run says it (a hit run has no cold policy, a run
    without a drafter no speculative tokens, a run with no planted fault none), else "unknown"."""
    from statediff.incident.record import speculative_text
    if key == "stopped":
        return "no (ran to its end)"
    if key == "cold_policy" and run.get("mode") == "hit":
        return "none (a hit run: normal prefix caching)"
    if key == "num_speculative_tokens" and speculative_text(run).startswith("none"):
        return "0 (no drafter)"
    if key == "fault" and run.get("mode") in ("hit", "cold"):
        return "none (no planted fault)"
    return "unknown"


def retention_line(effective: Any) -> str | None:
    """What the engine's prefix-cache retention (``effective.prefix_cache_retention``) lets a hit reuse; None if unrecorded."""
    if not isinstance(effective, dict) or "prefix_cache_retention" not in effective:
        return None
    v, text = effective.get("prefix_cache_retention_interval"), effective["prefix_cache_retention"]
    if text == "boundaries":
        return (f"{v} (only prompt-boundary states are kept: a hit ends at a prompt's last full block; "
                "states saved while decoding are not reused)")
    if text == "dense":
        return "None (dense: a state at every block boundary, decode included, can be reused)"
    return f"{v} ({text}, plus prompt boundaries)"


def _keep(keep: Any) -> str:
    """One line: the recorded keep policy (``record --keep``), or what its absence means."""
    if not isinstance(keep, dict):
        return "not recorded (a trace recorded before format version 3)"
    policy = keep.get("policy")
    text = str(policy) if policy is not None else "unknown"
    if policy == "budget" and isinstance(keep.get("budget_bytes"), int):
        text += f" ({_mib(keep['budget_bytes'])})"
    focus = keep.get("focus")
    if isinstance(focus, dict) and focus:  # in --focus order (the stored object has its keys sorted)
        order = sorted(focus, key=lambda k: (("request", "position", "layers") + (k,)).index(k))
        text += ", focus " + ",".join(f"{k}={'/'.join(map(str, focus[k])) if isinstance(focus[k], list) else focus[k]}"
                                      for k in order)
    if isinstance(keep.get("kept_tensors"), int) and isinstance(keep.get("kept_bytes"), int):
        text += f"; kept {keep['kept_tensors']} tensors ({_mib(keep['kept_bytes'])})"
    if isinstance(keep.get("digest_only_tensors"), int):
        text += f", {keep['digest_only_tensors']} digest only"
    return text


def _positions(ps: list[int]) -> str:
    if len(ps) <= MAX_POSITIONS_LISTED:
        return ", ".join(map(str, ps))
    return f"{ps[0]}, {ps[1]}, ... {ps[-1]} ({len(ps)} positions)"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _disk_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    return os.path.getsize(path)


def inspect_trace(path: str | os.PathLike) -> InspectResult:
    """Summarise a trace (file, or ``.parts`` directory of an unfinished one).

    Raises:
        TraceError: missing, unreadable or damaged trace.
    """
    from statediff.replay.hits import account_run  # pure: hit accounting from the request records

    with open_trace(path) as t:
        run = {k: t.run.get(k) for k in RUN_KEYS} | dict(t.run)
        hits = {a.request: a for a in account_run(t.run, t.requests)}
        requests = [{"index": i, "request_id": r.get("request_id"), "prompt_len": r.get("prompt_len"),
                     "num_cached_tokens": r.get("num_cached_tokens"),
                     "expected_hit_tokens": hits[i].expected, "expected_hit_source": hits[i].source,
                     "outputs": len(r.get("output_token_ids") or []), "finished": r.get("finished")}
                    for i, r in sorted(t.requests.items())]
        positions: dict[int, set[int]] = defaultdict(set)
        digests = list(getattr(t, "digests", ()))
        for e in [*t.entries, *digests]:
            positions[e.request].add(e.position)
        kinds: dict[str, dict[str, int]] = {}
        for e in sorted([*t.entries, *digests], key=lambda e: KIND_RANK.get(e.kind, len(KIND_RANK))):
            counts = kinds.setdefault(e.kind, {"data": 0, "digest_only": 0})
            counts["data" if isinstance(e, TensorEntry) else "digest_only"] += 1
        raw = sum(t.nbytes(e) for e in t.entries)
        stored = t.storage_bytes()
        opened = t.path if t.path.exists() else t.path.with_name(t.path.name + ".parts")
        return InspectResult(
            path=str(path), format_version=t.format_version, partial=t.partial, run=run,
            requests=requests, tensors=len(t.entries),
            by_kind=dict(Counter(e.kind for e in t.entries)),
            by_role=dict(Counter(e.role for e in t.entries)),
            by_layer=dict(sorted(Counter(e.layer for e in t.entries).items())),
            positions={r: sorted(ps) for r, ps in sorted(positions.items())},
            sizes={"raw_bytes": raw, "stored_bytes": stored, "file_bytes": _disk_bytes(str(opened)),
                   "ratio": raw / stored if stored else 0.0},
            incomplete_reason=t.partial_reason, hit_findings=[a.finding for a in hits.values() if a.finding],
            digest_only=len(digests), kinds=kinds,
            keep=t.run.get("keep") if isinstance(t.run.get("keep"), dict) else None,
            ranks=_rank_layouts(t.path, t.run))


def _rank_layouts(path: Path, run: dict) -> list[dict[str, Any]]:
    """Every rank of the tensor-parallel set ``path`` belongs to, with its shard layout (read from
    each rank's own trace: run field ``tensor_parallel.shards``); [] for a plain trace."""
    from statediff.diff.ranks import exists

    tp = run.get("tensor_parallel")
    if not (isinstance(tp, dict) and isinstance(tp.get("traces"), list) and isinstance(tp.get("world_size"), int)
            and len(tp["traces"]) == tp["world_size"] > 1):
        return []
    out = []
    for r, name in enumerate(tp["traces"]):
        p = Path(path).with_name(str(name)) if isinstance(name, str) and name and "/" not in name else None
        shards = tp.get("shards") if r == tp.get("rank") else None
        present = r == tp.get("rank") or (p is not None and exists(p))
        if shards is None and present and p is not None:
            try:
                with open_trace(p) as other:
                    shards = (other.run.get("tensor_parallel") or {}).get("shards")
            except Exception:  # a damaged rank trace: inspect it on its own for why
                shards = None
        out.append({"rank": r, "trace": str(name), "present": present,
                    "shards": shards if isinstance(shards, dict) else None})
    return out


def _layout_text(shards: dict) -> str:
    """One line of a rank's shard layout: each kind's slices of the unsharded tensor."""
    parts = []
    for kind, lay in shards.items():
        if not isinstance(lay, dict):
            continue
        if isinstance(lay.get("parts"), list):
            parts.append(f"{kind} axis {lay.get('axis')}: " + ", ".join(
                f"{p.get('name')} {_span(p.get('local'))}->{_span(p.get('global'))}" for p in lay["parts"]
                if isinstance(p, dict)))
        else:
            parts.append(f"{kind} axis {lay.get('axis')}: {_span(lay.get('slice'))} of {lay.get('of')}")
    return "; ".join(parts)


def _span(s: Any) -> str:
    return f"[{s[0]},{s[1]})" if isinstance(s, list) and len(s) == 2 else "?"


@dataclasses.dataclass(frozen=True)
class BundleInspectResult:
    """Summary of a bundle (``statediff extract``'s zip): its manifest, members and both traces.

    Attributes:
        path: the zip.
        manifest: format, version, folder, root, diagnosis, compare options, sources, notes, and a
            tensor-parallel bundle's ``tensor_parallel`` (world size, root rank, the other ranks' members).
        members: name -> {"bytes", "sha256"} (each checked against the zip before this was made).
        kept: how many tensors the manifest says each side keeps (the root rank's, in a tensor-parallel
            bundle; ``"ranks"``: the other ranks' shards of the root, both sides).
        traces: ``inspect`` of ``hit.h5`` and ``cold.h5`` (then of each other rank's pair, rank order),
            named ``BUNDLE.zip:folder/member``.
    """

    path: str
    manifest: dict[str, Any]
    members: dict[str, dict[str, Any]]
    kept: dict[str, int]
    traces: tuple[InspectResult, ...]
    exit_code: int = 0

    def to_json(self) -> dict:
        return jsonable({"statediff": "inspect", "bundle": self.path, "manifest": self.manifest,
                         "members": self.members, "kept": self.kept,
                         "traces": [t.to_json() for t in self.traces]})

    def to_text(self) -> str:
        m = self.manifest
        root = m.get("root") or [None] * 4
        out = [f"bundle: {self.path}",
               f"format: {m.get('format')} v{m.get('version')}, folder {m.get('folder')}/",
               f"root: request {root[0]}, position {root[1]}, layer {root[2]}, {root[3]}",
               f"diagnosis: {str(m.get('diagnosis') or 'none').removeprefix('diagnosis: ')}",
               "compare options: " + (" ".join(map(str, m.get("compare_options") or [])) or "none"),
               f"kept: {self.kept.get('hit', 0)} hit and {self.kept.get('cold', 0)} cold tensors",
               *_tp_lines(m.get("tensor_parallel"), self.kept.get("ranks", 0)),
               "sources: " + ", ".join(f"{k} {v}" for k, v in (m.get("sources") or {}).items()),
               "members (size and SHA-256 checked against the manifest):"]
        out += [f"  {name:<13} {d['bytes']:>10} bytes  sha256 {d['sha256'][:16]}..." for name, d in self.members.items()]
        out += [f"note: {n}" for n in m.get("notes") or []]
        for t in self.traces:
            out += ["", t.to_text()]
        return "\n".join(out)


def inspect_bundle(path: str | os.PathLike) -> BundleInspectResult:
    """Summarise a bundle: its manifest and members (checked as ``compare`` checks them: no
    duplicate or unlisted member, sizes and SHA-256 equal the manifest's, the root is in both
    traces) and ``inspect_trace`` of both its traces.

    Raises:
        StatediffError: not a readable, consistent bundle (``open_bundle``); TraceError for a trace.
    """
    from statediff.incident.unpack import open_bundle

    with open_bundle(path) as b:
        paths = [b.hit, b.cold] + [p for r in sorted(b.ranks) for p in b.ranks[r]]
        # a member's set is not in the bundle: each shows its own rank's layout only
        traces = tuple(dataclasses.replace(t, path=b.name(p.name), verify_target=str(path),
                                           ranks=[r for r in t.ranks if r["rank"] == t.run["tensor_parallel"]["rank"]])
                       for p in paths for t in [inspect_trace(p)])
        keep = ("format", "version", "folder", "root", "diagnosis", "compare_options", "sources", "notes",
                "tensor_parallel")
        listed = [k for k in b.manifest.get("kept") or [] if isinstance(k, dict)]
        kept = Counter(k.get("side") for k in listed if k.get("rank") in (None, b.root_rank))
        manifest = {k: b.manifest.get(k) for k in keep if k != "tensor_parallel" or b.ranks}
        return BundleInspectResult(str(path), manifest, b.members,
                                   {"hit": kept["hit"], "cold": kept["cold"]}
                                   | ({"ranks": len(listed) - kept["hit"] - kept["cold"]} if b.ranks else {}),
                                   traces)


def _tp_lines(tp: dict | None, n: int) -> list[str]:
    """A tensor-parallel bundle's line: the root rank and the other ranks' members."""
    if not tp:
        return []
    return [f"tensor parallel: rank {tp['root_rank']} of {tp['world_size']} is the root rank (hit.h5, cold.h5); "
            f"the other ranks' shards of the root: {n} tensors in "
            + ", ".join(f"{x['hit']}, {x['cold']}" for x in tp["ranks"])]
