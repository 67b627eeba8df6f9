"""Hostile and damaged trace files, generated from one small valid trace.

Each case is a function ``(dir) -> Path`` that writes one file (or parts
directory) that a reader must refuse with ``TraceError``, and the message
fragment the refusal must contain. ``tests/trace/test_trace_hostile.py`` runs them
all; ``python tests/hostile/corpus.py OUTDIR`` writes the corpus to OUTDIR
(seeds for a fuzzer, or test input for another reader implementation).

Generated rather than committed as binaries: a case stays readable, and a
change of the writer's byte layout cannot silently turn a hostile case into
a valid or differently-refused one without the test noticing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import zstandard

from statediff.trace import TraceWriter
from statediff.trace.digest import digest_array
from statediff.trace.schema import DIGEST_DTYPE, FORMAT_VERSION, INDEX_DTYPE, MAX_JSON_BYTES

# -- the valid trace everything starts from ------------------------------------

TENSORS = {
    # dataset: (array, logical dtype, kind, role, layer, position, token_start)
    "t000000000": (np.arange(32, dtype=np.float32).reshape(4, 8) / 7, "float32",
                   "gdn.ssm_state", "checkpoint", 0, 32, None),
    "t000000001": (np.arange(30, dtype=np.uint16).reshape(2, 3, 5) + 0x3F80, "bfloat16",
                   "attn.k", "kv_block", 1, 32, 0),
    "t000000002": (np.array(1.5, dtype=np.float32), "float32", "hidden", "activation", 2, 33, None),
    "t000000003": (np.zeros((0, 4), dtype=np.int32), "int32", "drafter.input", "drafter", 2, 33, None),
}


# digest-only K blocks (/digests rows), one per step: (block values, request, position)
DIGESTS = [(np.full((2, 16, 5), 7, np.uint16), 0, 16), (np.full((2, 16, 5), 9, np.uint16), 1, 16)]


# each request's 2 output tokens: their logprobs, top-2 ids and top-2 logprobs
LOGPROBS = ([-0.5, -1.25], [[7, 3], [9, 8]], [[-0.5, -2.0], [-0.75, -1.25]])


def write_valid(path: Path, **writer_kw) -> Path:
    """A small complete trace: 2 requests, the 4 tensors of TENSORS and 2 digests in 2 steps."""
    # a fixed creation time: the fuzz tier mutates these bytes, so its examples stay the same every run
    w = TraceWriter(path, {"engine": "synthetic", "mode": "cold", "block_size": 16,
                           "created_unix": 1764460800}, **writer_kw)
    w.begin_request(0, "req-0", list(range(40)), cache_salt="s0")
    w.begin_request(1, "req-1", list(range(10, 30)))
    for i, (name, (arr, dtype, kind, role, layer, pos, start)) in enumerate(TENSORS.items()):
        w.add(arr, request=i // 2, position=pos, layer=layer, kind=kind, role=role,
              module=f"model.layers.{layer}", dtype=dtype, token_start=start, step=i // 2)
        if i % 2:
            block, req, dpos = DIGESTS[i // 2]
            w.add_digest(digest_array(block), request=req, position=dpos, token_start=dpos - 16,
                         layer=1, kind="attn.k", role="resumed", module="model.layers.1",
                         dtype="bfloat16", shape=block.shape, step=i // 2, block=3)
            w.update_request(i // 2, chunks=[[0, 16], [16, pos]], output_token_ids=[7, 8],
                             output_logprobs=LOGPROBS[0], output_topk_ids=LOGPROBS[1],
                             output_topk_logprobs=LOGPROBS[2], finished=True)
            w.end_step()
    w.close()
    return path


def _base(d: Path, name: str) -> Path:
    p = d / name
    write_valid(p)
    return p


def _index_rows(f: h5py.File) -> np.ndarray:
    return f["index"][()]


def _replace_index(f: h5py.File, rows: np.ndarray) -> None:
    del f["index"]
    f.create_dataset("index", data=rows)


def _edit(d: Path, name: str, fn: Callable[[h5py.File], None], **open_kw) -> Path:
    p = _base(d, name)
    with h5py.File(p, "r+", **open_kw) as f:
        fn(f)
    return p


def _edit_row(field: str, value) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        rows = _index_rows(f)
        rows[field][0] = value
        _replace_index(f, rows)
    return fn


def _set_attr(path_in_file: str, name: str, value) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        f[path_in_file].attrs[name] = value
    return fn


def _del(path_in_file: str) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[path_in_file]
    return fn


def _replace_tensor(name: str, **create_kw) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f["tensors"][name]
        f["tensors"].create_dataset(name, **create_kw)
    return fn


def rle_frame(total: int, byte: int = 0) -> bytes:
    """A Zstandard frame of ``total`` copies of ``byte``: 4 bytes per 128 KiB (a bomb).

    Frame header: magic, descriptor 0xE0 (single segment, 8-byte content
    size), the content size; then RLE blocks (3-byte header + 1 byte).
    """
    out = bytearray(b"\x28\xb5\x2f\xfd\xe0" + total.to_bytes(8, "little"))
    left = total
    while left:
        n = min(left, 1 << 17)
        left -= n
        header = (n << 3) | (1 << 1) | (1 if left == 0 else 0)
        out += header.to_bytes(3, "little") + bytes([byte])
    return bytes(out)


# -- cases ---------------------------------------------------------------------

CASES: dict[str, tuple[Callable[[Path], Path], str]] = {}


def case(fragment: str):
    """Register ``fn`` as a hostile case whose refusal mentions ``fragment``."""
    def deco(fn: Callable[[Path], Path]) -> Callable[[Path], Path]:
        CASES[fn.__name__] = (fn, fragment)
        return fn
    return deco


def _truncated(at: float | int) -> Callable[[Path], Path]:
    def fn(d: Path) -> Path:
        p = _base(d, "truncated.h5")
        data = p.read_bytes()
        n = int(len(data) * at) if isinstance(at, float) else at
        p.write_bytes(data[:n])
        return p
    return fn


for _at, _frag in ((0, "not an HDF5 file"), (7, "not an HDF5 file"), (8, "damaged or truncated"),
                   (100, "damaged or truncated"), (2048, "damaged or truncated"),
                   (0.5, "damaged or truncated"), (-1, "damaged or truncated")):
    _name = f"truncated_at_{str(_at).replace('.', 'p').replace('-', 'minus')}"
    CASES[_name] = (_truncated(_at), _frag)


@case("not an HDF5 file")
def not_hdf5(d: Path) -> Path:
    p = d / "text.h5"
    p.write_text("this is not a trace\n" * 100)
    return p


@case("not an HDF5 file")
def png_named_h5(d: Path) -> Path:
    p = d / "image.h5"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    return p


@case("not a statediff trace (format=None)")
def hdf5_not_a_trace(d: Path) -> Path:
    p = d / "other.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("weights", data=np.ones(10))
    return p


@case("not a statediff trace (format='other.format')")
def wrong_format_name(d: Path) -> Path:
    return _edit(d, "fmt.h5", _set_attr("/", "format", "other.format"))


@case("attribute 'format' has the wrong type")
def format_attr_array(d: Path) -> Path:
    return _edit(d, "fmtarr.h5", _set_attr("/", "format", np.array([1, 2, 3])))


@case("attribute 'format' has the wrong type")
def format_attr_int(d: Path) -> Path:
    return _edit(d, "fmtint.h5", _set_attr("/", "format", 7))


@case("has trace format version 4; this statediff reads up to version 3 (upgrade statediff)")
def newer_format_version(d: Path) -> Path:
    return _edit(d, "v4.h5", _set_attr("/", "format_version", FORMAT_VERSION + 1))


@case("invalid trace format version 0")
def zero_format_version(d: Path) -> Path:
    return _edit(d, "v0.h5", _set_attr("/", "format_version", 0))


@case("attribute 'format_version' has the wrong type")
def format_version_string(d: Path) -> Path:
    return _edit(d, "vstr.h5", _set_attr("/", "format_version", "1"))


@case("attribute 'format_version' has the wrong type")
def format_version_float(d: Path) -> Path:
    return _edit(d, "vfloat.h5", _set_attr("/", "format_version", 1.5))


@case("missing format_version")
def format_version_missing(d: Path) -> Path:
    return _edit(d, "vnone.h5", lambda f: f.attrs.__delitem__("format_version"))


@case("attribute 'complete' has the wrong type")
def complete_attr_string(d: Path) -> Path:
    return _edit(d, "complete.h5", _set_attr("/", "complete", "yes"))


@case("is one segment of a recording")
def segment_flag_on_merged_file(d: Path) -> Path:
    return _edit(d, "seg.h5", _set_attr("/", "segment", True))


@case("missing /run group")
def run_missing(d: Path) -> Path:
    return _edit(d, "norun.h5", _del("run"))


@case("missing /run group")
def run_is_dataset(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["run"]
        f.create_dataset("run", data=np.arange(3))
    return _edit(d, "rundset.h5", fn)


@case("missing 'json' attribute")
def run_json_missing(d: Path) -> Path:
    return _edit(d, "runnojson.h5", lambda f: f["run"].attrs.__delitem__("json"))


@case("not valid JSON")
def run_json_not_json(d: Path) -> Path:
    return _edit(d, "runbad.h5", _set_attr("run", "json", "{engine: vllm"))


@case("JSON is not an object")
def run_json_list(d: Path) -> Path:
    return _edit(d, "runlist.h5", _set_attr("run", "json", "[1, 2, 3]"))


@case("not valid JSON")
def run_json_nan(d: Path) -> Path:
    return _edit(d, "runnan.h5", _set_attr("run", "json", '{"seed": NaN}'))


@case("not valid JSON")
def run_json_deeply_nested(d: Path) -> Path:
    return _edit(d, "rundeep.h5", _set_attr("run", "json", "[" * 200_000 + "]" * 200_000))


@case("attribute 'json' has the wrong type")
def run_json_number(d: Path) -> Path:
    return _edit(d, "runnum.h5", _set_attr("run", "json", 42))


@case("is over")
def run_json_huge(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["run"]
        g = f.create_group("run")  # a new-style object header holds attributes over 64 KiB
        g.attrs["json"] = json.dumps({"engine": "x" * (MAX_JSON_BYTES + 10)})
    return _edit(d, "runhuge.h5", fn, libver="latest")


@case("run field 'block_size' is 'sixteen'")
def run_field_wrong_type(d: Path) -> Path:
    return _edit(d, "runtype.h5", _set_attr("run", "json", json.dumps({"block_size": "sixteen"})))


@case("run field 'mode' is 'warm'")
def run_mode_unknown(d: Path) -> Path:
    return _edit(d, "runmode.h5", _set_attr("run", "json", json.dumps({"mode": "warm"})))


@case("missing /index dataset")
def index_missing(d: Path) -> Path:
    return _edit(d, "noindex.h5", _del("index"))


@case("/index has an unexpected record layout")
def index_float(d: Path) -> Path:
    return _edit(d, "indexf.h5", lambda f: _replace_index(f, np.zeros(4)))


@case("/index has an unexpected record layout")
def index_missing_field(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rows = _index_rows(f)
        names = [n for n in INDEX_DTYPE.names if n != "hash"]
        _replace_index(f, rows[names].astype([(n, INDEX_DTYPE[n]) for n in names]))
    return _edit(d, "indexfield.h5", fn)


@case("/index has an absurd shape")
def index_2d(d: Path) -> Path:
    return _edit(d, "index2d.h5", lambda f: _replace_index(f, _index_rows(f).reshape(2, 2)))


@case("missing /index dataset")
def index_is_group(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["index"]
        f.create_group("index")
    return _edit(d, "indexgrp.h5", fn)


@case("/index has an absurd shape")
def index_declares_too_many_rows(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["index"]
        f.create_dataset("index", shape=(1 << 40,), dtype=INDEX_DTYPE, chunks=(1024,),
                         **hdf5plugin.Zstd())
    return _edit(d, "indexhuge.h5", fn)


@case("unknown kind 'gdn.mystery'")
def row_bad_kind(d: Path) -> Path:
    return _edit(d, "kind.h5", _edit_row("kind", b"gdn.mystery"))


@case("unknown role 'guess'")
def row_bad_role(d: Path) -> Path:
    return _edit(d, "role.h5", _edit_row("role", b"guess"))


@case("unknown dtype 'complex64'")
def row_bad_dtype(d: Path) -> Path:
    return _edit(d, "dtype.h5", _edit_row("dtype", b"complex64"))


@case("index field 'kind' is not ascii text")
def row_kind_not_ascii(d: Path) -> Path:
    return _edit(d, "kindascii.h5", _edit_row("kind", "gdn.\u00e9t\u00e9".encode()))


@case("invalid request/position/token_start")
def row_negative_position(d: Path) -> Path:
    return _edit(d, "negpos.h5", _edit_row("position", -5))


@case("invalid request/position/token_start")
def row_token_start_after_position(d: Path) -> Path:
    return _edit(d, "tstart.h5", _edit_row("token_start", 1000))


@case("invalid shape (ndim 9")
def row_ndim_too_big(d: Path) -> Path:
    return _edit(d, "ndim.h5", _edit_row("ndim", 9))


@case("invalid shape (ndim -1")
def row_ndim_negative(d: Path) -> Path:
    return _edit(d, "ndimneg.h5", _edit_row("ndim", -1))


@case("invalid shape")
def row_negative_dim(d: Path) -> Path:
    return _edit(d, "negdim.h5", _edit_row("shape", [-4, 8, 0, 0, 0, 0, 0, 0]))


@case("invalid shape")
def row_shape_trailing_garbage(d: Path) -> Path:
    return _edit(d, "trail.h5", _edit_row("shape", [4, 8, 0, 0, 0, 0, 0, 5]))


@case("hash is not 32 hex digits")
def row_bad_hash(d: Path) -> Path:
    return _edit(d, "hash.h5", _edit_row("hash", b"xyz"))


@case("dataset name is not t<digits>")
def row_dataset_path_traversal(d: Path) -> Path:
    return _edit(d, "dsname.h5", _edit_row("dataset", b"../run"))


@case("declares 2199023255552 bytes (limit 1099511627776)")
def row_declares_2tib(d: Path) -> Path:
    return _edit(d, "decl.h5", _edit_row("shape", [1 << 39, 1, 0, 0, 0, 0, 0, 0]))


@case("dataset t000000000 is listed twice")
def duplicate_dataset_rows(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rows = _index_rows(f)
        rows[1] = rows[0]
        _replace_index(f, rows)
    return _edit(d, "dup.h5", fn)


@case("is missing from /tensors")
def row_points_at_missing_dataset(d: Path) -> Path:
    return _edit(d, "missingds.h5", _del("tensors/t000000001"))


@case("is missing from /tensors")
def tensors_group_missing(d: Path) -> Path:
    return _edit(d, "notensors.h5", _del("tensors"))


@case("/tensors holds datasets not in the index")
def extra_dataset(d: Path) -> Path:
    return _edit(d, "extra.h5", lambda f: f["tensors"].create_dataset("t000000099", data=[1.0]))


@case("/tensors/t000000000 is a link (only plain members are allowed)")
def tensor_is_external_link(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["tensors/t000000000"]
        f["tensors"]["t000000000"] = h5py.ExternalLink("/etc/passwd", "/x")
    return _edit(d, "extlink.h5", fn)


@case("/tensors/t000000000 is a link (only plain members are allowed)")
def tensor_is_soft_link(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["tensors/t000000000"]
        f["tensors"]["t000000000"] = h5py.SoftLink("/tensors/t000000001")
    return _edit(d, "softlink.h5", fn)


# /digests (format version 2): refused like /index.
def _digest_rows(f: h5py.File) -> np.ndarray:
    return f["digests"][()]


def _replace_digests(f: h5py.File, rows: np.ndarray) -> None:
    del f["digests"]
    f.create_dataset("digests", data=rows)


def _edit_digest(field: str, value) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        rows = _digest_rows(f)
        rows[field][0] = value
        _replace_digests(f, rows)
    return fn


@case("/digests in a version 1 trace (digests need format version 2)")
def digests_in_a_version_1_file(d: Path) -> Path:
    return _edit(d, "digv1.h5", _set_attr("/", "format_version", 1))


@case("/digests has an unexpected record layout")
def digests_with_index_layout(d: Path) -> Path:
    return _edit(d, "diglayout.h5", lambda f: _replace_digests(f, _index_rows(f)[:2]))


@case("/digests has an unexpected record layout")
def digests_missing_field(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        names = [n for n in DIGEST_DTYPE.names if n != "digest"]
        _replace_digests(f, _digest_rows(f)[names].astype([(n, DIGEST_DTYPE[n]) for n in names]))
    return _edit(d, "digfield.h5", fn)


@case("/digests has an unexpected record layout")
def digests_big_endian_field(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        dt = np.dtype([(n, DIGEST_DTYPE[n].newbyteorder(">") if n == "position" else DIGEST_DTYPE[n])
                       for n in DIGEST_DTYPE.names])
        _replace_digests(f, _digest_rows(f).astype(dt))
    return _edit(d, "digbe.h5", fn)


@case("/digests has an absurd shape")
def digests_2d(d: Path) -> Path:
    return _edit(d, "dig2d.h5", lambda f: _replace_digests(f, _digest_rows(f).reshape(1, 2)))


@case("/digests has an absurd shape")
def digests_declare_too_many_rows(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["digests"]
        f.create_dataset("digests", shape=(1 << 40,), dtype=DIGEST_DTYPE, chunks=(1024,),
                         **hdf5plugin.Zstd())
    return _edit(d, "dighuge.h5", fn)


@case("/digests is not a dataset")
def digests_is_group(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["digests"]
        f.create_group("digests")
    return _edit(d, "diggrp.h5", fn)


@case("/digests is a SoftLink (only plain members are allowed)")
def digests_soft_link(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["digests"]
        f["digests"] = h5py.SoftLink("/index")
    return _edit(d, "digsoft.h5", fn)


@case("/digests row 0: unknown kind 'attn.q'")
def digest_row_bad_kind(d: Path) -> Path:
    return _edit(d, "digkind.h5", _edit_digest("kind", b"attn.q"))


@case("/digests row 0: unknown role 'guess'")
def digest_row_bad_role(d: Path) -> Path:
    return _edit(d, "digrole.h5", _edit_digest("role", b"guess"))


@case("/digests row 0: unknown dtype 'complex64'")
def digest_row_bad_dtype(d: Path) -> Path:
    return _edit(d, "digdtype.h5", _edit_digest("dtype", b"complex64"))


@case("/digests row 0: digest is not 32 lowercase hex digits")
def digest_row_uppercase_hex(d: Path) -> Path:
    return _edit(d, "digupper.h5", _edit_digest("digest", b"ABCDEF" + b"0" * 26))


@case("/digests row 0: digest is not 32 lowercase hex digits")
def digest_row_short(d: Path) -> Path:
    return _edit(d, "digshort.h5", _edit_digest("digest", b"00ff"))


@case("index field 'module' is not utf-8 text")
def digest_row_module_not_utf8(d: Path) -> Path:
    return _edit(d, "digmod.h5", _edit_digest("module", b"layers.\xff\xfe"))


@case("/digests row 0: invalid request/position/token_start (0, 16, 17)")
def digest_row_token_start_after_position(d: Path) -> Path:
    return _edit(d, "digstart.h5", _edit_digest("token_start", 17))


@case("/digests row 0: invalid request/position/token_start (-1, 16, 0)")
def digest_row_negative_request(d: Path) -> Path:
    return _edit(d, "digreq.h5", _edit_digest("request", -1))


@case("/digests row 0: invalid shape (ndim 9")
def digest_row_ndim_too_big(d: Path) -> Path:
    return _edit(d, "digndim.h5", _edit_digest("ndim", 9))


@case("/digests row 0: invalid shape")
def digest_row_shape_trailing_garbage(d: Path) -> Path:
    return _edit(d, "digtrail.h5", _edit_digest("shape", [2, 16, 5, 0, 0, 0, 0, 3]))


@case("/digests row 0: declares 2199023255552 bytes (limit 1099511627776)")
def digest_row_declares_2tib(d: Path) -> Path:
    return _edit(d, "digdecl.h5", _edit_digest("shape", [1 << 40, 1, 1, 0, 0, 0, 0, 0]))


@case("/digests chunk (0,): stored chunk of 65549 bytes")
def digests_decompression_bomb(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rows = _digest_rows(f)
        del f["digests"]
        ds = f.create_dataset("digests", shape=rows.shape, dtype=DIGEST_DTYPE, chunks=rows.shape,
                              **hdf5plugin.Zstd())
        ds.id.write_direct_chunk((0,), rle_frame(1 << 31))
    return _edit(d, "digbomb.h5", fn)


# Tensor-level cases: the trace opens; reading the tensor t000000000 must fail.
READ_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {}


def _without_frames(p: Path) -> Path:
    """Drop ``/frames``: the reader then locates each tensor through its HDF5 dataset, as in traces
    written before ``/frames`` existed (the read cases edit those datasets)."""
    with h5py.File(p, "r+") as f:
        if "frames" in f:
            del f["frames"]
    return p


def read_case(fragment: str, *, frames: bool = False):
    """Register a case that opens and whose tensor t000000000 is refused when read (``frames``:
    keep ``/frames``, else the case is about the dataset itself and ``/frames`` is dropped)."""
    def deco(fn):
        READ_CASES[fn.__name__] = (fn if frames else (lambda d, fn=fn: _without_frames(fn(d))), fragment)
        return fn
    return deco


@read_case("stored type float64 is not the expected float32")
def tensor_other_dtype(d: Path) -> Path:
    return _edit(d, "f64.h5", _replace_tensor("t000000000", data=np.zeros((4, 8))))


@read_case("stored type >f4 is not the expected float32")
def tensor_big_endian(d: Path) -> Path:
    return _edit(d, "be.h5", _replace_tensor("t000000000", data=np.zeros((4, 8), ">f4")))


@read_case("stored type object is not the expected")
def tensor_vlen_string(d: Path) -> Path:
    return _edit(d, "vlen.h5", _replace_tensor(
        "t000000000", data=np.array([["x"] * 8] * 4, dtype=object), dtype=h5py.string_dtype()))


@read_case("stored type object is not the expected")
def tensor_vlen_int(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["tensors/t000000000"]
        ds = f["tensors"].create_dataset("t000000000", shape=(4, 8), dtype=h5py.vlen_dtype("i4"))
        ds[0, 0] = np.arange(10, dtype="i4")
    return _edit(d, "vlenint.h5", fn)


@read_case("stored type object is not the expected")
def tensor_object_references(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["tensors/t000000000"]
        ds = f["tensors"].create_dataset("t000000000", shape=(4, 8), dtype=h5py.ref_dtype)
        ds[0, 0] = f["run"].ref
    return _edit(d, "refs.h5", fn)


@read_case("is not the expected float32")
def tensor_compound(d: Path) -> Path:
    return _edit(d, "compound.h5", _replace_tensor(
        "t000000000", shape=(4, 8), dtype=np.dtype([("a", "<f4")])))


@read_case("is not the expected float32")
def tensor_opaque(d: Path) -> Path:
    return _edit(d, "opaque.h5", _replace_tensor("t000000000", shape=(4, 8), dtype="V4"))


@read_case("shape (4, 9) is not the expected (4, 8)")
def tensor_other_shape(d: Path) -> Path:
    return _edit(d, "shape.h5", _replace_tensor("t000000000", data=np.zeros((4, 9), "<f4")))


@read_case("is missing")
def tensor_is_group(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["tensors/t000000000"]
        f["tensors"].create_group("t000000000")
    return _edit(d, "tgroup.h5", fn)


@read_case("chunks of 134217728 bytes (limit 67108864)")
def tensor_huge_chunks(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rows = _index_rows(f)
        rows["shape"][0, :2] = [1 << 25, 1]
        _replace_index(f, rows)
        del f["tensors/t000000000"]
        f["tensors"].create_dataset("t000000000", shape=(1 << 25, 1), dtype="<f4",
                                    chunks=(1 << 25, 1), **hdf5plugin.Zstd())
    return _edit(d, "bigchunk.h5", fn)


@read_case("over the read limit")
def tensor_declares_2_pow_40_elements(d: Path) -> Path:
    """2**40 uint8 elements, matching index row, nothing stored: refused before allocating."""
    def fn(f: h5py.File) -> None:
        rows = _index_rows(f)
        rows["dtype"][0] = b"uint8"
        rows["ndim"][0] = 1
        rows["shape"][0] = [1 << 40, 0, 0, 0, 0, 0, 0, 0]
        _replace_index(f, rows)
        del f["tensors/t000000000"]
        f["tensors"].create_dataset("t000000000", shape=(1 << 40,), dtype="u1",
                                    chunks=(1 << 24,), **hdf5plugin.Zstd())
    return _edit(d, "elems.h5", fn)


@read_case("stored chunk of 65549 bytes at")
def decompression_bomb(d: Path) -> Path:
    """One 64 KiB chunk of a 128-byte tensor whose frame expands to 2 GiB.

    The registered HDF5 filter would allocate and fill the 2 GiB (h5py
    returns the 128 bytes it wanted and says nothing). Refused by size:
    a stored chunk cannot be much larger than the chunk it holds.
    """
    bomb = rle_frame(1 << 31)
    return _edit(d, "bomb.h5", lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), bomb))


@read_case("frame declares 33554432 bytes, the chunk holds 128 (refused before decompressing)")
def decompression_bomb_small_frame(d: Path) -> Path:
    """A 1 KiB frame (small enough to pass the size check) that expands to 32 MiB."""
    bomb = rle_frame(1 << 25)
    return _edit(d, "bomb32.h5", lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), bomb))


@read_case("frame declares -1 bytes")
def frame_without_content_size(d: Path) -> Path:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(128))
    return _edit(d, "nosize.h5", lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), frame))


@read_case("not a Zstandard frame")
def chunk_not_zstd(d: Path) -> Path:
    return _edit(d, "notzstd.h5",
                 lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), b"garbage!" * 4))


@read_case("corrupt Zstandard frame")
def chunk_frame_body_damaged(d: Path) -> Path:
    frame = zstandard.ZstdCompressor().compress(np.random.default_rng(0).bytes(128))
    return _edit(d, "frame.h5",
                 lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), frame[:-20]))


@read_case("its bytes do not match the hash in the index")
def data_changed_but_decodes(d: Path) -> Path:
    other = np.arange(32, dtype=np.float32).reshape(4, 8)  # not /7: different values
    frame = zstandard.ZstdCompressor().compress(other.tobytes())
    return _edit(d, "hashmm.h5",
                 lambda f: f["tensors/t000000000"].id.write_direct_chunk((0, 0), frame))


@read_case("chunk was stored without its filter")
def chunk_filter_skipped(d: Path) -> Path:
    raw = (np.arange(32, dtype=np.float32).reshape(4, 8) / 7).tobytes()
    return _edit(d, "mask.h5", lambda f: f["tensors/t000000000"].id.write_direct_chunk(
        (0, 0), raw, filter_mask=1))


@read_case("filter pipeline [1] is not exactly Zstandard")
def tensor_gzip(d: Path) -> Path:
    return _edit(d, "gzip.h5", _replace_tensor(
        "t000000000", data=np.arange(32, dtype=np.float32).reshape(4, 8) / 7, compression="gzip"))


@read_case("filter pipeline [2, 32015] is not exactly Zstandard")
def tensor_shuffle_zstd(d: Path) -> Path:
    return _edit(d, "shuffle.h5", _replace_tensor(
        "t000000000", data=np.arange(32, dtype=np.float32).reshape(4, 8) / 7, shuffle=True,
        **hdf5plugin.Zstd()))


@read_case("filter pipeline [] is not exactly Zstandard")
def tensor_chunked_no_filter(d: Path) -> Path:
    return _edit(d, "nofilter.h5", _replace_tensor(
        "t000000000", data=np.arange(32, dtype=np.float32).reshape(4, 8) / 7, chunks=(2, 8)))


@read_case("0 of 1 chunks are stored")
def tensor_chunks_unallocated(d: Path) -> Path:
    return _edit(d, "unalloc.h5", _replace_tensor(
        "t000000000", shape=(4, 8), dtype="<f4", chunks=(4, 8), **hdf5plugin.Zstd()))


@read_case("stores 0 bytes for 128 declared")
def tensor_contiguous_unallocated(d: Path) -> Path:
    return _edit(d, "contig0.h5", _replace_tensor("t000000000", shape=(4, 8), dtype="<f4"))


@read_case("uses external storage")
def tensor_external_storage(d: Path) -> Path:
    secret = d / "secret.bin"
    secret.write_bytes(bytes(range(128)))
    return _edit(d, "external.h5", _replace_tensor(
        "t000000000", shape=(4, 8), dtype="<f4", external=[(str(secret), 0, 128)]))


@read_case("unsupported storage layout 3 (virtual datasets are refused)")
def tensor_virtual(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        layout = h5py.VirtualLayout(shape=(4, 8), dtype="<f4")
        layout[:] = h5py.VirtualSource(str(d / "elsewhere.h5"), "x", shape=(4, 8))
        del f["tensors/t000000000"]
        f["tensors"].create_virtual_dataset("t000000000", layout)
    return _edit(d, "virtual.h5", fn)


# /frames of a merged trace: where each tensor's chunks lie (the reader reads them there).
def _edit_frames(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        rows = fn(f["frames"][()])
        del f["frames"]
        f.create_dataset("frames", data=rows)
    return edit


def _frames_row(rows: np.ndarray, name: bytes) -> int:
    return int(np.flatnonzero(rows["dataset"] == name)[0])


def _far_offset(rows: np.ndarray) -> np.ndarray:
    rows["offset"][0] = 1 << 40
    return rows


@case("/frames row 0 (")
def frames_row_outside_the_file(d: Path) -> Path:
    return _edit(d, "frfar.h5", _edit_frames(_far_offset))


@case("/frames does not locate /tensors/t000000001")
def frames_missing_a_tensor(d: Path) -> Path:
    return _edit(d, "frmiss.h5", _edit_frames(lambda rows: rows[rows["dataset"] != b"t000000001"]))


@case("/frames locates t000000099, which is not under /tensors")
def frames_locating_a_tensor_not_there(d: Path) -> Path:
    def add(rows: np.ndarray) -> np.ndarray:
        extra = rows[-1:].copy()
        extra["dataset"] = b"t000000099"
        return np.concatenate([rows, extra])
    return _edit(d, "frextra.h5", _edit_frames(add))


@read_case("frame declares 60 bytes, the chunk holds 128 (refused before decompressing)", frames=True)
def frames_pointing_at_another_tensor(d: Path) -> Path:
    """t000000000's row points at t000000001's frame: read there, refused by its declared size."""
    def swap(rows: np.ndarray) -> np.ndarray:
        a, b = _frames_row(rows, b"t000000000"), _frames_row(rows, b"t000000001")
        rows["offset"][a], rows["size"][a] = rows["offset"][b], rows["size"][b]
        return rows
    return _edit(d, "frswap.h5", _edit_frames(swap))


# Request records (the trace opens only if they are valid).
@case("/requests/r00000000: 'chunks' is not a list of [start, end) token ranges")
def request_chunks_wrong_type(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rec = json.loads(f["requests/r00000000"].attrs["json"])
        rec["chunks"] = "0-16"
        f["requests/r00000000"].attrs["json"] = json.dumps(rec)
    return _edit(d, "reqchunks.h5", fn)


@case("holds request index 5")
def request_index_mismatch(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rec = json.loads(f["requests/r00000000"].attrs["json"])
        rec["index"] = 5
        f["requests/r00000000"].attrs["json"] = json.dumps(rec)
    return _edit(d, "reqidx.h5", fn)


@case("request index True is not a non-negative integer")
def request_index_bool(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        rec = json.loads(f["requests/r00000000"].attrs["json"])
        rec["index"] = True
        f["requests/r00000000"].attrs["json"] = json.dumps(rec)
    return _edit(d, "reqbool.h5", fn)


@case("is not a request group named r<8 digits>")
def request_bad_name(d: Path) -> Path:
    return _edit(d, "reqname.h5", lambda f: f["requests"].move("r00000000", "zzz"))


@case("is not a request group named r<8 digits>")
def request_is_dataset(d: Path) -> Path:
    return _edit(d, "reqds.h5", lambda f: f["requests"].create_dataset("r00000009", data=[1]))


@case("is unreadable: its name is not UTF-8 text")
def request_name_not_utf8(d: Path) -> Path:
    """A member name h5py hands over as bytes (found by the metadata fuzz tier: the read guard's
    child failed to send such a map)."""
    return _edit(d, "requtf8.h5", lambda f: f["requests"].create_group(b"r\xff0000001"))


@case("prompt_token_ids: stored type float64 is not the expected int64")
def request_tokens_float(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["requests/r00000000/prompt_token_ids"]
        f["requests/r00000000"].create_dataset("prompt_token_ids", data=np.arange(40.0))
    return _edit(d, "tokf.h5", fn)


@case("prompt_token_ids is not a 1-D token dataset of sane size")
def request_tokens_2d(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["requests/r00000000/prompt_token_ids"]
        f["requests/r00000000"].create_dataset("prompt_token_ids", data=np.zeros((40, 2), "<i8"))
    return _edit(d, "tok2d.h5", fn)


@case("prompt_len 40 but 3 prompt token ids")
def request_prompt_len_mismatch(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        del f["requests/r00000000/prompt_token_ids"]
        f["requests/r00000000"].create_dataset("prompt_token_ids", data=np.arange(3, dtype="<i8"))
    return _edit(d, "toklen.h5", fn)


def _replace_request_ds(name: str, data: np.ndarray, req: str = "r00000000") -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        g = f["requests"][req]
        if name in g:
            del g[name]
        g.create_dataset(name, data=data)
    return fn


@case("output_logprobs: stored type float64 is not the expected float32")
def logprobs_float64(d: Path) -> Path:
    return _edit(d, "lpf64.h5", _replace_request_ds("output_logprobs", np.array(LOGPROBS[0], "<f8")))


@case("output_logprobs: stored type >f4 is not the expected float32")
def logprobs_big_endian(d: Path) -> Path:
    return _edit(d, "lpbe.h5", _replace_request_ds("output_logprobs", np.array(LOGPROBS[0], ">f4")))


@case("output_topk_ids: stored type int32 is not the expected int64")
def topk_ids_int32(d: Path) -> Path:
    return _edit(d, "tki32.h5", _replace_request_ds("output_topk_ids", np.array(LOGPROBS[1], "<i4")))


@case("output_topk_ids is not a 2-D dataset of sane size")
def topk_ids_1d(d: Path) -> Path:
    return _edit(d, "tk1d.h5", _replace_request_ds("output_topk_ids", np.array([7, 3, 9, 8], "<i8")))


@case("output_logprobs has 3 values for 2 output tokens")
def logprobs_length_mismatch(d: Path) -> Path:
    return _edit(d, "lplen.h5", _replace_request_ds("output_logprobs", np.array([-1, -2, -3], "<f4")))


@case("output_topk_ids has shape (2, 2) but output_topk_logprobs (2, 3)")
def topk_shapes_disagree(d: Path) -> Path:
    return _edit(d, "tkshape.h5", _replace_request_ds("output_topk_logprobs", np.zeros((2, 3), "<f4")))


@case("output_topk_ids has shape (2, 65), not [2 output tokens, k <= 64]")
def topk_too_wide(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        _replace_request_ds("output_topk_ids", np.zeros((2, 65), "<i8"))(f)
        _replace_request_ds("output_topk_logprobs", np.zeros((2, 65), "<f4"))(f)
    return _edit(d, "tkwide.h5", fn)


@case("output_topk_ids and output_topk_logprobs must come together, with output_logprobs")
def topk_without_logprobs(d: Path) -> Path:
    return _edit(d, "tkalone.h5", _del("requests/r00000001/output_logprobs"))


@case("output_topk_ids and output_topk_logprobs must come together, with output_logprobs")
def topk_half(d: Path) -> Path:
    return _edit(d, "tkhalf.h5", _del("requests/r00000000/output_topk_logprobs"))


@case("'output_logprobs' is not a list of numbers")
def legacy_logprobs_not_numbers(d: Path) -> Path:
    def fn(f: h5py.File) -> None:
        for name in ("output_logprobs", "output_topk_ids", "output_topk_logprobs"):
            del f["requests/r00000000"][name]
        rec = json.loads(f["requests/r00000000"].attrs["json"])
        rec["output_logprobs"] = [-0.5, "x"]
        f["requests/r00000000"].attrs["json"] = json.dumps(rec)
    return _edit(d, "lplegacy.h5", fn)


@case("missing /requests group")
def requests_missing(d: Path) -> Path:
    return _edit(d, "noreq.h5", _del("requests"))


@case("does not fit (chunk 320 bytes")
def request_tokens_bomb(d: Path) -> Path:
    bomb = rle_frame(1 << 30)

    def fn(f: h5py.File) -> None:
        del f["requests/r00000000/prompt_token_ids"]
        ds = f["requests/r00000000"].create_dataset("prompt_token_ids", shape=(40,), dtype="<i8",
                                                    chunks=(40,), **hdf5plugin.Zstd())
        ds.id.write_direct_chunk((0,), bomb)
    return _edit(d, "tokbomb.h5", fn)


# Paths that are not files.
@case("does not exist")
def missing_path(d: Path) -> Path:
    return d / "nothing-here.h5"


@case("is not a regular file")
def fifo(d: Path) -> Path:
    p = d / "pipe.h5"
    os.mkfifo(p)
    return p


# Parts directories of unfinished recordings.
def _parts(d: Path, name: str) -> Path:
    """A parts directory as a killed recording leaves it (2 segments)."""
    src = d / f"{name}-src"
    src.mkdir()
    w = TraceWriter(src / "t.h5", {"engine": "synthetic"})
    for i, (dname, (arr, dtype, kind, role, layer, pos, start)) in enumerate(TENSORS.items()):
        w.add(arr, request=0, position=pos, layer=layer, kind=kind, role=role, module="m",
              dtype=dtype, token_start=start)
        if i % 2:
            w.end_step()
    w._at_exit()  # as at interpreter exit without close(): segments written, never merged
    dst = d / f"{name}.h5.parts"
    shutil.move(str(w.parts), dst)
    return dst


@case("run.json is not a regular file")
def parts_run_json_fifo(d: Path) -> Path:
    p = _parts(d, "fiforunjson")
    (p / "run.json").unlink()
    os.mkfifo(p / "run.json")  # opening it would block forever
    return p


@case("partial recording without a readable run.json")
def parts_without_run_json(d: Path) -> Path:
    p = _parts(d, "norunjson")
    (p / "run.json").unlink()
    return p


@case("run.json is not UTF-8 text")
def parts_run_json_not_utf8(d: Path) -> Path:
    p = _parts(d, "binrunjson")
    (p / "run.json").write_bytes(b"\x00\xff{")
    return p


@case("run.json: not valid JSON")
def parts_run_json_garbage(d: Path) -> Path:
    p = _parts(d, "badrunjson")
    (p / "run.json").write_text('{"engine": ')
    return p


@case("run.json: JSON is not an object")
def parts_run_json_list(d: Path) -> Path:
    p = _parts(d, "listrunjson")
    (p / "run.json").write_text("[]")
    return p


@case("run.json is over")
def parts_run_json_huge(d: Path) -> Path:
    p = _parts(d, "hugerunjson")
    (p / "run.json").write_text(json.dumps({"x": "y" * (MAX_JSON_BYTES + 1)}))
    return p


# Parts directories whose damage is past the valid prefix: served as a partial
# trace of the steps before it (name -> (builder, number of entries served, reason)).
PARTIAL_CASES: dict[str, tuple[Callable[[Path], Path], int, str]] = {}


def _damage_segment(n: int, how: str) -> Callable[[Path], Path]:
    def fn(d: Path) -> Path:
        p = _parts(d, f"seg{n}{how}")
        seg = p / f"seg-{n:08d}.h5"
        if how == "garbage":
            seg.write_bytes(b"garbage" * 100)
        elif how == "empty":
            seg.write_bytes(b"")
        elif how == "truncated":
            seg.write_bytes(seg.read_bytes()[:1000])
        elif how == "gap":
            seg.unlink()
        elif how == "fifo":
            seg.unlink()
            os.mkfifo(seg)
        return p
    return fn


PARTIAL_CASES["second_segment_garbage"] = (_damage_segment(1, "garbage"), 2, "seg-00000001.h5 is damaged")
PARTIAL_CASES["second_segment_empty"] = (_damage_segment(1, "empty"), 2, "seg-00000001.h5 is damaged")
PARTIAL_CASES["second_segment_truncated"] = (_damage_segment(1, "truncated"), 2, "seg-00000001.h5 is damaged")
PARTIAL_CASES["first_segment_garbage"] = (_damage_segment(0, "garbage"), 0, "seg-00000000.h5 is damaged")
PARTIAL_CASES["second_segment_fifo"] = (_damage_segment(1, "fifo"), 2, "seg-00000001.h5 is not a regular file")
PARTIAL_CASES["first_segment_missing"] = (_damage_segment(0, "gap"), 0, "(0 steps)")


def _segment_with_bad_digests(d: Path) -> Path:
    """Step 1's segment carries a /digests table with an unknown role: its whole step is dropped."""
    p = _parts(d, "segdigests")
    with h5py.File(p / "seg-00000001.h5", "r+") as f:
        block, req, pos = DIGESTS[0]
        row = np.zeros(1, DIGEST_DTYPE)
        row[0] = (req, pos, pos - 16, 1, b"attn.k", b"guess", b"m", 1, 3, b"bfloat16", 3,
                  list(block.shape) + [0] * 5, digest_array(block).encode(), b"", b"",
                  0.0, 0.0, 0.0, 0, 0, [0.0] * 16)
        f.create_dataset("digests", data=row)
        f.attrs["format_version"] = 3  # a segment without digests is written as version 1
    return p


PARTIAL_CASES["second_segment_bad_digests"] = (
    _segment_with_bad_digests, 2, "/digests row 0: unknown role 'guess'")


def write_corpus(out: Path) -> list[Path]:
    """Write every case under ``out`` (one subdirectory per case)."""
    paths = []
    for name, (fn, _) in {**CASES, **READ_CASES}.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        paths.append(fn(d))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/hostile/corpus.py OUTDIR")
    for p in write_corpus(Path(sys.argv[1])):
        print(p)
