"""What libhdf5 says about the parts of a trace file the reader uses: a ``FileMap``, plain data.

This is the only module that lets libhdf5 parse a file statediff did not
just write, and it runs in the bounded child process of ``guard`` (never in
the reader's own process): libhdf5 parses superblocks, object headers,
attribute and link messages, heaps and chunk indexes as it finds them, and
a crafted file can make it loop forever or allocate without bound (libhdf5
2.0.0 loops forever reading a root-group attribute whose global heap has a
short free-space object: ``tests/hostile/found/``).

``map_file`` reads what the reader needs and nothing else: the root
attributes ``ROOT_ATTRS``, the root members ``ROOT_MEMBERS`` (by name, never
by iterating the root group), ``/run``'s and each request group's ``json``
attribute, the member names of ``/tensors`` and ``/requests``, and the
header of every table and request dataset: type, shape, layout, filters,
chunk shape and where each stored chunk lies (``chunk_iter``). Tensor
datasets need no header when the file has ``/frames`` (every trace written
since it exists: the table says where each chunk lies); in older files
each tensor's header is mapped too (about a millisecond each). It reads
no dataset data: the reader reads tables and tensors itself, by byte
range (``arrays.StoredArray``). The map is JSON text on the wire (``to_json`` /
``FileMap.from_json``); its sizes are bounded by ``schema``'s limits.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import warnings
from typing import Any

import h5py
import numpy as np

from ..errors import TraceError, first_line as _short
from .schema import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_INDEX_ROWS, MAX_JSON_BYTES, MAX_REQUESTS, REQUEST_DATASETS

ROOT_ATTRS = ("format", "format_version", "segment", "complete")
ROOT_MEMBERS = ("run", "index", "digests", "frames", "tensors", "requests")
MAX_INLINE_BYTES = 64 * 1024  # compact datasets hold their data in the object header (HDF5 caps them at 64 KiB)
LINK_NAMES = {"hard": "HardLink", "soft": "SoftLink", "external": "ExternalLink"}
_LINK_TYPES = {h5py.h5l.TYPE_HARD: "hard", h5py.h5l.TYPE_SOFT: "soft", h5py.h5l.TYPE_EXTERNAL: "external"}


# -- the map: plain data ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Attr:
    """One attribute as libhdf5 reports it.

    ``value`` is read only for a scalar of a string, integer, boolean or
    float type whose stored size is at most ``MAX_JSON_BYTES``: text (UTF-8
    decoded; ``utf8`` False and no value when a byte string is not UTF-8) or
    a number. ``error``: libhdf5's refusal, first line.
    """

    dtype: str = ""
    kind: str = ""
    is_str: bool = False
    shape: tuple[int, ...] | None = None
    size: int = 0
    value: str | int | float | bool | None = None
    utf8: bool = True
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset's header and chunk locations; nothing of its data (except a compact one's bytes).

    Attributes:
        descr: its numpy dtype as ``numpy.lib.format.dtype_to_descr`` writes it (metadata dropped).
        dtype: the same as text, for messages.
        shape: its dataspace (None: not simple).
        layout: ``h5py.h5d`` layout code (0 compact, 1 contiguous, 2 chunked, 3 virtual).
        external: external storage files.
        filters: filter ids of its pipeline, in order; ``level``: the first filter's first value.
        chunk: chunk shape (chunked layout), else None.
        storage: bytes stored (``get_storage_size``).
        address: file offset of a contiguous dataset's data (None: not allocated).
        inline: a compact dataset's bytes, base64.
        allocated: chunks stored (chunked), -1 when not asked (the limits refuse the dataset anyway).
        chunks: ``(chunk offset, file offset, stored bytes, filter mask)`` per stored chunk, when
            ``allocated`` equals the chunk grid's size (else empty).
        error: libhdf5's refusal of its header, first line ("" when readable).
    """

    descr: Any = None
    dtype: str = ""
    shape: tuple[int, ...] | None = None
    layout: int = -1
    external: int = 0
    filters: tuple[int, ...] = ()
    level: int | None = None
    chunk: tuple[int, ...] | None = None
    storage: int = 0
    address: int | None = None
    inline: str | None = None
    allocated: int = -1
    chunks: tuple[tuple[tuple[int, ...], int, int, int], ...] = ()
    error: str = ""

    def numpy_dtype(self) -> np.dtype | None:
        """The numpy dtype ``descr`` describes (None: not describable)."""
        if self.descr is None:
            return None
        try:
            return np.lib.format.descr_to_dtype(_tuples(self.descr))
        except (TypeError, ValueError):
            return None

    def inline_bytes(self) -> bytes:
        return base64.b64decode(self.inline) if self.inline else b""


