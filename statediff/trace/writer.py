"""Crash-safe trace writer: one segment file per engine step, merged on close.

While recording, ``<trace>.parts/`` holds ``run.json`` and one complete
HDF5 segment per step that produced data (written to ``*.tmp`` and renamed,
so every visible segment is whole). A process killed at any point leaves a
readable partial trace: the reader serves the parts directory as a trace
marked partial, up to the last completed step. ``close()`` merges the
segments into the single file ``<trace>`` (chunks copied without
recompression) and removes the parts directory.

Writes run on one background thread so the engine only pays for the copy
of each tensor to host memory. If a write fails (disk full, path gone), the
writer stops recording, keeps what is on disk readable, and reports the
error from ``close()``; it never raises into the engine's step.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np

from .. import __version__
from ..dtypes import storage_dtype
from ..errors import TraceError
from .fingerprint import fingerprint
from .schema import FORMAT_NAME, FORMAT_VERSION, INDEX_DTYPE, MAX_NDIM, RUN_KEYS, TensorEntry

MIN_FREE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1 << 20  # target HDF5 chunk size: ~1 MiB compresses well and reads in bounded memory


def parts_dir(path: Path) -> Path:
    """Directory holding the segments of an unfinished recording of ``path``."""
    return path.with_name(path.name + ".parts")


def check_writable(path: Path, *, overwrite: bool = False, min_free: int = MIN_FREE_BYTES) -> None:
    """Refuse a trace path before any engine starts.

    Raises:
        TraceError: the directory is missing or not writable, the file exists
            (without ``overwrite``), or fewer than ``min_free`` bytes are free.
    """
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise TraceError(f"cannot write trace {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise TraceError(f"cannot write trace {path}: directory {parent} is not writable")
    if path.is_dir():
        raise TraceError(f"cannot write trace {path}: it is a directory")
    if path.exists() and not overwrite:
        raise TraceError(f"trace {path} already exists (use --overwrite to replace it)")
    free = shutil.disk_usage(parent).free
    if free < min_free:
        raise TraceError(
            f"cannot write trace {path}: only {free // (1 << 20)} MiB free on its disk "
            f"(need at least {min_free // (1 << 20)} MiB)"
        )


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """Chunk shape of about CHUNK_BYTES that splits along the leading axes."""
    if not shape or 0 in shape:
        return None
    chunk = list(shape)
    total = itemsize
    for d in shape:
        total *= d
    axis = 0
    while total > CHUNK_BYTES and axis < len(chunk):
        rest = total // chunk[axis]
        keep = max(1, CHUNK_BYTES // max(rest, 1))
        if keep < chunk[axis]:
            total = rest * keep
            chunk[axis] = keep
        if chunk[axis] > 1:
            break
        axis += 1
    return tuple(chunk)


def write_json_attr(obj: h5py.HLObject, name: str, value: Any) -> None:
    obj.attrs[name] = json.dumps(value, sort_keys=True, allow_nan=False, default=str)


class TraceWriter:
    """Writes one run's trace.

    Args:
        path: final trace file (``.h5``). ``<path>.parts/`` is used meanwhile.
        run: run metadata; keys of ``schema.RUN_KEYS`` missing here are stored as null.
        clevel: Zstandard level (3: ~0.5 GB/s per core; higher levels barely help).
        overwrite: replace an existing trace at ``path``.

    Raises:
        TraceError: the path cannot be written (checked before anything starts).
    """

    def __init__(self, path: str | os.PathLike, run: dict, *, clevel: int = 3,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        check_writable(self.path, overwrite=overwrite)
        self.parts = parts_dir(self.path)
        if self.parts.exists():
            if not overwrite:
                raise TraceError(
                    f"{self.parts} exists: an earlier recording of {self.path} did not finish "
                    "(read it with 'statediff inspect', or use --overwrite)"
                )
            shutil.rmtree(self.parts)
        self.parts.mkdir()
        self.run = {k: run.get(k) for k in RUN_KEYS} | dict(run)
        self.run.setdefault("statediff_version", __version__)
        self.run["statediff_version"] = self.run["statediff_version"] or __version__
        self.run["created_unix"] = self.run["created_unix"] or time.time()
        self.clevel = clevel
        self.requests: dict[int, dict] = {}
        self._dirty: set[int] = set()
        self._pending: list[tuple[dict, np.ndarray]] = []
        self._seq = 0
        self._segments = 0
        self._bytes_raw = 0
        self.error: str | None = None
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=8)
        self._thread = threading.Thread(target=self._drain, name="statediff-writer", daemon=True)
        self._thread.start()
        self.update_run()

    # -- engine-thread API -------------------------------------------------

    def update_run(self, **fields: Any) -> None:
        """Merge fields into the run metadata and persist it (``run.json``)."""
        self.run.update(fields)
        tmp = self.parts / "run.json.tmp"
        try:
            tmp.write_text(json.dumps(self.run, sort_keys=True, default=str))
            os.replace(tmp, self.parts / "run.json")
        except OSError as e:
            self._fail(f"cannot write {tmp}: {e}")

    def begin_request(self, index: int, request_id: str, prompt_token_ids: list[int],
                      **fields: Any) -> None:
        """Register request ``index`` (its order in the replay; the alignment id)."""
        rec = {"index": index, "request_id": request_id,
               "prompt_len": len(prompt_token_ids), "num_cached_tokens": None,
               "output_token_ids": [], "chunks": [], "finished": False}
        rec.update(fields)
        rec["prompt_token_ids"] = list(prompt_token_ids)
        self.requests[index] = rec
        self._dirty.add(index)

    def update_request(self, index: int, **fields: Any) -> None:
        """Set fields of a registered request (output ids, hit length, chunks, acceptance)."""
        self.requests[index].update(fields)
        self._dirty.add(index)

    def add(self, array: np.ndarray, *, request: int, position: int, layer: int, kind: str,
            role: str, module: str, dtype: str, token_start: int | None = None,
            step: int = -1, block: int = -1) -> None:
        """Queue one tensor for the current step.

        Args:
            array: host copy in storage dtype (bf16 as uint16 bit patterns,
                fp8 as uint8); the writer keeps a reference, so the caller
                must not modify it afterwards.
            request, position, layer, kind: the alignment key (see schema).
            dtype: logical dtype name (e.g. "bfloat16").
        """
        if self.error is not None or self._closed:
            return
        if array.dtype != storage_dtype(dtype):
            raise TypeError(f"{kind}: array dtype {array.dtype} is not the storage dtype of {dtype}")
        if array.ndim > MAX_NDIM:
            raise ValueError(f"{kind}: {array.ndim} dimensions (at most {MAX_NDIM})")
        meta = dict(request=request, position=position, layer=layer, kind=kind, role=role,
                    module=module, token_start=position if token_start is None else token_start,
                    step=step, block=block, dtype=dtype, shape=tuple(array.shape),
                    dataset=f"t{self._seq:09d}")
        self._seq += 1
        self._pending.append((meta, array))

    def end_step(self) -> None:
        """Hand the tensors and request updates of this step to the writer thread."""
        if self.error is not None or self._closed:
            self._pending.clear()
            return
        if not self._pending and not self._dirty:
            return
        reqs = {i: self._request_snapshot(i) for i in sorted(self._dirty)}
        self._dirty.clear()
        item = (self._segments, self._pending, reqs)
        self._segments += 1
        self._pending = []
        self._queue.put(item)

    def close(self) -> dict:
        """Flush, merge the segments into the trace file, remove the parts.

        Returns:
            stats: ``{"tensors", "bytes_raw", "bytes_file", "segments"}``.

        Raises:
            TraceError: a write failed during recording; the parts directory
                (readable as a partial trace) is kept.
        """
        if self._closed:
            return {}
        self.end_step()
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise TraceError(f"recording stopped early: {self.error}; partial trace kept in {self.parts}")
        self.update_run()
        stats = merge_parts(self.parts, self.path, self.requests)
        shutil.rmtree(self.parts, ignore_errors=True)
        stats["bytes_raw"] = self._bytes_raw
        return stats

    # -- writer thread -----------------------------------------------------

    def _request_snapshot(self, index: int) -> dict:
        rec = dict(self.requests[index])
        rec["prompt_token_ids"] = list(rec["prompt_token_ids"])
        rec["output_token_ids"] = list(rec["output_token_ids"])
        return rec

    def _fail(self, msg: str) -> None:
        if self.error is None:
            self.error = msg
            print(f"statediff: recording stopped: {msg}", flush=True)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue
            seg, tensors, reqs = item
            final = self.parts / f"seg-{seg:08d}.h5"
            tmp = final.with_suffix(".h5.tmp")
            try:
                self._write_segment(tmp, tensors, reqs)
                os.replace(tmp, final)
            except Exception as e:  # disk full, path removed, ...: stop, keep what is there
                self._fail(f"cannot write {tmp}: {e}")
                try:
                    tmp.unlink()
                except OSError:
                    pass

    def _write_segment(self, path: Path, tensors: list, reqs: dict) -> None:
        rows = []
        with h5py.File(path, "w") as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["segment"] = True
            g = f.create_group("tensors")
            for meta, array in tensors:
                ds = g.create_dataset(
                    meta["dataset"], data=array, chunks=_chunks(array.shape, array.itemsize),
                    **hdf5plugin.Zstd(clevel=self.clevel),
                )
                ds.attrs["dtype"] = meta["dtype"]
                fp = fingerprint(array, meta["dtype"])
                rows.append(TensorEntry(**meta, **fp).to_row())
                self._bytes_raw += array.nbytes
            f.create_dataset("index", data=np.array(rows, dtype=INDEX_DTYPE))
            write_requests(f, reqs)


def write_requests(f: h5py.File, reqs: dict[int, dict]) -> None:
    """Write request records under /requests/rNNNNNNNN (token ids as int64 datasets)."""
    g = f.require_group("requests")
    for i, rec in reqs.items():
        name = f"r{int(i):08d}"
        if name in g:
            del g[name]
        rg = g.create_group(name)
        meta = {k: v for k, v in rec.items() if k not in ("prompt_token_ids", "output_token_ids")}
        write_json_attr(rg, "json", meta)
        for key in ("prompt_token_ids", "output_token_ids"):
            rg.create_dataset(key, data=np.asarray(rec.get(key) or [], dtype="<i8"))


def merge_parts(parts: Path, out: Path, requests: dict[int, dict] | None = None) -> dict:
    """Merge a parts directory into one trace file (atomically replacing ``out``).

    ``requests`` (the writer's in-memory view) wins over the segments' snapshots;
    without it (``statediff recover``), the last snapshot of each request is used.
    """
    from .reader import read_parts_requests  # the reader owns segment discovery

    run = json.loads((parts / "run.json").read_text())
    segs = sorted(parts.glob("seg-*.h5"))
    if requests is None:
        requests = read_parts_requests(segs)
    tmp = out.with_name(out.name + ".tmp")
    rows = []
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["complete"] = True
        rg = f.create_group("run")
        write_json_attr(rg, "json", run)
        tg = f.create_group("tensors")
        for seg in segs:
            with h5py.File(seg, "r") as s:
                for name in s["tensors"]:
                    s.copy(s["tensors"][name], tg, name=name)
                rows.append(s["index"][()])
        index = np.concatenate(rows) if rows else np.zeros(0, dtype=INDEX_DTYPE)
        f.create_dataset("index", data=index, **hdf5plugin.Zstd(clevel=3) if len(index) > 64 else {})
        write_requests(f, requests)
    os.replace(tmp, out)
    return {"tensors": int(len(index)), "segments": len(segs), "bytes_file": out.stat().st_size}
