"""The trace format, version 3 (docs/trace-format.md): what a trace holds and how it is written and read.

``schema`` (names, record layouts, limits), ``dtypes``, ``fingerprint`` and
``digest`` (hashes and block digests), ``summary`` (per-tensor summaries);
writing: ``storage`` (chunk layout, encoding), ``records`` (run and request
records, the digest table) and ``writer`` (the crash-safe ``TraceWriter``),
``recovery`` (``recover``/``merge_parts``); reading:
``guard`` and ``h5map`` (libhdf5 parses a file only in a bounded child),
``validate`` and ``rows`` (the checks, in a fixed order), ``arrays``
(byte-range reads), ``parts`` (unfinished recordings), ``reader``
(``open_trace``). Imports nothing else of statediff but ``errors`` and ``jsonutil``.
"""

from .reader import Trace, open_trace
from .schema import FORMAT_VERSION, KINDS, ROLES, DigestEntry, TensorEntry
from .summary import Summary
from .recovery import merge_parts, recover
from .writer import TraceWriter, check_writable, parts_dir

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
