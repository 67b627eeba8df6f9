"""Reading a stored array by byte range: checked chunk locations, Zstandard frames decoded here.

Every table and tensor the reader reads comes through ``StoredArray``: the
bytes are read with ``pread`` at the offsets a segment's ``/frames`` rows
(a parts directory) or the file's map (``h5map``, made by the bounded
child of ``guard``) give, never through libhdf5, so no HDF5 structure is
parsed in the reader's process. Before any byte is read the layout is
checked against what the index declares and against ``schema``'s limits;
each frame's declared content size is checked before it is decompressed,
so memory stays bounded whatever the file says (docs/trace-format.md,
"Limits"). Errors are ``TraceError`` lines naming the dataset.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import zstandard

from ..errors import TraceError, first_line as _short
from .h5map import Dataset
from .schema import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_UNCHUNKED_BYTES, ZSTD_FILTER_ID
from .storage import n_chunks

COMPACT, CONTIGUOUS, CHUNKED = 0, 1, 2  # h5py.h5d layout codes (h5map.Dataset.layout)


class DataFile:
    """A file read by byte ranges (``pread``), never through libhdf5.

    Raises:
        TraceError: the file cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            st = os.fstat(self.fd)
        except OSError as e:
            raise TraceError(f"{path}: cannot open ({e.strerror})") from None
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino)

    def pread(self, offset: int, size: int, where: str) -> bytes:
        try:
            data = os.pread(self.fd, size, offset)
        except OSError as e:
            raise TraceError(f"{where}: cannot read {self.path} ({e.strerror})") from None
        if len(data) != size:
            raise TraceError(f"{where}: {self.path} ends before the {size} bytes at {offset}")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DataFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Frames:
    """Where one array's stored chunks lie in a data file.

    ``chunk`` is None for an unchunked array: one range of raw bytes
    (``offsets[0]``, ``sizes[0]``), or ``inline`` bytes (a compact HDF5
    dataset holds them in its header). Otherwise ``offsets``/``sizes``
    (and ``masks``, HDF5's filter masks; empty: all 0) follow the chunk grid
    in C order; an offset of -1 is a chunk that is not stored. ``level``:
    the Zstandard level the file declares (kept by copies).
    """

    chunk: tuple[int, ...] | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    masks: tuple[int, ...] = ()
    inline: bytes | None = None
    level: int = 3


def frames_by_dataset(rows: np.ndarray, where: str, data_size: int) -> dict[str, Frames]:
    """Group a segment's ``/frames`` rows by tensor, checking what needs no index row.

    Refused (``TraceError``): a name that is not ``t<digits>`` ASCII, a
    tensor's rows not adjacent or with differing chunk shapes, negative chunk
    entries, a range past the data file's ``data_size`` bytes, an unchunked
    tensor with more than one row. The chunk shape is checked against the
    tensor's shape and dtype when it is read (``StoredArray``).
    """
    out: dict[str, Frames] = {}
    if len(rows) == 0:
        return out
    names = rows["dataset"]
    chunk = rows["chunk"].astype(np.int64)
    offset, size = rows["offset"].astype(np.uint64), rows["size"].astype(np.uint64)
    if (chunk < 0).any():
        raise TraceError(f"{where}: /frames has a negative chunk shape")
    end = offset + size
    if (end < offset).any() or (end > np.uint64(data_size)).any():
        n = int(np.argmax((end < offset) | (end > np.uint64(data_size))))
        raise TraceError(f"{where}: /frames row {n} ({int(size[n])} bytes at {int(offset[n])}) "
                         f"lies outside the data file ({data_size} bytes)")
    starts = np.flatnonzero(np.r_[True, names[1:] != names[:-1]])
    bounds = np.r_[starts, len(rows)]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        try:
            name = names[a].decode("ascii")
        except UnicodeDecodeError:
            raise TraceError(f"{where}: /frames row {a}: dataset name is not ASCII") from None
        if not (name[:1] == "t" and name[1:].isdigit() and len(name) >= 10):
            raise TraceError(f"{where}: /frames row {a}: dataset name is not t<digits>")
        if name in out:
            raise TraceError(f"{where}: /frames rows of {name} are not adjacent")
        c = chunk[a]
        if (chunk[a:b] != c).any():
            raise TraceError(f"{where}: /frames rows of {name} differ in chunk shape")
        nd = int(np.count_nonzero(c))
        if (c[nd:] != 0).any():
            raise TraceError(f"{where}: /frames rows of {name} have chunk shape {c.tolist()}")
        if nd == 0 and b - a != 1:
            raise TraceError(f"{where}: /frames: unchunked {name} has {b - a} rows")
        out[name] = Frames(tuple(int(x) for x in c[:nd]) if nd else None,
                           tuple(offset[a:b].tolist()), tuple(size[a:b].tolist()))
    return out


