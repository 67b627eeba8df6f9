"""The ``engine`` marker: which tests need torch or an inference engine (pytest hooks used by conftest.py).

A test is ``engine`` when it is marked ``vllm`` or ``engine``, uses an engine
fixture (``tiny_model``, ``recordings``), or its module (at load time), its
function or one of its fixtures (when run) imports one of ``ENGINE_PACKAGES``,
directly or through local test helpers and ``statediff_hooks`` modules (a
string naming such a module, as ``monkeypatch.setattr`` takes, counts). A test that
needs the engine another way (it runs an engine-side command) is marked
``@pytest.mark.engine`` by hand. Found statically (ast), so ``pytest -m "not engine"``
works where torch is not installed: such modules are then not even imported.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
HOOKS = TESTS.parent / "hooks"  # installed as statediff_hooks
ENGINE_PACKAGES = frozenset({"torch", "vllm", "transformers", "tokenizers", "triton"})
ENGINE_FIXTURES = frozenset({"tiny_model", "recordings"})


def _load_time_imports(tree: ast.AST, package: str) -> set[str]:
    """Dotted names imported when ``tree`` runs (a module loads, a function is called), not inside
    the functions or classes it defines."""
    out: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join(p for p in (*parts, base) if p)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        todo.extend(ast.iter_child_nodes(node))
    return out


def _local_file(name: str) -> tuple[Path, str] | None:
    """(source file, its package) of a test helper or ``statediff_hooks`` module, else None."""
    head, _, rest = name.partition(".")
    if head == "statediff_hooks":
        base, package = HOOKS, "statediff_hooks"
    elif (TESTS / f"{head}.py").is_file() or (TESTS / head / "__init__.py").is_file():
        base, package, rest = TESTS, "", name
    else:
        return None
    stem = base.joinpath(*rest.split(".")) if rest else base
    if (stem / "__init__.py").is_file():
        return stem / "__init__.py", ".".join(p for p in (package, rest) if p)
    if stem.with_suffix(".py").is_file():
        return stem.with_suffix(".py"), ".".join(p for p in (package, rest.rpartition(".")[0]) if p)
    return None


@functools.cache
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _named_modules(node: ast.AST) -> set[str]:
    """Dotted ``statediff_hooks`` names in string constants (``monkeypatch.setattr("statediff_hooks.x.f", ...)``
    imports the module)."""
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("statediff_hooks.") and n.value.replace(".", "").replace("_", "").isalnum()}


def _imports_engine(names: set[str], path: Path) -> bool:
    for name in names:
        if name.partition(".")[0] in ENGINE_PACKAGES:
            return True
        local = _local_file(name)
        if local is not None and local[0] != path and needs_engine(*local):
            return True
    return False


@functools.cache
def needs_engine(path: Path, package: str = "") -> bool:
    """Whether loading the module at ``path`` imports an engine package (``ENGINE_PACKAGES``)."""
    tree = _tree(path)
    return tree is not None and _imports_engine(_load_time_imports(tree, package), path)


@functools.cache
def function_needs_engine(path: Path, name: str) -> bool:
    """Whether the function ``name`` (a test or a fixture) of the module at ``path`` imports an engine
    package when run, or names a ``statediff_hooks`` module that does."""
    tree = _tree(path)
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            names = _load_time_imports(node, "") | _named_modules(node)
            return _imports_engine({n for name in names for n in _prefixes(name)}, path)
    return False


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a`` (a string names a module and then an attribute)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _engine_deselected(config: pytest.Config) -> bool:
    return "not engine" in " ".join((config.getoption("markexpr", "") or "").split())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m "not engine"`` and no torch installed, do not import modules that would import it."""
    if (collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and _engine_deselected(config) and importlib.util.find_spec("torch") is None
            and needs_engine(collection_path.resolve())):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``engine`` every test that needs torch or an engine (see the module docstring)."""
    for item in items:
        module = getattr(item, "module", None)
        path = Path(module.__file__).resolve() if module is not None and getattr(module, "__file__", None) else None
        if (item.get_closest_marker("vllm") is not None
                or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
                or (path is not None and (needs_engine(path) or any(
                    function_needs_engine(where, name)
                    for name in (getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ()))
                    for where in (path, TESTS / "conftest.py"))))):
            item.add_marker(pytest.mark.engine)
