"""Replace one benchmark's own section of docs/performance.md, keeping the others."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"


def replace_section(heading: str, body: str, doc: Path = DOC) -> None:
    """Put ``body`` (which starts with ``heading``, a ``## `` line) in place of that section."""
    old = doc.read_text() if doc.exists() else "# Performance\n"
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + body
    else:
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + body + (old[end + 1:] if end >= 0 else "")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(new.rstrip("\n") + "\n")
