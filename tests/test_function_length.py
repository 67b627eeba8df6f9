"""No function of the offline side (statediff/) or the engine side (hooks/) is over 80 lines unless a
comment at its top says why (the developers' guide's rule)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def long_functions(root: Path) -> list[str]:
    """``path:line name (n lines)`` (path relative to ``root``) of each function over ``MAX_LINES``
    lines without a ``# long:`` comment on its first lines, saying why."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                head = lines[node.lineno - 1:node.lineno + 5]
                if n > MAX_LINES and not any("# long:" in line for line in head):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_long_function_in_statediff():
    assert long_functions(ROOT / "statediff") == []


def test_no_long_function_in_hooks():
    assert long_functions(ROOT / "hooks") == []


def test_the_check_finds_a_long_function_and_accepts_a_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    (tmp_path / "a.py").write_text(f"def f():\n{body}\n\n\ndef g():  # long: one table, read top to bottom\n{body}\n")
    assert long_functions(tmp_path) == ["a.py:1 f (86 lines)"]
