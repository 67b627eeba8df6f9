"""How a tensor is stored as an HDF5 dataset: Zstandard-framed chunks on write, checked direct-chunk reads back.

The reader never lets HDF5 run a decompression filter: it checks layout,
filters and chunk sizes against ``schema``'s limits and decodes each frame
itself, so memory stays bounded by what the index declares (why:
docs/trace-format.md, "Limits"). Errors are ``TraceError`` lines naming the dataset.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Iterator

import h5py
import hdf5plugin
import numpy as np
import zstandard

from ..errors import TraceError, first_line as _short
from .fingerprint import Fingerprint
from .schema import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_UNCHUNKED_BYTES, ZSTD_FILTER_ID

WRITE_CHUNK_BYTES = 1 << 20  # ~1 MiB chunks: compress well, read in bounded memory


# -- layout --------------------------------------------------------------------


def chunk_shape(shape: tuple[int, ...], itemsize: int,
                target: int = WRITE_CHUNK_BYTES) -> tuple[int, ...] | None:
    """Chunk shape of at most ``target`` bytes (or one element) for an array.

    Splits the leading axis first and moves inwards only when one index of
    an axis is still over ``target``, so chunks cover whole trailing rows
    whenever they fit. Returns None for 0-d and empty arrays (they are
    stored unchunked).
    """
    if not shape or 0 in shape:
        return None
    chunk = list(shape)
    total = itemsize * math.prod(shape)
    for axis in range(len(chunk)):
        if total <= target:
            break
        rest = total // chunk[axis]  # bytes of one index along this axis
        keep = max(1, target // max(rest, 1))
        if keep < chunk[axis]:
            chunk[axis] = keep
            total = rest * keep
    return tuple(chunk)


def chunk_offsets(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Offsets of every chunk of the grid, in C order."""
    return itertools.product(*(range(0, s, c) for s, c in zip(shape, chunk)))


