"""Rows of a trace's tables (``/index``, ``/digests``) turned into validated entries.

Pure functions over numpy record arrays: no file access. Every field the
format constrains is checked, column-wise first (tens of thousands of rows
in milliseconds) and the first bad row then row by row for its exact
message (docs/trace-format.md, "Refusals").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceError
from ..textsafe import one_line
from .dtypes import STORAGE
from .schema import (
    DIGEST_DTYPE,
    DIGEST_DTYPE_V2,
    KINDS,
    MAX_DECLARED_BYTES,
    MAX_NDIM,
    MIN_DIGEST_VERSION,
    ROLES,
    DigestEntry,
    TensorEntry,
)
from .summary import Summary

DATASET_RE = re.compile(r"t\d{9,}")
HASH_RE = re.compile(r"[0-9a-f]{32}")
_KINDS, _ROLES = frozenset(KINDS), frozenset(ROLES)


def digest_layout(path: Path | str, version: int) -> np.dtype:
    """The ``/digests`` record layout of a file declaring ``version``.

    Raises:
        TraceError: the version predates digests (``MIN_DIGEST_VERSION``).
    """
    if version < MIN_DIGEST_VERSION:
        raise TraceError(f"{path}: /digests in a version {version} trace "
                         f"(digests need format version {MIN_DIGEST_VERSION})")
    return DIGEST_DTYPE_V2 if version == 2 else DIGEST_DTYPE


def _decode(raw: bytes, field: str, where: str, encoding: str = "ascii") -> str:
    """An index field as text; free text (``module``, UTF-8) passes through ``one_line``, as every
    string read from a trace does: a module name cannot carry a line break or escape sequence to
    the terminal. The ASCII fields are checked against their vocabularies by the callers."""
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        raise TraceError(f"{where}: index field '{field}' is not {encoding} text") from None
    return one_line(text) if encoding != "ascii" else text


def entry(row: np.void, where: str) -> TensorEntry:
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


def digest_entries(rows: np.ndarray, path: Path | str, version: int) -> tuple[list[DigestEntry], dict[str, tuple[dict, Summary]]]:
    """The rows of a ``/digests`` table (read with ``digest_layout(version)``), validated row by row.

    Returns:
        (digest-only tensors, {dataset name: (key fields, summary)} of the rows
        that summarise a tensor with data); both empty when the table is absent.

    Refused (``TraceError``): any row with an unknown kind, role or dtype,
    text that does not decode, a bad shape, positions out of order, a digest
    that is not 32 lowercase hex digits, a bf16 digest that is neither empty
    nor 32 hex digits, counts below -1, a dataset name that is not
    ``t<digits>`` or is named twice.
    """
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


def check_keep_counts(run: dict, entries: int, digests: int, where: Path) -> None:
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


def attach(entries: list[TensorEntry], linked: dict[str, tuple[dict, Summary]],
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


