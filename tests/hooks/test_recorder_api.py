"""Adapters talk to the trace writer only through ``Recorder`` (issue 22): no module of the engine
side other than ``hooks/recording/recorder.py`` reaches a ``TraceWriter`` or its private records.

Walks the source with ``ast`` (nothing is imported, so this runs without torch).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWNER = REPO / "hooks" / "recording" / "recorder.py"
#: Attributes that reach the writer (``rec.writer``/``rec._writer``) or its private
#: request and run records (``writer._requests``/``writer._run``).
FORBIDDEN_ATTRIBUTES = frozenset({"writer", "_writer", "_requests", "_run"})


def writer_touches(source: str, *, may_write: bool = False) -> list[str]:
    """``line: what`` for each place ``source`` reaches a trace writer's internals, and, unless
    ``may_write`` (a benchmark of the writer itself), each use of ``TraceWriter``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            out.append((node.lineno, f".{node.attr}"))
        elif may_write:
            continue
        elif isinstance(node, ast.ImportFrom) and any(a.name == "TraceWriter" for a in node.names):
            out.append((node.lineno, "imports TraceWriter"))
        elif isinstance(node, ast.Name) and node.id == "TraceWriter":
            out.append((node.lineno, "TraceWriter"))
    return [f"{line}: {what}" for line, what in sorted(out)]


def engine_side_modules() -> list[Path]:
    """Every module of ``hooks/`` (installed as ``statediff_hooks``) but the recorder, and the benchmarks."""
    files = [*(REPO / "hooks").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    return sorted(p for p in files if p != OWNER)


def test_no_module_but_the_recorder_touches_the_trace_writer():
    found = {str(p.relative_to(REPO)): hits for p in engine_side_modules()
             if (hits := writer_touches(p.read_text(encoding="utf-8"), may_write=p.parent.name == "benchmarks"))}
    assert found == {}


def test_the_walk_finds_each_way_of_reaching_the_writer():
    src = ("from statediff.trace import TraceWriter\n"
           "rec.writer.requests[0]['chunks'].append(1)\n"
           "rec._writer.update_run(x=1)\n"
           "w._requests[3]\n"
           "w._run['mode']\n"
           "rec.set_run(mode='hit')\n")
    assert writer_touches(src) == ["1: imports TraceWriter", "2: .writer", "3: ._writer", "4: ._requests",
                                   "5: ._run"]
    assert writer_touches(src, may_write=True) == ["2: .writer", "3: ._writer", "4: ._requests", "5: ._run"]
    assert len(engine_side_modules()) > 30 and OWNER not in engine_side_modules()
