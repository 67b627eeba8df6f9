"""Bundle I/O: write the zip ``extract`` makes from a compare result, and open one for ``compare``.

A bundle (``bundle.zip`` -> folder ``bundle/``) holds ``hit.h5`` and
``cold.h5`` (valid traces with only the selected tensors and every run and
request record), ``report.md``, ``heatmap.png``, ``replay.jsonl``, an
optional ``noise.json`` and ``manifest.json``; docs/bundles.md describes
each member and the checks made before the zip is moved into place.
``open_bundle`` (``unpack.py``) checks a bundle from a stranger before any member is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from statediff.diff.pair import CompareOptions
from statediff.diff.result import CompareResult, Divergence, no_data_text
from statediff.errors import StatediffError
from statediff.jsonutil import jsonable
from statediff.replay.command import focus_lines
from statediff.trace.layers import drafter_index, layer_text
from statediff.trace.reader import Trace, open_trace
from statediff.trace.schema import DigestEntry, TensorEntry
from statediff.trace.writer import TraceWriter

from .record import build_report
from .select import Entry, Kept, Selection, select
from .unpack import (FORMAT, MEMBERS, VERSION, Bundle, looks_like_bundle, open_bundle, rank_member, rename,
                     sha256_file)

__all__ = ["FORMAT", "MEMBERS", "VERSION", "Bundle", "BundleResult", "compare_bundle", "looks_like_bundle",
           "open_bundle", "write_bundle"]

GITHUB_LIMIT_MB = 25.0  # GitHub's limit for a file attached to an issue or comment
MB = 1_000_000  # GitHub counts decimal megabytes
RAW_FACTOR = 20  # refuse before reading when the selection's raw bytes exceed this x max_mb


@dataclasses.dataclass(frozen=True)
class BundleResult:
    """Outcome of ``extract``; ``exit_code`` is 0 (written).

    Attributes:
        path: the zip written.
        bytes: its size.
        max_mb: the size limit it was checked against (decimal MB).
        members: (name in the zip, bytes uncompressed) of each member.
        root: the root divergence (key and text).
        diagnosis: its diagnosis line, or None.
        kept: the tensors kept.
        source_tensors: tensors in the (hit, cold) source traces.
        verified: what was checked before writing (fingerprints, compare).
        notes: anything skipped (e.g. the heatmap without matplotlib).
        tensor_parallel: a tensor-parallel set's bundle: ``{"world_size", "root_rank", "ranks": [{"rank",
            "hit", "cold"}]}`` as in the manifest (``kept`` is then the root rank's), else None.
        rank_kept: the other ranks' kept tensors (``Kept.to_json()`` with ``rank``), rank order.
    """

    path: str
    bytes: int
    max_mb: float
    members: list[tuple[str, int]]
    root: Divergence
    diagnosis: str | None
    kept: list[Kept]
    source_tensors: tuple[int, int]
    verified: list[str]
    notes: list[str]
    exit_code: int = 0
    tensor_parallel: dict | None = None
    rank_kept: list[dict] = dataclasses.field(default_factory=list)

    def to_text(self) -> str:
        n_hit = sum(k.side == "hit" for k in self.kept)
        lines = [f"wrote {self.path}: {_size(self.bytes)} (limit {self.max_mb:g} MB)",
                 f"  root: {self.root.where()}",
                 f"  diagnosis: {self.diagnosis.removeprefix('diagnosis: ') if self.diagnosis else 'none'}",
                 f"  kept: {n_hit} of {self.source_tensors[0]} hit tensors, {len(self.kept) - n_hit} of "
                 f"{self.source_tensors[1]} cold tensors; all run and request metadata"]
        if self.tensor_parallel is not None:
            tp = self.tensor_parallel
            lines.insert(2, f"  tensor parallel: rank {tp['root_rank']} of {tp['world_size']} is the root rank "
                            f"(hit.h5, cold.h5); every other rank's shards of the root tensor: "
                            f"{len(self.rank_kept)} tensors in "
                            + ", ".join(f"{x['hit']}/{x['cold']}" for x in tp["ranks"]))
        lines += [f"  verified: {v}" for v in self.verified]
        lines += [f"  {name}: {_size(n)}" for name, n in self.members]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return jsonable({"statediff": "extract", "exit_code": self.exit_code, "path": self.path,
                         "bytes": self.bytes, "max_mb": self.max_mb,
                         "members": [{"name": n, "bytes": b} for n, b in self.members],
                         "root": self.root.to_json(), "diagnosis": self.diagnosis,
                         "kept": [k.to_json() for k in self.kept],
                         "source_tensors": list(self.source_tensors), "verified": self.verified,
                         "notes": self.notes, "tensor_parallel": self.tensor_parallel,
                         "rank_kept": self.rank_kept})


def have_matplotlib() -> bool:
    """Whether the heatmap can be drawn (tests replace this function)."""
    return importlib.util.find_spec("matplotlib") is not None


def _size(n: int) -> str:
    return f"{n / MB:.2f} MB" if n >= MB else f"{n / 1000:.1f} kB"


def _copy_trace(src: Trace, entries: Sequence[Entry], out: Path, extra_run: dict) -> list[TensorEntry]:
    """Write ``entries`` of ``src`` (and all its run/request metadata) as a new trace at ``out``:
    index entries with their data (and summary, when recorded), digest rows as digest rows.

    Returns the index entries in the order they were written (dataset ``t<i>`` is the i-th).
    """
    w = TraceWriter(out, dict(src.run) | extra_run, overwrite=True, threads=0)
    try:
        for i in sorted(src.requests):
            rec = dict(src.requests[i])
            prompt = rec.pop("prompt_token_ids", None) or []
            outputs = rec.pop("output_token_ids", None) or []
            request_id = rec.pop("request_id", None)
            rec.pop("index", None)
            w.begin_request(i, request_id, prompt, output_token_ids=outputs, **rec)  # with its logprobs
        order = sorted(entries, key=lambda e: (e.step, e.causal_order))
        for e in order:
            meta = dict(request=e.request, position=e.position, layer=e.layer, kind=e.kind, role=e.role,
                        module=e.module, dtype=e.dtype, token_start=e.token_start, step=e.step, block=e.block)
            if isinstance(e, DigestEntry):
                w.add_digest(e.summary if e.summary is not None else e.digest, shape=e.shape, **meta)
            else:
                w.add(src.read(e), summary=e.summary, **meta)
        w.end_step()
    except BaseException:
        with contextlib.suppress(Exception):
            w.close()
        raise
    w.close()
    return [e for e in order if isinstance(e, TensorEntry)]


def _same_moment(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)


def verify_fingerprints(written: Sequence[TensorEntry], path: Path) -> int:
    """Check that the trace at ``path`` holds ``written`` with the original fingerprints.

    The hash, shape, dtype, key fields, NaN/Inf counts, min and max must be
    equal; sum and sum of squares equal within float64 rounding (their
    reduction order is an implementation detail of the fingerprint code).

    Returns:
        the number of tensors checked.
    Raises:
        StatediffError: a tensor is missing or its fingerprint differs.
    """
    with open_trace(path) as t:
        got = sorted(t.entries, key=lambda e: e.dataset)
        if len(got) != len(written):
            raise StatediffError(f"extracted trace {path.name} holds {len(got)} tensors, "
                                 f"{len(written)} were written")
        for new, old in zip(got, written):
            same = (new.hash == old.hash and new.shape == old.shape and new.dtype == old.dtype
                    and (new.request, new.position, new.layer, new.kind, new.role, new.module,
                         new.token_start, new.step, new.block)
                    == (old.request, old.position, old.layer, old.kind, old.role, old.module,
                        old.token_start, old.step, old.block)
                    and (new.n_nan, new.n_inf, new.min, new.max) == (old.n_nan, old.n_inf, old.min, old.max)
                    and _same_moment(new.sum, old.sum) and _same_moment(new.sumsq, old.sumsq))
            if not same:
                raise StatediffError(f"extracted tensor {old.label()} in {path.name}: its fingerprint "
                                     "differs from the original's")
    return len(written)


def replay_lines(requests: dict[int, dict]) -> list[str]:
    """``replay.jsonl`` lines: every request's prompt token ids and sampling (a conversation file)."""
    out = []
    keys = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    for i in sorted(requests):
        rec = requests[i]
        ids = rec.get("prompt_token_ids") or []
        if not ids:
            continue
        s = rec.get("sampling") if isinstance(rec.get("sampling"), dict) else {}
        line: dict[str, Any] = {"id": f"request-{i}", "prompt_token_ids": ids}
        line |= {k: s[k] for k in keys
                 if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)}
        if isinstance(line.get("top_k"), int) and line["top_k"] <= 0:
            del line["top_k"]  # vLLM's "disabled"
        out.append(json.dumps(line))
    return out


