"""Trace reader: validates in a fixed order, reads tensors lazily.

Refusals, in order (each a ``TraceError`` with one line naming the file):
missing path -> not a file or parts directory -> not HDF5 -> unreadable
HDF5 -> wrong format name -> newer format version -> bad run metadata ->
bad index (dtype, size) -> bad request records. Tensor reads check the
dataset against its index row (storage dtype, shape, declared size limit)
before touching data. Nothing is unpickled or evaluated: JSON attributes
and numeric datasets only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin  # noqa: F401  registers the Zstandard filter (id 32015) with h5py
import numpy as np

from ..dtypes import storage_dtype
from ..errors import TraceError
from .schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DTYPE,
    MAX_INDEX_ROWS,
    MAX_JSON_BYTES,
    MAX_NDIM,
    MAX_REQUESTS,
    MAX_TOKENS_PER_REQUEST,
    TensorEntry,
)

# Largest tensor read whole; bigger ones must go through iter_blocks().
MAX_TENSOR_BYTES = int(os.environ.get("STATEDIFF_MAX_TENSOR_BYTES", 8 << 30))
READ_BLOCK_BYTES = 64 << 20


def _open_h5(path: Path) -> h5py.File:
    try:
        if not h5py.is_hdf5(str(path)):
            raise TraceError(f"{path} is not an HDF5 file (not a statediff trace)")
        return h5py.File(path, "r")
    except TraceError:
        raise
    except Exception as e:  # h5py raises OSError/KeyError/RuntimeError on damaged files
        raise TraceError(f"{path} is damaged or truncated: {_short(e)}") from None


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _json_attr(obj: Any, name: str, where: str) -> dict:
    try:
        raw = obj.attrs[name]
    except Exception:
        raise TraceError(f"{where}: missing '{name}' attribute") from None
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not isinstance(raw, str) or len(raw) > MAX_JSON_BYTES:
        raise TraceError(f"{where}: '{name}' attribute is not JSON text of a sane size")
    try:
        val = json.loads(raw)
    except ValueError as e:
        raise TraceError(f"{where}: '{name}' attribute is not valid JSON ({e})") from None
    if not isinstance(val, dict):
        raise TraceError(f"{where}: '{name}' attribute is not a JSON object")
    return val


def _check_header(f: h5py.File, path: Path) -> None:
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if fmt != FORMAT_NAME:
        raise TraceError(f"{path} is an HDF5 file but not a statediff trace (format={fmt!r})")
    ver = f.attrs.get("format_version")
    try:
        ver = int(ver)
    except (TypeError, ValueError):
        raise TraceError(f"{path}: format_version {ver!r} is not an integer") from None
    if ver > FORMAT_VERSION:
        raise TraceError(
            f"{path} has trace format version {ver}; this statediff reads up to "
            f"version {FORMAT_VERSION} (upgrade statediff)"
        )
    if ver < 1:
        raise TraceError(f"{path}: invalid trace format version {ver}")


def _read_index(f: h5py.File, path: Path) -> np.ndarray:
    ds = f.get("index")
    if not isinstance(ds, h5py.Dataset):
        raise TraceError(f"{path}: missing /index dataset")
    if ds.dtype != INDEX_DTYPE:
        raise TraceError(f"{path}: /index has an unexpected record layout")
    if ds.ndim != 1 or ds.shape[0] > MAX_INDEX_ROWS:
        raise TraceError(f"{path}: /index has an absurd shape {ds.shape}")
    try:
        return ds[()]
    except Exception as e:
        raise TraceError(f"{path}: /index is unreadable: {_short(e)}") from None


def _read_requests(f: h5py.File, path: Path) -> dict[int, dict]:
    g = f.get("requests")
    if g is None:
        return {}
    if not isinstance(g, h5py.Group) or len(g) > MAX_REQUESTS:
        raise TraceError(f"{path}: /requests is not a group of sane size")
    out = {}
    for name in g:
        rg = g[name]
        where = f"{path}: /requests/{name}"
        if not isinstance(rg, h5py.Group):
            raise TraceError(f"{where} is not a group")
        rec = _json_attr(rg, "json", where)
        idx = rec.get("index")
        if not isinstance(idx, int) or idx < 0:
            raise TraceError(f"{where}: request index {idx!r} is not a non-negative integer")
        for key in ("prompt_token_ids", "output_token_ids"):
            ds = rg.get(key)
            if ds is None:
                rec[key] = []
                continue
            if (not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "iu" or ds.ndim != 1
                    or ds.shape[0] > MAX_TOKENS_PER_REQUEST):
                raise TraceError(f"{where}/{key} is not a 1-D integer dataset of sane size")
            try:
                rec[key] = [int(t) for t in ds[()]]
            except Exception as e:
                raise TraceError(f"{where}/{key} is unreadable: {_short(e)}") from None
        out[idx] = rec
    return out


def read_parts_requests(segs: list[Path]) -> dict[int, dict]:
    """Last snapshot of each request across segment files (later wins)."""
    out: dict[int, dict] = {}
    for seg in segs:
        with _open_h5(seg) as f:
            out.update(_read_requests(f, seg))
    return out


class Trace:
    """A statediff trace opened for reading (merged file or partial parts directory).

    Attributes:
        path: what was opened.
        partial: True when read from an unfinished recording (``<trace>.parts``).
        format_version: int.
        run: run metadata dict (keys of ``schema.RUN_KEYS``; unknown ones null).
        requests: {request index: record dict with prompt/output token ids}.
        entries: every recorded tensor, in causal order.

    Raises:
        TraceError: on any refusal listed in the module docstring.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        p = Path(path)
        self.path = p
        self._files: dict[Path, h5py.File] = {}
        self._where: dict[str, Path] = {}
        parts = p.with_name(p.name + ".parts")
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
        self.entries.sort(key=lambda e: e.causal_order)

    def _open_file(self, p: Path) -> None:
        f = _open_h5(p)
        self._files[p] = f
        try:
            _check_header(f, p)
            if f.attrs.get("segment", False):
                raise TraceError(f"{p} is one segment of a recording; open its .parts directory")
            rg = f.get("run")
            if not isinstance(rg, h5py.Group):
                raise TraceError(f"{p}: missing /run group")
            self.format_version = int(f.attrs["format_version"])
            self.run = _json_attr(rg, "json", f"{p}: /run")
            self.partial = not bool(f.attrs.get("complete", False))
            rows = _read_index(f, p)
            self.requests = _read_requests(f, p)
            self.entries = self._entries(rows, p)
        except TraceError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise TraceError(f"{p} is damaged: {_short(e)}") from None

    def _open_parts(self, d: Path) -> None:
        self.partial = True
        self.format_version = FORMAT_VERSION
        try:
            text = (d / "run.json").read_text()
        except OSError:
            raise TraceError(f"{d}: partial recording without run.json") from None
        try:
            self.run = json.loads(text)
        except ValueError:
            raise TraceError(f"{d}/run.json is not valid JSON") from None
        if not isinstance(self.run, dict):
            raise TraceError(f"{d}/run.json is not a JSON object")
        self.requests, self.entries = {}, []
        for seg in sorted(d.glob("seg-*.h5")):  # *.tmp are unfinished: ignored
            f = _open_h5(seg)
            self._files[seg] = f
            try:
                _check_header(f, seg)
                rows = _read_index(f, seg)
                self.requests.update(_read_requests(f, seg))
                self.entries.extend(self._entries(rows, seg))
            except TraceError:
                self.close()
                raise

    def _entries(self, rows: np.ndarray, src: Path) -> list[TensorEntry]:
        out = []
        for row in rows:
            e = TensorEntry.from_row(row)
            if not 0 <= int(row["ndim"]) <= MAX_NDIM or any(d < 0 for d in e.shape):
                raise TraceError(f"{src}: index row for {e.dataset} has an invalid shape")
            storage_dtype(e.dtype)  # refuses unknown dtypes
            if e.dataset in self._where:
                raise TraceError(f"{src}: dataset {e.dataset} is listed twice")
            self._where[e.dataset] = src
            out.append(e)
        return out

    # -- metadata ------------------------------------------------------------

    def describe(self) -> str:
        state = "partial (recording did not finish; read up to its last completed step)" if self.partial else "complete"
        return f"{self.path} [{state}]"

    # -- tensor access -------------------------------------------------------

    def _dataset(self, e: TensorEntry) -> h5py.Dataset:
        src = self._where.get(e.dataset)
        f = self._files.get(src) if src else None
        ds = f.get("tensors/" + e.dataset) if f is not None else None
        if not isinstance(ds, h5py.Dataset):
            raise TraceError(f"{self.path}: tensor {e.dataset} ({e.label()}) is missing")
        want = storage_dtype(e.dtype)
        if ds.dtype != want or tuple(ds.shape) != e.shape:
            raise TraceError(
                f"{self.path}: tensor {e.dataset} is {ds.dtype}{tuple(ds.shape)}, "
                f"index says {e.dtype}{e.shape}"
            )
        return ds

    def nbytes(self, e: TensorEntry) -> int:
        return e.numel * storage_dtype(e.dtype).itemsize

    def read(self, e: TensorEntry) -> np.ndarray:
        """The stored array (storage dtype, logical shape) of one entry.

        Raises:
            TraceError: missing or mismatched dataset, a tensor above
                STATEDIFF_MAX_TENSOR_BYTES (8 GiB), or undecodable data.
        """
        ds = self._dataset(e)
        if self.nbytes(e) > MAX_TENSOR_BYTES:
            raise TraceError(f"{self.path}: tensor {e.dataset} declares {self.nbytes(e)} bytes, over the read limit")
        try:
            return ds[()]
        except Exception as err:
            raise TraceError(f"{self.path}: tensor {e.dataset} ({e.label()}) is unreadable: {_short(err)}") from None

    def iter_blocks(self, e: TensorEntry, block_bytes: int = READ_BLOCK_BYTES) -> Iterator[np.ndarray]:
        """The stored tensor flattened, in C-order pieces of at most ~block_bytes."""
        ds = self._dataset(e)
        if not e.shape:
            yield np.asarray(ds[()]).reshape(-1)
            return
        row_bytes = self.nbytes(e) // max(e.shape[0], 1)
        rows = max(1, block_bytes // max(row_bytes, 1))
        try:
            for start in range(0, e.shape[0], rows):
                yield ds[start:start + rows].reshape(-1)
        except Exception as err:
            raise TraceError(f"{self.path}: tensor {e.dataset} ({e.label()}) is unreadable: {_short(err)}") from None

    def storage_bytes(self) -> int:
        """Bytes the tensor datasets take on disk (compressed)."""
        total = 0
        for e in self.entries:
            try:
                total += self._dataset(e).id.get_storage_size()
            except TraceError:
                pass
        return total

    def close(self) -> None:
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
    """Open a trace file (or the ``.parts`` directory of an unfinished one)."""
    return Trace(path)
