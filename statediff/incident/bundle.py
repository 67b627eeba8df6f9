"""``extract``: the smallest pair of traces that still shows the root divergence, in one .zip.

A bundle is what a user attaches to an upstream bug report. It holds, under
one folder named after the zip (``bundle.zip`` -> ``bundle/``):

- ``hit.h5``, ``cold.h5``: valid traces (written with ``TraceWriter``, so
  the same format) holding only
  1. the first divergent tensor (the root), on both sides;
  2. the same layer's tensors of the root's kind and its sibling kinds
     (e.g. conv and SSM state; K and V) at the root position and at
     ``neighbours`` boundaries on each side of it in that request, on both
     sides (the union of both traces' positions: in the hit trace the
     boundary before a hit often exists only on the cold side);
  3. the cold tensor the diagnosis says the wrong hit tensor matches (e.g.
     the cold state one block earlier), if any;
  and ALL run metadata and request records (token ids, hit lengths, chunks,
  acceptance). The run metadata gains one key, ``extracted_from``.
- ``report.md``: the incident record (``statediff.incident.record``) of the full
  traces, with a section listing what the bundle keeps and why.
- ``heatmap.png``: ``compare --plot`` of the full traces (skipped, with a
  note, when matplotlib is missing or with ``plot=False``).
- ``replay.jsonl``: the prompts (token ids) and sampling of every request,
  a conversation file ``statediff record`` replays as is.
- ``noise.json``: the noise file the pair was judged with, if any.
- ``manifest.json``: format, the compare options, the root, the diagnosis,
  the tensors kept and why, member sizes.

Before the zip is moved into place, ``extract`` checks that (a) every
extracted tensor's fingerprint (hash, NaN/Inf counts, min, max; sums within
float64 rounding) equals the original's, (b) ``compare`` on the extracted
pair, with the same options, names the same root (request, position, layer,
kind) and the same diagnosis, and (c) the zip fits ``max_mb`` (default 25
MB: GitHub's attachment limit). Any failure is a ``StatediffError`` and no
file is left behind.

``open_bundle`` unpacks a bundle's traces for ``statediff compare
bundle.zip`` (only the known members, size-checked, under fixed names).
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.diff.result import CompareResult, Divergence
from statediff.jsonutil import jsonable
from statediff.trace.reader import Trace, open_trace
from statediff.trace.schema import TensorEntry
from statediff.trace.writer import TraceWriter

FORMAT = "statediff.bundle"
VERSION = 1
GITHUB_LIMIT_MB = 25.0  # GitHub's limit for a file attached to an issue or comment
MB = 1_000_000  # GitHub counts decimal megabytes
MAX_MEMBER_BYTES = 4 << 30  # open_bundle refuses members declaring more (zip bombs)
RAW_FACTOR = 20  # refuse before reading when the selection's raw bytes exceed this x max_mb
MEMBERS = ("hit.h5", "cold.h5", "report.md", "heatmap.png", "replay.jsonl", "noise.json", "manifest.json")

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class Kept:
    """One tensor kept in the bundle: which trace it is from and why it was kept."""

    side: str  # "hit" or "cold"
    entry: TensorEntry
    why: str

    def to_json(self) -> dict:
        e = self.entry
        return {"side": self.side, "request": e.request, "position": e.position, "layer": e.layer,
                "kind": e.kind, "role": e.role, "module": e.module, "dtype": e.dtype,
                "shape": list(e.shape), "hash": e.hash, "why": self.why}


@dataclasses.dataclass
class Selection:
    """What a bundle keeps of each trace (entries in causal order)."""

    root: tuple[int, int, int, str]
    kept: list[Kept]

    def entries(self, side: str) -> list[TensorEntry]:
        return [k.entry for k in self.kept if k.side == side]


@dataclasses.dataclass
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

    def to_text(self) -> str:
        n_hit = sum(k.side == "hit" for k in self.kept)
        lines = [f"wrote {self.path}: {_size(self.bytes)} (limit {self.max_mb:g} MB)",
                 f"  root: {self.root.where()}",
                 f"  diagnosis: {self.diagnosis.removeprefix('diagnosis: ') if self.diagnosis else 'none'}",
                 f"  kept: {n_hit} of {self.source_tensors[0]} hit tensors, {len(self.kept) - n_hit} of "
                 f"{self.source_tensors[1]} cold tensors; all run and request metadata"]
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
                         "notes": self.notes})


def have_matplotlib() -> bool:
    """Whether the heatmap can be drawn (tests replace this function)."""
    return importlib.util.find_spec("matplotlib") is not None


def _size(n: int) -> str:
    return f"{n / MB:.2f} MB" if n >= MB else f"{n / 1000:.1f} kB"


def select(result: CompareResult, hit: Trace, cold: Trace, *, neighbours: int = 1,
           siblings: bool = True) -> Selection:
    """Choose the tensors a bundle keeps for ``result``'s first (root) divergence.

    Args:
        result: ``compare`` of ``hit`` against ``cold`` (with a divergence).
        hit, cold: the open traces.
        neighbours: boundaries kept on each side of the root position (0: none).
        siblings: keep the layer's other kinds (conv with SSM, V with K).

    Raises:
        StatediffError: ``result`` has no divergence.
    """
    root = result.first
    if root is None:
        raise StatediffError("no divergence: nothing to extract")
    r, p, layer, kind = root.key
    scope = (lambda e: e.request == r and e.layer == layer and (siblings or e.kind == kind))
    kinds = {e.kind for t in (hit, cold) for e in t.entries if scope(e)}
    positions = sorted({e.position for t in (hit, cold) for e in t.entries if scope(e)})
    i = positions.index(p) if p in positions else 0
    near = set(positions[max(0, i - neighbours): i + neighbours + 1]) | {p}
    match = None
    for g in result.diagnoses:
        if (g.request, g.position, g.layer, g.kind) == root.key and g.match_request is not None:
            match = (g.match_request, g.match_position, g.layer, g.kind)
            break
    kept = []
    for side, t in (("hit", hit), ("cold", cold)):
        for e in t.entries:
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
    return Selection(root.key, kept)


def _copy_trace(src: Trace, entries: Sequence[TensorEntry], out: Path, extra_run: dict) -> list[TensorEntry]:
    """Write ``entries`` of ``src`` (and all its run/request metadata) as a new trace at ``out``.

    Returns the entries in the order they were written (dataset ``t<i>`` is the i-th).
    """
    w = TraceWriter(out, dict(src.run) | extra_run, overwrite=True, threads=0)
    try:
        for i in sorted(src.requests):
            rec = dict(src.requests[i])
            prompt = rec.pop("prompt_token_ids", None) or []
            outputs = rec.pop("output_token_ids", None) or []
            request_id = rec.pop("request_id", None)
            rec.pop("index", None)
            w.begin_request(i, request_id, prompt, **rec)
            w.update_request(i, output_token_ids=outputs)
        order = sorted(entries, key=lambda e: (e.step, e.causal_order))
        for e in order:
            w.add(src.read(e), request=e.request, position=e.position, layer=e.layer, kind=e.kind,
                  role=e.role, module=e.module, dtype=e.dtype, token_start=e.token_start, step=e.step,
                  block=e.block)
        w.end_step()
    except BaseException:
        with contextlib.suppress(Exception):
            w.close()
        raise
    w.close()
    return order


def _same_moment(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-300


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


def _bundle_lines(sel: Selection, folder: str, notes: list[str]) -> list[str]:
    out = [f"`{folder}/hit.h5` and `{folder}/cold.h5` hold only these tensors (and every run and "
           "request record); `statediff compare` finds the same root and diagnosis in them:", "",
           "| trace | request | position | layer | kind | role | why kept |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in sel.kept:
        e = k.entry
        out.append(f"| {k.side} | {e.request} | {e.position} | {e.layer} | {e.kind} | {e.role} | {k.why} |")
    out += ["", f"Also: `{folder}/report.md` (this record), `{folder}/replay.jsonl` (the prompts and sampling "
            f"of every request, replayable with `statediff record`), `{folder}/manifest.json`"
            + (f", `{folder}/heatmap.png` (error over layer x position, full traces)"
               if not any(n.startswith("heatmap") for n in notes) else "") + "."]
    out += [f"Note: {n}" for n in notes]
    return out


def extract(hit_path: PathLike, cold_path: PathLike, out: PathLike, *, max_mb: float = GITHUB_LIMIT_MB,
            neighbours: int = 1, siblings: bool = True, plot: bool = True, overwrite: bool = False,
            tol: Sequence[str] = (), noise: PathLike | None = None, noise_factor: float | None = None,
            allow_engine_mismatch: bool = False, allow_noise_in_exact: bool = False,
            progress: bool = False) -> BundleResult:
    """Write the bundle of the root divergence between ``hit_path`` and ``cold_path``.

    Args:
        hit_path, cold_path: the full traces.
        out: the .zip to write (its stem names the folder inside).
        max_mb: refuse a bundle over this many decimal MB (GitHub: 25).
        neighbours: boundaries kept on each side of the root (``select``).
        siblings: keep the root layer's sibling kinds.
        plot: add the heatmap (needs matplotlib; without it a note says so).
        overwrite: replace an existing ``out``.
        tol, noise, noise_factor, allow_engine_mismatch, allow_noise_in_exact:
            the ``compare`` options; the same ones judge the extracted pair.
        progress: progress bar for the full comparison.

    Returns:
        what was written and checked.

    Raises:
        StatediffError: no divergence (nothing to extract), ``out`` exists
            or cannot be written, the bundle does not fit ``max_mb``, or a
            check failed (fingerprints, root, diagnosis); TraceError and
            MismatchError as ``compare``.
    """
    from statediff.diff.compare import compare
    from statediff.incident.record import build_report, compare_options
    from statediff.diff.noise import DEFAULT_FACTOR

    out = Path(out)
    if out.suffix.lower() != ".zip":
        raise StatediffError(f"bundle {out}: the output must be a .zip file")
    if out.is_dir() or (out.exists() and not overwrite):
        raise StatediffError(f"bundle {out} already exists (use --overwrite to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise StatediffError(f"cannot write bundle {out}: directory {parent} does not exist")
    if not max_mb > 0:
        raise StatediffError(f"--max-mb must be positive, not {max_mb:g}")
    factor = DEFAULT_FACTOR if noise_factor is None else noise_factor
    options = dict(tol=list(tol), noise=noise, noise_factor=factor, allow_engine_mismatch=allow_engine_mismatch,
                   allow_noise_in_exact=allow_noise_in_exact)
    result = compare(hit_path, cold_path, progress=progress, **options)
    if result.first is None:
        raise StatediffError(f"no divergence between {hit_path} and {cold_path} ({result.pairs} pairs "
                             "within tolerance): nothing to extract")
    folder = out.stem or "bundle"
    notes: list[str] = []
    with open_trace(hit_path) as hit, open_trace(cold_path) as cold:
        sel = select(result, hit, cold, neighbours=neighbours, siblings=siblings)
        raw = sum(hit.nbytes(k.entry) if k.side == "hit" else cold.nbytes(k.entry) for k in sel.kept)
        if raw > RAW_FACTOR * max_mb * MB:
            raise StatediffError(f"the tensors to extract hold {_size(raw)} uncompressed: far over "
                                 f"--max-mb {max_mb:g} (try --no-neighbours)")
        runs = (dict(hit.run), dict(cold.run))
        reqs = (dict(hit.requests), dict(cold.requests))
        for t in (hit, cold):
            if t.partial:
                notes.append(f"{t.path} is partial ({t.partial_reason}); its extract is a complete file")
        with tempfile.TemporaryDirectory(prefix=".statediff-bundle-", dir=parent) as tmp:
            d = Path(tmp) / folder
            d.mkdir()
            written = {}
            for side, t, src_path in (("hit", hit, hit_path), ("cold", cold, cold_path)):
                extra = {"extracted_from": {"path": str(src_path), "partial": t.partial,
                                            "tensors": len(t.entries), "kept": len(sel.entries(side)),
                                            "root": list(sel.root)}}
                written[side] = _copy_trace(t, sel.entries(side), d / f"{side}.h5", extra)
            verified = [f"fingerprints of {verify_fingerprints(written['hit'], d / 'hit.h5')} hit and "
                        f"{verify_fingerprints(written['cold'], d / 'cold.h5')} cold tensors equal the originals"]
            noise_name = None
            if noise is not None:
                shutil.copyfile(noise, d / "noise.json")
                noise_name = "noise.json"
            again = compare(d / "hit.h5", d / "cold.h5", **(options | {"noise": d / "noise.json"
                                                                        if noise_name else None}))
            _check_same(result, again)
            verified.append("statediff compare on the extracted pair finds the same root and diagnosis")
            if not plot:
                notes.append("heatmap skipped (--no-plot)")
            elif not have_matplotlib():
                notes.append("heatmap skipped: matplotlib is not installed (pip install 'statediff[plot]')")
            else:
                from statediff.diff.plot import plot as write_plot

                write_plot(result, d / "heatmap.png")
            (d / "replay.jsonl").write_text("\n".join(replay_lines(reqs[0])) + "\n", encoding="utf-8")
            diag = next((g.text for g in result.diagnoses
                         if (g.request, g.position, g.layer, g.kind) == sel.root), None)
            opts = compare_options([str(x) for x in tol], noise_name and f"{folder}/noise.json",
                                   factor if noise is not None else None)
            report = build_report(result, *runs, *reqs, tol=[str(x) for x in tol],
                                  noise=None if noise is None else str(noise),
                                  noise_factor=factor if noise is not None else None,
                                  bundle=out.name, bundle_lines=_bundle_lines(sel, folder, notes),
                                  replay_file=f"{folder}/replay.jsonl")
            (d / "report.md").write_text(report.to_markdown(), encoding="utf-8")
            manifest = {"format": FORMAT, "version": VERSION, "folder": folder,
                        "root": list(sel.root), "diagnosis": diag, "compare_options": opts,
                        "tol": [str(x) for x in tol], "noise": noise_name,
                        "noise_factor": factor if noise is not None else None,
                        "allow_engine_mismatch": allow_engine_mismatch,
                        "allow_noise_in_exact": allow_noise_in_exact,
                        "sources": {"hit": str(hit_path), "cold": str(cold_path)},
                        "kept": [k.to_json() for k in sel.kept], "notes": notes}
            (d / "manifest.json").write_text(json.dumps(jsonable(manifest), indent=1) + "\n", encoding="utf-8")
            tmp_zip = Path(tmp) / "bundle.zip"
            members = _write_zip(tmp_zip, d, folder)
            size = tmp_zip.stat().st_size
            if size > max_mb * MB:
                parts = ", ".join(f"{n} {_size(b)}" for n, b in members)
                hint = "; try --no-neighbours" if neighbours or siblings else ""
                raise StatediffError(f"the bundle would be {_size(size)}, over --max-mb {max_mb:g} "
                                     f"({parts}){hint}")
            try:
                os.replace(tmp_zip, out)
            except OSError as e:
                raise StatediffError(f"cannot write bundle {out}: {e.strerror or e}") from None
    return BundleResult(path=str(out), bytes=size, max_mb=max_mb, members=members, root=result.first,
                        diagnosis=diag, kept=sel.kept,
                        source_tensors=(len(hit.entries), len(cold.entries)), verified=verified, notes=notes)


def _check_same(full: CompareResult, part: CompareResult) -> None:
    """The extracted pair must reproduce the full pair's root and diagnosis."""
    a, b = full.first, part.first
    if b is None or a.key != b.key:
        raise StatediffError(f"internal check failed: compare on the extracted pair names "
                             f"{b.where() if b else 'no divergence'} instead of {a.where()}")

    def diag(res: CompareResult) -> tuple | None:
        for g in res.diagnoses:
            if (g.request, g.position, g.layer, g.kind) == a.key:
                return (g.finding, g.exact, g.match_request, g.match_position)
        return None

    if diag(full) != diag(part):
        raise StatediffError(f"internal check failed: the extracted pair's diagnosis {diag(part)} differs "
                             f"from the full pair's {diag(full)}")