def _bundle_lines(sel: Selection, folder: str, notes: list[str], run: Mapping[str, Any]) -> list[str]:
    """The report's bundle section: each kept tensor (a layer of the drafter named as the drafter's,
    from the hit trace's run metadata ``run``), then the other members."""
    out = [f"`{folder}/hit.h5` and `{folder}/cold.h5` hold only these tensors (and every run and "
           "request record); `statediff compare` finds the same root and diagnosis in them:", "",
           "| trace | request | position | layer | kind | role | why kept |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in sel.kept:
        e = k.entry
        own = drafter_index(run, e.layer, e.kind)
        layer = e.layer if own is None else layer_text(e.layer, own)
        out.append(f"| {k.side} | {e.request} | {e.position} | {layer} | {e.kind} | {e.role} | {k.why} |")
    out += ["", f"Also: `{folder}/report.md` (this record), `{folder}/replay.jsonl` (the prompts and sampling "
            f"of every request, replayable with `statediff record`), `{folder}/manifest.json`"
            + (f", `{folder}/heatmap.png` (error over layer x position, full traces)"
               if not any(n.startswith("heatmap") for n in notes) else "") + "."]
    out += [f"Note: {n}" for n in notes]
    return out


def check_output(out: str | os.PathLike, *, overwrite: bool = False,
                 max_mb: float = GITHUB_LIMIT_MB) -> Path:
    """Refuse a bundle path before any work: not a .zip, exists (without ``overwrite``), no directory.

    Returns:
        ``out`` as a Path.
    Raises:
        StatediffError: one of the above, or ``max_mb`` not finite and above 0.
    """
    if not (math.isfinite(max_mb) and max_mb > 0):
        raise StatediffError(f"--max-mb must be a finite number of MB above 0, not {max_mb:g}")
    if str(out) in ("", "."):
        raise StatediffError("the output path is empty: give a .zip file name, e.g. incident.zip")
    out = Path(out)
    if out.suffix.lower() != ".zip":
        raise StatediffError(f"bundle {out}: the output must be a .zip file")
    if not out.stem.strip("."):  # the stem names the folder inside: '..zip' would name '.'
        raise StatediffError(f"bundle {out}: give the .zip a name before '.zip' (it names the folder inside), "
                             "e.g. incident.zip")
    try:
        out.name.encode("utf-8")
    except UnicodeEncodeError:  # zip member names and the report are UTF-8
        raise StatediffError(f"bundle {ascii(str(out))[1:-1]}: the file name is not valid UTF-8; "
                             "give a UTF-8 name") from None
    if out.is_dir() or (out.exists() and not overwrite):
        raise StatediffError(f"bundle {out} already exists (use --overwrite to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise StatediffError(f"cannot write bundle {out}: directory {parent} does not exist")
    probe = parent / f".{out.name}.probe-{os.getpid()}"  # /sys, /proc, read-only mounts: a real attempt
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise StatediffError(f"cannot write bundle {out}: directory {parent} is not writable "
                             f"({e.strerror or e})") from None
    return out


def write_bundle(result: Any, out: str | os.PathLike, options: CompareOptions = CompareOptions(), *,
                 max_mb: float = GITHUB_LIMIT_MB, neighbours: int = 1, siblings: bool = True,
                 plot: bool = True, overwrite: bool = False) -> BundleResult:
    """Write the bundle of ``result``'s root divergence.

    Stages: open the two traces named by ``result`` once; choose what to keep
    (``_selection``); the notes the reader needs (``_notes``); copy the kept
    tensors and check the copies (``_write_traces``: fingerprints, and
    ``compare`` on the extracted pair, with ``options``, names the same root
    and diagnosis); the other members (``_write_members``); the zip, checked
    against ``max_mb`` (``_fits``) and opened as a reader would (``_opens``:
    ``open_bundle``'s checks); then move it into place.

    A tensor-parallel set (``result`` a ``statediff.diff.ranks.RankedResult``): ``hit.h5`` and
    ``cold.h5`` are the root rank's selection, as above; ``hit.rankR.h5`` and ``cold.rankR.h5``
    hold every other rank R's shards of the root tensor (its key on that rank: every role), and
    nothing more (``_write_ranks``); the manifest's ``tensor_parallel`` field names them.

    Args:
        result: ``compare`` of the full traces, run with ``options`` (a ``CompareResult``), or of
            two tensor-parallel sets (a ``RankedResult``).
        out: the .zip to write (its stem names the folder inside).
        options: the options that judged the pair; they travel in the manifest.
        max_mb: refuse a bundle over this many decimal MB (GitHub: 25).
        neighbours: boundaries kept on each side of the root (``select``).
        siblings: keep the root layer's sibling kinds.
        plot: add the heatmap (needs matplotlib; without it a note says so).
        overwrite: replace an existing ``out``.

    Returns:
        what was written and checked.

    Raises:
        StatediffError: no divergence (nothing to extract), ``out`` refused
            (``check_output``), the bundle does not fit ``max_mb``, or a
            check failed (fingerprints, root, diagnosis); TraceError when a
            trace cannot be read again.
    """
    from statediff.diff.ranks import RankedResult

    out = check_output(out, overwrite=overwrite, max_mb=max_mb)
    parent = out.parent if str(out.parent) else Path(".")
    ranked = result if isinstance(result, RankedResult) else None
    if ranked is not None:
        if ranked.root_rank is None or ranked.root.first is None:
            raise StatediffError(f"no divergence between the tensor-parallel sets {ranked.paths[0][0]} and "
                                 f"{ranked.paths[0][1]} on any of their {ranked.world_size} ranks: nothing to extract")
        result = ranked.root
    if result.first is None:
        raise StatediffError(f"no divergence between {result.hit.path} and {result.cold.path} "
                             f"({result.pairs} pairs within tolerance): nothing to extract")
    folder = out.stem or "bundle"
    with open_trace(result.hit.path) as hit, open_trace(result.cold.path) as cold:
        traces = {"hit": hit, "cold": cold}
        sel = _selection(result, traces, max_mb, neighbours, siblings)
        notes = _notes(result, traces)
        tp, rank_kept = _tp_field(ranked, folder, notes), []
        with tempfile.TemporaryDirectory(prefix=".statediff-bundle-", dir=parent) as tmp:
            d = Path(tmp) / folder
            d.mkdir()
            verified = _write_traces(result, traces, sel, d, options)
            if ranked is not None:
                rank_kept = _write_ranks(ranked, sel.root, d, verified)
            diag = _write_members(result, sel, d, folder, out, options, notes, plot, tp, rank_kept)
            tmp_zip = Path(tmp) / "bundle.zip"
            members = _write_zip(tmp_zip, d, folder)
            size = _fits(tmp_zip, members, max_mb, hint=bool(neighbours or siblings))
            verified.append(_opens(tmp_zip, out))
            try:
                os.replace(tmp_zip, out)
            except OSError as e:
                raise StatediffError(f"cannot write bundle {out}: {e.strerror or e}") from None
        source = (len(hit.entries) + len(hit.digests), len(cold.entries) + len(cold.digests))
    return BundleResult(path=str(out), bytes=size, max_mb=max_mb, members=members, root=result.first,
                        diagnosis=diag, kept=list(sel.kept), source_tensors=source, verified=verified, notes=notes,
                        tensor_parallel=tp, rank_kept=rank_kept)


def _selection(result: CompareResult, traces: dict[str, Trace], max_mb: float, neighbours: int,
               siblings: bool) -> Selection:
    """What the bundle keeps (``select``), refused before anything is read when its raw bytes are far
    over the size limit (``RAW_FACTOR`` x ``max_mb``)."""
    hit, cold = traces["hit"], traces["cold"]
    sel = select(result, [*hit.entries, *hit.digests], [*cold.entries, *cold.digests],
                 neighbours=neighbours, siblings=siblings)
    raw = sum(traces[k.side].nbytes(k.entry) for k in sel.kept if isinstance(k.entry, TensorEntry))
    if raw > RAW_FACTOR * max_mb * MB:
        raise StatediffError(f"the tensors to extract hold {_size(raw)} uncompressed: far over "
                             f"--max-mb {max_mb:g} (try --no-neighbours)")
    return sel


def _notes(result: CompareResult, traces: dict[str, Trace]) -> list[str]:
    """What the reader of the bundle must know: partial sources, a root without data (and the
    commands that record it)."""
    notes = [f"{t.path} is partial ({t.partial_reason}); its extract is a complete file"
             for t in traces.values() if t.partial]
    if not all(result.first.data):  # the bundle can hold only what the traces hold: say how to get it
        notes.append(f"the root has {no_data_text(result.first.data)}: the bundle holds its summary, "
                     "not its values; to record them, replay both runs again keeping data around the "
                     "root: " + "; ".join(line.text for line in focus_lines(
                         result.hit.run, result.cold.run, result.focus, (result.hit.path, result.cold.path))))
    return notes


def _write_traces(result: CompareResult, traces: dict[str, Trace], sel: Selection, d: Path,
                  options: CompareOptions) -> list[str]:
    """Write ``hit.h5``/``cold.h5`` (and ``noise.json``) into ``d`` and check them: the copies'
    fingerprints equal the originals', and ``compare`` on them names the same root and diagnosis.

    Returns:
        what was verified, one line each.
    """
    from statediff.diff.compare import compare

    written = {}
    for side, src in (("hit", result.hit.path), ("cold", result.cold.path)):
        t = traces[side]
        extra = {"extracted_from": {"path": src, "partial": t.partial, "tensors": len(t.entries) + len(t.digests),
                                    "kept": len(sel.entries(side)), "root": list(sel.root)}}
        written[side] = _copy_trace(t, sel.entries(side), d / f"{side}.h5", extra)
    verified = [f"fingerprints of {verify_fingerprints(written['hit'], d / 'hit.h5')} hit and "
                f"{verify_fingerprints(written['cold'], d / 'cold.h5')} cold tensors equal the originals"]
    if options.noise is not None:
        shutil.copyfile(options.noise, d / "noise.json")
    again = compare(d / "hit.h5", d / "cold.h5",
                    **(options.kwargs() | {"noise": d / "noise.json" if options.noise is not None else None}))
    _check_same(result, again)
    verified.append("statediff compare on the extracted pair finds the same root and diagnosis")
    return verified


def _tp_field(ranked: Any, folder: str, notes: list[str]) -> dict | None:
    """The manifest's ``tensor_parallel`` field of a set's bundle (None for a pair), and its note
    (appended to ``notes``): which member holds which rank."""
    if ranked is None:
        return None
    tp = {"world_size": ranked.world_size, "root_rank": ranked.root_rank,
          "ranks": [{"rank": r, "hit": rank_member("hit", r), "cold": rank_member("cold", r)}
                    for r in range(ranked.world_size) if r != ranked.root_rank]}
    notes.append(f"tensor parallel: {folder}/hit.h5 and {folder}/cold.h5 hold rank {ranked.root_rank} "
                 f"of {ranked.world_size} (the root rank: its first divergence comes first); "
                 + ", ".join(f"{folder}/{x['hit']} and {folder}/{x['cold']}" for x in tp["ranks"])
                 + " hold that rank's shards of the root tensor only")
    return tp


def _write_ranks(ranked: Any, root: tuple, d: Path, verified: list[str]) -> list[dict]:
    """Write ``hit.rankR.h5``/``cold.rankR.h5`` into ``d`` for every rank R but the root rank: each
    holds that rank's tensors at the root key (request, position, layer, kind; every role; digest rows
    as digest rows) and every run and request record; their fingerprints are checked against the
    originals (a line appended to ``verified``).

    Returns:
        the kept tensors, ``Kept.to_json()`` with ``rank``, rank order, hit side first.
    Raises:
        StatediffError: a rank's trace lacks the root key (the set's ranks do not hold the same tensors).
    """
    kept, n = [], 0
    for r, paths in enumerate(ranked.paths):
        if r == ranked.root_rank:
            continue
        for side, src in zip(("hit", "cold"), paths):
            with open_trace(src) as t:
                entries = [e for e in [*t.entries, *t.digests] if (e.request, e.position, e.layer, e.kind) == root]
                if not entries:
                    raise StatediffError(f"{src} (rank {r}) holds no tensor at the root (request {root[0]}, position "
                                         f"{root[1]}, layer {root[2]}, {root[3]}): the ranks of the set do not "
                                         "hold the same tensors")
                extra = {"extracted_from": {"path": str(src), "partial": t.partial,
                                            "tensors": len(t.entries) + len(t.digests), "kept": len(entries),
                                            "root": list(root), "rank": r}}
                written = _copy_trace(t, entries, d / rank_member(side, r), extra)
            n += verify_fingerprints(written, d / rank_member(side, r))
            kept += [Kept(side, e, "this rank's shard of the root tensor").to_json() | {"rank": r} for e in entries]
    verified.append(f"fingerprints of {n} tensors of the other ranks' shards of the root equal the originals")
    return kept


def _write_members(result: CompareResult, sel: Selection, d: Path, folder: str, out: Path,
                   options: CompareOptions, notes: list[str], plot: bool, tp: dict | None = None,
                   rank_kept: Sequence[dict] = ()) -> str | None:
    """Write ``heatmap.png`` (when asked and possible; else a note), ``replay.jsonl``, ``report.md``
    and ``manifest.json`` into ``d``. Returns the root's diagnosis line (None: none)."""
    if not plot:
        notes.append("heatmap skipped (--no-plot)")
    elif not have_matplotlib():
        notes.append("heatmap skipped: matplotlib is not installed (pip install 'statediff[plot]')")
    else:
        from statediff.diff.plot import write_plot

        write_plot(result, d / "heatmap.png")
    (d / "replay.jsonl").write_text("\n".join(replay_lines(result.hit.requests)) + "\n", encoding="utf-8")
    diag = result.diagnosis_for(sel.root)
    diag = diag.text if diag is not None else None
    report = build_report(result, options, bundle=out.name, bundle_lines=_bundle_lines(sel, folder, notes, result.hit.run),
                          replay_file=f"{folder}/replay.jsonl")
    (d / "report.md").write_text(report.to_markdown(), encoding="utf-8")
    noise = options.noise is not None
    noise_name = "noise.json" if noise else None
    members = {name: {"bytes": (d / name).stat().st_size, "sha256": sha256_file(d / name)}
               for name in _member_names(tp) if name != "manifest.json" and (d / name).exists()}
    root_rank = {} if tp is None else {"rank": tp["root_rank"]}
    manifest = {"format": FORMAT, "version": VERSION if tp is not None else 2, "folder": folder, "members": members,
                "root": list(sel.root), "diagnosis": diag,
                "compare_options": options.argv(noise_name and f"{folder}/noise.json"),
                "tol": list(options.tol), "noise": noise_name,
                "noise_factor": options.factor if noise else None,
                **{flag: getattr(options, flag) for flag in CompareOptions.FLAGS},
                "sources": {"hit": result.hit.path, "cold": result.cold.path},
                "kept": [k.to_json() | root_rank for k in sel.kept] + list(rank_kept), "notes": notes}
    if tp is not None:
        manifest["tensor_parallel"] = tp
    (d / "manifest.json").write_text(json.dumps(jsonable(manifest), indent=1) + "\n", encoding="utf-8")
    return diag


def _fits(zip_path: Path, members: list[tuple[str, int]], max_mb: float, hint: bool) -> int:
    """The zip's size; refuses one over ``max_mb`` (naming each member's size)."""
    size = zip_path.stat().st_size
    if size > max_mb * MB:
        parts = ", ".join(f"{n} {_size(b)}" for n, b in members)
        raise StatediffError(f"the bundle would be {_size(size)}, over --max-mb {max_mb:g} ({parts})"
                             + ("; try --no-neighbours" if hint else ""))
    return size


def _opens(zip_path: Path, out: Path) -> str:
    """The zip written must pass every check a reader makes (``open_bundle``); one verified line."""
    try:
        with open_bundle(zip_path):
            pass
    except StatediffError as e:
        raise StatediffError(f"internal check failed: bundle {out} would not open: "
                             f"{str(e).replace(str(zip_path), str(out))}") from None
    return "the zip opens as a bundle: members, sizes, SHA-256 hashes, root and kept tensors checked"


def _check_same(full: CompareResult, part: CompareResult) -> None:
    """The extracted pair must reproduce the full pair's root and diagnosis."""
    a, b = full.first, part.first
    if b is None or a.key != b.key:
        raise StatediffError(f"internal check failed: compare on the extracted pair names "
                             f"{b.where() if b else 'no divergence'} instead of {a.where()}")

    def diag(res: CompareResult) -> tuple | None:
        g = res.diagnosis_for(a.key)
        return None if g is None else (g.finding, g.exact, g.match_request, g.match_position)

    if diag(full) != diag(part):
        raise StatediffError(f"internal check failed: the extracted pair's diagnosis {diag(part)} differs "
                             f"from the full pair's {diag(full)}")


def _member_names(tp: dict | None) -> list[str]:
    """Every member a bundle may hold: ``MEMBERS``, then a tensor-parallel bundle's rank traces."""
    ranks = [x[side] for x in (tp or {}).get("ranks", []) for side in ("hit", "cold")]
    return [*MEMBERS[:2], *ranks, *MEMBERS[2:]]


def _write_zip(path: Path, d: Path, folder: str) -> list[tuple[str, int]]:
    members = []
    tp = json.loads((d / "manifest.json").read_text(encoding="utf-8")).get("tensor_parallel")
    with zipfile.ZipFile(path, "w") as z:
        for name in _member_names(tp):
            f = d / name
            if not f.exists():
                continue
            # traces are Zstandard-compressed already: stored; text deflated
            method = zipfile.ZIP_STORED if name.endswith((".h5", ".png")) else zipfile.ZIP_DEFLATED
            z.write(f, f"{folder}/{name}", compress_type=method)
            members.append((f"{folder}/{name}", f.stat().st_size))
    return members


def compare_bundle(path: str | os.PathLike, options: CompareOptions = CompareOptions(),
                   **kw: Any) -> Any:
    """``compare`` the two traces of a bundle, with the bundle's own options unless given.

    ``options.tol``, ``options.noise`` and ``options.noise_factor`` default
    to those the bundle was extracted with (its manifest); a flag (``allow_*``, ``strict_hits``) is
    on when either asks for it. Other keywords (``max_listed``,
    ``progress``, ``stop_at_first``) go to ``compare``. The result names the
    traces as ``bundle.zip:folder/hit.h5``.

    A bundle holds only the tensors around its root (a subset of the traces): ``--tol``,
    ``--noise`` or ``--noise-factor`` other than the bundle's own would judge tensors it does not
    hold, and are refused.

    A tensor-parallel bundle returns a ``statediff.diff.ranks.RankedResult``: each rank's pair
    compared (the root rank's ``hit.h5``/``cold.h5``, every other rank's shards of the root), whose
    root rank must be the manifest's.

    Raises:
        StatediffError: not a readable bundle; options that change the root; as ``compare`` otherwise.
    """
    from statediff.diff.compare import compare

    with open_bundle(path) as b:
        m = b.manifest
        raw_tol = m.get("tol") or []
        if not (isinstance(raw_tol, list) and all(isinstance(x, str) for x in raw_tol)):
            raise StatediffError(f"bundle {path}: its manifest's tol {raw_tol!r:.80} is not a list of --tol "
                                 "options (strings)")
        own_tol = tuple(raw_tol)
        changed = [name for name, given, own in (("--tol", options.tol and tuple(options.tol), own_tol),
                                                 ("--noise", options.noise, None),
                                                 ("--noise-factor", options.noise_factor, m.get("noise_factor")))
                   if given and given != own]
        if changed:
            raise StatediffError(f"bundle {path} holds only the tensors around its root, a subset of the traces: "
                                 f"{' and '.join(changed)} would judge tensors it does not hold; compare the "
                                 "original traces with them (the bundle keeps the options it was extracted with)")
        own_factor = m.get("noise_factor")
        if own_factor is not None and not (isinstance(own_factor, (int, float)) and not isinstance(own_factor, bool)
                                           and math.isfinite(own_factor) and own_factor > 0):
            raise StatediffError(f"bundle {path}: its manifest's noise_factor {own_factor!r} is not a finite "
                                 "number above 0")
        tol = options.tol or own_tol
        noise, factor = options.noise, options.noise_factor
        if noise is None and b.noise is not None:
            noise = str(b.noise)
            if factor is None and isinstance(m.get("noise_factor"), (int, float)):
                factor = float(m["noise_factor"])
        flags = {key: getattr(options, key) or m.get(key) is True for key in CompareOptions.FLAGS}
        used = CompareOptions(tol=tuple(tol), noise=noise, noise_factor=factor, **flags)
        result = compare(b.hit, b.cold, **used.kwargs(), **kw)
        _check_root(b, result)
        others = {r: compare(h, c, **used.kwargs(), **kw) for r, (h, c) in b.ranks.items()}
        # the traces were unpacked to a temporary directory: name them by the zip instead
        warnings = []
        for w in result.warnings:
            w = rename(w, b.hit.parent, b)
            for n in ("hit.h5", "cold.h5"):  # verify takes the bundle, not a member
                w = w.replace(f"'statediff verify {b.name(n)}'", f"'statediff verify {b.path}'")
            warnings.append(w)
        policy = rename(result.policy, b.hit.parent, b)  # "noise file <tmp>/noise.json (...)"
    result = dataclasses.replace(
        result, hit=dataclasses.replace(result.hit, path=b.name("hit.h5")),
        cold=dataclasses.replace(result.cold, path=b.name("cold.h5")), warnings=warnings, policy=policy)
    if not others:
        return result
    from statediff.diff.ranks import RankedResult, _root_rank

    n = b.manifest["tensor_parallel"]["world_size"]
    names = {r: (rank_member("hit", r), rank_member("cold", r)) for r in others} | {b.root_rank: ("hit.h5", "cold.h5")}
    results = [result if r == b.root_rank else others[r] for r in range(n)]
    root_rank = _root_rank(results)
    if root_rank != b.root_rank:
        raise StatediffError(f"bundle {b.path}: its ranks' first divergences put the root at rank {root_rank}, but "
                             f"its manifest names rank {b.root_rank}: the bundle is not what 'statediff extract' "
                             f"checked (run 'statediff verify {b.path}')")
    return RankedResult(n, [(Path(b.name(names[r][0])), Path(b.name(names[r][1]))) for r in range(n)], results,
                        root_rank)


def _check_root(b: Bundle, result: CompareResult) -> None:
    """``compare`` on the bundle must name the root its manifest names (``extract`` checked that
    before writing it): anything else is a tampered or damaged bundle, refused rather than judged."""
    want = tuple(b.manifest["root"])
    got = result.first
    if got is None or got.key != want:
        found = "no divergence" if got is None else f"the first divergence at {got.where()}"
        raise StatediffError(
            f"bundle {b.path}: compare finds {found}, but its manifest names the root at request {want[0]}, "
            f"position {want[1]}, layer {want[2]}, {want[3]}: the bundle is not what 'statediff extract' "
            f"checked (run 'statediff verify {b.path}')")
