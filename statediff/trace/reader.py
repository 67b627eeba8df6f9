"""Trace reader: validates a trace (one file, or the ``.parts`` directory of an unfinished recording) and reads its tensors.

Refusals come in a fixed order, each one ``TraceError`` line naming the
file (docs/trace-format.md, "Refusals" and "Limits"); tensors are read
lazily, with bounded memory (``storage.StoredArray``), and their stored
hash is checked. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin  # noqa: F401  registers the Zstandard filter (id 32015) for other HDF5 tools
import numpy as np

from statediff.trace.dtypes import STORAGE, storage_dtype
from ..errors import TraceError, first_line as _short
from .fingerprint import new_hasher
from .schema import stop_reason
from .schema import (
    DIGEST_DTYPE,
    DIGEST_DTYPE_V2,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DTYPE,
    KINDS,
    MAX_DECLARED_BYTES,
    MAX_DIGEST_ROWS,
    MAX_INDEX_ROWS,
    MAX_JSON_BYTES,
    MAX_NDIM,
    MAX_REQUESTS,
    MAX_SEGMENTS,
    MAX_TOKENS_PER_REQUEST,
    MIN_DIGEST_VERSION,
    REQUEST_DATASETS,
    ROLES,
    RUN_KEYS,
    TOKEN_DATASETS,
    DigestEntry,
    TensorEntry,
    request_arrays_problem,
    request_problem,
    run_problem,
)
from .storage import DATA_FILE, FRAME_DTYPE, MAX_FRAME_ROWS, DataFile, FramedArray, Frames, \
    StoredArray, frames_by_dataset
from .summary import Summary

# Largest tensor read whole; bigger ones must go through iter_blocks().
MAX_TENSOR_BYTES = int(os.environ.get("STATEDIFF_MAX_TENSOR_BYTES", 8 << 30))
READ_BLOCK_BYTES = 64 << 20
MAX_OPEN_FILES = 64  # segment files of a parts directory kept open at once

SEGMENT_RE = re.compile(r"seg-(\d{8,})\.h5")
DATASET_RE = re.compile(r"t\d{9,}")
REQUEST_RE = re.compile(r"r(\d{8,})")
HASH_RE = re.compile(r"[0-9a-f]{32}")
_KINDS, _ROLES = frozenset(KINDS), frozenset(ROLES)


def _open_h5(path: Path) -> h5py.File:
    """Open an HDF5 file read-only, or refuse with one line."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or device would block or never end
            raise TraceError(f"{path} is not a regular file")
        with open(path, "rb") as fh:
            magic = fh.read(8)
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or _short(e)})") from None
    if magic != b"\x89HDF\r\n\x1a\n":
        # HDF5 may also find a superblock at 512, 1024, ... bytes; traces always start with it
        raise TraceError(f"{path} is not an HDF5 file (not a statediff trace)")
    try:
        return h5py.File(path, "r")
    except Exception as e:  # h5py raises OSError/KeyError/RuntimeError on damaged files
        raise TraceError(f"{path} is damaged or truncated: {_short(e)}") from None


def _hard_child(group: h5py.Group, name: str, where: str) -> h5py.HLObject | None:
    """``group[name]`` if it is a hard link; None if absent; refuses other links."""
    try:
        link = group.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise TraceError(f"{where}/{name} is a {type(link).__name__} (only plain members are allowed)")
        return group[name]
    except TraceError:
        raise
    except Exception as e:
        raise TraceError(f"{where}/{name} is unreadable: {_short(e)}") from None


def _attr(obj: h5py.HLObject, name: str, where: str, kinds: str, max_bytes: int = 64) -> Any:
    """A scalar attribute whose numpy dtype kind is in ``kinds``; None if absent.

    ``kinds`` uses numpy's codes ('i', 'u', 'b', 'S'); 'T' accepts any string.
    The stored size is checked before the value is read.
    """
    try:
        if name not in obj.attrs:
            return None
        aid = obj.attrs.get_id(name)
        dt, shape, size = aid.dtype, aid.shape, aid.get_storage_size()
    except Exception as e:
        raise TraceError(f"{where}: attribute '{name}' is unreadable: {_short(e)}") from None
    is_str = h5py.check_string_dtype(dt) is not None
    ok = (is_str and ("T" in kinds or (dt.kind == "S" and "S" in kinds))) or (
        not is_str and dt.kind in kinds and dt.kind != "O")
    if shape != () or not ok or size > max_bytes:
        raise TraceError(f"{where}: attribute '{name}' has the wrong type ({dt}, shape {shape})")
    try:
        val = obj.attrs[name]
    except Exception as e:
        raise TraceError(f"{where}: attribute '{name}' is unreadable: {_short(e)}") from None
    if isinstance(val, bytes):
        try:
            val = val.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(f"{where}: attribute '{name}' is not UTF-8 text") from None
    if isinstance(val, str) and len(val) > max_bytes:
        raise TraceError(f"{where}: attribute '{name}' is over {max_bytes} bytes")
    return val.item() if isinstance(val, np.generic) else val


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def parse_json_object(text: str, where: str) -> dict:
    """A JSON object from untrusted text: size-checked, no NaN/Infinity, depth-safe."""
    if len(text) > MAX_JSON_BYTES:
        raise TraceError(f"{where}: JSON text over {MAX_JSON_BYTES} bytes")
    try:
        val = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{where}: not valid JSON ({_short(e)})") from None
    if not isinstance(val, dict):
        raise TraceError(f"{where}: JSON is not an object")
    return val


