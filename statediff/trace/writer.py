"""Crash-safe trace writer: tensor data written once, to the file that becomes ``<trace>``.

While recording, ``<trace>.parts/`` holds ``data.h5`` (the HDF5 file every
step's tensors are appended to; on close it gets the index, digests, requests
and run metadata and is renamed to ``<trace>``: no data is copied) and one
small segment file per step (index and digest rows, request snapshots, and
where each chunk of the step lies in ``data.h5``), renamed into place once
the step's chunks are written. A reader of the parts directory reads the
chunks by those offsets, never through ``data.h5``'s HDF5 metadata, which a
kill can leave half written.

Writes run on a background thread, so the engine pays only for the copy of
each tensor to host memory; a failed write stops recording, keeps what is on
disk readable and is reported by ``close()``, never raised into the engine's
step. ``recovery.recover`` copies what a killed recording left into one file.
Guarantees per kind of crash: docs/trace-format.md, "Crash safety".
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import copy
import os
import queue
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import __version__
from statediff.trace.dtypes import storage_dtype
from ..errors import TraceError
from .records import (_check_arrays, _plain, _request_arrays, digest_rows, snapshot_request, to_json,
                      write_digest_table, write_json_attr, write_requests)
from .schema import (
    FORMAT_NAME,
    INDEX_DTYPE,
    KINDS,
    MAX_NDIM,
    ROLES,
    RUN_KEYS,
    REQUEST_DATASETS,
    DigestEntry,
    TensorEntry,
    request_problem,
    run_problem,
    version_for,
)
from .storage import (DATA_FILE, FRAME_DTYPE, chunk_shape, create_dataset_id, encode, frame_rows, write_array,
                      write_whole)
from .summary import Summary

_HEX = frozenset("0123456789abcdef")

MIN_FREE_BYTES = 64 * 1024 * 1024
# HDF5 1.10 file format: checksummed metadata (damage is detected), compact
# links and chunk indexes (~400 bytes per small tensor instead of ~3 KB with
# the 1.6 default), readable by every HDF5 since 1.10 (h5py, h5dump 1.10, ...).
LIBVER = ("v110", "v110")
QUEUE_STEPS = 8  # steps handed over but not yet written; end_step() waits beyond this


def parts_dir(path: str | os.PathLike) -> Path:
    """Directory holding the segments of an unfinished recording of ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".parts")


