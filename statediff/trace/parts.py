"""Reading the parts directory of an unfinished recording: its valid prefix of steps.

A recording killed (or still running) leaves ``<trace>.parts/``: ``run.json``,
``data.h5`` (every step's chunks, read by byte range, never through its HDF5
metadata, which a kill can leave half written) and one segment file per
completed step (``seg-NNNNNNNN.h5``: index and digest rows, request
snapshots, ``/frames`` locating the step's chunks in ``data.h5``). The
steps served are the segments in order up to the first gap or the first
segment that is damaged (any refusal of ``validate.read_segment``, or of the
read guard): a step is in the trace only if its segment is whole
(docs/trace-format.md, "Crash safety").
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path

from ..errors import TraceError, first_line as _short
from . import guard
from .arrays import DataFile, Frames
from .h5map import Dataset
from .schema import MAX_JSON_BYTES, MAX_SEGMENTS, DigestEntry, TensorEntry, stop_reason
from .storage import DATA_FILE
from .validate import FileContents, check_run, parse_json_object, read_segment

SEGMENT_RE = re.compile(r"seg-(\d{8,})\.h5")
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@dataclasses.dataclass
class Parts:
    """What a parts directory serves.

    Attributes:
        run: ``run.json``, type-checked.
        format_version: the newest version among the valid segments (none: 1).
        entries, digests, requests: of the valid segments, in step order (later snapshots win).
        frames: where each tensor of the valid segments lies in ``data`` (``data.h5``).
        legacy: tensors of segments that hold their own ``/tensors`` (older writers): dataset
            name -> (segment file, its header).
        segments: the number of valid segments (steps served).
        damage: why the valid prefix ends before the last segment file ("" if every one is whole).
        breach: the read guard's bound the damaged segment broke ("time", "cpu", "memory",
            "crash"; ``guard.GuardBreach``), or "" when libhdf5 did not break one.
        partial_reason: one line saying why the trace is partial.
        data: ``data.h5`` opened for byte-range reads (None when no segment has ``/frames``).
    """

    run: dict
    format_version: int = 1
    entries: list[TensorEntry] = dataclasses.field(default_factory=list)
    digests: list[DigestEntry] = dataclasses.field(default_factory=list)
    requests: dict[int, dict] = dataclasses.field(default_factory=dict)
    frames: dict[str, Frames] = dataclasses.field(default_factory=dict)
    legacy: dict[str, tuple[Path, Dataset | None]] = dataclasses.field(default_factory=dict)
    segments: int = 0
    damage: str = ""
    breach: str = ""
    partial_reason: str = ""
    data: DataFile | None = None


def check_hdf5_file(path: Path) -> None:
    """Refuse, before libhdf5 sees it, what is not a regular file starting with the HDF5 signature.

    A FIFO or device would block the reader or never end; HDF5 may also find a superblock at
    512, 1024, ... bytes, but traces always start with it.

    Raises:
        TraceError: not a regular file, unreadable, or not an HDF5 file.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise TraceError(f"{path} is not a regular file")
        with open(path, "rb") as fh:
            magic = fh.read(8)
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or _short(e)})") from None
    if magic != HDF5_MAGIC:
        raise TraceError(f"{path} is not an HDF5 file (not a statediff trace)")


def list_segments(d: Path) -> list[Path]:
    """Segment files of a parts directory in step order, up to the first gap."""
    found: dict[int, Path] = {}
    try:
        for n, p in enumerate(d.iterdir()):
            if n > MAX_SEGMENTS:
                raise TraceError(f"{d}: over {MAX_SEGMENTS} files")
            m = SEGMENT_RE.fullmatch(p.name)  # *.tmp are unfinished: ignored
            if m:
                found[int(m.group(1))] = p
    except OSError as e:
        raise TraceError(f"{d}: cannot list ({e.strerror})") from None
    out = []
    while len(out) in found:
        out.append(found[len(out)])
    return out