def _json_attr(obj: h5py.HLObject, name: str, where: str) -> dict:
    raw = _attr(obj, name, where, "T", MAX_JSON_BYTES)
    if raw is None:
        raise TraceError(f"{where}: missing '{name}' attribute")
    return parse_json_object(raw, f"{where} '{name}' attribute")


def _check_header(f: h5py.File, path: Path) -> int:
    fmt = _attr(f, "format", str(path), "T", 256)
    if fmt != FORMAT_NAME:
        raise TraceError(f"{path} is an HDF5 file but not a statediff trace (format={fmt!r})")
    ver = _attr(f, "format_version", str(path), "iu")
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


def _check_run(run: dict, where: str) -> dict:
    """Type-check the documented run keys; add missing RUN_KEYS as null."""
    problem = run_problem(run)
    if problem:
        raise TraceError(f"{where}: {problem}")
    return {k: None for k in RUN_KEYS} | run


def _read_index(f: h5py.File, path: Path) -> np.ndarray:
    ds = _hard_child(f, "index", str(path))
    if not isinstance(ds, h5py.Dataset):
        raise TraceError(f"{path}: missing /index dataset")
    return _read_table(f, path, ds, "index", INDEX_DTYPE, MAX_INDEX_ROWS)


def _read_table(f: h5py.File, path: Path, ds: h5py.Dataset, name: str, dtype: np.dtype,
                max_rows: int) -> np.ndarray:
    """The rows of a 1-D compound table (``/index``, ``/digests``): exactly ``dtype``, at most
    ``max_rows`` rows, read within the file's size limits."""
    try:
        shape = tuple(ds.shape) if ds.shape is not None else None
    except Exception as e:
        raise TraceError(f"{path}: /{name} is unreadable: {_short(e)}") from None
    if shape is None or len(shape) != 1 or shape[0] > max_rows:
        raise TraceError(f"{path}: /{name} has an absurd shape {shape} (at most {max_rows} rows)")
    if ds.dtype != dtype:
        raise TraceError(f"{path}: /{name} has an unexpected record layout")
    return StoredArray(ds, dtype, shape, f"{path}: /{name}", _file_size(f, path)).read()


