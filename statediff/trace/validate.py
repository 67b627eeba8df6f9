"""One trace file (or segment file) read and validated from its map: header, run, tables, requests.

Input: the file's ``h5map.FileMap`` (made by libhdf5 in the bounded child
of ``guard``) and the file opened for byte-range reads
(``arrays.DataFile``). Output: a ``FileContents`` record. Tables and
request datasets are read through ``arrays.StoredArray`` (checked byte
ranges, never libhdf5); so are tensors, located by ``/frames``. Each stage refuses with one ``TraceError`` line
naming the file, in the order docs/trace-format.md ("Refusals") lists:
``check_header``, ``read_run``, ``read_digests``, ``read_index`` and
``check_entries`` (``/index`` against the tensors present), ``read_frames``,
``read_requests``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceError
from ..textsafe import clean_strings
from .arrays import DataFile, Frames, from_header, frames_by_dataset
from .h5map import LINK_NAMES, Attr, Dataset, FileMap, Member
from .rows import attach, digest_entries, digest_layout, entry
from .schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DTYPE,
    MAX_DIGEST_ROWS,
    MAX_INDEX_ROWS,
    MAX_JSON_BYTES,
    MAX_REQUESTS,
    MAX_TOKENS_PER_REQUEST,
    REQUEST_DATASETS,
    RUN_KEYS,
    TOKEN_DATASETS,
    DigestEntry,
    TensorEntry,
    request_arrays_problem,
    request_problem,
    run_problem,
)
from .storage import FRAME_DTYPE, MAX_FRAME_ROWS

REQUEST_RE = re.compile(r"r(\d{8,})")


@dataclasses.dataclass
class FileContents:
    """What one validated file holds.

    Attributes:
        format_version: the version it declares.
        complete: root attribute ``complete`` (merged files; False when absent).
        run: the run metadata (merged files: every ``RUN_KEYS`` key; segments: None).
        entries: its index entries, summaries attached (``TensorEntry.summary``).
        digests: its digest-only rows.
        requests: its request records (a segment: the snapshots it carries).
        tensors: a merged file's ``/tensors`` datasets by name (headers, checked when read).
        frames: a segment's ``/frames``: where each of its tensors lies in the data file.
    """

    format_version: int
    complete: bool
    run: dict | None
    entries: list[TensorEntry]
    digests: list[DigestEntry]
    requests: dict[int, dict]
    tensors: dict[str, Dataset | None] = dataclasses.field(default_factory=dict)
    frames: dict[str, Frames] | None = None


def read_file(fmap: FileMap, data: DataFile, path: Path, seen: set[str] | None = None) -> FileContents:
    """A merged trace file: every stage, in the documented order.

    Raises:
        TraceError: any refusal (docs/trace-format.md, "Refusals").
    """
    version = check_header(fmap, path)
    if attr(fmap.attrs, "segment", str(path), "biu"):
        raise TraceError(f"{path} is one segment of a recording; open its .parts directory")
    run = read_run(fmap, path)
    complete = bool(attr(fmap.attrs, "complete", str(path), "biu"))
    digests, linked = read_digests(fmap, data, path, version)
    rows = read_index(fmap, data, path)
    tensors = tensor_datasets(fmap, path)
    entries = attach(check_entries(rows, path, set(tensors), "/tensors", seen), linked, path)
    frames = read_frames(fmap, data, path, data)  # the file itself holds the chunks it locates
    if frames is not None:
        check_frames_cover(frames, tensors, path)
    requests = read_requests(fmap, data, path)
    return FileContents(version, complete, run, entries, digests, requests,
                        tensors=tensors if frames is None else {}, frames=frames)


def read_segment(fmap: FileMap, data: DataFile, path: Path, data_file: DataFile,
                 seen: set[str]) -> FileContents:
    """One segment file of a parts directory (``data_file``: the directory's ``data.h5``).

    Raises:
        TraceError: any refusal; the parts reader then ends the valid prefix here.
    """
    version = check_header(fmap, path)
    if not attr(fmap.attrs, "segment", str(path), "biu"):
        raise TraceError(f"{path} is not marked as a segment")
    frames = read_frames(fmap, data, path, data_file)
    digests, linked = read_digests(fmap, data, path, version)
    rows = read_index(fmap, data, path)
    tensors = {} if frames is not None else tensor_datasets(fmap, path)
    names, table = (set(frames), "/frames") if frames is not None else (set(tensors), "/tensors")
    entries = attach(check_entries(rows, path, names, table, seen), linked, path)
    requests = read_requests(fmap, data, path)
    return FileContents(version, False, None, entries, digests, requests, tensors=tensors, frames=frames)


# -- attributes and members ------------------------------------------------------------------


def attr(attrs: Mapping[str, Attr], name: str, where: str, kinds: str, max_bytes: int = 64) -> Any:
    """A scalar attribute whose numpy dtype kind is in ``kinds``; None if absent.

    ``kinds`` uses numpy's codes ('i', 'u', 'b', 'S'); 'T' accepts any string.
    The stored size is checked before the value is used.
    """
    a = attrs.get(name)
    if a is None:
        return None
    if a.error and not a.dtype:
        raise TraceError(f"{where}: attribute '{name}' is unreadable: {a.error}")
    ok = (a.is_str and ("T" in kinds or (a.kind == "S" and "S" in kinds))) or (
        not a.is_str and a.kind in kinds and a.kind != "O")
    if a.shape != () or not ok or a.size > max_bytes:
        raise TraceError(f"{where}: attribute '{name}' has the wrong type ({a.dtype}, shape {a.shape})")
    if a.error:
        raise TraceError(f"{where}: attribute '{name}' is unreadable: {a.error}")
    if not a.utf8:
        raise TraceError(f"{where}: attribute '{name}' is not UTF-8 text")
    val = a.value
    if isinstance(val, str) and len(val) > max_bytes:
        raise TraceError(f"{where}: attribute '{name}' is over {max_bytes} bytes")
    return val


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def parse_json_object(text: str, where: str) -> dict:
    """A JSON object from untrusted text: size-checked, no NaN/Infinity, depth-safe, every string
    one line (``statediff.textsafe.one_line``: a stranger's line break or escape sequence cannot
    fake or hide a line of our output)."""
    if len(text) > MAX_JSON_BYTES:
        raise TraceError(f"{where}: JSON text over {MAX_JSON_BYTES} bytes")
    try:
        val = clean_strings(json.loads(text, parse_constant=_no_constants))
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{where}: not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(val, dict):
        raise TraceError(f"{where}: JSON is not an object")
    return val


def json_attr(attrs: Mapping[str, Attr], name: str, where: str) -> dict:
    raw = attr(attrs, name, where, "T", MAX_JSON_BYTES)
    if raw is None:
        raise TraceError(f"{where}: missing '{name}' attribute")
    return parse_json_object(raw, f"{where} '{name}' attribute")


def hard_child(members: Mapping[str, Member], name: str, where: str) -> Member | None:
    """The member ``name`` if it is a hard link; None if absent; refuses other links."""
    m = members.get(name)
    if m is None or m.link is None:
        return None
    if m.link != "hard":
        raise TraceError(f"{where}/{name} is a {LINK_NAMES.get(m.link, 'UserDefinedLink')} "
                         "(only plain members are allowed)")
    if m.error and m.kind is None:
        raise TraceError(f"{where}/{name} is unreadable: {m.error}")
    return m


# -- stages ------------------------------------------------------------------------------------


def check_header(fmap: FileMap, path: Path) -> int:
    """The format name and version (root attributes).

    Raises:
        TraceError: not a statediff trace, or a version this statediff does not read.
    """
    fmt = attr(fmap.attrs, "format", str(path), "T", 256)
    if fmt != FORMAT_NAME:
        raise TraceError(f"{path} is an HDF5 file but not a statediff trace (format={fmt!r})")
    ver = attr(fmap.attrs, "format_version", str(path), "iu")
    if ver is None:
        raise TraceError(f"{path}: missing format_version attribute")
    if ver > FORMAT_VERSION:
        raise TraceError(
            f"{path} has trace format version {ver}; this statediff reads up to "
            f"version {FORMAT_VERSION} (upgrade statediff)"
        )
    if ver < 1:
        raise TraceError(f"{path}: invalid trace format version {ver}")
    return int(ver)


def check_run(run: dict, where: str) -> dict:
    """Type-check the documented run keys; add missing RUN_KEYS as null."""
    problem = run_problem(run)
    if problem:
        raise TraceError(f"{where}: {problem}")
    return {k: None for k in RUN_KEYS} | run


def read_run(fmap: FileMap, path: Path) -> dict:
    """``/run``'s ``json`` attribute, type-checked (``check_run``)."""
    rg = hard_child(fmap.members, "run", str(path))
    if rg is None or rg.kind != "group":
        raise TraceError(f"{path}: missing /run group")
    return check_run(json_attr(rg.attrs, "json", f"{path}: /run"), f"{path}: /run")


def read_table(member: Member | None, data: DataFile, path: Path, name: str, dtype: np.dtype,
               max_rows: int) -> np.ndarray:
    """The rows of a 1-D compound table (``/index``, ``/digests``, ``/frames``): exactly ``dtype``,
    at most ``max_rows`` rows, read within the file's size limits."""
    ds = member.dataset if member is not None else None
    if ds is None:
        raise TraceError(f"{path}: /{name} is not a dataset")
    if ds.error and ds.shape is None:
        raise TraceError(f"{path}: /{name} is unreadable: {ds.error}")
    shape = ds.shape
    if shape is None or len(shape) != 1 or shape[0] > max_rows:
        raise TraceError(f"{path}: /{name} has an absurd shape {shape} (at most {max_rows} rows)")
    if ds.numpy_dtype() != dtype:
        raise TraceError(f"{path}: /{name} has an unexpected record layout")
    return from_header(ds, dtype, shape, f"{path}: /{name}", data).read()


def read_digests(fmap: FileMap, data: DataFile, path: Path,
                 version: int) -> tuple[list[DigestEntry], dict]:
    """The optional ``/digests`` table (``rows.digest_entries``): digest-only rows and the rows
    linked to tensors with data; both empty when the table is absent.

    Refused like ``/index``: not a plain 1-D dataset of exactly the table
    layout of the file's version (``DIGEST_DTYPE_V2`` in version 2,
    ``DIGEST_DTYPE`` from version 3), over ``MAX_DIGEST_ROWS`` rows, present
    in a file that declares a format version older than ``MIN_DIGEST_VERSION``.
    """
    m = hard_child(fmap.members, "digests", str(path))
    if m is None:
        return [], {}
    if m.kind != "dataset":
        raise TraceError(f"{path}: /digests is not a dataset")
    layout = digest_layout(path, version)
    return digest_entries(read_table(m, data, path, "digests", layout, MAX_DIGEST_ROWS), path, version)


def tensor_datasets(fmap: FileMap, path: Path) -> dict[str, Dataset | None]:
    """``/tensors``'s members (none when the group is absent): each a dataset header, or None
    for a member that is not a dataset (refused when read: "missing").

    Raises:
        TraceError: ``/tensors`` is not a group or unreadable, holds a link that is not a
            plain member, or holds over ``MAX_INDEX_ROWS`` members.
    """
    g = hard_child(fmap.members, "tensors", str(path))
    if g is None:
        return {}
    if g.kind != "group":
        raise TraceError(f"{path}: /tensors is not a group")
    if g.error:
        raise TraceError(f"{path}: /tensors is unreadable: {g.error}")
    if g.bad_link:
        raise TraceError(f"{path}: /tensors/{g.bad_link} is a link (only plain members are allowed)")
    if g.over:
        raise TraceError(f"{path}: /tensors has over {MAX_INDEX_ROWS} members")
    if g.names:  # mapped without headers: /frames locates the tensors
        return dict.fromkeys(g.names)
    return {name: m.dataset if m.kind == "dataset" else None for name, m in g.members.items()}


def read_index(fmap: FileMap, data: DataFile, path: Path) -> np.ndarray:
    """The rows of ``/index`` (``INDEX_DTYPE``), read within the limits.

    Raises:
        TraceError: ``/index`` missing, not a 1-D table of exactly that layout, or too long.
    """
    m = hard_child(fmap.members, "index", str(path))
    if m is None or m.kind != "dataset":
        raise TraceError(f"{path}: missing /index dataset")
    return read_table(m, data, path, "index", INDEX_DTYPE, MAX_INDEX_ROWS)


def check_entries(rows: np.ndarray, path: Path, names: set[str], table: str,
                  seen: set[str] | None) -> list[TensorEntry]:
    """``/index`` rows, each validated (``rows.entry``) and matched with a tensor of ``names``.

    ``seen``: dataset names of earlier segments of the same recording (updated).

    Raises:
        TraceError: a dataset listed twice, a row without its tensor in ``table``, or a
            tensor without its row.
    """
    seen = set() if seen is None else seen
    out = []
    for row in rows:
        e = entry(row, str(path))
        if e.dataset in seen:
            raise TraceError(f"{path}: dataset {e.dataset} is listed twice")
        if e.dataset not in names:
            raise TraceError(f"{path}: tensor {e.dataset} ({e.label()}) is missing from {table}")
        seen.add(e.dataset)
        out.append(e)
    if len(names) != len(out):
        extra = sorted(names - {e.dataset for e in out})[:3]
        raise TraceError(f"{path}: {table} holds datasets not in the index, e.g. {extra}")
    return out


def read_frames(fmap: FileMap, data: DataFile, seg: Path, data_file: DataFile) -> dict[str, Frames] | None:
    """``/frames``: where each tensor's chunks lie in ``data_file`` (a segment: the recording's data
    file; a merged trace: itself; docs/trace-format.md, "Frames"); None for a file without it
    (older writers: each tensor is then located through its dataset's header)."""
    m = hard_child(fmap.members, "frames", str(seg))
    if m is None:
        return None
    if m.kind != "dataset":
        raise TraceError(f"{seg}: /frames is not a dataset")
    rows = read_table(m, data, seg, "frames", FRAME_DTYPE, MAX_FRAME_ROWS)
    return frames_by_dataset(rows, str(seg), data_file.size)


def check_frames_cover(frames: dict[str, Frames], tensors: dict, path: Path) -> None:
    """A merged trace's ``/frames`` must locate exactly the datasets under ``/tensors``.

    Raises:
        TraceError: a dataset it does not locate, or one it locates that is not there.
    """
    missing = sorted(set(tensors) - set(frames))
    if missing:
        raise TraceError(f"{path}: /frames does not locate /tensors/{missing[0]}")
    extra = sorted(set(frames) - set(tensors))
    if extra:
        raise TraceError(f"{path}: /frames locates {extra[0]}, which is not under /tensors")


def read_requests(fmap: FileMap, data: DataFile, path: Path) -> dict[int, dict]:
    """Every request record under ``/requests``: its JSON fields, type-checked
    (``schema.request_problem``), and its datasets (``read_request_arrays``).

    Raises:
        TraceError: ``/requests`` missing, over ``MAX_REQUESTS`` members, a member that is not a
            group named ``r<8 digits>`` holding that index, or any field or dataset refused.
    """
    g = hard_child(fmap.members, "requests", str(path))
    if g is None or g.kind != "group":
        raise TraceError(f"{path}: missing /requests group")
    if g.error:
        raise TraceError(f"{path}: /requests is unreadable: {g.error}")
    if g.over:
        raise TraceError(f"{path}: /requests has over {MAX_REQUESTS} members")
    out = {}
    for name in g.members:
        where = f"{path}: /requests/{name}"
        m = REQUEST_RE.fullmatch(name)
        rg = hard_child(g.members, name, f"{path}: /requests")
        if rg is None or rg.kind != "group" or m is None:
            raise TraceError(f"{where} is not a request group named r<8 digits>")
        rec = json_attr(rg.attrs, "json", where)
        problem = request_problem(rec)
        if problem:
            raise TraceError(f"{where}: {problem}")
        if rec["index"] != int(m.group(1)):
            raise TraceError(f"{where}: holds request index {rec['index']}")
        read_request_arrays(rg, data, rec, where)
        plen = rec.get("prompt_len")
        if plen is not None and plen != len(rec["prompt_token_ids"]):
            raise TraceError(
                f"{where}: prompt_len {plen} but {len(rec['prompt_token_ids'])} prompt token ids")
        out[rec["index"]] = rec
    return out


def read_request_arrays(rg: Member, data: DataFile, rec: dict, where: str) -> None:
    """Read a request group's datasets (``schema.REQUEST_DATASETS``) into ``rec``.

    Token ids (1-D ``<i8``; missing: empty) become lists of int;
    ``output_logprobs`` (1-D ``<f4``) a list of float; ``output_topk_ids``
    (2-D ``<i8``) and ``output_topk_logprobs`` (2-D ``<f4``) lists of rows.
    A missing logprob dataset reads as None, except that a JSON
    ``output_logprobs`` list (traces written before it was a dataset) is
    kept. Every dataset is checked (type exactly, number of dimensions,
    size, layout, filters, chunks) and the shapes against each other
    (``schema.request_arrays_problem``) before any data is read.

    Raises:
        TraceError: any check fails.
    """
    found: dict[str, tuple[Dataset, tuple[int, ...]]] = {}
    for key, (dtype, ndim) in REQUEST_DATASETS.items():
        m = hard_child(rg.members, key, where)
        if m is None:
            continue
        ds = m.dataset if m.kind == "dataset" else None
        if ds is not None and ds.error and ds.shape is None:
            raise TraceError(f"{where}/{key} is unreadable: {ds.error}")
        shape = ds.shape if ds is not None else None
        if shape is None or len(shape) != ndim or math.prod(shape) > MAX_TOKENS_PER_REQUEST:
            what = "token dataset" if key in TOKEN_DATASETS else "dataset"
            raise TraceError(f"{where}/{key} is not a {ndim}-D {what} of sane size")
        found[key] = (ds, shape)
    legacy = rec.get("output_logprobs")
    if "output_logprobs" not in found and legacy is not None:
        if not isinstance(legacy, list) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in legacy):
            raise TraceError(f"{where}: 'output_logprobs' is not a list of numbers")
    problem = request_arrays_problem({k: shape for k, (_, shape) in found.items()})
    if problem:
        raise TraceError(f"{where}: {problem}")
    for key, (dtype, _) in REQUEST_DATASETS.items():
        if key not in found:
            if key in TOKEN_DATASETS:
                rec[key] = []
            elif key != "output_logprobs" or legacy is None:
                rec[key] = None
            continue
        ds, shape = found[key]
        rec[key] = from_header(ds, np.dtype(dtype), shape, f"{where}/{key}", data).read().tolist()