def read_run_json(d: Path) -> dict:
    """``run.json`` of a parts directory: a regular file of at most ``MAX_JSON_BYTES``, a JSON
    object whose documented run keys have their types (``validate.check_run``).

    Raises:
        TraceError: missing, not a regular file, too big, not UTF-8, not a JSON object, bad run field.
    """
    run_json = d / "run.json"
    try:
        st = run_json.stat()
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(f"{run_json} is not a regular file")
        if st.st_size > MAX_JSON_BYTES:
            raise TraceError(f"{run_json} is over {MAX_JSON_BYTES} bytes")
        text = run_json.read_text(encoding="utf-8")
    except OSError:
        if not d.name.endswith(".parts") and not run_json.exists():  # ".", "/", any plain folder
            raise TraceError(f"{d} is a directory, not a trace (nor a recording's TRACE.h5.parts "
                             "directory)") from None
        raise TraceError(f"{d}: partial recording without a readable run.json") from None
    except UnicodeDecodeError:
        raise TraceError(f"{run_json} is not UTF-8 text") from None
    return check_run(parse_json_object(text, str(run_json)), str(run_json))


def read_parts(d: Path) -> Parts:
    """The valid prefix of the parts directory ``d`` (see the module docstring).

    Raises:
        TraceError: ``run.json`` is refused or the directory cannot be listed; damage in a
            segment only ends the prefix (``Parts.damage``).
    """
    out = Parts(run=read_run_json(d))
    segs = list_segments(d)
    try:
        _read_segments(d, segs, out)
    except BaseException:
        if out.data is not None:
            out.data.close()
        raise
    if not out.damage:
        out.partial_reason = (f"the recording did not finish; read up to its last completed step "
                              f"({out.segments} steps)")
        if stop_reason(out.run):  # the replay stopped early and its close did not finish either
            out.partial_reason = f"{stop_reason(out.run)}; {out.partial_reason}"
    return out


def _read_segments(d: Path, segs: list[Path], out: Parts) -> None:
    """Serve ``segs`` in order into ``out`` until the first damaged one."""
    mappable = []
    first_bad: tuple[Path, Exception] | None = None
    for seg in segs:  # checked before the guard maps any: a FIFO would block libhdf5
        try:
            check_hdf5_file(seg)
        except TraceError as e:
            first_bad = (seg, e)
            break
        mappable.append(seg)
    seen: set[str] = set()
    for seg, fmap in zip(mappable, guard.map_files(mappable)):
        try:
            if isinstance(fmap, TraceError):
                raise fmap
            contents = _segment(d, seg, fmap, out, seen)
        except Exception as e:  # TraceError, or anything else a damaged file provokes
            _damaged(out, seg, e)
            return
        _add(out, seg, contents)
    if first_bad is not None:
        _damaged(out, *first_bad)


def _segment(d: Path, seg: Path, fmap, out: Parts, seen: set[str]) -> FileContents:
    with DataFile(seg) as sdata:
        if sdata.identity != tuple(fmap.identity[:2]):
            raise TraceError(f"{seg} changed while it was read")
        if out.data is None and "frames" in fmap.members:
            # opened after the segments were listed: it holds all their chunks
            out.data = DataFile(d / DATA_FILE)
        here = set(seen)
        contents = read_segment(fmap, sdata, seg, out.data, here)
    seen |= here
    return contents


def _add(out: Parts, seg: Path, c: FileContents) -> None:
    if c.frames is not None:  # its tensors are read from the data file
        out.frames.update(c.frames)
    else:
        out.legacy.update({name: (seg, ds) for name, ds in c.tensors.items()})
    out.format_version = max(out.format_version, c.format_version)
    out.entries.extend(c.entries)
    out.digests.extend(c.digests)
    out.requests.update(c.requests)
    out.segments += 1


def _damaged(out: Parts, seg: Path, e: Exception) -> None:
    why = str(e) if isinstance(e, TraceError) else _short(e)
    out.damage = f"segment {seg.name} is damaged: {why}"
    out.breach = e.bound if isinstance(e, guard.GuardBreach) else ""
    out.partial_reason = f"the recording did not finish; read up to step {out.segments} ({out.damage})"
