"""Trace format v1 (see docs/trace-format.md): schema, writer, reader."""

from .reader import Trace, open_trace
from .schema import FORMAT_VERSION, KINDS, TensorEntry
from .writer import TraceWriter

__all__ = ["FORMAT_VERSION", "KINDS", "TensorEntry", "Trace", "TraceWriter", "open_trace"]
