"""Trace format v2 (see docs/trace-format.md): schema, writer, reader, block digests."""

from .reader import Trace, open_trace
from .schema import FORMAT_VERSION, KINDS, ROLES, DigestEntry, TensorEntry
from .writer import TraceWriter, check_writable, merge_parts, parts_dir, recover

__all__ = [
    "DigestEntry",
    "FORMAT_VERSION",
    "KINDS",
    "ROLES",
    "TensorEntry",
    "Trace",
    "TraceWriter",
    "check_writable",
    "merge_parts",
    "open_trace",
    "parts_dir",
    "recover",
]
