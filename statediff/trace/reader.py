"""Trace reader: ``open_trace`` validates a trace (one file, or the ``.parts`` directory of an
unfinished recording) and serves its tensors.

Opening runs in stages, each refusing with one ``TraceError`` line naming
the file (docs/trace-format.md, "Refusals" and "Limits"): a file that is not
a regular HDF5 file is refused before libhdf5 sees it
(``parts.check_hdf5_file``); libhdf5 maps it in the read guard's bounded
child (``guard``, ``h5map``); ``validate`` checks the map and reads the
tables by byte range; a parts directory is read by ``parts``. Tensors are
read lazily, by byte range with bounded memory (``arrays.StoredArray``),
and their stored hash is checked. Nothing is unpickled or evaluated, and
libhdf5 never parses the file in this process.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from statediff.trace.dtypes import storage_dtype
from ..errors import TraceError, first_line as _short
from . import guard
from .arrays import DataFile, StoredArray, from_header
from .fingerprint import new_hasher
from .h5map import Dataset
from .parts import check_hdf5_file, read_parts
from .rows import check_keep_counts
from .schema import TensorEntry, stop_reason
from .validate import read_file

# Largest tensor read whole; bigger ones must go through iter_blocks().
MAX_TENSOR_BYTES = int(os.environ.get("STATEDIFF_MAX_TENSOR_BYTES", 8 << 30))
READ_BLOCK_BYTES = 64 << 20
MAX_OPEN_FILES = 64  # segment files of older parts directories kept open at once


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
        breach: for a parts directory whose damaged segment broke a bound of the read guard,
            which ("time", "cpu", "memory", "crash"); else "".
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
        # where each tensor's bytes are: a merged file's datasets (header, checked when read),
        # a parts directory's frames in data.h5, or an older segment's own datasets
        self._tensors: dict[str, Dataset | None] = {}
        self._legacy: dict[str, tuple[Path, Dataset | None]] = {}
        self._frames: dict = {}
        self._data: DataFile | None = None
        self._files: collections.OrderedDict[Path, DataFile] = collections.OrderedDict()
        self._lock = threading.RLock()
        self.partial_reason = ""
        self.damage = ""
        self.breach = ""
        self.segments = 0
        parts = p.with_name(p.name + ".parts") if p.name else None  # "." and "/" have no name
        try:
            if p.is_dir():
                self._open_parts(p)
            elif p.is_file():
                self._open_file(p)
            elif parts is not None and parts.is_dir():
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
        check_hdf5_file(p)
        self._data = DataFile(p)  # opened first: the map must describe this very file
        fmap = guard.map_file(p)
        if tuple(fmap.identity[:2]) != self._data.identity:
            raise TraceError(f"{p} changed while it was read")
        c = read_file(fmap, self._data, p)
        self.format_version, self.run = c.format_version, c.run
        self.partial = not c.complete or stop_reason(self.run) is not None
        if self.partial:
            self.partial_reason = stop_reason(self.run) or "the recording did not finish (recovered from its parts)"
        self.entries, self.digests, self.requests = c.entries, c.digests, c.requests
        self._tensors, self._frames = c.tensors, c.frames or {}
        check_keep_counts(self.run, len(self.entries), len(self.digests), p)

    def _open_parts(self, d: Path) -> None:
        got = read_parts(d)
        self.partial = True
        self._data = got.data
        self.run, self.format_version = got.run, got.format_version
        self.entries, self.digests, self.requests = got.entries, got.digests, got.requests
        self._frames, self._legacy = got.frames, got.legacy
        self.segments, self.damage, self.partial_reason = got.segments, got.damage, got.partial_reason
        self.breach = got.breach

    def _file(self, p: Path) -> DataFile:
        """An older segment file open for byte-range reads (at most MAX_OPEN_FILES kept open)."""
        with self._lock:
            f = self._files.get(p)
            if f is not None:
                self._files.move_to_end(p)
                return f
            f = self._files[p] = DataFile(p)
            while len(self._files) > MAX_OPEN_FILES:
                self._files.popitem(last=False)[1].close()
            return f

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
        """Where ``e``'s bytes are, checked against its index row (nothing read yet)."""
        dtype = storage_dtype(e.dtype)
        frames = self._frames.get(e.dataset)
        if frames is not None:
            return StoredArray(self._data, frames, dtype, e.shape,
                               f"{self._data.path}: /tensors/{e.dataset} ({e.label()})")
        if e.dataset in self._tensors:
            src, ds, data = self.path, self._tensors[e.dataset], self._data
        elif e.dataset in self._legacy:
            (src, ds), data = self._legacy[e.dataset], None
        else:
            raise TraceError(f"{self.path}: tensor {e.dataset} ({e.label()}) is not in this trace")
        where = f"{src}: /tensors/{e.dataset} ({e.label()})"
        if ds is None:
            raise TraceError(f"{where} is missing")
        return from_header(ds, dtype, e.shape, where, data if data is not None else self._file(src))

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

    def stored_frames(self, e: TensorEntry) -> Iterator[bytes]:
        """The stored bytes of ``e`` as they lie on disk, undecoded: each chunk's compressed frame
        in grid order (unchunked: the raw bytes, in pieces of at most 1 MiB). For comparing two
        tensors' storage without decoding it (``statediff.diff.damage``).

        Raises:
            TraceError: a chunk that is not stored or does not fit its place (as ``read``).
        """
        stored = self._stored(e)
        f = stored.frames
        if f.chunk is None:
            if f.inline is not None:
                yield f.inline
                return
            for at in range(0, f.sizes[0], 1 << 20):
                yield stored.data.pread(f.offsets[0] + at, min(1 << 20, f.sizes[0] - at), stored.where)
            return
        for at, size in zip(f.offsets, f.sizes):
            if at < 0 or size <= 0 or size > stored.max_frame or at + size > stored.file_size:
                raise TraceError(f"{stored.where}: a stored chunk of {size} bytes at {at} does not fit")
            yield stored.data.pread(at, size, stored.where)

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
            f.close()
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
