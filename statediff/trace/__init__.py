"""Trace format v3 (see docs/trace-format.md): schema, writer, reader, per-tensor summaries (digests)."""

from .reader import Trace, open_trace
from .schema import FORMAT_VERSION, KINDS, ROLES, DigestEntry, TensorEntry
from .summary import Summary
from .writer import TraceWriter, check_writable, merge_parts, parts_dir, recover

__all__ = [
    "DigestEntry",
    "FORMAT_VERSION",
    "KINDS",
    "ROLES",
    "Summary",
    "TensorEntry",
    "Trace",
    "TraceWriter",
    "check_writable",
    "merge_parts",
    "open_trace",
    "parts_dir",
    "recover",
]
