"""Open a bundle from a stranger: every check made before its traces are used.

A bundle attached to a bug report may be damaged or built by hand to
mislead. ``open_bundle`` reads it in this order and refuses it, in one
line naming ``BUNDLE.zip:member``, at the first failure:

1. the zip's central directory: no member name twice; the declared
   (uncompressed) sizes add up to at most ``MAX_BUNDLE_BYTES`` (1 GiB,
   environment ``STATEDIFF_BUNDLE_MAX_BYTES``) and no member over
   ``RATIO_FLOOR`` bytes expands more than ``MAX_RATIO`` times its
   compressed size (zip bombs) -- all before anything is unpacked;
2. one ``<folder>/manifest.json``, of format ``statediff.bundle`` and
   version ``MIN_VERSION``..``VERSION``, whose member table lists each
   other member's size and SHA-256;
3. every member of the zip is the manifest or listed there (nothing else,
   nothing outside the folder; the folder's own empty entry is allowed),
   every listed member is present, and ``hit.h5`` and ``cold.h5`` are listed;
4. each listed member is streamed (never more than its declared size)
   and its size and SHA-256 must equal the manifest's; the traces and the
   noise file are written under fixed names in a temporary directory;
5. ``hit.h5`` and ``cold.h5`` are not the same bytes, the manifest's
   root (request, position, layer, tensor kind) is a tensor of both, and
   each trace holds exactly the tensors the manifest lists as kept for it.

A bundle of a tensor-parallel set (version 3, manifest field ``tensor_parallel``) also holds
``hit.rankR.h5`` and ``cold.rankR.h5`` for every rank R but the root's (whose shards are
``hit.h5`` and ``cold.h5``): step 3 allows exactly those names, step 4 unpacks them, and step 5
requires each to hold exactly the tensors the manifest lists for its rank and side, the root
among them.

``strict=False`` (``statediff verify``) collects hash and size
disagreements in ``Bundle.damaged`` instead of refusing (verify reports
them as damage, exit 1) and then skips the root check.

Any ``StatediffError`` raised while the bundle is open has the temporary
paths in its message replaced by ``BUNDLE.zip:folder/member``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError, first_line
from statediff.textsafe import clean_strings

FORMAT = "statediff.bundle"
VERSION = 3  # 2: the manifest lists every member's size and SHA-256; 3: the ranks of a tensor-parallel set
MIN_VERSION = 2  # version 1 bundles list no member hashes: they cannot be checked
MEMBERS = ("hit.h5", "cold.h5", "report.md", "heatmap.png", "replay.jsonl", "noise.json", "manifest.json")
MAX_RANKS = 4096  # a tensor-parallel bundle's world size, at most


def rank_member(side: str, rank: int) -> str:
    """The member holding rank ``rank``'s shards on ``side`` ("hit"/"cold") in a tensor-parallel
    bundle (the root rank's are ``hit.h5`` and ``cold.h5``)."""
    return f"{side}.rank{rank}.h5"


def tensor_parallel(p: Path, manifest: dict) -> dict | None:
    """The manifest's ``tensor_parallel`` field, validated, or None (not a tensor-parallel bundle):
    ``{"world_size": N, "root_rank": R, "ranks": [{"rank": r, "hit": "hit.rank<r>.h5", "cold": ...},
    ...]}`` listing every rank but R once, in rank order.

    Raises:
        StatediffError: a malformed field, or one in a version 2 manifest.
    """
    tp = manifest.get("tensor_parallel")
    if tp is None:
        return None

    def whole(x: Any, lo: int, hi: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi

    n = tp.get("world_size") if isinstance(tp, dict) else None
    ok = (manifest.get("version", 0) >= 3 and whole(n, 2, MAX_RANKS) and whole(tp.get("root_rank"), 0, n - 1)
          and isinstance(tp.get("ranks"), list))
    if ok:
        want = [{"rank": r, "hit": rank_member("hit", r), "cold": rank_member("cold", r)}
                for r in range(n) if r != tp["root_rank"]]
        ok = tp["ranks"] == want
    if not ok:
        raise StatediffError(f"bundle {p}: its manifest's tensor_parallel field is malformed (version 3: world_size, "
                             "root_rank and one hit.rankR.h5/cold.rankR.h5 pair for every other rank, in rank order)")
    return tp
MAX_BUNDLE_BYTES = 1 << 30  # STATEDIFF_BUNDLE_MAX_BYTES overrides it (max_bundle_bytes)


def max_bundle_bytes() -> int:
    """The most bytes a bundle may unpack to: ``STATEDIFF_BUNDLE_MAX_BYTES`` (a whole number of
    bytes above 0, ``1e9`` allowed) or ``MAX_BUNDLE_BYTES`` (1 GiB).

    Raises:
        StatediffError: the variable is set to something else.
    """
    raw = os.environ.get("STATEDIFF_BUNDLE_MAX_BYTES", "").strip()
    if not raw:
        return MAX_BUNDLE_BYTES
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise StatediffError(f"STATEDIFF_BUNDLE_MAX_BYTES={raw[:40]!r} is not a whole number of bytes above 0 "
                             "(e.g. 2000000000 or 2e9)")
    return int(value)
MAX_MANIFEST_BYTES = 16 << 20
MAX_RATIO = 100  # deflate reaches ~1000x on zeros; JSON and Markdown stay well under 20x
RATIO_FLOOR = 1 << 20  # members smaller than this unpack to little whatever their ratio
_TMP_FOLDER = "m"  # members unpack to <tmp>/m/<name>


@dataclasses.dataclass(frozen=True)
class Bundle:
    """An unpacked bundle.

    Attributes:
        path: the zip as the user named it.
        folder: the folder inside the zip (``bundle.zip`` -> ``bundle``).
        hit, cold: the unpacked traces (temporary paths; name them with ``name``).
        noise: the unpacked noise file, or None.
        manifest: the parsed manifest.
        members: name -> {"bytes": int, "sha256": str}, from the manifest.
        damaged: members whose size or hash disagrees with the manifest (``strict=False`` only).
        ranks: a tensor-parallel bundle's other ranks: rank -> (hit, cold) unpacked traces holding
            that rank's shards of the root (empty otherwise); ``root_rank``: the rank of ``hit``/``cold``.
    """

    path: str
    folder: str
    hit: Path
    cold: Path
    noise: Path | None
    manifest: dict
    members: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    damaged: tuple[str, ...] = ()
    ranks: dict[int, tuple[Path, Path]] = dataclasses.field(default_factory=dict)
    root_rank: int | None = None

    def name(self, member: str) -> str:
        """``BUNDLE.zip:folder/member``: how a member is named to the user."""
        return f"{self.path}:{self.folder}/{member}"


def looks_like_bundle(path: str | os.PathLike) -> bool:
    """True when ``path`` is meant as a bundle: a zip file whatever its name, or named ``*.zip``
    unless it is an HDF5 file (a trace named ``x.zip`` is read as the trace it is).

    ``compare`` with one argument opens such a path with ``open_bundle``, whose
    refusal then says what is wrong with the zip (missing, damaged, not a bundle).
    """
    p = Path(path)
    if p.is_file():
        try:
            with open(p, "rb") as f:
                if f.read(8) == HDF5_SIGNATURE:  # statediff writes traces without a user block
                    return False
        except OSError:
            pass  # unreadable: the opener that follows says why
        if zipfile.is_zipfile(p):
            return True
    return p.suffix.lower() == ".zip"


#: The first 8 bytes of an HDF5 file without a user block (HDF5 file format spec, superblock).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_zip(p: Path) -> zipfile.ZipFile:
    if not p.exists():
        raise StatediffError(f"bundle {p} does not exist")
    if not p.is_file():
        raise StatediffError(f"bundle {p} is not a file (a bundle is the .zip 'statediff extract' writes)")
    try:
        return zipfile.ZipFile(p)
    except (zipfile.BadZipFile, ValueError, NotImplementedError) as e:
        raise StatediffError(f"bundle {p} is not a readable zip file: damaged, truncated or not a zip "
                             f"({first_line(e)})") from None
    except OSError as e:
        raise StatediffError(f"bundle {p}: cannot read ({e.strerror or first_line(e)})") from None


def check_directory(p: Path, infos: list[zipfile.ZipInfo]) -> str:
    """Checks on the zip's central directory alone (step 1 and the manifest's place). Returns the folder.

    Raises:
        StatediffError: a name twice, over ``MAX_BUNDLE_BYTES`` in all, a member expanding over
            ``MAX_RATIO`` times, or no single ``<folder>/manifest.json``.
    """
    twice = sorted(n for n, c in Counter(i.filename for i in infos).items() if c > 1)
    if twice:
        raise StatediffError(f"{p}:{twice[0]} appears twice in the zip: a damaged or tampered bundle "
                             "(a bundle names each member once)")
    total, limit = sum(i.file_size for i in infos), max_bundle_bytes()
    if total > limit:
        raise StatediffError(f"bundle {p} would unpack to {total} bytes, over the limit of {limit} "
                             "(STATEDIFF_BUNDLE_MAX_BYTES): refused before unpacking anything")
    for i in infos:
        if i.file_size > RATIO_FLOOR and i.file_size > MAX_RATIO * max(i.compress_size, 1):
            raise StatediffError(f"{p}:{i.filename} would expand {i.file_size} bytes from "
                                 f"{i.compress_size} compressed, over {MAX_RATIO}x (a zip bomb): refused "
                                 "before unpacking anything")
    manifests = [i.filename for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/manifest.json")]
    if len(manifests) != 1:
        raise StatediffError(f"{p} is not a statediff bundle (no single <folder>/manifest.json; "
                             "write one with 'statediff extract')")
    folder = manifests[0].split("/")[0]
    if folder in ("", ".", ".."):
        raise StatediffError(f"{p} is not a statediff bundle (its manifest is in folder {folder!r})")
    return folder


def _read_manifest(p: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo) -> dict:
    if info.file_size > MAX_MANIFEST_BYTES:
        raise StatediffError(f"{p}:{info.filename} declares {info.file_size} bytes "
                             f"(a manifest is at most {MAX_MANIFEST_BYTES})")
    try:
        with z.open(info) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except (OSError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as e:
        raise StatediffError(f"bundle {p}: cannot read {info.filename}, the zip is damaged "
                             f"({first_line(e)})") from None
    try:
        manifest = clean_strings(json.loads(raw.decode("utf-8")))  # printed by inspect: one line each
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise StatediffError(f"bundle {p}: manifest.json is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StatediffError(f"{p} is not a statediff bundle (manifest format "
                             f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise StatediffError(f"bundle {p} has version {version!r}; this statediff reads up to {VERSION}")
    if version < MIN_VERSION:
        raise StatediffError(f"bundle {p} has version {version}, whose manifest lists no member hashes, so "
                             "it cannot be checked; extract it again from the traces with this statediff")
    return manifest


def member_table(p: Path, folder: str, manifest: dict) -> dict[str, dict[str, Any]]:
    """The manifest's member table, validated: known names, sizes, SHA-256 hex digests.

    Raises:
        StatediffError: a malformed table, an unknown name, or no ``hit.h5``/``cold.h5``.
    """
    table = manifest.get("members")
    if not isinstance(table, dict):
        raise StatediffError(f"bundle {p}: {p}:{folder}/manifest.json has no member table (\"members\")")
    tp = tensor_parallel(p, manifest)
    rank_names = {x[side] for x in (tp or {}).get("ranks", []) for side in ("hit", "cold")}
    for name, m in table.items():
        if (name not in MEMBERS and name not in rank_names) or name == "manifest.json":
            raise StatediffError(f"bundle {p}: its manifest lists an unknown member {name!r}")
        if not (isinstance(m, dict) and isinstance(m.get("bytes"), int) and not isinstance(m["bytes"], bool)
                and m["bytes"] >= 0 and isinstance(m.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", m["sha256"])):
            raise StatediffError(f"bundle {p}: its manifest's entry for {folder}/{name} is not "
                                 "{\"bytes\": N, \"sha256\": HEX}")
    for name in ("hit.h5", "cold.h5", *sorted(rank_names)):
        if name not in table:
            raise StatediffError(f"bundle {p}: its manifest lists no {folder}/{name}")
    if bool(manifest.get("noise")) != ("noise.json" in table):
        raise StatediffError(f"bundle {p}: its manifest's noise setting and member table disagree on "
                             f"{folder}/noise.json")
    return table


def _unpack(p: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo, want: dict[str, Any],
            dst: Path | None) -> str | None:
    """Stream one member (to ``dst``, or only hashed), never more than declared; what disagrees with
    ``want`` (size, hash), or None."""
    label = f"{p}:{info.filename}"
    if info.file_size != want["bytes"]:
        return f"{label} declares {info.file_size} bytes, its manifest {want['bytes']}"
    h, copied = hashlib.sha256(), 0
    try:
        with z.open(info) as src, (open(dst, "wb") if dst is not None else contextlib.nullcontext()) as f:
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > info.file_size:
                    raise StatediffError(f"{label} is longer than it declares: a damaged or tampered bundle")
                h.update(chunk)
                if f is not None:
                    f.write(chunk)
    except (OSError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as e:
        raise StatediffError(f"bundle {p}: cannot read {info.filename}, the zip is damaged "
                             f"({first_line(e)})") from None
    if h.hexdigest() != want["sha256"]:
        return f"{label} does not match its manifest (SHA-256 {h.hexdigest()[:16]}..., manifest " \
               f"{want['sha256'][:16]}...)"
    return None


def _check_root(b: Bundle) -> None:
    """The two traces are not the same bytes, the manifest's root is a tensor of both, and each holds
    exactly the tensors the manifest lists as kept on its side (request, position, layer, kind, role)."""
    from statediff.trace.reader import open_trace

    if b.members["hit.h5"]["sha256"] == b.members["cold.h5"]["sha256"]:
        raise StatediffError(f"bundle {b.path}: {b.folder}/hit.h5 and {b.folder}/cold.h5 are the same bytes: "
                             "not a hit and a cold trace (a damaged or tampered bundle)")
    root = b.manifest.get("root")
    if not (isinstance(root, list) and len(root) == 4 and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in root[:3]) and isinstance(root[3], str)):
        raise StatediffError(f"bundle {b.path}: its manifest's root {root!r} is not "
                             "[request, position, layer, kind]")
    key = tuple(root)
    kept = b.manifest.get("kept")
    members = [(side, None, side + ".h5", path) for side, path in (("hit", b.hit), ("cold", b.cold))]
    members += [(side, r, rank_member(side, r), path) for r, pair in sorted(b.ranks.items())
                for side, path in zip(("hit", "cold"), pair)]
    for side, rank, name, path in members:
        with open_trace(path) as t:
            held = {(e.request, e.position, e.layer, e.kind, e.role) for e in [*t.entries, *t.digests]}
        if not (isinstance(kept, list) and all(isinstance(k, dict) for k in kept)):
            raise StatediffError(f"bundle {b.path}: its manifest's list of kept tensors is missing or malformed")
        if not any(h[:4] == key for h in held):
            raise StatediffError(
                f"bundle {b.path}: its manifest's root (request {key[0]}, position {key[1]}, layer {key[2]}, "
                f"{key[3]}) is not in {b.name(name)}: the bundle is not what 'statediff extract' wrote")
        # the root rank's kept tensors carry its rank (or none, before version 3); another rank's, that rank
        mine = (None, b.root_rank) if rank is None else (rank,)
        listed = {(k.get("request"), k.get("position"), k.get("layer"), k.get("kind"), k.get("role"))
                  for k in kept if k.get("side") == side and k.get("rank") in mine}
        if held != listed:
            raise StatediffError(
                f"bundle {b.path}: {b.name(name)} holds {len(held - listed)} tensor(s) its manifest does "
                f"not list as kept and lacks {len(listed - held)} it lists: the bundle is not what "
                "'statediff extract' wrote")


@contextlib.contextmanager
def open_bundle(path: str | os.PathLike, strict: bool = True) -> Iterator[Bundle]:
    """Check a bundle and unpack its traces (and noise file) into a temporary directory.

    The checks and their order are the module docstring's. Report, heatmap
    and replay members are hashed as they stream by, not written.

    Args:
        path: the zip.
        strict: refuse a member whose size or hash disagrees with the manifest (else collect it in
            ``Bundle.damaged``, for ``verify``).
    Yields:
        the ``Bundle``.
    Raises:
        StatediffError: any check above fails; also an error raised inside the ``with`` block, with
            the temporary paths in its message renamed ``BUNDLE.zip:folder/member``.
    """
    p = Path(path)
    with _open_zip(p) as z, tempfile.TemporaryDirectory(prefix="statediff-bundle-") as tmp:
        infos = z.infolist()
        folder = check_directory(p, infos)
        by_name = {i.filename: i for i in infos}
        manifest = _read_manifest(p, z, by_name[f"{folder}/manifest.json"])
        table = member_table(p, folder, manifest)
        for i in infos:
            rel = i.filename.removeprefix(f"{folder}/")
            if i.filename == f"{folder}/" and i.file_size == 0:
                continue  # the folder's own entry (a bundle zipped again with 'zip -r')
            if i.filename != f"{folder}/manifest.json" and (rel == i.filename or rel not in table):
                raise StatediffError(f"{p}:{i.filename} is not listed in the bundle's manifest: a damaged "
                                     "or tampered bundle")
        for name in table:
            if f"{folder}/{name}" not in by_name:
                raise StatediffError(f"bundle {p} has no {folder}/{name}")
        d = Path(tmp) / _TMP_FOLDER
        d.mkdir()
        damaged = []
        tp = tensor_parallel(p, manifest)
        for name, want in table.items():
            dst = d / name if name.endswith(".h5") or name == "noise.json" else None
            bad = _unpack(p, z, by_name[f"{folder}/{name}"], want, dst)
            if bad and strict:
                raise StatediffError(f"{bad}: damaged or altered ('statediff verify {p}' lists what is "
                                     "damaged)")
            if bad:
                damaged.append(bad)
        b = Bundle(str(p), folder, d / "hit.h5", d / "cold.h5", d / "noise.json" if "noise.json" in table else None,
                   manifest, table, tuple(damaged),
                   {x["rank"]: (d / x["hit"], d / x["cold"]) for x in tp["ranks"]} if tp else {},
                   tp["root_rank"] if tp else None)
        try:
            if not damaged:
                _check_root(b)
            yield b
        except StatediffError as e:
            e.args = (rename(str(e), d, b),)
            raise


def rename(text: str, d: Path, b: Bundle) -> str:
    """``text`` with paths under the temporary directory ``d`` named ``BUNDLE.zip:folder/member``."""
    return text.replace(f"{d}{os.sep}", f"{b.path}:{b.folder}/").replace(str(d), f"{b.path}:{b.folder}")