@dataclasses.dataclass(frozen=True)
class Member:
    """A named member of a group: its link type (``hard``/``soft``/``external``/``user``, None:
    absent), the kind of object a hard link reaches (``group``/``dataset``/``other``), and what
    was mapped of it (``attrs``, ``dataset`` header, ``members`` of a group and their count).

    ``error``: the member could not be resolved (libhdf5's message, first line); ``over``: a
    group with more members than the reader's limit (then ``members`` is empty); ``bad_link``:
    the first member of ``/tensors`` that is not a hard link; ``names``: the member names of a
    group mapped without them (``/tensors`` when ``/frames`` locates the tensors)."""

    link: str | None = None
    kind: str | None = None
    error: str = ""
    attrs: dict[str, Attr] = dataclasses.field(default_factory=dict)
    dataset: Dataset | None = None
    members: dict[str, "Member"] = dataclasses.field(default_factory=dict)
    count: int = 0
    over: bool = False
    bad_link: str = ""
    names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FileMap:
    """What ``map_file`` found: the file's identity (device, inode, size when mapped), the root
    attributes and the root members (absent ones are not listed)."""

    identity: tuple[int, int, int]
    attrs: dict[str, Attr]
    members: dict[str, Member]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "FileMap":
        return cls(tuple(doc["identity"]), {k: _attr_from(v) for k, v in doc["attrs"].items()},
                   {k: _member_from(v) for k, v in doc["members"].items()})


def _tuples(x: Any) -> Any:
    """JSON lists back to the tuples a dtype descr uses for fields and shapes."""
    if isinstance(x, list):
        return [tuple(_tuples(v) for v in item) if isinstance(item, list) else item for item in x]
    return x


def _attr_from(d: dict) -> Attr:
    return Attr(**(d | {"shape": None if d["shape"] is None else tuple(d["shape"])}))


def _dataset_from(d: dict | None) -> Dataset | None:
    if d is None:
        return None
    return Dataset(**(d | {
        "shape": None if d["shape"] is None else tuple(d["shape"]),
        "filters": tuple(d["filters"]), "chunk": None if d["chunk"] is None else tuple(d["chunk"]),
        "chunks": tuple((tuple(c), o, s, m) for c, o, s, m in d["chunks"])}))


def _member_from(d: dict) -> Member:
    return Member(**(d | {"attrs": {k: _attr_from(v) for k, v in d["attrs"].items()},
                          "dataset": _dataset_from(d["dataset"]), "names": tuple(d["names"]),
                          "members": {k: _member_from(v) for k, v in d["members"].items()}}))


# -- mapping (runs in the guarded child) ------------------------------------------------------


def map_file(path: str | os.PathLike) -> FileMap:
    """Map the trace file (or segment file) at ``path``.

    Raises:
        TraceError: libhdf5 cannot open it (damaged or truncated); every later problem is
            recorded in the map for the reader to refuse in its own order.
    """
    try:
        f = h5py.File(path, "r")
    except Exception as e:  # h5py raises OSError/KeyError/RuntimeError on damaged files
        raise TraceError(f"{path} is damaged or truncated: {_short(e)}") from None
    with f:
        st = os.fstat(f.id.get_vfd_handle()) if _has_vfd_handle(f) else os.stat(path)
        attrs = {n: a for n in ROOT_ATTRS if (a := _attr(f, n)) is not None}
        members = {}
        for name in ROOT_MEMBERS:  # "frames" before "tensors": with it, no tensor header is needed
            m = _member(f, name)
            if m.link is not None:
                members[name] = _expand(f, name, m, headers="frames" not in members)
        return FileMap((st.st_dev, st.st_ino, st.st_size), attrs, members)


def _has_vfd_handle(f: h5py.File) -> bool:
    try:
        f.id.get_vfd_handle()
        return True
    except Exception:
        return False


