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
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import hdf5plugin  # noqa: F401  (registers the Zstandard filter with HDF5)
import numpy as np
import zstandard

from ..errors import TraceError, first_line as _short
from .dtypes import FLOAT_DTYPES
from .fingerprint import Extremes, Fingerprint, new_hasher
from .schema import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_NDIM, MAX_UNCHUNKED_BYTES, ZSTD_FILTER_ID

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


@dataclasses.dataclass(frozen=True)
class Frames:
    """Where one tensor's stored chunks lie in a data file (rows of ``FRAME_DTYPE``).

    ``chunk`` is None for an unchunked tensor (one range of raw bytes);
    ``offsets``/``sizes`` follow the chunk grid in C order.
    """

    chunk: tuple[int, ...] | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def frames_by_dataset(rows: np.ndarray, where: str, data_size: int) -> dict[str, Frames]:
    """Group a segment's ``/frames`` rows by tensor, checking what needs no index row.

    Refused (``TraceError``): a name that is not ``t<digits>`` ASCII, a
    tensor's rows not adjacent or with differing chunk shapes, negative chunk
    entries, a range past the data file's ``data_size`` bytes, an unchunked
    tensor with more than one row. The chunk shape is checked against the
    tensor's shape and dtype when it is read (``FramedArray``).
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


class DataFile:
    """A parts directory's data file, read by byte ranges (``pread``), never through HDF5.

    While a recording runs (or after it was killed) HDF5 refuses to open the
    file, and its metadata may be half written; the chunks the segments
    locate were written before their segment was and are never rewritten.

    Raises:
        TraceError: the file cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            raise TraceError(f"{path}: cannot open the recording's data file ({e.strerror})") from None

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

    def storage_size(self) -> int:
        """Bytes the tensor takes on disk (compressed chunks, or the raw bytes when unchunked)."""
        return self.ds.id.get_storage_size()

    def _unchunked(self) -> np.ndarray:
        """The whole array of an unchunked dataset."""
        try:
            full = self.ds[()]
        except Exception as e:
            raise TraceError(f"{self.where}: unreadable ({_short(e)})") from None
        return np.asarray(full, dtype=self.dtype).reshape(self.shape)

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


class FramedArray(StoredArray):
    """A tensor of a parts directory's data file, read through its segment's ``/frames`` rows.

    The same checks and reads as ``StoredArray`` (chunk size and count
    limits, frame sizes, declared content size before decompressing), with
    the chunk locations taken from ``frames`` instead of HDF5's chunk index.

    Args:
        data: the open data file.
        frames: the tensor's ``Frames``.
        dtype, shape: what its index row declares.
        where: label for messages.

    Raises:
        TraceError: the frames do not fit the declared shape and dtype.
    """

    def __init__(self, data: DataFile, frames: Frames, dtype: np.dtype, shape: tuple[int, ...],
                 where: str) -> None:
        self.data, self.frames, self.where = data, frames, where
        self.ds = None
        self.file_size = data.size
        self.dtype = dtype
        self.shape = tuple(shape)
        self.nbytes = dtype.itemsize * math.prod(self.shape)
        self.clevel = 3  # only declared in the filter of a recovered copy; frames decode alike
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
        self.max_frame = self.chunk_nbytes + (self.chunk_nbytes >> 7) + 1024
        self._grid = tuple(-(-s // c) for s, c in zip(self.shape, chunk))

    def storage_size(self) -> int:
        return int(sum(self.frames.sizes))

    def raw_chunk(self, offset: tuple[int, ...]) -> bytes:
        where = f"{self.where} chunk {offset}"
        if any(o % c or not 0 <= o < s for o, c, s in zip(offset, self.chunk, self.shape)):
            raise TraceError(f"{where}: not a chunk of the grid")
        i = int(np.ravel_multi_index(tuple(o // c for o, c in zip(offset, self.chunk)), self._grid))
        size = self.frames.sizes[i]
        if size == 0 or size > self.max_frame:
            raise TraceError(f"{where}: stored chunk of {size} bytes (chunk {self.chunk_nbytes} bytes)")
        return self.data.pread(self.frames.offsets[i], size, where)

    def _unchunked(self) -> np.ndarray:
        raw = self.data.pread(self.frames.offsets[0], self.nbytes, self.where) if self.nbytes else b""
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape).copy()
