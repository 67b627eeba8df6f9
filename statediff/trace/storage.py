"""How a tensor is written as an HDF5 dataset: chunk layout, one-pass encoding (hash, moments,
Zstandard frames), dataset creation, direct chunk writes, and the ``/frames`` rows that locate
each chunk in a recording's data file.

The read side is ``arrays`` (byte-range reads, frames decoded and checked there, never by an
HDF5 filter). Errors are ``TraceError`` lines naming the dataset.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import h5py
import hdf5plugin  # noqa: F401  (registers the Zstandard filter with HDF5)
import numpy as np
import zstandard

from ..errors import TraceError
from .dtypes import FLOAT_DTYPES
from .fingerprint import Extremes, Fingerprint, new_hasher
from .schema import MAX_NDIM, ZSTD_FILTER_ID

if TYPE_CHECKING:
    from .summary import Summary

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
            write_whole(ds, array)
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


def _summary_moments(summary: "Summary | None", logical: str) -> bool:
    """True when the index moments can come from ``summary`` (a float tensor without NaN/Inf)."""
    return (summary is not None and logical in FLOAT_DTYPES and summary.n_nan == 0
            and summary.n_inf == 0 and math.isfinite(summary.sum) and math.isfinite(summary.sumsq))


def encode(array: np.ndarray, logical: str, clevel: int, summary: "Summary | None" = None) -> Encoded:
    """Fingerprint and compress one tensor in a single pass over its memory.

    Each ~1 MiB chunk is hashed, reduced for moments and compressed while
    it is in cache (chunks produced by ``chunk_shape`` are C-order ranges).
    Thread-safe; releases the GIL for most of the work.

    With a ``summary`` (``statediff.trace.summary``, computed by the engine
    side) of a float tensor that reports no NaN/Inf, the float64 moments are
    not recomputed: ``sum``/``sumsq`` are the summary's and only min/max are
    reduced here, on the bit patterns (``fingerprint.Extremes``, ~15x cheaper
    than decoding bfloat16); ``n_nan``/``n_inf`` are 0, which that reduction
    checks. A NaN or infinity it finds after all (a summary that does not
    describe ``array``) falls back to the full host moments.
    """
    if _summary_moments(summary, logical):
        enc = _encode_with_summary(array, logical, clevel, summary)
        if enc is not None:
            return enc
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


def _encode_with_summary(array: np.ndarray, logical: str, clevel: int,
                         summary: "Summary") -> Encoded | None:
    """``encode``'s fast path: hash, min/max and compression in one pass; None if NaN/Inf turn up."""
    hasher = new_hasher()
    ex = Extremes(logical)
    chunks = chunk_shape(array.shape, array.itemsize)
    array = np.ascontiguousarray(array)  # 0-d becomes 1-d: chunks come from the shape above
    frames = []
    if chunks is None:
        flat = array.reshape(-1)
        hasher.update(memoryview(flat).cast("B"))
        ex.update(flat)
    elif not _contiguous_chunks(array.shape, chunks):  # not produced by chunk_shape; kept general
        flat = array.reshape(-1)
        hasher.update(memoryview(flat).cast("B"))
        ex.update(flat)
        for offset in chunk_offsets(array.shape, chunks):
            frames.append((offset, compress(chunk_bytes(array, offset, chunks), clevel)))
    else:
        for offset in chunk_offsets(array.shape, chunks):
            flat = array[tuple(slice(o, o + c) for o, c in zip(offset, chunks))].reshape(-1)
            hasher.update(memoryview(flat).cast("B"))
            ex.update(flat)
            frames.append((offset, compress(chunk_bytes(array, offset, chunks), clevel)))
    got = ex.result()
    if got is None:
        return None
    return Encoded(chunks, frames, {"hash": hasher.hexdigest(), "sum": float(summary.sum),
                                    "sumsq": float(summary.sumsq), "min": got[0], "max": got[1],
                                    "n_nan": 0, "n_inf": 0})


_DCPL: dict[tuple, h5py.h5p.PropDCID] = {}  # creation property lists by (chunks, clevel)
_TYPES: dict[np.dtype, h5py.h5t.TypeID] = {}


