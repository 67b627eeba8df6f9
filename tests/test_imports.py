"""The import graph of statediff/ (static, ast): no cycle, and dependencies point one way.

trace (the format) <- diff (the comparison) <- incident (reports, bundles) <- verdict (one pair's audit,
compare and report: ``check_pair``) <- cli; audit (one run alone) on the format only; replay beside them;
errors, jsonutil and textsafe below everything; nothing imports the engine side (statediff_hooks) or torch.
And the engine side (hooks/, statediff_hooks) never imports the offline CLI layer (``statediff.cli``): what
it needs of the offline side is a library call (``statediff.verdict.check_pair``, ``statediff.diff.pair``).
Every import counts, also those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "statediff"
HOOKS = PKG.parent / "hooks"

# package -> what else of statediff it may import (besides itself)
ALLOWED = {
    "statediff.trace": {"statediff.errors", "statediff.jsonutil", "statediff.textsafe"},
    "statediff.replay": {"statediff.errors", "statediff.jsonutil"},
    "statediff.audit": {"statediff.trace", "statediff.errors", "statediff.jsonutil", "statediff.textsafe"},
    "statediff.errors": set(),
    "statediff.jsonutil": set(),
    "statediff.textsafe": set(),
}
FORBIDDEN = {  # package -> packages it must not import
    "statediff.diff": {"statediff.incident", "statediff.verdict", "statediff.cli"},
    "statediff.incident": {"statediff.verdict", "statediff.cli"},
    "statediff.verdict": {"statediff.cli"},
}
ENGINE = {"torch", "vllm", "transformers", "statediff_hooks"}


def modules(root: Path = PKG) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every dotted name ``path`` (module ``name``) imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the statediff modules it imports (a name resolves to its longest known prefix; a
    package is left out where a module under it is named, as in ``from ..incident import record``)."""
    edges = {}
    for m, path in mods.items():
        targets = set()
        for t in imports(m, path):
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != m and not m.startswith(t + "."):  # a module's own parent packages load first anyway
                targets.add(t)
        edges[m] = {t for t in targets if not any(u.startswith(t + ".") for u in targets)}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(edges: dict[str, set[str]], mods: dict[str, Path]) -> list[str]:
    """Each import that breaks ``ALLOWED``, ``FORBIDDEN`` or the engine rule, as 'a -> b'."""
    bad = []
    for m, targets in sorted(edges.items()):
        for pkg, allowed in ALLOWED.items():
            if _under(m, pkg):
                bad += [f"{m} -> {t}" for t in sorted(targets) if not _under(t, pkg)
                        and not any(_under(t, a) for a in allowed)]
        for pkg, forbidden in FORBIDDEN.items():
            if _under(m, pkg):
                bad += [f"{m} -> {t}" for t in sorted(targets) if any(_under(t, f) for f in forbidden)]
        bad += [f"{m} -> {name}" for name in sorted(imports(m, mods[m])) if name.partition(".")[0] in ENGINE]
    return bad


def test_statediff_has_no_import_cycle():
    mods = modules()
    assert {"statediff.trace.reader", "statediff.diff.compare", "statediff.diff.pair", "statediff.incident.bundle",
            "statediff.verdict", "statediff.cli"} <= set(mods)
    assert cycles(graph(mods)) == []


def test_dependencies_point_one_way():
    mods = modules()
    assert violations(graph(mods), mods) == []


def test_the_checks_catch_a_cycle_and_a_forbidden_edge(tmp_path):
    pkg = tmp_path / "statediff"
    for rel, text in {"__init__.py": "", "errors.py": "", "trace/__init__.py": "",
                      "trace/reader.py": "from statediff.diff import metrics\n",
                      "diff/__init__.py": "", "diff/metrics.py": "from . import tolerance\n",
                      "diff/tolerance.py": "def f():\n    from .metrics import x\n    import torch\n",
                      "incident/__init__.py": "", "diff/compare.py": "from ..incident import record\n",
                      "incident/record.py": ""}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    mods = modules(pkg)
    edges = graph(mods)
    assert cycles(edges) == [["statediff.diff.metrics", "statediff.diff.tolerance"]]
    assert violations(edges, mods) == [
        "statediff.diff.compare -> statediff.incident.record",
        "statediff.diff.tolerance -> torch",
        "statediff.trace.reader -> statediff.diff.metrics"]


@pytest.mark.parametrize("package", sorted(ALLOWED) + sorted(FORBIDDEN))
def test_every_rule_names_a_real_module(package):
    assert package in modules()


def cli_uses(root: Path) -> list[str]:
    """Each place under ``root`` (the engine side, hooks/) that reaches ``statediff.cli``: an import
    (ast; relative ones resolved as if ``root`` were ``statediff_hooks``) or the name in the text at all
    (an ``importlib`` string, a docstring pointing there), as 'file:line' or 'file -> module'."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = ("statediff_hooks", *rel.with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        bad += [f"{rel} -> {t}" for t in sorted(imports(name, path)) if _under(t, "statediff.cli")]
        bad += [f"{rel}:{i}" for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if "statediff.cli" in line]
    return bad


def test_the_engine_side_never_imports_the_cli():
    assert len(list(HOOKS.rglob("*.py"))) > 40  # the engine side is there (an empty walk would pass)
    assert cli_uses(HOOKS) == []


def test_the_hooks_rule_catches_an_import_and_a_string(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "check.py").write_text("def f():\n    from statediff.cli.shared import compare_pair\n")
    (tmp_path / "cli" / "x.py").write_text("import importlib\nm = importlib.import_module('statediff.cli')\n")
    (tmp_path / "ok.py").write_text("from statediff.verdict import check_pair\nfrom ..cli import record\n")
    assert cli_uses(tmp_path) == ["check.py -> statediff.cli.shared", "check.py -> statediff.cli.shared.compare_pair",
                                  "check.py:2", "cli/x.py:2"]