def _file_size(f: h5py.File, path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise TraceError(f"{path}: cannot stat ({e.strerror})") from None


def _decode(raw: bytes, field: str, where: str, encoding: str = "ascii") -> str:
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError:
        raise TraceError(f"{where}: index field '{field}' is not {encoding} text") from None


def _entry(row: np.void, where: str) -> TensorEntry:
    """A validated index row (refuses anything the format does not allow)."""
    ds_name = _decode(row["dataset"], "dataset", where)
    label = f"{where}: index row for {ds_name!r}"
    if not DATASET_RE.fullmatch(ds_name):
        raise TraceError(f"{label}: dataset name is not t<digits>")
    fields = _row_fields(row, label, where)
    h = _decode(row["hash"], "hash", where)
    if not HASH_RE.fullmatch(h):
        raise TraceError(f"{label}: hash is not 32 hex digits")
    return TensorEntry(
        **fields, dataset=ds_name, hash=h, sum=float(row["sum"]), sumsq=float(row["sumsq"]),
        min=float(row["min"]), max=float(row["max"]), n_nan=int(row["n_nan"]),
        n_inf=int(row["n_inf"]),
    )


def _read_digests(f: h5py.File, path: Path, version: int) -> tuple[list[DigestEntry], dict[str, tuple[dict, Summary]]]:
    """The optional ``/digests`` table, validated row by row.

    Returns:
        (digest-only tensors, {dataset name: (key fields, summary)} of the rows
        that summarise a tensor with data); both empty when the table is absent.

    Refused like ``/index``: not a plain 1-D dataset of exactly the table
    layout of the file's version (``DIGEST_DTYPE_V2`` in version 2,
    ``DIGEST_DTYPE`` from version 3), over ``MAX_DIGEST_ROWS`` rows, present
    in a file that declares a format version older than
    ``MIN_DIGEST_VERSION``, or any row with an unknown kind, role or dtype,
    text that does not decode, a bad shape, positions out of order, a digest
    that is not 32 lowercase hex digits, a bf16 digest that is neither empty
    nor 32 hex digits, counts below -1, a dataset name that is not
    ``t<digits>`` or is named twice.
    """
    ds = _hard_child(f, "digests", str(path))
    if ds is None:
        return [], {}
    if not isinstance(ds, h5py.Dataset):
        raise TraceError(f"{path}: /digests is not a dataset")
    if version < MIN_DIGEST_VERSION:
        raise TraceError(f"{path}: /digests in a version {version} trace "
                         f"(digests need format version {MIN_DIGEST_VERSION})")
    layout = DIGEST_DTYPE_V2 if version == 2 else DIGEST_DTYPE
    rows = _read_table(f, path, ds, "digests", layout, MAX_DIGEST_ROWS)
    label = lambda n: f"{path}: /digests row {n}"  # noqa: E731
    fields = _table_fields(rows, label)
    bad = ~_is_hex(rows["digest"])
    if version > 2:
        bf16 = rows["digest_bf16"]
        bad |= ~(_is_hex(bf16) | (bf16 == b""))
        bad |= (rows["n_nan"] < -1) | (rows["n_inf"] < -1)
        bad |= (rows["sumsq"] < 0) | (rows["absmax"] < 0)  # NaN (unknown) compares False
        bad |= (bf16 != b"") & (rows["dtype"] != b"float32")
        nan_sketch = np.isnan(rows["sketch"])
        bad |= nan_sketch.any(axis=1) & ~nan_sketch.all(axis=1)
        names = rows["dataset"]
        bad |= ~((names == b"") | _is_dataset_name(names))
    if bad.any():  # the row-by-row check names the problem
        n = int(np.argmax(bad))
        _check_digest_row(rows[n], version, label(n))
    only: list[DigestEntry] = []
    linked: dict[str, tuple[dict, Summary]] = {}
    if version == 2:
        return [DigestEntry(**kw, digest=d.decode("ascii"))
                for kw, d in zip(fields, rows["digest"].tolist())], linked
    known_sketches = ~np.isnan(rows["sketch"]).all(axis=1)

    def columns() -> Iterator[tuple]:
        for c in range(0, len(rows), _CHUNK_ROWS):
            r = rows[c:c + _CHUNK_ROWS]
            yield from zip(r["digest"].tolist(), r["digest_bf16"].tolist(), r["sum"].tolist(),
                           r["sumsq"].tolist(), r["absmax"].tolist(), r["n_nan"].tolist(),
                           r["n_inf"].tolist(), r["sketch"].tolist(), r["dataset"].tolist(),
                           known_sketches[c:c + _CHUNK_ROWS].tolist())

    for n, (kw, (d, bf16, s1, s2, amax, nn, ni, sk, name, known_sketch)) in enumerate(zip(fields, columns())):
        d = d.decode("ascii")
        summary = Summary(digest=d, digest_bf16=bf16.decode("ascii"), sum=s1, sumsq=s2, absmax=amax,
                          n_nan=nn, n_inf=ni, sketch=tuple(sk) if known_sketch else None)
        if not name:  # a row that knows only its digest reads like a version-2 row
            known = summary.known_moments or known_sketch or summary.digest_bf16
            only.append(DigestEntry(**kw, digest=d, summary=summary if known else None))
            continue
        name = name.decode("ascii")
        if name in linked:
            raise TraceError(f"{label(n)}: dataset {name} has two /digests rows")
        linked[name] = (kw, summary)
    return only, linked


def _is_hex(col: np.ndarray) -> np.ndarray:
    """Per element of an ``S32`` column: exactly 32 lowercase hex digits."""
    if col.size == 0:
        return np.ones(0, bool)
    b = np.ascontiguousarray(col).view(np.uint8).reshape(col.size, -1)
    return (((b >= 48) & (b <= 57)) | ((b >= 97) & (b <= 102))).all(axis=1)


def _is_dataset_name(col: np.ndarray) -> np.ndarray:
    """Per element of an ``S32`` column: matches ``DATASET_RE`` (t and at least 9 digits)."""
    return np.array([DATASET_RE.fullmatch(x.decode("latin-1")) is not None for x in col.tolist()], bool)


def _check_digest_row(row: np.void, version: int, label: str) -> None:
    """Raise the ``TraceError`` that names what is wrong with one ``/digests`` row."""
    digest = _decode(row["digest"], "digest", label)
    if not HASH_RE.fullmatch(digest):
        raise TraceError(f"{label}: digest is not 32 lowercase hex digits")
    if version > 2:
        _summary(row, digest, label)
        name = _decode(row["dataset"], "dataset", label)
        if name and not DATASET_RE.fullmatch(name):
            raise TraceError(f"{label}: dataset name is not t<digits>")
    raise TraceError(f"{label}: invalid row")


def _check_keep_counts(run: dict, entries: int, digests: int, where: Path) -> None:
    """A file whose tables hold other counts than its run field ``keep`` says it recorded (a
    truncated or edited ``/index`` or ``/digests``; bundles, run field ``extracted_from``, hold
    a subset and are not checked) is refused: compare would read missing
    rows as "not captured" and send the user after the wrong cause.

    Raises:
        TraceError: ``keep.kept_tensors`` or ``keep.digest_only_tensors`` disagrees.
    """
    keep = run.get("keep")
    if not isinstance(keep, dict) or run.get("extracted_from") is not None:  # a bundle holds a subset
        return
    for field, have, table in (("kept_tensors", entries, "/index"), ("digest_only_tensors", digests, "/digests")):
        want = keep.get(field)
        if isinstance(want, int) and not isinstance(want, bool) and want != have:
            raise TraceError(f"{where}: run field keep.{field} is {want} but {table} holds {have} such "
                             "tensors (a table was cut or edited)")


def _summary(row: np.void, digest: str, label: str) -> Summary:
    """The summary fields of a version-3 ``/digests`` row, validated."""
    bf16 = _decode(row["digest_bf16"], "digest_bf16", label)
    if bf16 and not HASH_RE.fullmatch(bf16):
        raise TraceError(f"{label}: digest_bf16 is neither empty nor 32 lowercase hex digits")
    if bf16 and row["dtype"] != b"float32":
        raise TraceError(f"{label}: digest_bf16 on a {row['dtype'].decode('ascii', 'replace')} tensor "
                         "(only float32 tensors have one)")
    n_nan, n_inf = int(row["n_nan"]), int(row["n_inf"])
    if n_nan < -1 or n_inf < -1:
        raise TraceError(f"{label}: NaN/Inf counts below -1 ({n_nan}, {n_inf})")
    if row["sumsq"] < 0 or row["absmax"] < 0:
        raise TraceError(f"{label}: negative sum of squares or abs max")
    sketch = tuple(float(x) for x in row["sketch"])
    if any(math.isnan(x) for x in sketch) and not all(math.isnan(x) for x in sketch):
        raise TraceError(f"{label}: sketch is partly NaN (all NaN: unknown; else every value a number)")
    return Summary(digest=digest, digest_bf16=bf16, sum=float(row["sum"]), sumsq=float(row["sumsq"]),
                   absmax=float(row["absmax"]), n_nan=n_nan, n_inf=n_inf,
                   sketch=None if all(math.isnan(x) for x in sketch) else sketch)


_LINK_FIELDS = ("request", "position", "token_start", "layer", "kind", "role", "dtype", "shape")


def _attach(entries: list[TensorEntry], linked: dict[str, tuple[dict, Summary]],
            where: Path) -> list[TensorEntry]:
    """``entries`` with the summaries of their ``/digests`` rows attached (``TensorEntry.summary``).

    Raises:
        TraceError: a row names a dataset that is not in this file's index, or
            its key fields differ from that index row's.
    """
    if not linked:
        return entries
    out = []
    for e in entries:
        link = linked.pop(e.dataset, None)
        if link is None:
            out.append(e)
            continue
        fields, summary = link
        bad = [k for k in _LINK_FIELDS if fields[k] != getattr(e, k)]
        if bad:
            raise TraceError(f"{where}: the /digests row of {e.dataset} disagrees with its index row "
                             f"on {', '.join(bad)}")
        out.append(dataclasses.replace(e, summary=summary))
    if linked:
        name = sorted(linked)[0]
        raise TraceError(f"{where}: /digests names dataset {name}, which is not in the index")
    return out


def _row_fields(row: np.void, label: str, where: str) -> dict:
    """The fields an index row and a digest row share, validated (``where`` names the file in
    decoding errors): request, position, token_start >= 0 in order; known kind, role, dtype; a shape
    of at most ``MAX_NDIM`` dims declaring at most ``MAX_DECLARED_BYTES``."""
    ndim = int(row["ndim"])
    shape_all = [int(d) for d in row["shape"]]
    if not 0 <= ndim <= MAX_NDIM or any(d < 0 for d in shape_all[:ndim]) or any(shape_all[ndim:]):
        raise TraceError(f"{label}: invalid shape (ndim {ndim}, dims {shape_all})")
    kind = _decode(row["kind"], "kind", where)
    role = _decode(row["role"], "role", where)
    dtype = _decode(row["dtype"], "dtype", where)
    if kind not in _KINDS:
        raise TraceError(f"{label}: unknown kind {kind!r}")
    if role not in _ROLES:
        raise TraceError(f"{label}: unknown role {role!r}")
    if dtype not in STORAGE:
        raise TraceError(f"{label}: unknown dtype {dtype!r}")
    request, position, token_start = int(row["request"]), int(row["position"]), int(row["token_start"])
    if request < 0 or position < 0 or not 0 <= token_start <= position:
        raise TraceError(
            f"{label}: invalid request/position/token_start ({request}, {position}, {token_start})")
    nbytes = math.prod(shape_all[:ndim]) * STORAGE[dtype].itemsize
    if nbytes > MAX_DECLARED_BYTES:
        raise TraceError(f"{label}: declares {nbytes} bytes (limit {MAX_DECLARED_BYTES})")
    return dict(request=request, position=position, token_start=token_start, layer=int(row["layer"]),
                kind=kind, role=role, module=_decode(row["module"], "module", where, "utf-8"),
                step=int(row["step"]), block=int(row["block"]), dtype=dtype, shape=tuple(shape_all[:ndim]))


_KIND_BYTES = np.array(sorted(k.encode() for k in KINDS))
_ROLE_BYTES = np.array(sorted(r.encode() for r in ROLES))
_DTYPE_BYTES = np.array(sorted(d.encode() for d in STORAGE))


_CHUNK_ROWS = 4096  # rows turned into Python objects at a time (bounds the temporaries)


def _table_fields(rows: np.ndarray, label: Any) -> Iterator[dict]:
    """``_row_fields`` of every row of a table, checked column-wise (tens of thousands of rows
    in milliseconds) before the first is yielded; the first bad row is handed to ``_row_fields``
    for its exact message.

    ``label(n)`` names row n in errors.
    """
    n = len(rows)
    if n == 0:
        return iter(())
    ndim = rows["ndim"].astype(np.int64)
    shape = rows["shape"].astype(np.int64)
    inside = np.arange(MAX_NDIM)[None, :] < ndim[:, None]
    kind, role, dtype = rows["kind"], rows["role"], rows["dtype"]
    req, pos, start = (rows[k].astype(np.int64) for k in ("request", "position", "token_start"))
    ok = (ndim >= 0) & (ndim <= MAX_NDIM) & ~((shape < 0) & inside).any(1) & ~((shape != 0) & ~inside).any(1)
    ok &= np.isin(kind, _KIND_BYTES) & np.isin(role, _ROLE_BYTES) & np.isin(dtype, _DTYPE_BYTES)
    ok &= (req >= 0) & (pos >= 0) & (start >= 0) & (start <= pos)
    if ok.all():
        itemsize = {d: STORAGE[d.decode()].itemsize for d in np.unique(dtype).tolist()}
        size = np.array([itemsize[d] for d in dtype.tolist()], np.float64)
        ok &= np.where(inside, shape, 1).astype(np.float64).prod(axis=1) * size <= MAX_DECLARED_BYTES
    if not ok.all():
        i = int(np.argmin(ok))
        _row_fields(rows[i], label(i), label(i))
        raise TraceError(f"{label(i)}: invalid row")
    names: dict[bytes, str] = {}

    def text(raw: bytes, field: str, encoding: str = "ascii") -> str:
        got = names.get(raw)
        if got is None:
            got = names[raw] = _decode(raw, field, label(0), encoding)
        return got

    shapes: dict[tuple, tuple] = {}

    def gen() -> Iterator[dict]:
        for c in range(0, n, _CHUNK_ROWS):
            sl = slice(c, c + _CHUNK_ROWS)
            for r, p, s, layer, k, ro, mod, step, block, dt, nd, sh in zip(
                    req[sl].tolist(), pos[sl].tolist(), start[sl].tolist(), rows["layer"][sl].tolist(),
                    kind[sl].tolist(), role[sl].tolist(), rows["module"][sl].tolist(),
                    rows["step"][sl].tolist(), rows["block"][sl].tolist(), dtype[sl].tolist(),
                    ndim[sl].tolist(), map(tuple, shape[sl].tolist())):
                key = sh[:nd]
                yield dict(request=r, position=p, token_start=s, layer=layer, kind=text(k, "kind"),
                           role=text(ro, "role"), module=text(mod, "module", "utf-8"), step=step,
                           block=block, dtype=text(dt, "dtype"), shape=shapes.setdefault(key, key))
    return gen()


def _tensor_names(f: h5py.File, path: Path) -> set[str]:
    """Names under /tensors (one pass over the links; refuses anything but plain members)."""
    g = _hard_child(f, "tensors", str(path))
    if g is None:
        return set()
    if not isinstance(g, h5py.Group):
        raise TraceError(f"{path}: /tensors is not a group")
    names: set[str] = set()
    bad: list[str] = []

    def visit(name: bytes, info) -> bool | None:
        if info.type != h5py.h5l.TYPE_HARD:
            bad.append(name.decode("utf-8", "replace"))
            return True  # stop
        names.add(name.decode("utf-8", "replace"))
        return len(names) > MAX_INDEX_ROWS or None

    try:
        g.id.links.iterate(visit, info=True)
    except Exception as e:
        raise TraceError(f"{path}: /tensors is unreadable: {_short(e)}") from None
    if bad:
        raise TraceError(f"{path}: /tensors/{bad[0]} is a link (only plain members are allowed)")
    if len(names) > MAX_INDEX_ROWS:
        raise TraceError(f"{path}: /tensors has over {MAX_INDEX_ROWS} members")
    return names


def _read_requests(f: h5py.File, path: Path) -> dict[int, dict]:
    g = _hard_child(f, "requests", str(path))
    if not isinstance(g, h5py.Group):
        raise TraceError(f"{path}: missing /requests group")
    try:
        n = len(g)
        names = list(g) if n <= MAX_REQUESTS else None
    except Exception as e:
        raise TraceError(f"{path}: /requests is unreadable: {_short(e)}") from None
    if names is None:
        raise TraceError(f"{path}: /requests has over {MAX_REQUESTS} members")
    size = _file_size(f, path)
    out = {}
    for name in names:
        where = f"{path}: /requests/{name}"
        m = REQUEST_RE.fullmatch(name)
        rg = _hard_child(g, name, f"{path}: /requests")
        if not isinstance(rg, h5py.Group) or m is None:
            raise TraceError(f"{where} is not a request group named r<8 digits>")
        rec = _json_attr(rg, "json", where)
        problem = request_problem(rec)
        if problem:
            raise TraceError(f"{where}: {problem}")
        if rec["index"] != int(m.group(1)):
            raise TraceError(f"{where}: holds request index {rec['index']}")
        _read_request_arrays(rg, rec, where, size)
        plen = rec.get("prompt_len")
        if plen is not None and plen != len(rec["prompt_token_ids"]):
            raise TraceError(
                f"{where}: prompt_len {plen} but {len(rec['prompt_token_ids'])} prompt token ids")
        out[rec["index"]] = rec
    return out


def _read_request_arrays(rg: h5py.Group, rec: dict, where: str, size: int) -> None:
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
    found: dict[str, tuple[h5py.Dataset, tuple[int, ...]]] = {}
    for key, (dtype, ndim) in REQUEST_DATASETS.items():
        ds = _hard_child(rg, key, where)
        if ds is None:
            continue
        try:
            shape = tuple(ds.shape) if isinstance(ds, h5py.Dataset) else None
        except Exception as e:
            raise TraceError(f"{where}/{key} is unreadable: {_short(e)}") from None
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
        rec[key] = StoredArray(ds, np.dtype(dtype), shape, f"{where}/{key}", size).read().tolist()


def read_parts_requests(segs: list[Path]) -> dict[int, dict]:
    """Last snapshot of each request across segment files (later wins)."""
    out: dict[int, dict] = {}
    for seg in segs:
        f = _open_h5(seg)
        try:
            out.update(_read_requests(f, seg))
        finally:
            f.close()
    return out


def list_segments(d: Path) -> list[Path]:
    """Segment files of a parts directory in step order, up to the first gap."""
    found: dict[int, Path] = {}
    try:
        for n, p in enumerate(d.iterdir()):
            if n > MAX_SEGMENTS:
                raise TraceError(f"{d}: over {MAX_SEGMENTS} files")
            m = SEGMENT_RE.fullmatch(p.name)  # *.tmp are unfinished: ignored
            if m:
                found[int(m.group(1))] = p
    except OSError as e:
        raise TraceError(f"{d}: cannot list ({e.strerror})") from None
    out = []
    while len(out) in found:
        out.append(found[len(out)])
    return out


class Trace:
    """A statediff trace opened for reading (merged file or partial parts directory).

    Attributes:
        path: what was opened.
        partial: True when read from an unfinished recording (``<trace>.parts``)
            or from a file recovered from one (root attribute complete=False),
            or when the replay stopped early (run field ``stopped``): incomplete.
        partial_reason: one line saying why the trace is partial, "" if complete.
        damage: for a parts directory, why its valid prefix ends before its
            last segment file ("" if every segment is whole).
        segments: for a parts directory, the number of steps served.
        format_version: int.
        run: run metadata dict (every key of ``schema.RUN_KEYS``; unknown ones null).
        requests: {request index: record dict with prompt/output token ids}.
        entries: every tensor recorded with data, in causal order (each with
            ``summary``: its ``/digests`` row from version 3, else None).
        digests: every digest-only tensor (``/digests`` rows without data), in
            causal order; [] when the trace has none.

    Raises:
        TraceError: on any refusal listed in the module docstring.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        p = Path(path)
        self.path = p
        self._files: collections.OrderedDict[Path, h5py.File] = collections.OrderedDict()
        self._where: dict[str, Path] = {}
        self._frames: dict[str, Frames] = {}  # parts directory: tensors located in its data file
        self._data: DataFile | None = None
        self._lock = threading.RLock()
        self.partial_reason = ""
        self.damage = ""
        self.segments = 0
        parts = p.with_name(p.name + ".parts")
        try:
            if p.is_dir():
                self._open_parts(p)
            elif p.is_file():
                self._open_file(p)
            elif parts.is_dir():
                self._open_parts(parts)
            elif p.exists():
                raise TraceError(f"{p} is not a regular file")
            else:
                raise TraceError(f"{p} does not exist")
        except TraceError:
            self.close()
            raise
        except Exception as e:  # a defensive net: damaged input never escapes as another type
            self.close()
            raise TraceError(f"{p} is damaged: {_short(e)}") from None
        self.entries.sort(key=lambda e: e.causal_order)
        self.digests.sort(key=lambda d: d.causal_order)

    # -- opening ---------------------------------------------------------------

    def _open_file(self, p: Path) -> None:
        f = self._file(p)
        self.format_version = _check_header(f, p)
        if _attr(f, "segment", str(p), "biu"):
            raise TraceError(f"{p} is one segment of a recording; open its .parts directory")
        rg = _hard_child(f, "run", str(p))
        if not isinstance(rg, h5py.Group):
            raise TraceError(f"{p}: missing /run group")
        self.run = _check_run(_json_attr(rg, "json", f"{p}: /run"), f"{p}: /run")
        complete = _attr(f, "complete", str(p), "biu")
        self.partial = not bool(complete) or stop_reason(self.run) is not None
        if self.partial:
            self.partial_reason = stop_reason(self.run) or "the recording did not finish (recovered from its parts)"
        self.digests, linked = _read_digests(f, p, self.format_version)
        self.entries = _attach(self._entries(f, p), linked, p)
        self.requests = _read_requests(f, p)
        _check_keep_counts(self.run, len(self.entries), len(self.digests), p)

    def _open_parts(self, d: Path) -> None:
        self.partial = True
        self.format_version = 1  # the newest version among the valid segments (none: 1)
        run_json = d / "run.json"
        try:
            st = run_json.stat()
            if not stat.S_ISREG(st.st_mode):
                raise TraceError(f"{run_json} is not a regular file")
            if st.st_size > MAX_JSON_BYTES:
                raise TraceError(f"{run_json} is over {MAX_JSON_BYTES} bytes")
            text = run_json.read_text(encoding="utf-8")
        except OSError:
            raise TraceError(f"{d}: partial recording without a readable run.json") from None
        except UnicodeDecodeError:
            raise TraceError(f"{run_json} is not UTF-8 text") from None
        self.run = _check_run(parse_json_object(text, str(run_json)), str(run_json))
        self.requests, self.entries, self.digests = {}, [], []
        segs = list_segments(d)
        for seg in segs:
            try:
                f = self._file(seg)
                version = _check_header(f, seg)
                if not _attr(f, "segment", str(seg), "biu"):
                    raise TraceError(f"{seg} is not marked as a segment")
                frames = self._segment_frames(f, seg, d)
                digests, linked = _read_digests(f, seg, version)
                entries = _attach(self._entries(f, seg, frames), linked, seg)
                requests = _read_requests(f, seg)
            except Exception as e:  # TraceError, or anything h5py raises on a damaged file
                # keep the valid prefix: a step is in the trace only if its segment is whole
                for name, src in list(self._where.items()):
                    if src == seg:
                        del self._where[name]
                self._drop(seg)
                why = str(e) if isinstance(e, TraceError) else _short(e)
                self.damage = f"segment {seg.name} is damaged: {why}"
                self.partial_reason = (
                    f"the recording did not finish; read up to step {self.segments} ({self.damage})")
                return
            if frames is not None:  # its tensors are read from the data file: no handle needed
                self._frames.update(frames)
                self._drop(seg)
            self.format_version = max(self.format_version, version)
            self.entries.extend(entries)
            self.digests.extend(digests)
            self.requests.update(requests)
            self.segments += 1
        self.partial_reason = (
            f"the recording did not finish; read up to its last completed step "
            f"({self.segments} steps)")
        if stop_reason(self.run):  # the replay stopped early and its close did not finish either
            self.partial_reason = f"{stop_reason(self.run)}; {self.partial_reason}"

    def _segment_frames(self, f: h5py.File, seg: Path, d: Path) -> dict[str, Frames] | None:
        """A segment's ``/frames``: where its tensors lie in the data file (docs/trace-format.md,
        Crash safety); None for a segment that holds its own ``/tensors`` (older writers)."""
        ds = _hard_child(f, "frames", str(seg))
        if ds is None:
            return None
        if not isinstance(ds, h5py.Dataset):
            raise TraceError(f"{seg}: /frames is not a dataset")
        if self._data is None:  # opened after the segments were listed: it holds all their chunks
            self._data = DataFile(d / DATA_FILE)
        rows = _read_table(f, seg, ds, "frames", FRAME_DTYPE, MAX_FRAME_ROWS)
        return frames_by_dataset(rows, str(seg), self._data.size)

    def _entries(self, f: h5py.File, src: Path,
                 frames: dict[str, Frames] | None = None) -> list[TensorEntry]:
        rows = _read_index(f, src)
        names = _tensor_names(f, src) if frames is None else set(frames)
        table = "/tensors" if frames is None else "/frames"
        out = []
        for row in rows:
            e = _entry(row, str(src))
            if e.dataset in self._where:
                raise TraceError(f"{src}: dataset {e.dataset} is listed twice")
            if e.dataset not in names:
                raise TraceError(f"{src}: tensor {e.dataset} ({e.label()}) is missing from {table}")
            self._where[e.dataset] = src
            out.append(e)
        if len(names) != len(out):
            extra = sorted(names - {e.dataset for e in out})[:3]
            raise TraceError(f"{src}: {table} holds datasets not in the index, e.g. {extra}")
        return out

    def _file(self, p: Path) -> h5py.File:
        """An open handle (parts directories keep at most MAX_OPEN_FILES open)."""
        with self._lock:
            return self._file_locked(p)

    def _file_locked(self, p: Path) -> h5py.File:
        f = self._files.get(p)
        if f is not None:
            self._files.move_to_end(p)
            return f
        f = _open_h5(p)
        self._files[p] = f
        while len(self._files) > MAX_OPEN_FILES:
            _, old = self._files.popitem(last=False)
            try:
                old.close()
            except Exception:
                pass
        return f

    def _drop(self, p: Path) -> None:
        f = self._files.pop(p, None)
        if f is not None:
            try:
                f.close()
            except Exception:
                pass

    # -- metadata ------------------------------------------------------------

    def describe(self) -> str:
        """One line: the path and whether the trace is complete or partial (and why)."""
        state = f"partial: {self.partial_reason}" if self.partial else "complete"
        return f"{self.path} [{state}]"

    def nbytes(self, e: TensorEntry) -> int:
        """Bytes of the stored (decoded) tensor."""
        return e.numel * storage_dtype(e.dtype).itemsize

    # -- tensor access -------------------------------------------------------

    def _stored(self, e: TensorEntry) -> StoredArray:
        src = self._where.get(e.dataset)
        if src is None:
            raise TraceError(f"{self.path}: tensor {e.dataset} ({e.label()}) is not in this trace")
        frames = self._frames.get(e.dataset)
        if frames is not None:
            return FramedArray(self._data, frames, storage_dtype(e.dtype), e.shape,
                               f"{self._data.path}: /tensors/{e.dataset} ({e.label()})")
        where = f"{src}: /tensors/{e.dataset} ({e.label()})"
        try:
            f = self._file(src)
            g = _hard_child(f, "tensors", str(src))
            ds = _hard_child(g, e.dataset, f"{src}: /tensors") if isinstance(g, h5py.Group) else None
            if not isinstance(ds, h5py.Dataset):
                raise TraceError(f"{where} is missing")
            return StoredArray(ds, storage_dtype(e.dtype), e.shape, where, _file_size(f, src))
        except TraceError:
            raise
        except Exception as err:
            raise TraceError(f"{where} is unreadable: {_short(err)}") from None

    def read(self, e: TensorEntry, *, verify: bool = True) -> np.ndarray:
        """The stored array of one entry: storage dtype (bf16 as uint16), logical shape.

        Args:
            e: an entry of ``self.entries``.
            verify: check the XXH3-128 hash of the bytes read against the
                index (costs ~1 ms per MB; catches damage that still decodes).

        Raises:
            TraceError: missing or mismatched dataset, a tensor above
                STATEDIFF_MAX_TENSOR_BYTES (default 8 GiB; use iter_blocks),
                undecodable data, or a hash mismatch.
        """
        if self.nbytes(e) > MAX_TENSOR_BYTES:
            raise TraceError(
                f"{self.path}: tensor {e.dataset} ({e.label()}) declares {self.nbytes(e)} bytes, "
                f"over the read limit of {MAX_TENSOR_BYTES} (STATEDIFF_MAX_TENSOR_BYTES)")
        try:
            arr = self._stored(e).read()
        except MemoryError:
            raise TraceError(f"{self.path}: not enough memory to read tensor {e.dataset}") from None
        if verify:
            h = new_hasher()
            h.update(memoryview(arr.reshape(-1)).cast("B"))
            if h.hexdigest() != e.hash:
                raise TraceError(
                    f"{self.path}: tensor {e.dataset} ({e.label()}) is damaged: "
                    "its bytes do not match the hash in the index")
        return arr

    def iter_blocks(self, e: TensorEntry, block_bytes: int = READ_BLOCK_BYTES, *,
                    verify: bool = True) -> Iterator[np.ndarray]:
        """The stored tensor flattened, in C-order pieces of about ``block_bytes`` or less.

        Memory is bounded by ``max(block_bytes, one chunk)`` whatever the
        tensor's size. With ``verify``, the hash is checked as the pieces go
        by and a mismatch raises TraceError after the last piece (before the
        iterator ends), so a consumer must finish the iteration before
        trusting what it computed.
        """
        stored = self._stored(e)
        h = new_hasher() if verify else None
        for block in stored.iter_blocks(block_bytes):
            if h is not None:
                h.update(memoryview(block).cast("B"))
            yield block
        if h is not None and h.hexdigest() != e.hash:
            raise TraceError(
                f"{self.path}: tensor {e.dataset} ({e.label()}) is damaged: "
                "its bytes do not match the hash in the index")

    def storage_bytes(self) -> int:
        """Bytes the tensor datasets take on disk (compressed); damaged ones count 0."""
        total = 0
        for e in self.entries:
            try:
                total += self._stored(e).storage_size()
            except Exception:
                pass
        return total

    def close(self) -> None:
        """Close every open file (idempotent)."""
        if self._data is not None:
            self._data.close()
        for f in self._files.values():
            try:
                f.close()
            except Exception:
                pass
        self._files.clear()

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trace(path: str | os.PathLike) -> Trace:
    """Open a trace file, or the ``.parts`` directory of an unfinished recording.

    ``path`` may name the trace file, its parts directory, or a trace file
    that does not exist yet while ``<path>.parts`` does (then the partial
    trace is served).

    Raises:
        TraceError: the path is missing, not a trace, damaged or hostile.
    """
    return Trace(path)