def _expand(f: h5py.File, name: str, m: Member, headers: bool) -> Member:
    """What the reader needs of one root member (``headers``: map each tensor dataset's header;
    not needed when ``/frames`` locates the tensors)."""
    if m.link != "hard" or m.error:
        return m
    obj = f[name]
    if name == "run" and m.kind == "group":
        return dataclasses.replace(m, attrs=_attrs(obj, ("json",)))
    if name in ("index", "digests", "frames") and m.kind == "dataset":
        return dataclasses.replace(m, dataset=_dataset(obj))
    if name == "tensors" and m.kind == "group":
        return _tensors(obj, m, headers)
    if name == "requests" and m.kind == "group":
        return _requests(obj, m)
    return m


def _member(group: h5py.Group, name: str) -> Member:
    """The link ``name`` of ``group`` and, for a hard link, the kind of object it reaches."""
    try:
        link = group.get(name, getlink=True)
        if link is None:
            return Member()
        if not isinstance(link, h5py.HardLink):
            kind = {h5py.SoftLink: "soft", h5py.ExternalLink: "external"}.get(type(link), "user")
            return Member(link=kind)
        obj = group[name]
    except Exception as e:
        return Member(link="hard", error=_short(e))
    kind = "group" if isinstance(obj, h5py.Group) else "dataset" if isinstance(obj, h5py.Dataset) else "other"
    return Member(link="hard", kind=kind)


def _attrs(obj: h5py.HLObject, names: tuple[str, ...]) -> dict[str, Attr]:
    return {n: a for n in names if (a := _attr(obj, n)) is not None}


def _attr(obj: h5py.HLObject, name: str) -> Attr | None:
    """``obj``'s attribute ``name`` (None if absent); its value when it is a small scalar."""
    try:
        if name not in obj.attrs:
            return None
        aid = obj.attrs.get_id(name)
        dt, shape, size = aid.dtype, aid.shape, aid.get_storage_size()
    except Exception as e:
        return Attr(error=_short(e))
    is_str = h5py.check_string_dtype(dt) is not None
    facts = dict(dtype=str(dt), kind=dt.kind, is_str=is_str, shape=None if shape is None else tuple(shape),
                 size=int(size))
    if shape != () or size > MAX_JSON_BYTES or not (is_str or dt.kind in "iubf"):
        return Attr(**facts)
    try:
        val = obj.attrs[name]
    except Exception as e:
        return Attr(**facts, error=_short(e))
    if isinstance(val, bytes):
        try:
            val = val.decode("utf-8")
        except UnicodeDecodeError:
            return Attr(**facts, utf8=False)
    if isinstance(val, np.generic):
        val = val.item()
    if not isinstance(val, (str, int, float, bool)):
        return Attr(**facts)
    return Attr(**facts, value=val)


