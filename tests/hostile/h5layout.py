"""Where the bytes libhdf5 parses lie in an HDF5 file, and how to keep a mutated block's checksum right.

For the metadata fuzz tier (``metafuzz.py``): a mutation of a checksummed
block (superblock v2/v3, object headers and their continuation chunks,
B-tree nodes, fractal heap and free-space blocks) is refused by libhdf5's
checksum check before it parses anything, so the fuzzer recomputes the
checksum (Jenkins' lookup3, as ``H5_checksum_lookup3``) and libhdf5 parses
the mutated structure. ``blocks`` finds every metadata block by its
signature: its extent, where its checksum is, and for object headers each
message (type, where its data lies).

Format reference: the HDF5 File Format Specification, version 3 (superblock
v2/v3, object header v2, global heap collection, fractal heap, v2 B-tree,
free space); a trace uses 8-byte offsets and lengths.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import numpy as np

SIGNATURES = (b"OHDR", b"OCHK", b"GCOL", b"FRHP", b"FHDB", b"FHIB", b"BTHD", b"BTIN", b"BTLF", b"FAHD",
              b"FADB", b"EAHD", b"EAIB", b"EASB", b"EADB", b"FSHD", b"FSSE", b"SMTB", b"SMLI")
SUPERBLOCK = b"\x89HDF\r\n\x1a\n"
MAX_BLOCK = 16384  # longest checksummed block searched for (B-tree nodes, heap blocks are smaller here)
MESSAGE_NAMES = {0x01: "dataspace", 0x02: "link info", 0x03: "datatype", 0x05: "fill value", 0x06: "link",
                 0x08: "layout", 0x0A: "group info", 0x0B: "filter pipeline", 0x0C: "attribute",
                 0x10: "continuation", 0x12: "modification time", 0x15: "attribute info"}
_M = 0xFFFFFFFF


# -- lookup3 (H5_checksum_lookup3, initval 0) ------------------------------------------------------


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data``, as HDF5 checksums its metadata."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & _M
    k = 0
    while n > 12:
        a = (a + int.from_bytes(data[k:k + 4], "little")) & _M
        b = (b + int.from_bytes(data[k + 4:k + 8], "little")) & _M
        c = (c + int.from_bytes(data[k + 8:k + 12], "little")) & _M
        a, b, c = _mix(a, b, c)
        n -= 12
        k += 12
    if n == 0:
        return c
    tail = data[k:k + n] + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & _M
    b = (b + int.from_bytes(tail[4:8], "little")) & _M
    c = (c + int.from_bytes(tail[8:12], "little")) & _M
    return _final(a, b, c)


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _M; a ^= _rot(c, 4); c = (c + b) & _M  # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 6); a = (a + c) & _M  # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 8); b = (b + a) & _M  # noqa: E702
    a = (a - c) & _M; a ^= _rot(c, 16); c = (c + b) & _M  # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 19); a = (a + c) & _M  # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 4); b = (b + a) & _M  # noqa: E702
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c ^= b; c = (c - _rot(b, 14)) & _M  # noqa: E702
    a ^= c; a = (a - _rot(c, 11)) & _M  # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & _M  # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & _M  # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & _M  # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & _M  # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & _M  # noqa: E702
    return c


def _vrot(x: np.ndarray, k: int) -> np.ndarray:
    return (x << np.uint32(k)) | (x >> np.uint32(32 - k))


def checksum_end(buf: bytes, start: int, longest: int = MAX_BLOCK) -> int | None:
    """The end of the checksummed block starting at ``start``: the smallest ``e`` such that the
    4 bytes before ``e`` are the lookup3 checksum of ``buf[start:e - 4]``; None if none within
    ``longest`` bytes. Every candidate length is hashed at once (numpy, one lane per length)."""
    data = np.frombuffer(buf[start:start + longest] + bytes(16), np.uint8)
    top = min(longest, len(buf) - start) - 4
    if top < 8:
        return None
    lens = np.arange(8, top + 1, dtype=np.int64)  # hashed lengths (the block minus its checksum)
    stored = (data[lens].astype(np.uint32) | data[lens + 1].astype(np.uint32) << np.uint32(8)
              | data[lens + 2].astype(np.uint32) << np.uint32(16) | data[lens + 3].astype(np.uint32) << np.uint32(24))
    words = np.frombuffer(data[:(len(data) // 4) * 4].tobytes(), "<u4").astype(np.uint32)
    a = (np.uint32(0xDEADBEEF) + lens.astype(np.uint32)).astype(np.uint32)
    b, c = a.copy(), a.copy()
    full = (lens - 1) // 12  # 12-byte blocks mixed before the tail
    for j in range(int(full.max())):
        i = int(np.searchsorted(full, j + 1))  # lens sorted: lanes i.. still have block j to mix
        x, y, z = a[i:], b[i:], c[i:]
        x += words[3 * j]; y += words[3 * j + 1]; z += words[3 * j + 2]  # noqa: E702
        x -= z; x ^= _vrot(z, 4); z += y  # noqa: E702
        y -= x; y ^= _vrot(x, 6); x += z  # noqa: E702
        z -= y; z ^= _vrot(y, 8); y += x  # noqa: E702
        x -= z; x ^= _vrot(z, 16); z += y  # noqa: E702
        y -= x; y ^= _vrot(x, 19); x += z  # noqa: E702
        z -= y; z ^= _vrot(y, 4); y += x  # noqa: E702
    rest = lens - 12 * full  # 1..12 tail bytes, zero-padded
    tail = np.zeros((len(lens), 12), np.uint32)
    for t in range(12):
        tail[:, t] = np.where(t < rest, data[12 * full + t], 0)
    shifts = np.array([0, 8, 16, 24], np.uint32)
    a += (tail[:, 0:4] << shifts).sum(1, dtype=np.uint32)
    b += (tail[:, 4:8] << shifts).sum(1, dtype=np.uint32)
    c += (tail[:, 8:12] << shifts).sum(1, dtype=np.uint32)
    c ^= b; c -= _vrot(b, 14)  # noqa: E702
    a ^= c; a -= _vrot(c, 11)  # noqa: E702
    b ^= a; b -= _vrot(a, 25)  # noqa: E702
    c ^= b; c -= _vrot(b, 16)  # noqa: E702
    a ^= c; a -= _vrot(c, 4)  # noqa: E702
    b ^= a; b -= _vrot(a, 14)  # noqa: E702
    c ^= b; c -= _vrot(b, 24)  # noqa: E702
    hit = np.flatnonzero(c == stored)
    return None if not hit.size else start + int(lens[hit[0]]) + 4


# -- blocks -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Message:
    """One object header message: its type and where its header and data lie (absolute offsets)."""

    type: int
    header: int
    data: int
    size: int

    @property
    def name(self) -> str:
        return MESSAGE_NAMES.get(self.type, f"type 0x{self.type:02x}")


@dataclasses.dataclass(frozen=True)
class Block:
    """A metadata block: its signature, ``[start, end)``, and ``checksum`` (the offset of its
    4-byte checksum, None for a block without one, e.g. a global heap collection); for object
    headers and continuation chunks, their messages."""

    sig: str
    start: int
    end: int
    checksum: int | None
    messages: tuple[Message, ...] = ()

    def fix(self, buf: bytearray) -> None:
        """Write the checksum of the block's (possibly mutated) bytes."""
        if self.checksum is not None:
            struct.pack_into("<I", buf, self.checksum, lookup3(bytes(buf[self.start:self.checksum])))


