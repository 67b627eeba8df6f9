"""Recovery: one trace file from the parts directory a killed recording left.

``merge_parts`` copies the valid prefix of segments (what ``open_trace``
serves for the parts directory) into one file, compressed chunks byte for
byte; ``recover`` is the ``statediff recover`` command's function: the same,
marked incomplete. The parts directory is read like any trace (the read
guard maps its segment files; its data file is read by byte range).
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from ..errors import TraceError
from .reader import Trace
from .schema import FORMAT_NAME, INDEX_DTYPE, version_for
from .storage import FRAME_DTYPE, chunk_offsets, create_dataset, frame_rows, write_array, write_whole
from .records import digest_rows, snapshot_request, write_digest_table, write_json_attr, write_requests
from .writer import LIBVER, _oserror_text, check_writable


def merge_parts(parts: str | os.PathLike, out: str | os.PathLike,
                requests: dict[int, dict] | None = None, *, overwrite: bool = False,
                complete: bool = True) -> dict:
    """Copy what a parts directory holds into one trace file (atomically creating ``out``).

    Only the valid prefix of segments is copied (what ``open_trace`` serves
    for the parts directory); tensors are copied as stored (compressed
    chunks byte for byte, nothing decoded), read by the offsets the segments
    record. ``requests`` wins over the segments' snapshots; without it the
    last snapshot of each request is used.

    Args:
        parts: the ``<trace>.parts`` directory.
        out: the trace file to create (written as ``<out>.tmp``, then renamed).
        requests: request records to store instead of the segments' snapshots.
        overwrite: replace an existing ``out``.
        complete: the root attribute ``complete`` (False for a recovered trace).

    Returns:
        stats: ``{"tensors", "digests", "segments", "bytes_file"}``.

    Raises:
        TraceError: the parts directory is unreadable or ``out`` cannot be written
            (``out`` is then left untouched and ``<out>.tmp`` removed).
    """
    parts, out = Path(parts), Path(out)
    if not parts.is_dir():
        raise TraceError(f"{parts} is not a parts directory")
    if out.exists() and not overwrite:
        raise TraceError(f"trace {out} already exists (use --overwrite to replace it)")
    src = Trace(parts)
    tmp = out.with_name(out.name + ".tmp")
    try:
        if requests is None:
            requests = src.requests
        entries = sorted(src.entries, key=lambda e: e.dataset)
        rows = [e.to_row() for e in entries]
        with h5py.File(tmp, "w", libver=LIBVER) as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = version_for(bool(src.digests) or any(
                e.summary is not None for e in src.entries))
            f.attrs["complete"] = bool(complete)
            write_json_attr(f.create_group("run"), "json", src.run)
            tg = f.create_group("tensors")
            copied = [_copy_stored(src._stored(e), tg, e.dataset) for e in entries]
            f.flush()  # unchunked data has its place in the file only once flushed
            frames = [row for ds, name, chunk in copied
                      for row in frame_rows(ds.id, name, chunk, list(chunk_offsets(ds.shape, chunk)) if chunk else [])]
            write_array(f, "index", np.array(rows, dtype=INDEX_DTYPE), 3)
            write_array(f, "frames", np.array(frames, dtype=FRAME_DTYPE), 3)
            write_digest_table(f, digest_rows(src.digests, src.entries))
            write_requests(f, {i: snapshot_request(r) for i, r in requests.items()})
        os.replace(tmp, out)
        return {"tensors": len(rows), "digests": len(src.digests), "segments": src.segments,
                "bytes_file": out.stat().st_size}
    except TraceError:
        _unlink(tmp)
        raise
    except BaseException as e:
        _unlink(tmp)
        if isinstance(e, Exception):
            raise TraceError(f"cannot write trace {out}: {_oserror_text(e)}; "
                             f"partial trace kept in {parts}") from None
        raise
    finally:
        src.close()


def _copy_stored(st, dst: h5py.Group, name: str) -> tuple[h5py.Dataset, str, tuple[int, ...] | None]:
    """Copy one tensor as stored (``arrays.StoredArray``): compressed chunks byte for byte.
    Returns the new dataset, its name and chunk shape (for its ``/frames`` rows)."""
    ds = create_dataset(dst, name, st.shape, st.dtype, st.chunk,
                        st.clevel if st.chunk is not None else 3)
    if st.chunk is None:
        if st.nbytes:
            write_whole(ds, st.read())
        return ds, name, None
    for offset in chunk_offsets(st.shape, st.chunk):
        ds.id.write_direct_chunk(offset, st.raw_chunk(offset))
    return ds, name, st.chunk


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def recover(parts_dir: str | os.PathLike, out: str | os.PathLike, *,
            overwrite: bool = False) -> dict:
    """Turn the parts directory a killed recording left into one trace file.

    The result holds every completed step (the valid prefix of segments),
    the run metadata and the last snapshot of every request; its root
    attribute ``complete`` is False, so readers report it as partial. The
    parts directory is left in place (delete it once the file is checked).

    Args:
        parts_dir: the ``<trace>.parts`` directory.
        out: the trace file to create.
        overwrite: replace an existing ``out``.

    Returns:
        stats: ``{"tensors", "digests", "segments", "bytes_file"}``.

    Raises:
        TraceError: ``parts_dir`` is not a readable parts directory, or
            ``out`` exists or cannot be written.
    """
    parts = Path(parts_dir)
    if not parts.is_dir():
        raise TraceError(f"{parts} is not a directory (expected <trace>.parts)")
    out = Path(out)
    if out.resolve().is_relative_to(parts.resolve()):  # --overwrite would replace the data being recovered
        raise TraceError(f"{out} is inside {parts}, the parts directory being recovered: write it elsewhere")
    check_writable(out, overwrite=overwrite, min_free=0)
    return merge_parts(parts, out, overwrite=overwrite, complete=False)
