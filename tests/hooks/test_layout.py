"""The engine side's layout (docs/architecture.md, "The engine side"): imports inside ``hooks/`` are
relative, and its sub-packages stand on floors, each importing only packages below it."""

from __future__ import annotations

import ast
from pathlib import Path

HOOKS = Path(__file__).resolve().parents[2] / "hooks"

#: Floors from the ground up: a package may import its own modules and any package on a lower floor.
FLOORS = {"recording": 1, "tiny": 2, "transformers": 3, "vllm": 3, "drivers": 4, "cli": 5}
#: Edges against the floors, each with the reason it stays.
EXCEPTIONS = {
    # check records each run as a `statediff record` subprocess: the words come from the click command
    ("drivers/check.py", "cli"),
}


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """(level, module, line) of every import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((0, a.name, node.lineno) for a in node.names)
    return out


def _sources() -> list[Path]:
    return sorted(p for p in HOOKS.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_inside_hooks_are_relative() -> None:
    absolute = [f"{p.relative_to(HOOKS)}:{line} {mod}" for p in _sources()
                for level, mod, line in _imports(p) if level == 0 and mod.split(".")[0] == "statediff_hooks"]
    assert absolute == []


def test_every_package_imports_only_packages_below_it() -> None:
    against = []
    for p in _sources():
        rel = p.relative_to(HOOKS)
        if len(rel.parts) == 1:
            continue  # hooks/__init__.py
        own = rel.parts[0]
        package = ["statediff_hooks", *rel.parts[:-1]]
        for level, mod, line in _imports(p):
            if level == 0:
                continue
            target = package[: len(package) - (level - 1)] + (mod.split(".") if mod else [])
            if len(target) < 2 or target[1] == own:
                continue
            if FLOORS[target[1]] >= FLOORS[own] and (str(rel), target[1]) not in EXCEPTIONS:
                against.append(f"{rel}:{line} imports {'.'.join(target)}")
    assert against == []


def test_every_sub_package_has_a_floor() -> None:
    packages = {p.name for p in HOOKS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS)