def _messages(buf: bytes, at: int, end: int, creation_order: bool) -> tuple[Message, ...]:
    out = []
    head = 6 if creation_order else 4
    while at + head <= end:
        mtype, size = buf[at], struct.unpack_from("<H", buf, at + 1)[0]
        if at + head + size > end:
            break
        out.append(Message(mtype, at, at + head, size))
        at += head + size
    return tuple(out)


def _ohdr(buf: bytes, s: int) -> Block | None:
    flags = buf[s + 5]
    at = s + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    size = int.from_bytes(buf[at:at + width], "little")
    body = at + width
    end = body + size + 4
    if end > len(buf) or struct.unpack_from("<I", buf, end - 4)[0] != lookup3(buf[s:end - 4]):
        return None
    return Block("OHDR", s, end, end - 4, _messages(buf, body, end - 4, bool(flags & 0x04)))


def _continuations(buf: bytes, b: Block) -> dict[int, int]:
    """The continuation chunks a header's continuation messages point at: address -> length."""
    return {struct.unpack_from("<Q", buf, m.data)[0]: struct.unpack_from("<Q", buf, m.data + 8)[0]
            for m in b.messages if m.type == 0x10 and m.size >= 16}


def blocks(buf: bytes) -> list[Block]:
    """Every metadata block found in ``buf``: the superblock, then blocks by signature (a signature
    inside compressed data is kept only when its checksum is found)."""
    out: list[Block] = []
    if buf[:8] == SUPERBLOCK and buf[8] in (2, 3):
        out.append(Block("superblock", 0, 48, 44))
    elif buf[:8] == SUPERBLOCK:
        out.append(Block("superblock", 0, 96, None))  # versions 0/1: no checksum
    found = list(re.finditer(b"|".join(re.escape(s) for s in SIGNATURES), buf))
    chunks = {}  # continuation chunks: address -> length, from the continuation messages
    for m in found:
        if m.group() == b"OHDR" and (b := _ohdr(buf, m.start())) is not None:
            out.append(b)
            chunks |= _continuations(buf, b)
    for m in found:
        s, sig = m.start(), m.group().decode()
        if sig == "OHDR":
            continue
        if sig == "OCHK" and s in chunks:
            end = s + chunks[s]
            if end <= len(buf) and struct.unpack_from("<I", buf, end - 4)[0] == lookup3(buf[s:end - 4]):
                b = Block("OCHK", s, end, end - 4, _messages(buf, s + 4, end - 4, False))
                out.append(b)
                chunks |= _continuations(buf, b)
            continue
        if sig == "GCOL":
            size = struct.unpack_from("<Q", buf, s + 8)[0]
            if 16 <= size <= len(buf) - s:
                out.append(Block("GCOL", s, s + size, None))
            continue
        end = checksum_end(buf, s, 4096) or checksum_end(buf, s)
        if end is None:
            if sig == "FHDB":  # direct blocks of a heap without checksums: up to the next block
                out.append(Block(sig, s, min(s + 4096, len(buf)), None))
            continue
        out.append(Block(sig, s, end, end - 4))
    out.sort(key=lambda b: b.start)
    return out


def gcol_objects(buf: bytes, block: Block) -> list[tuple[int, int, int]]:
    """(offset of the object header, heap index, object size) of each global heap object."""
    out, at = [], block.start + 16
    while at + 16 <= block.end:
        idx, _, _, size = struct.unpack_from("<HHIQ", buf, at)
        out.append((at, idx, size))
        if idx == 0 or size > block.end - at:
            break
        at += 16 + ((size + 7) // 8) * 8
    return out