def check_writable(path: str | os.PathLike, *, overwrite: bool = False,
                   min_free: int = MIN_FREE_BYTES) -> None:
    """Refuse a trace path before any engine starts.

    Raises:
        TraceError: the directory is missing or not writable, the path is a
            directory, the file exists (without ``overwrite``), or fewer than
            ``min_free`` bytes are free on its disk.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise TraceError(f"cannot write trace {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TraceError(f"cannot write trace {path}: directory {parent} is not writable")
    # os.access trusts permission bits; root, read-only mounts and pseudo file
    # systems need a real attempt
    probe = parent / f".{path.name}.probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TraceError(f"cannot write trace {path}: directory {parent} is not writable "
                         f"({e.strerror})") from None
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


def default_threads() -> int:
    """Compression threads: half the cores, 1 to 4 (the engine needs the rest)."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _create_data_file(path: Path) -> h5py.File:
    """The parts directory's data file, open for writing (``LIBVER``).

    Without HDF5's sieve buffer: small unchunked writes reach the file at
    once, so a write error is raised where it happens rather than when a
    dataset handle is freed (where HDF5 cannot report it, and its library
    shutdown then crashes on the half-closed dataset).
    """
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(*(h5py.h5f.LIBVER_V110,) * 2)
    fapl.set_sieve_buf_size(0)
    fapl.set_fclose_degree(h5py.h5f.CLOSE_STRONG)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)  # no clock in the root group's header: same records, same bytes
    return h5py.File(h5py.h5f.create(str(path).encode(), h5py.h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


class TraceWriter:
    """Writes one run's trace.

    Args:
        path: final trace file (``.h5``). ``<path>.parts/`` is used meanwhile.
        run: run metadata; keys of ``schema.RUN_KEYS`` missing here are stored as null.
        clevel: Zstandard level (3: ~0.5 GB/s per core; higher levels barely help).
        overwrite: replace an existing trace (and a leftover parts directory) at ``path``.
        threads: compression/fingerprint threads (default ``default_threads()``);
            0 does everything on the writer thread.

    Raises:
        TraceError: the path cannot be written (checked before anything starts).
        ValueError: a documented run field has the wrong type (``schema.run_problem``).

    Attributes:
        error: None, or one line saying why recording stopped early.
    """

    def __init__(self, path: str | os.PathLike, run: dict, *, clevel: int = 3,
                 overwrite: bool = False, threads: int | None = None) -> None:
        self.path = Path(path)
        self._run = _plain({k: run.get(k) for k in RUN_KEYS} | dict(run))
        self._run["statediff_version"] = self._run.get("statediff_version") or __version__
        self._run["created_unix"] = self._run.get("created_unix") or time.time()
        problem = run_problem(self._run)
        if problem:
            raise ValueError(problem)
        check_writable(self.path, overwrite=overwrite)
        self.parts = parts_dir(self.path)
        if self.parts.exists():
            if not overwrite:
                raise TraceError(
                    f"{self.parts} exists: an earlier recording of {self.path} did not finish "
                    "(read it with 'statediff inspect', recover it with 'statediff recover', "
                    "or use --overwrite)"
                )
            shutil.rmtree(self.parts)
        try:
            self.parts.mkdir()
        except OSError as e:
            raise TraceError(f"cannot create {self.parts}: {e.strerror}") from None
        self.clevel = clevel
        self._requests: dict[int, dict] = {}
        self._dirty: set[int] = set()
        self._pending: list[tuple[dict, np.ndarray]] = []
        self._pending_digests: list[DigestEntry] = []
        self._seq = 0
        self._segments = 0  # written by the writer thread only
        self._bytes_raw = 0
        self._index: list[np.ndarray] = []  # per segment, for the final file (writer thread)
        self._digest_rows: list[np.ndarray] = []
        self._frame_rows: list[np.ndarray] = []
        self._n_digest_only = 0
        self._target = DATA_FILE
        self.error: str | None = None
        self._closed = False
        try:
            self._data: h5py.File | None = _create_data_file(self.parts / DATA_FILE)
            self._tensors = self._data.create_group("tensors")
        except Exception as e:
            shutil.rmtree(self.parts, ignore_errors=True)
            raise TraceError(f"cannot start recording {self.path}: cannot create "
                             f"{self.parts / DATA_FILE}: {_oserror_text(e)}") from None
        n = default_threads() if threads is None else threads
        self._pool = (concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="statediff-zstd")
                      if n > 0 else None)
        self._window = n + 1  # tensors encoded ahead of the HDF5 writes
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self._thread = threading.Thread(target=self._drain, name="statediff-writer", daemon=True)
        self._thread.start()
        self.update_run()
        if self.error is not None:
            self._stop_threads()
            self._close_data()
            shutil.rmtree(self.parts, ignore_errors=True)
            raise TraceError(f"cannot start recording {self.path}: {self.error}")
        atexit.register(self._at_exit)

    # -- engine-thread API -------------------------------------------------

    def update_run(self, **fields: Any) -> None:
        """Merge fields into the run metadata and persist it (``run.json``, atomically).

        Never raises on I/O errors: a failure stops recording (see ``error``).

        Raises:
            ValueError: a documented field has the wrong type (``schema.run_problem``).
        """
        new = _plain(self._run | fields)
        problem = run_problem(new)
        if problem:
            raise ValueError(problem)
        self._run = new
        if self.error is not None:
            return
        tmp = self.parts / "run.json.tmp"
        try:
            tmp.write_text(to_json(self._run))
            os.replace(tmp, self.parts / "run.json")
        except (OSError, ValueError) as e:
            self._fail(f"cannot write {tmp}: {e}")

    def begin_request(self, index: int, request_id: str, prompt_token_ids: list[int],
                      **fields: Any) -> None:
        """Register request ``index`` (its order in the replay; the alignment id).

        ``fields`` may set any documented request field (``cache_salt``,
        ``num_cached_tokens``, ...) or extra JSON-serialisable ones; the
        dataset keys of ``schema.REQUEST_DATASETS`` (``output_token_ids``,
        ``output_logprobs``, ``output_topk_ids``, ``output_topk_logprobs``)
        are stored as datasets (see ``update_request``).

        Raises:
            ValueError: a documented field has the wrong type (``schema.request_problem``),
                or the datasets disagree in shape (``schema.request_arrays_problem``).
            TypeError: a token or top-k id array that is not integer.
        """
        arrays = _request_arrays(fields)
        arrays["prompt_token_ids"] = _request_arrays({"prompt_token_ids": prompt_token_ids})[
            "prompt_token_ids"]
        rec = {"index": index, "request_id": request_id,
               "prompt_len": len(arrays["prompt_token_ids"]), "num_cached_tokens": None,
               "chunks": [], "finished": False, "acceptance": None, "cache_salt": None}
        rec = self._checked(rec | fields)
        _check_arrays(rec["index"], rec | arrays)
        rec.update(arrays)
        self._requests[rec["index"]] = rec
        self._dirty.add(rec["index"])

    def update_request(self, index: int, **fields: Any) -> None:
        """Set fields of a registered request (output ids, hit length, chunks, acceptance).

        Dataset fields (``schema.REQUEST_DATASETS``): ``prompt_token_ids`` and
        ``output_token_ids`` (integer sequences, stored ``<i8``);
        ``output_logprobs`` (one float per output token, ``<f4``; None
        entries are stored as NaN), ``output_topk_ids`` (integers) and
        ``output_topk_logprobs`` (floats), both ``[n_out, k]``; None removes
        a logprob dataset. Give the output ids and their logprobs in the same
        call: the record must be consistent after every call.

        Raises:
            KeyError: ``index`` was never registered with ``begin_request``.
            ValueError: a documented field has the wrong type, or the datasets
                disagree in shape (``schema.request_arrays_problem``).
            TypeError: a token or top-k id array that is not integer.
        """
        rec = self._requests[index]
        arrays = _request_arrays(fields)
        fields.pop("index", None)
        new = self._checked({"index": index} | fields)  # checks only what changes
        if "prompt_token_ids" in arrays and "prompt_len" not in fields:
            new["prompt_len"] = len(arrays["prompt_token_ids"])
        _check_arrays(index, rec | new | arrays)
        rec.update(new)
        rec.update(arrays)
        self._dirty.add(index)

    def add_chunk(self, index: int, start: int, end: int) -> None:
        """Append the prefill/decode chunk ``[start, end)`` (tokens) that request ``index``
        computed in the step now ending (request field ``chunks``).

        Raises:
            KeyError: ``index`` was never registered with ``begin_request``.
            ValueError: ``end < start`` or a negative start.
        """
        if not 0 <= start <= end:
            raise ValueError(f"request {index}: chunk [{start}, {end}) is not a token range")
        self._requests[index]["chunks"].append([int(start), int(end)])
        self._dirty.add(index)

    def has_request(self, index: int) -> bool:
        """Whether request ``index`` was registered (``begin_request``)."""
        return index in self._requests

    def request_indices(self) -> list[int]:
        """Registered request indices, in registration order."""
        return list(self._requests)

    def request_field(self, index: int, key: str, default: Any = None) -> Any:
        """One field of a registered request as recorded so far (a copy for lists and dicts).

        Raises:
            KeyError: ``index`` was never registered.
        """
        return copy.deepcopy(self._requests[index].get(key, default))

    def run_field(self, key: str, default: Any = None) -> Any:
        """One run-metadata field as recorded so far (a copy for lists and dicts)."""
        return copy.deepcopy(self._run.get(key, default))

    @staticmethod
    def _checked(rec: dict) -> dict:
        plain = _plain({k: v for k, v in rec.items() if k not in REQUEST_DATASETS})
        problem = request_problem(plain)
        if problem:
            raise ValueError(f"request {rec.get('index')!r}: {problem}")
        return plain

    def add(self, array: np.ndarray, *, request: int, position: int, layer: int, kind: str,
            role: str, module: str, dtype: str, token_start: int | None = None,
            step: int = -1, block: int = -1, summary: Summary | None = None) -> None:
        """Queue one tensor for the current step.

        Args:
            array: host copy in storage dtype (bf16 as uint16 bit patterns,
                fp8 as uint8), at most 8 dimensions; the writer keeps a
                reference, so the caller must not modify it afterwards.
            request, position, layer, kind: the alignment key (see schema).
            role: one of ``schema.ROLES``.
            module: engine module name (UTF-8, truncated to 96 bytes).
            dtype: logical dtype name (e.g. "bfloat16").
            token_start: first token covered (K/V blocks); defaults to ``position``.
            summary: the tensor's summary (``statediff.trace.summary``, computed
                by the engine side on its device); stored as its ``/digests``
                row, linked to the data. None: no row (older callers).

        Raises:
            TypeError, ValueError: a programming error in the caller (wrong
                storage dtype, unknown kind/role, bad position, a summary that
                is not a ``Summary``); never for I/O.
        """
        if self.error is not None or self._closed:
            return
        if not isinstance(array, np.ndarray) or array.dtype != storage_dtype(dtype):
            raise TypeError(f"{kind}: array dtype {getattr(array, 'dtype', type(array))} "
                            f"is not the storage dtype of {dtype} ({storage_dtype(dtype)})")
        if array.ndim > MAX_NDIM:
            raise ValueError(f"{kind}: {array.ndim} dimensions (at most {MAX_NDIM})")
        if kind not in KINDS or role not in ROLES:
            raise ValueError(f"unknown kind {kind!r} or role {role!r} (see statediff.trace.schema)")
        start = position if token_start is None else token_start
        if request < 0 or position < 0 or not 0 <= start <= position:
            raise ValueError(f"{kind}: invalid request {request} / position {position} / "
                             f"token_start {start}")
        if summary is not None and not isinstance(summary, Summary):
            raise TypeError(f"{kind}: summary is a {type(summary).__name__}, not a Summary")
        meta = dict(request=request, position=position, layer=layer, kind=kind, role=role,
                    module=module, token_start=start, step=step, block=block, dtype=dtype,
                    shape=tuple(array.shape), dataset=f"t{self._seq:09d}", summary=summary)
        self._seq += 1
        self._pending.append((meta, array))

    def add_digest(self, digest: str | Summary, *, request: int, position: int, layer: int, kind: str,
                   role: str, module: str, dtype: str, shape: tuple[int, ...],
                   token_start: int | None = None, step: int = -1, block: int = -1) -> None:
        """Queue one digest-only tensor for the current step (a row of ``/digests``).

        Args:
            digest: the tensor's ``Summary`` (the engine computes it on its
                device), or only its digest (``statediff.trace.digest`` of the
                storage bytes, 32 lowercase hex digits; the rest is then unknown).
            request, position, layer, kind, role, module, token_start, step, block:
                as for ``add`` (a K/V block covers tokens ``[token_start, position)``).
            dtype: logical dtype name (e.g. "bfloat16").
            shape: logical shape, at most 8 dimensions.

        Raises:
            ValueError: a programming error in the caller (bad digest text,
                unknown kind/role/dtype, bad shape or position); never for I/O.
        """
        if self.error is not None or self._closed:
            return
        storage_dtype(dtype)  # raises on an unknown dtype
        shape = tuple(int(d) for d in shape)
        summary = digest if isinstance(digest, Summary) else None
        digest = summary.digest if summary is not None else digest
        if not (isinstance(digest, str) and len(digest) == 32 and set(digest) <= _HEX):
            raise ValueError(f"{kind}: digest {digest!r} is not 32 lowercase hex digits")
        if kind not in KINDS or role not in ROLES:
            raise ValueError(f"unknown kind {kind!r} or role {role!r} (see statediff.trace.schema)")
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise ValueError(f"{kind}: invalid shape {shape}")
        start = position if token_start is None else token_start
        if request < 0 or position < 0 or not 0 <= start <= position:
            raise ValueError(f"{kind}: invalid request {request} / position {position} / "
                             f"token_start {start}")
        self._pending_digests.append(DigestEntry(
            request=request, position=position, token_start=start, layer=layer, kind=kind,
            role=role, module=module, step=step, block=block, dtype=dtype, shape=shape,
            digest=digest, summary=summary))

    def end_step(self) -> None:
        """Hand the tensors and request updates of this step to the writer thread.

        Waits only when ``QUEUE_STEPS`` steps are already waiting to be
        written. Never raises on I/O errors.
        """
        if self.error is not None or self._closed:
            self._pending.clear()
            self._pending_digests.clear()
            return
        if not self._pending and not self._pending_digests and not self._dirty:
            return
        reqs = {i: self._request_snapshot(i) for i in sorted(self._dirty)}
        self._dirty.clear()
        item = (self._pending, self._pending_digests, reqs)
        self._pending, self._pending_digests = [], []
        self._queue.put(item)

    def close(self) -> dict:
        """Flush, finish the data file as the trace file and rename it to ``path``; remove the parts.

        The tensors are already in ``<path>.parts/data.h5``: close adds the
        index, digests, request records and run metadata, then renames it.

        Returns:
            stats: ``{"tensors", "digests", "segments", "bytes_raw", "bytes_file"}``
            (``digests``: digest-only tensors; ``segments``: steps written).

        Raises:
            TraceError: a write failed during recording or while finishing; the
                parts directory (readable as a partial trace) is kept.
        """
        if self._closed:
            return {}
        self.end_step()
        self._closed = True
        atexit.unregister(self._at_exit)
        self._stop_threads()
        if self.error is not None:
            self._close_data()
            raise TraceError(f"recording of {self.path} stopped early: {self.error}; "
                             f"partial trace kept in {self.parts}")
        self.update_run()
        if self.error is not None:
            self._close_data()
            raise TraceError(f"cannot finish {self.path}: {self.error}; "
                             f"partial trace kept in {self.parts}")
        stats = self._finish()
        shutil.rmtree(self.parts, ignore_errors=True)
        return stats

    def _finish(self) -> dict:
        """Write the trace's tables into the data file, close it and rename it to ``path``."""
        f, data = self._data, self.parts / DATA_FILE
        try:
            index = (np.concatenate(self._index) if self._index else np.zeros(0, INDEX_DTYPE))
            digests = np.concatenate(self._digest_rows) if self._digest_rows else None
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = version_for(digests is not None)
            # a replay that stopped early (run field "stopped") closes as an incomplete trace
            f.attrs["complete"] = not self._run.get("stopped")
            write_json_attr(f.create_group("run"), "json", self._run)
            write_array(f, "index", index, self.clevel)
            # where every chunk lies: the reader locates tensors by this table, never through the
            # datasets' HDF5 headers (docs/trace-format.md, "Frames")
            write_array(f, "frames", np.concatenate(self._frame_rows) if self._frame_rows
                        else np.zeros(0, FRAME_DTYPE), self.clevel)
            write_digest_table(f, digests, self.clevel)
            write_requests(f, {i: snapshot_request(r) for i, r in self._requests.items()}, self.clevel)
            self._data = None
            f.close()
            os.replace(data, self.path)
        except BaseException as e:
            self._data = f
            self._close_data()
            if isinstance(e, Exception):
                raise TraceError(f"cannot write trace {self.path}: {_oserror_text(e)}; "
                                 f"partial trace kept in {self.parts}") from None
            raise
        return {"tensors": len(index), "digests": self._n_digest_only, "segments": self._segments,
                "bytes_raw": self._bytes_raw, "bytes_file": self.path.stat().st_size}

    def _close_data(self) -> None:
        """Close the data file without finishing it (it stays in the parts directory)."""
        f, self._data = self._data, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass  # its chunks are on disk already; the segments say where

    def _at_exit(self) -> None:
        """Interpreter exit without close() (e.g. Ctrl-C): write every step already handed over.

        The parts directory then holds every step passed to ``end_step()``
        and stays a readable partial trace; it is not finished (an error may
        have stopped the engine half way): ``statediff recover`` makes a file of it.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        self._close_data()
        print(f"statediff: recording of {self.path} did not finish; partial trace of "
              f"{self._segments} steps kept in {self.parts}", file=sys.stderr, flush=True)

    def _stop_threads(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- writer thread -----------------------------------------------------

    def _request_snapshot(self, index: int) -> tuple[str, dict[str, np.ndarray]]:
        return snapshot_request(self._requests[index])

    def _fail(self, msg: str) -> None:
        if self.error is None:
            self.error = msg
            print(f"statediff: recording stopped: {msg}", file=sys.stderr, flush=True)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # keep consuming so end_step() never blocks forever
            tensors, digests, reqs = item
            final = self.parts / f"seg-{self._segments:08d}.h5"
            tmp = final.with_name(final.name + ".tmp")
            try:
                self._write_segment(tmp, tensors, reqs, digests)
                os.replace(tmp, final)
                self._segments += 1
            except Exception as e:  # disk full, path removed, ...: stop, keep what is there
                self._fail(f"cannot write step {self._segments} ({self._target}): "
                           f"{_oserror_text(e)}")
                try:
                    tmp.unlink()
                except OSError:
                    pass

    def _write_segment(self, path: Path, tensors: list, reqs: dict,
                       digests: list[DigestEntry] = ()) -> None:
        """Write one step: its tensors into the data file, then its segment file.

        Tensors are encoded (fingerprint + compression) by the pool, up to
        ``_window`` ahead of this thread, which only does the HDF5 writes.
        The segment (index and digest rows, request snapshots, ``/frames``:
        where each chunk lies in the data file) is written after the chunks,
        so a segment renamed into place only points at bytes already written.
        """
        rows, entries, frames, unchunked = [], [], [], []
        self._target = DATA_FILE  # named if a write fails
        jobs: collections.deque = collections.deque()
        todo = iter(tensors)

        def submit() -> None:
            for meta, array in todo:
                jobs.append((meta, array, self._submit(encode, array, meta["dtype"], self.clevel,
                                                       meta.get("summary"))))
                if len(jobs) >= self._window:
                    break

        submit()  # the pool starts compressing while the datasets are created
        # all in one go: interleaved with compression, HDF5's structures fall out of the CPU
        # caches and each creation costs ~3x more (~80 instead of ~25 us)
        ids = iter([create_dataset_id(self._tensors, meta["dataset"], array.shape, array.dtype,
                                      chunk_shape(array.shape, array.itemsize), self.clevel)
                    for meta, array in tensors])
        while jobs:
            meta, array, fut = jobs.popleft()
            enc = fut.result()
            submit()
            name, dsid = meta["dataset"], next(ids)
            if enc.chunks is None:
                if array.size:
                    write_whole(dsid, array)
                unchunked.append((name, dsid))
            else:
                for offset, frame in enc.frames:
                    dsid.write_direct_chunk(offset, frame)
                frames += frame_rows(dsid, name, enc.chunks, [o for o, _ in enc.frames])
            entry = TensorEntry(**meta, **enc.fingerprint)
            rows.append(entry.to_row())
            entries.append(entry)
            self._bytes_raw += array.nbytes
        if unchunked:
            self._data.flush()  # small unchunked data may wait in HDF5's buffers until a flush
            for name, dsid in unchunked:
                frames += frame_rows(dsid, name, None, [])
        index = np.array(rows, dtype=INDEX_DTYPE)
        digest_table = digest_rows(digests, entries)
        self._target = path.name
        with h5py.File(path, "w", libver=LIBVER) as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = version_for(digest_table is not None)
            f.attrs["segment"] = True
            write_array(f, "index", index, self.clevel)
            write_digest_table(f, digest_table, self.clevel)
            frame_table = np.array(frames, dtype=FRAME_DTYPE)
            write_array(f, "frames", frame_table, self.clevel)
            write_requests(f, reqs, self.clevel)
        self._index.append(index)
        self._frame_rows.append(frame_table)
        if digest_table is not None:
            self._digest_rows.append(digest_table)
        self._n_digest_only += len(digests)

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(*args))
        return fut


_HDF5_OS_ERROR = re.compile(r"errno = (\d+), error message = '([^']*)'")


def _oserror_text(e: BaseException) -> str:
    """One short line: the OS reason first (HDF5 messages can be very long)."""
    if m := _HDF5_OS_ERROR.search(str(e)):  # HDF5 buries the OS reason in a long line
        text = f"{m.group(2)} (errno {m.group(1)})"
    elif isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror} (errno {e.errno})" if e.errno else e.strerror
    else:
        text = str(e) or type(e).__name__
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