def _dataset(ds: h5py.Dataset | h5py.h5d.DatasetID) -> Dataset:
    """A dataset's header and chunk locations (``Dataset``); libhdf5's errors are recorded.

    Low-level calls only (a trace may hold tens of thousands of tensors: h5py's high-level
    objects cost several times more per dataset)."""
    dsid = ds.id if isinstance(ds, h5py.Dataset) else ds
    try:
        dt = dsid.dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "metadata on a dtype is not saved": what is compared is kept
            descr = json.loads(json.dumps(np.lib.format.dtype_to_descr(dt)))  # its wire form: lists
        shape = None if dsid.shape is None else tuple(int(n) for n in dsid.shape)
        plist = dsid.get_create_plist()
        layout = plist.get_layout()
        pipeline = [plist.get_filter(i) for i in range(plist.get_nfilters())]
        facts = dict(descr=descr, dtype=str(dt), shape=shape, layout=int(layout),
                     external=int(plist.get_external_count()),
                     filters=tuple(int(p[0]) for p in pipeline),
                     level=int(pipeline[0][2][0]) if pipeline and len(pipeline[0][2]) else None)
        if layout == h5py.h5d.CHUNKED:
            facts["chunk"] = tuple(int(c) for c in plist.get_chunk())
        facts["storage"] = int(dsid.get_storage_size())
    except Exception as e:
        return Dataset(error=_short(e))
    if layout == h5py.h5d.CONTIGUOUS:
        try:
            facts["address"] = dsid.get_offset()
        except Exception as e:
            return Dataset(**facts, error=_short(e))
    elif layout == h5py.h5d.COMPACT and shape is not None and 0 < facts["storage"] <= MAX_INLINE_BYTES:
        try:
            raw = np.empty(shape, dtype=dt)
            dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, raw)
        except Exception as e:
            return Dataset(**facts, error=_short(e))
        facts["inline"] = base64.b64encode(raw.tobytes()).decode("ascii")
    elif layout == h5py.h5d.CHUNKED and shape is not None:
        chunk = facts["chunk"]
        if (len(chunk) == len(shape) and all(c >= 1 for c in chunk)
                and dt.itemsize * math.prod(chunk) <= MAX_CHUNK_BYTES
                and math.prod(-(-s // c) for s, c in zip(shape, chunk)) <= MAX_CHUNKS):
            try:
                facts["allocated"] = int(dsid.get_num_chunks())
                if facts["allocated"] == math.prod(-(-s // c) for s, c in zip(shape, chunk)):
                    facts["chunks"] = _chunks(dsid)
            except Exception as e:
                return Dataset(**facts, error=_short(e))
    return Dataset(**facts)


def _chunks(dsid: h5py.h5d.DatasetID) -> tuple:
    """Every stored chunk: (chunk offset, file offset, stored bytes, filter mask), at most MAX_CHUNKS."""
    out: list = []

    def visit(info) -> bool | None:
        off = info.byte_offset
        out.append((tuple(int(o) for o in info.chunk_offset), -1 if off is None else int(off),
                    int(info.size), int(info.filter_mask)))
        return True if len(out) > MAX_CHUNKS else None

    dsid.chunk_iter(visit)
    return tuple(out)


def _tensors(g: h5py.Group, m: Member, headers: bool = True) -> Member:
    """``/tensors``: its member names (hard links only: the first other link is named) and, with
    ``headers``, each dataset's header (else each member is listed as a hard link of unknown kind)."""
    names: list[str] = []
    bad: list[str] = []

    def visit(name: bytes, info) -> bool | None:
        if info.type != h5py.h5l.TYPE_HARD:
            bad.append(name.decode("utf-8", "replace"))
            return True  # stop
        names.append(name.decode("utf-8", "replace"))
        return len(names) > MAX_INDEX_ROWS or None

    try:
        g.id.links.iterate(visit, info=True)
    except Exception as e:
        return dataclasses.replace(m, error=_short(e))
    if bad or len(names) > MAX_INDEX_ROWS:
        return dataclasses.replace(m, bad_link=bad[0] if bad else "", over=not bad, count=len(names))
    if not headers:
        return dataclasses.replace(m, names=tuple(names), count=len(names))
    members = {}
    for name in names:  # hard links all (checked above): open each object directly
        try:
            oid = h5py.h5o.open(g.id, name.encode("utf-8", "surrogateescape"))
        except Exception as e:
            members[name] = Member(link="hard", error=_short(e))
            continue
        if isinstance(oid, h5py.h5d.DatasetID):
            members[name] = Member(link="hard", kind="dataset", dataset=_dataset(oid))
        else:
            members[name] = Member(link="hard", kind="group" if isinstance(oid, h5py.h5g.GroupID) else "other")
    return dataclasses.replace(m, members=members, count=len(names))


def _requests(g: h5py.Group, m: Member) -> Member:
    """``/requests``: each request group's ``json`` attribute and datasets (``REQUEST_DATASETS``)."""
    try:
        n = len(g)
        names = list(g) if n <= MAX_REQUESTS else None
    except Exception as e:
        return dataclasses.replace(m, error=_short(e))
    if names is None:
        return dataclasses.replace(m, over=True, count=n)
    members = {}
    for name in names:
        if not isinstance(name, str):  # h5py gives names that are not UTF-8 as bytes
            members[name.decode("utf-8", "replace")] = Member(link="hard", error="its name is not UTF-8 text")
            continue
        sub = _member(g, name)
        if sub.link == "hard" and sub.kind == "group" and not sub.error:
            rg = g[name]
            datasets = {}
            for key in REQUEST_DATASETS:
                d = _member(rg, key)
                if d.link == "hard" and d.kind == "dataset" and not d.error:
                    d = dataclasses.replace(d, dataset=_dataset(rg[key]))
                if d.link is not None:
                    datasets[key] = d
            sub = dataclasses.replace(sub, attrs=_attrs(rg, ("json",)), members=datasets)
        members[name] = sub
    return dataclasses.replace(m, members=members, count=n)