def from_header(ds: Dataset, dtype: np.dtype, shape: tuple[int, ...], where: str,
                data: DataFile) -> "StoredArray":
    """The ``StoredArray`` of a mapped HDF5 dataset, after checking its header.

    Checks (no data is read): the header was readable; the dtype equals
    ``dtype`` exactly (this refuses object, variable-length, reference,
    compound-where-not-expected and big-endian types); the shape equals
    ``shape``; no external storage; either unchunked without filters, at
    most ``MAX_UNCHUNKED_BYTES`` and storing exactly its declared bytes, or
    chunked with exactly the Zstandard filter, chunks of at most
    ``MAX_CHUNK_BYTES``, at most ``MAX_CHUNKS`` chunks, all stored.

    Raises:
        TraceError: any check fails.
    """
    if ds.error:
        raise TraceError(f"{where}: unreadable dataset header ({ds.error})")
    found = ds.numpy_dtype()
    if found is None or found != dtype:
        raise TraceError(f"{where}: stored type {ds.dtype} is not the expected {dtype}")
    if ds.shape != tuple(shape):
        raise TraceError(f"{where}: shape {ds.shape} is not the expected {tuple(shape)}")
    if ds.external:
        raise TraceError(f"{where}: uses external storage (refused: a trace is self-contained)")
    nbytes = dtype.itemsize * math.prod(shape)
    if ds.layout in (CONTIGUOUS, COMPACT):
        if ds.filters:
            raise TraceError(f"{where}: unchunked dataset with filters {list(ds.filters)}")
        if nbytes > min(MAX_UNCHUNKED_BYTES, data.size):
            raise TraceError(f"{where}: unchunked dataset of {nbytes} bytes does not fit "
                             f"(limit {MAX_UNCHUNKED_BYTES} bytes, file {data.size} bytes)")
        if ds.storage != nbytes:
            raise TraceError(f"{where}: stores {ds.storage} bytes for {nbytes} declared")
        if ds.layout == COMPACT:
            raw = ds.inline_bytes()
            if len(raw) != nbytes:
                raise TraceError(f"{where}: stores {len(raw)} bytes for {nbytes} declared")
            return StoredArray(data, Frames(None, (0,), (nbytes,), inline=raw), dtype, shape, where)
        at = -1 if ds.address is None else ds.address
        if nbytes and (at < 0 or at + nbytes > data.size):
            raise TraceError(f"{where}: its {nbytes} bytes at {at} lie outside the file ({data.size} bytes)")
        return StoredArray(data, Frames(None, (max(at, 0),), (nbytes,)), dtype, shape, where)
    if ds.layout != CHUNKED:
        raise TraceError(f"{where}: unsupported storage layout {ds.layout} (virtual datasets are refused)")
    if list(ds.filters) != [ZSTD_FILTER_ID]:
        raise TraceError(f"{where}: filter pipeline {list(ds.filters)} is not exactly Zstandard ({ZSTD_FILTER_ID})")
    chunk = tuple(ds.chunk or ())
    if len(chunk) != len(shape) or any(c < 1 for c in chunk):
        raise TraceError(f"{where}: invalid chunk shape {chunk}")
    chunk_nbytes = dtype.itemsize * math.prod(chunk)
    if chunk_nbytes > MAX_CHUNK_BYTES:
        raise TraceError(f"{where}: chunks of {chunk_nbytes} bytes (limit {MAX_CHUNK_BYTES})")
    total = n_chunks(shape, chunk)
    if total > MAX_CHUNKS:
        raise TraceError(f"{where}: {total} chunks (limit {MAX_CHUNKS})")
    if ds.allocated != total or len(ds.chunks) != total:
        raise TraceError(f"{where}: {max(ds.allocated, 0)} of {total} chunks are stored")
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    offsets, sizes, masks = [-1] * total, [0] * total, [0] * total
    for coord, at, size, mask in ds.chunks:
        if (len(coord) != len(shape) or any(o % c or not 0 <= o < s for o, c, s in zip(coord, chunk, shape))):
            raise TraceError(f"{where}: chunk {coord} is not a chunk of the grid")
        i = int(np.ravel_multi_index(tuple(o // c for o, c in zip(coord, chunk)), grid))
        offsets[i], sizes[i], masks[i] = at, size, mask
    level = ds.level if ds.level is not None and 1 <= ds.level <= 22 else 3
    return StoredArray(data, Frames(chunk, tuple(offsets), tuple(sizes), tuple(masks), level=level),
                       dtype, shape, where)


class StoredArray:
    """An array stored as Zstandard-framed chunks (or raw bytes), read with bounded memory.

    Args:
        data: the open file holding the bytes.
        frames: where the chunks lie (``Frames``).
        dtype, shape: what the index row declares (storage dtype).
        where: label for messages, e.g. ``"trace.h5: /tensors/t000000001 (...)"``.

    Raises:
        TraceError: the frames do not fit the declared shape and dtype, or exceed the limits.
    """

    def __init__(self, data: DataFile, frames: Frames, dtype: np.dtype, shape: tuple[int, ...],
                 where: str) -> None:
        self.data, self.frames, self.where = data, frames, where
        self.file_size = data.size
        self.dtype = dtype
        self.shape = tuple(shape)
        self.nbytes = dtype.itemsize * math.prod(self.shape)
        self.clevel = frames.level  # for copies (recovery): frames decode alike at any level
        chunk = frames.chunk
        if chunk is None:
            if self.nbytes > MAX_UNCHUNKED_BYTES or frames.sizes[0] != self.nbytes:
                raise TraceError(f"{where}: unchunked data of {frames.sizes[0]} bytes for "
                                 f"{self.nbytes} declared (limit {MAX_UNCHUNKED_BYTES} bytes)")
            self.chunk = None
            return
        if len(chunk) != len(self.shape) or 0 in self.shape:
            raise TraceError(f"{where}: chunk shape {chunk} does not fit shape {self.shape}")
        self.chunk = chunk
        self.chunk_nbytes = dtype.itemsize * math.prod(chunk)
        if self.chunk_nbytes > MAX_CHUNK_BYTES:
            raise TraceError(f"{where}: chunks of {self.chunk_nbytes} bytes (limit {MAX_CHUNK_BYTES})")
        self.n_chunks = n_chunks(self.shape, chunk)
        if self.n_chunks > MAX_CHUNKS or self.n_chunks != len(frames.offsets):
            raise TraceError(f"{where}: {len(frames.offsets)} chunks located, {self.n_chunks} "
                             f"expected (limit {MAX_CHUNKS})")
        # a compressed frame can be slightly larger than its input, never much larger
        self.max_frame = self.chunk_nbytes + (self.chunk_nbytes >> 7) + 1024
        self._grid = tuple(-(-s // c) for s, c in zip(self.shape, chunk))

    # -- chunks --

    def storage_size(self) -> int:
        """Bytes the array takes on disk (compressed chunks, or the raw bytes when unchunked)."""
        return int(sum(s for s in self.frames.sizes if s > 0))

    def raw_chunk(self, offset: tuple[int, ...]) -> bytes:
        """The stored (compressed) bytes of one chunk, after checking its size and place."""
        where = f"{self.where} chunk {offset}"
        if any(o % c or not 0 <= o < s for o, c, s in zip(offset, self.chunk, self.shape)):
            raise TraceError(f"{where}: not a chunk of the grid")
        i = int(np.ravel_multi_index(tuple(o // c for o, c in zip(offset, self.chunk)), self._grid))
        at, size = self.frames.offsets[i], self.frames.sizes[i]
        mask = self.frames.masks[i] if self.frames.masks else 0
        if at < 0 or size == 0:
            raise TraceError(f"{where}: chunk is not stored")
        if mask != 0:
            raise TraceError(f"{where}: chunk was stored without its filter (mask {mask})")
        if size > self.max_frame or at + size > self.file_size:
            raise TraceError(f"{where}: stored chunk of {size} bytes at {at} does not fit "
                             f"(chunk {self.chunk_nbytes} bytes, file {self.file_size} bytes)")
        return self.data.pread(at, size, where)

    def _chunk(self, offset: tuple[int, ...]) -> np.ndarray:
        """Decode one chunk into an array of the full chunk shape."""
        where = f"{self.where} chunk {offset}"
        raw = self.raw_chunk(offset)
        try:
            declared = zstandard.frame_content_size(raw)
        except zstandard.ZstdError as e:
            raise TraceError(f"{where}: not a Zstandard frame ({_short(e)})") from None
        if declared != self.chunk_nbytes:
            raise TraceError(
                f"{where}: frame declares {declared} bytes, the chunk holds {self.chunk_nbytes} "
                "(refused before decompressing)")
        try:
            data = zstandard.ZstdDecompressor().decompress(raw)
        except zstandard.ZstdError as e:
            raise TraceError(f"{where}: corrupt Zstandard frame ({_short(e)})") from None
        if len(data) != self.chunk_nbytes:
            raise TraceError(f"{where}: frame decodes to {len(data)} bytes, not {self.chunk_nbytes}")
        return np.frombuffer(data, dtype=self.dtype).reshape(self.chunk)

    def _unchunked(self) -> np.ndarray:
        """The whole array of an unchunked dataset."""
        f = self.frames
        if f.inline is not None:
            raw = f.inline
        else:
            raw = self.data.pread(f.offsets[0], self.nbytes, self.where) if self.nbytes else b""
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape).copy()

    # -- reading --

    def read_region(self, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray:
        """The box ``[start, stop)`` as a new C-contiguous array (storage dtype)."""
        out_shape = tuple(b - a for a, b in zip(start, stop))
        if self.chunk is None:
            full = self._unchunked()
            return np.array(full[tuple(slice(a, b) for a, b in zip(start, stop))], order="C")
        out = np.empty(out_shape, dtype=self.dtype)
        if 0 in out_shape:
            return out
        ranges = [range((a // c) * c, b, c) for a, b, c in zip(start, stop, self.chunk)]
        for offset in itertools.product(*ranges):
            block = self._chunk(offset)
            src, dst = [], []
            for o, c, a, b in zip(offset, self.chunk, start, stop):
                lo, hi = max(o, a), min(o + c, b)
                src.append(slice(lo - o, hi - o))
                dst.append(slice(lo - a, hi - a))
            out[tuple(dst)] = block[tuple(src)]
        return out

    def read(self) -> np.ndarray:
        """The whole array (memory: its declared size plus one chunk)."""
        return self.read_region((0,) * len(self.shape), self.shape)

    def iter_blocks(self, block_bytes: int) -> Iterator[np.ndarray]:
        """The array flattened in C order, in pieces of about ``block_bytes`` or less.

        A piece is larger only when one chunk is (at most ``MAX_CHUNK_BYTES``).
        """
        if not self.shape:
            yield self.read().reshape(-1)
            return
        if 0 in self.shape:
            return
        yield from self._iter_axis(0, (), max(1, block_bytes))

    def _iter_axis(self, axis: int, prefix: tuple[int, ...], block_bytes: int) -> Iterator[np.ndarray]:
        shape, ndim = self.shape, len(self.shape)
        row = self.dtype.itemsize * math.prod(shape[axis + 1:])
        step_unit = self.chunk[axis] if self.chunk else 1
        if row > block_bytes and axis < ndim - 1:
            # one index of this axis is too big: go one axis deeper, index by index
            for i in range(shape[axis]):
                yield from self._iter_axis(axis + 1, prefix + (i,), block_bytes)
            return
        step = max(1, block_bytes // max(row, 1))
        if step >= step_unit:
            step -= step % step_unit  # whole chunks: each chunk is decoded once
        for a in range(0, shape[axis], step):
            b = min(a + step, shape[axis])
            start = prefix + (a,) + (0,) * (ndim - axis - 1)
            stop = tuple(p + 1 for p in prefix) + (b,) + shape[axis + 1:]
            yield self.read_region(start, stop).reshape(-1)