def n_chunks(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    return math.prod(-(-s // c) for s, c in zip(shape, chunk))


def chunk_bytes(array: np.ndarray, offset: tuple[int, ...], chunk: tuple[int, ...]) -> bytes | memoryview:
    """The C-order bytes of one chunk, zero-padded to the full chunk shape at the edges."""
    sl = tuple(slice(o, o + c) for o, c in zip(offset, chunk))
    part = array[sl]
    if part.shape != chunk:  # edge chunk: HDF5 stores filtered chunks whole
        full = np.zeros(chunk, dtype=array.dtype)
        full[tuple(slice(0, n) for n in part.shape)] = part
        part = full
    return memoryview(np.ascontiguousarray(part)).cast("B")


_local = threading.local()


def compress(data: bytes | memoryview, level: int) -> bytes:
    """One Zstandard frame with the content size in its header (thread-safe)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


def write_array(group: h5py.Group, name: str, array: np.ndarray, clevel: int,
                plain_up_to: int = WRITE_CHUNK_BYTES) -> h5py.Dataset:
    """Store a whole array now, on this thread (index, token ids).

    Arrays of at most ``plain_up_to`` bytes are stored unchunked and
    uncompressed (any HDF5 tool reads them without plugins); bigger ones as
    Zstandard chunks.
    """
    array = np.array(array, order="C", copy=None)  # keeps 0-d arrays 0-d
    chunks = chunk_shape(array.shape, array.itemsize) if array.nbytes > plain_up_to else None
    ds = create_dataset(group, name, array.shape, array.dtype, chunks, clevel)
    if chunks is None:
        if array.size:
            ds[()] = array
        return ds
    for offset in chunk_offsets(array.shape, chunks):
        ds.id.write_direct_chunk(offset, compress(chunk_bytes(array, offset, chunks), clevel))
    return ds


def _contiguous_chunks(shape: tuple[int, ...], chunk: tuple[int, ...]) -> bool:
    """True when every chunk is one C-order range of the flat array (ones, then a split, then whole)."""
    for k in range(len(shape)):
        if chunk[k] != 1 or k == len(shape) - 1:
            return tuple(chunk[k + 1:]) == tuple(shape[k + 1:])
    return True


@dataclasses.dataclass
class Encoded:
    """A tensor ready to store: chunk shape (None: unchunked), frames in C order, fingerprint."""

    chunks: tuple[int, ...] | None
    frames: list[tuple[tuple[int, ...], bytes]]
    fingerprint: dict


def encode(array: np.ndarray, logical: str, clevel: int) -> Encoded:
    """Fingerprint and compress one tensor in a single pass over its memory.

    Each ~1 MiB chunk is hashed, reduced for moments and compressed while
    it is in cache (chunks produced by ``chunk_shape`` are C-order ranges).
    Thread-safe; releases the GIL for most of the work.
    """
    fp = Fingerprint(logical)
    chunks = chunk_shape(array.shape, array.itemsize)
    if chunks is None:
        fp.update(np.ascontiguousarray(array).reshape(-1))
        return Encoded(None, [], fp.result())
    frames = []
    if not _contiguous_chunks(array.shape, chunks):  # not produced by chunk_shape; kept general
        fp.update(np.ascontiguousarray(array).reshape(-1))
        for offset in chunk_offsets(array.shape, chunks):
            frames.append((offset, compress(chunk_bytes(array, offset, chunks), clevel)))
        return Encoded(chunks, frames, fp.result())
    array = np.ascontiguousarray(array)
    for offset in chunk_offsets(array.shape, chunks):
        sl = array[tuple(slice(o, o + c) for o, c in zip(offset, chunks))]
        fp.update(sl.reshape(-1))
        frames.append((offset, compress(chunk_bytes(array, offset, chunks), clevel)))
    return Encoded(chunks, frames, fp.result())


def create_dataset(group: h5py.Group, name: str, shape: tuple[int, ...], dtype: np.dtype,
                   chunks: tuple[int, ...] | None, clevel: int) -> h5py.Dataset:
    """An empty dataset: chunked with the Zstandard filter, or unchunked when ``chunks`` is None."""
    if chunks is None:
        return group.create_dataset(name, shape=shape, dtype=dtype)
    return group.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks,
                                **hdf5plugin.Zstd(clevel=clevel))


# -- reading -------------------------------------------------------------------


class StoredArray:
    """A dataset checked against what the index declares, read with bounded memory.

    Checks (no data is read): the dataset is a real dataset (no external
    storage, not virtual); its numpy dtype equals ``dtype`` exactly (this
    refuses object, variable-length, reference, compound-where-not-expected
    and big-endian types); its shape equals ``shape``; it is either
    unchunked without filters and at most ``MAX_UNCHUNKED_BYTES``, or
    chunked with exactly the Zstandard filter, chunks of at most
    ``MAX_CHUNK_BYTES`` and at most ``MAX_CHUNKS`` chunks, all allocated.

    Args:
        ds: the h5py dataset.
        dtype: expected storage dtype.
        shape: expected shape.
        where: label for messages, e.g. ``"trace.h5: /tensors/t000000001"``.
        file_size: size in bytes of the file holding ``ds`` (chunks must lie inside it).

    Raises:
        TraceError: any check fails.
    """

    def __init__(self, ds: h5py.Dataset, dtype: np.dtype, shape: tuple[int, ...], where: str,
                 file_size: int) -> None:
        self.ds, self.where, self.file_size = ds, where, file_size
        try:
            found_dtype, found_shape = ds.dtype, tuple(ds.shape)
            plist = ds.id.get_create_plist()
            layout = plist.get_layout()
            n_external = plist.get_external_count()
            pipeline = [plist.get_filter(i) for i in range(plist.get_nfilters())]
            filters = [f[0] for f in pipeline]
            chunk = plist.get_chunk() if layout == h5py.h5d.CHUNKED else None
        except TraceError:
            raise
        except Exception as e:
            raise TraceError(f"{where}: unreadable dataset header ({_short(e)})") from None
        if found_dtype != dtype:
            raise TraceError(f"{where}: stored type {found_dtype} is not the expected {dtype}")
        if found_shape != tuple(shape):
            raise TraceError(f"{where}: shape {found_shape} is not the expected {tuple(shape)}")
        if n_external:
            raise TraceError(f"{where}: uses external storage (refused: a trace is self-contained)")
        self.dtype = dtype
        self.shape = found_shape
        self.nbytes = dtype.itemsize * math.prod(found_shape)
        if layout in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT):
            if filters:
                raise TraceError(f"{where}: unchunked dataset with filters {filters}")
            if self.nbytes > min(MAX_UNCHUNKED_BYTES, file_size):
                raise TraceError(
                    f"{where}: unchunked dataset of {self.nbytes} bytes does not fit "
                    f"(limit {MAX_UNCHUNKED_BYTES} bytes, file {file_size} bytes)")
            self.chunk = None
            try:
                stored = ds.id.get_storage_size()
            except Exception as e:
                raise TraceError(f"{where}: unreadable storage size ({_short(e)})") from None
            if stored != self.nbytes:
                raise TraceError(f"{where}: stores {stored} bytes for {self.nbytes} declared")
            return
        if layout != h5py.h5d.CHUNKED:
            raise TraceError(f"{where}: unsupported storage layout {layout} (virtual datasets are refused)")
        if filters != [ZSTD_FILTER_ID]:
            raise TraceError(
                f"{where}: filter pipeline {filters} is not exactly Zstandard ({ZSTD_FILTER_ID})")
        values = pipeline[0][2]
        self.clevel = int(values[0]) if values and 1 <= values[0] <= 22 else 3  # for copies
        chunk = tuple(int(c) for c in chunk)
        if len(chunk) != len(found_shape) or any(c < 1 for c in chunk):
            raise TraceError(f"{where}: invalid chunk shape {chunk}")
        self.chunk = chunk
        self.chunk_nbytes = dtype.itemsize * math.prod(chunk)
        if self.chunk_nbytes > MAX_CHUNK_BYTES:
            raise TraceError(
                f"{where}: chunks of {self.chunk_nbytes} bytes (limit {MAX_CHUNK_BYTES})")
        self.n_chunks = n_chunks(found_shape, chunk)
        if self.n_chunks > MAX_CHUNKS:
            raise TraceError(f"{where}: {self.n_chunks} chunks (limit {MAX_CHUNKS})")
        try:
            allocated = ds.id.get_num_chunks()
        except Exception as e:
            raise TraceError(f"{where}: unreadable chunk index ({_short(e)})") from None
        if allocated != self.n_chunks:
            raise TraceError(f"{where}: {allocated} of {self.n_chunks} chunks are stored")
        # a compressed frame can be slightly larger than its input, never much larger
        self.max_frame = self.chunk_nbytes + (self.chunk_nbytes >> 7) + 1024

    # -- chunks --

    def raw_chunk(self, offset: tuple[int, ...]) -> bytes:
        """The stored (compressed) bytes of one chunk, after checking its size and place."""
        where = f"{self.where} chunk {offset}"
        try:
            info = self.ds.id.get_chunk_info_by_coord(offset)
        except Exception as e:
            raise TraceError(f"{where}: unreadable chunk index ({_short(e)})") from None
        if info.byte_offset is None or info.size == 0:
            raise TraceError(f"{where}: chunk is not stored")
        if info.filter_mask != 0:
            raise TraceError(f"{where}: chunk was stored without its filter (mask {info.filter_mask})")
        if info.size > self.max_frame or info.byte_offset + info.size > self.file_size:
            raise TraceError(
                f"{where}: stored chunk of {info.size} bytes at {info.byte_offset} "
                f"does not fit (chunk {self.chunk_nbytes} bytes, file {self.file_size} bytes)")
        try:
            mask, raw = self.ds.id.read_direct_chunk(offset)
        except Exception as e:
            raise TraceError(f"{where}: unreadable chunk ({_short(e)})") from None
        if mask != 0 or len(raw) != info.size:
            raise TraceError(f"{where}: chunk changed while reading")
        return raw

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

    def read_region(self, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray:
        """The box ``[start, stop)`` as a new C-contiguous array (storage dtype)."""
        out_shape = tuple(b - a for a, b in zip(start, stop))
        if self.chunk is None:
            try:
                full = self.ds[()]
            except Exception as e:
                raise TraceError(f"{self.where}: unreadable ({_short(e)})") from None
            full = np.asarray(full, dtype=self.dtype).reshape(self.shape)
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