def _dcpl(chunks: tuple[int, ...] | None, clevel: int) -> h5py.h5p.PropDCID:
    key = (chunks, clevel)
    plist = _DCPL.get(key)
    if plist is None:
        # what h5py's create_dataset sets, built once: it costs ~70 us per dataset otherwise
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_obj_track_times(False)
        if chunks is not None:
            plist.set_chunk(chunks)
            plist.set_filter(ZSTD_FILTER_ID, h5py.h5z.FLAG_OPTIONAL, (clevel,))
        if len(_DCPL) >= 1024:
            _DCPL.clear()
        _DCPL[key] = plist
    return plist


def create_dataset(group: h5py.Group, name: str, shape: tuple[int, ...], dtype: np.dtype,
                   chunks: tuple[int, ...] | None, clevel: int) -> h5py.Dataset:
    """An empty dataset: chunked with the Zstandard filter, or unchunked when ``chunks`` is None.

    The same dataset h5py's ``create_dataset`` makes (no time stamps, filter
    optional), through the low-level API with cached property lists (~20 us
    instead of ~90 us per dataset).
    """
    return h5py.Dataset(create_dataset_id(group, name, shape, dtype, chunks, clevel))


def create_dataset_id(group: h5py.Group, name: str, shape: tuple[int, ...], dtype: np.dtype,
                      chunks: tuple[int, ...] | None, clevel: int) -> h5py.h5d.DatasetID:
    """``create_dataset`` without the high-level wrapper (~15 us less per dataset)."""
    tid = _type(np.dtype(dtype))
    space = h5py.h5s.create_simple(tuple(shape)) if len(shape) else h5py.h5s.create(h5py.h5s.SCALAR)
    return h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=_dcpl(chunks, clevel))


def _type(dtype: np.dtype) -> h5py.h5t.TypeID:
    """The HDF5 type of a numpy dtype, built once (a compound type takes ~0.3 ms to build)."""
    tid = _TYPES.get(dtype)
    if tid is None:
        tid = _TYPES[dtype] = h5py.h5t.py_create(dtype, logical=True)
    return tid


def write_whole(ds: h5py.Dataset | h5py.h5d.DatasetID, array: np.ndarray) -> None:
    """Write all of an unchunked dataset (``array`` of its shape and exact dtype)."""
    dsid = ds.id if isinstance(ds, h5py.Dataset) else ds
    array = np.ascontiguousarray(array).reshape(dsid.shape)
    dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, array, mtype=_type(array.dtype))


# -- data written once: where each chunk of a recording's data file lies --------------

DATA_FILE = "data.h5"  # in a parts directory: every step's tensors; on close, the trace itself

# One row per stored chunk of a tensor of the data file of a parts directory (in the chunk
# grid's C order), kept in the step's segment: a reader finds the bytes without HDF5 metadata.
FRAME_DTYPE = np.dtype([
    ("dataset", "S32"),  # name under /tensors
    ("chunk", "<i8", (MAX_NDIM,)),  # chunk shape, entries past ndim 0; all 0: unchunked
    ("offset", "<u8"),  # byte offset of the stored chunk in the data file
    ("size", "<u8"),  # stored (compressed) bytes; an unchunked tensor: its raw bytes (0 if empty)
])
MAX_FRAME_ROWS = 1 << 24


def frame_rows(dsid: h5py.h5d.DatasetID, name: str, chunks: tuple[int, ...] | None,
               offsets: list[tuple[int, ...]]) -> list[tuple]:
    """``FRAME_DTYPE`` rows locating the chunks just written to ``dsid`` (``offsets`` in C order).

    An unchunked dataset gets one row (its contiguous storage); its data must
    be flushed (``File.flush``) before the rows are published.

    Raises:
        TraceError: HDF5 does not report a stored chunk where one was written.
    """
    key = name.encode()
    if chunks is None:
        addr = dsid.get_offset()
        nbytes = dsid.get_storage_size()
        if nbytes and addr is None:
            raise TraceError(f"/tensors/{name}: HDF5 reports no storage after the write")
        return [(key, (0,) * MAX_NDIM, addr or 0, nbytes)]
    shape = tuple(chunks) + (0,) * (MAX_NDIM - len(chunks))
    rows = []
    for offset in offsets:
        info = dsid.get_chunk_info_by_coord(offset)
        if info.byte_offset is None or info.filter_mask != 0:
            raise TraceError(f"/tensors/{name}: chunk {offset} is not stored as written")
        rows.append((key, shape, info.byte_offset, info.size))
    return rows