def _write_zip(path: Path, d: Path, folder: str) -> list[tuple[str, int]]:
    members = []
    with zipfile.ZipFile(path, "w") as z:
        for name in MEMBERS:
            f = d / name
            if not f.exists():
                continue
            # traces are Zstandard-compressed already: stored; text deflated
            method = zipfile.ZIP_STORED if name.endswith((".h5", ".png")) else zipfile.ZIP_DEFLATED
            z.write(f, f"{folder}/{name}", compress_type=method)
            members.append((f"{folder}/{name}", f.stat().st_size))
    return members


@dataclasses.dataclass
class Bundle:
    """An unpacked bundle: paths of its traces (and noise file) plus its manifest."""

    path: str
    hit: Path
    cold: Path
    noise: Path | None
    manifest: dict


def is_bundle(path: PathLike) -> bool:
    """True when ``path`` is a zip file (``open_bundle`` then says whether it is a bundle)."""
    p = Path(path)
    return p.is_file() and zipfile.is_zipfile(p)


@contextlib.contextmanager
def open_bundle(path: PathLike) -> Iterator[Bundle]:
    """Unpack a bundle's traces (and noise file) into a temporary directory.

    Only the members named in ``MEMBERS`` under the manifest's folder are
    read, each at most ``MAX_MEMBER_BYTES`` and written under a fixed name,
    so a hostile zip cannot write elsewhere or fill the disk.

    Raises:
        StatediffError: not a zip, no ``manifest.json``, another format or a
            newer version, a missing trace member, or an oversized member.
    """
    p = Path(path)
    try:
        z = zipfile.ZipFile(p)
    except (OSError, zipfile.BadZipFile) as e:
        raise StatediffError(f"{p} is not a statediff bundle (not a readable zip: {e})") from None
    with z, tempfile.TemporaryDirectory(prefix="statediff-bundle-") as tmp:
        infos = {i.filename: i for i in z.infolist()}
        manifests = [n for n in infos if n.count("/") == 1 and n.endswith("/manifest.json")]
        if len(manifests) != 1:
            raise StatediffError(f"{p} is not a statediff bundle (no single <folder>/manifest.json; "
                                 "write one with 'statediff extract')")
        folder = manifests[0].split("/")[0]

        def member(name: str, required: bool = True) -> Path | None:
            info = infos.get(f"{folder}/{name}")
            if info is None:
                if required:
                    raise StatediffError(f"bundle {p} has no {folder}/{name}")
                return None
            if info.file_size > MAX_MEMBER_BYTES:
                raise StatediffError(f"bundle {p}: {info.filename} declares {info.file_size} bytes "
                                     f"(limit {MAX_MEMBER_BYTES})")
            dst = Path(tmp) / name
            try:
                with z.open(info) as src, open(dst, "wb") as f:
                    copied = 0
                    while chunk := src.read(1 << 20):
                        copied += len(chunk)
                        if copied > info.file_size:
                            raise StatediffError(f"bundle {p}: {info.filename} is longer than it declares")
                        f.write(chunk)
            except (OSError, zipfile.BadZipFile, EOFError, RuntimeError) as e:
                raise StatediffError(f"bundle {p}: cannot read {info.filename} ({e})") from None
            return dst

        mpath = member("manifest.json")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise StatediffError(f"bundle {p}: manifest.json is not valid JSON") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise StatediffError(f"{p} is not a statediff bundle (manifest format "
                                 f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
        version = manifest.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise StatediffError(f"bundle {p} has version {version!r}; this statediff reads up to {VERSION}")
        yield Bundle(str(p), member("hit.h5"), member("cold.h5"),
                     member("noise.json", required=False) if manifest.get("noise") else None, manifest)


def compare_bundle(path: PathLike, *, tol: Sequence[str] = (), noise: PathLike | None = None,
                   **kw: Any) -> CompareResult:
    """``compare`` the two traces of a bundle, with the bundle's own options unless given.

    ``tol`` and ``noise`` default to those the bundle was extracted with
    (its manifest); other keywords go to ``compare``. The result names the
    traces as ``bundle.zip:folder/hit.h5``.

    Raises:
        StatediffError: not a readable bundle; as ``compare`` otherwise.
    """
    from statediff.diff.compare import compare

    with open_bundle(path) as b:
        m = b.manifest
        tol = tuple(tol) or tuple(str(x) for x in m.get("tol") or [] if isinstance(x, str))
        if noise is None and b.noise is not None:
            noise = b.noise
            if isinstance(m.get("noise_factor"), (int, float)) and "noise_factor" not in kw:
                kw["noise_factor"] = float(m["noise_factor"])
        for key in ("allow_engine_mismatch", "allow_noise_in_exact"):
            if m.get(key) is True and not kw.get(key):
                kw[key] = True
        result = compare(b.hit, b.cold, tol=tol, noise=noise, **kw)
        folder = m.get("folder") or b.hit.parent.name
        result.hit.path = f"{path}:{folder}/hit.h5"
        result.cold.path = f"{path}:{folder}/cold.h5"
        return result
