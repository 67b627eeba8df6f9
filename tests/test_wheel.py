"""The built wheel ships every module of the source tree (issue 32: a hand-kept package list
left ``statediff.audit`` out of the wheel, and the editable install, which maps the whole tree,
could not show it).

The wheel is built as a user's ``pip install .`` builds it (setuptools, the configuration of
``pyproject.toml`` and ``setup.py``), offline (``--no-build-isolation``: the setuptools
installed here), from a copy of the tree without bytecode, so that neither ``build/`` left by
an earlier build nor this checkout's caches can make up for a missing package.
"""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Source directory -> the package it installs as.
PACKAGES = {"statediff": "statediff", "hooks": "statediff_hooks"}
#: What package data ships: the suffixes in pyproject.toml's [tool.setuptools.package-data].
DATA_SUFFIXES = (".toml", ".json", ".jsonl")
NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for directory in PACKAGES:
        shutil.copytree(REPO / directory, src / directory, ignore=NOT_SOURCE)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600,
                       env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (built,) = out.glob("statediff-*.whl")
    with zipfile.ZipFile(built) as z:
        yield z


def source_files() -> set[str]:
    """Every file of the source packages, by the path it has once installed (``hooks/x.py`` ->
    ``statediff_hooks/x.py``)."""
    out = set()
    for directory, package in PACKAGES.items():
        for p in (REPO / directory).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                out.add(f"{package}/{p.relative_to(REPO / directory).as_posix()}")
    return out


def dist_info(z: zipfile.ZipFile) -> str:
    (name,) = {n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info")}
    return name


def test_the_wheel_ships_every_module_and_data_file_of_the_source_tree(wheel):
    shipped = {n for n in wheel.namelist() if not n.startswith(dist_info(wheel) + "/")}
    source = source_files()
    assert "statediff/audit/live.py" in shipped and "statediff_hooks/vllm/plugin.py" in shipped
    unshippable = sorted(s for s in source if not s.endswith((".py", *DATA_SUFFIXES)))
    assert unshippable == [], "files no package-data rule ships (pyproject.toml [tool.setuptools.package-data])"
    assert sorted(source - shipped) == [], "in the source tree but not in the wheel"
    assert sorted(shipped - source) == [], "in the wheel but not in the source tree"


def test_only_the_two_packages_land_in_site_packages(wheel):
    """No top-level ``hooks`` (the directory's own name) or ``tests``: a package of that name
    would shadow or be shadowed by another distribution's."""
    assert {n.split("/")[0] for n in wheel.namelist()} == {"statediff", "statediff_hooks", dist_info(wheel)}
    top_level = wheel.read(f"{dist_info(wheel)}/top_level.txt").decode().split()
    assert sorted(top_level) == ["statediff", "statediff_hooks"]


def test_every_entry_point_names_a_function_the_wheel_ships(wheel):
    """The commands, the engine-side subcommands and vLLM's plugin hook resolve inside the wheel."""
    points = configparser.ConfigParser(delimiters=("=",))
    points.read_string(wheel.read(f"{dist_info(wheel)}/entry_points.txt").decode())
    assert {"console_scripts", "statediff.commands", "vllm.general_plugins"} <= set(points.sections())
    assert points["vllm.general_plugins"]["statediff"].startswith("statediff_hooks.vllm.")
    for group in points.sections():
        for name, target in points[group].items():
            module, _, attr = target.partition(":")
            stem = module.replace(".", "/")
            path = next((p for p in (f"{stem}.py", f"{stem}/__init__.py") if p in wheel.namelist()), None)
            assert path is not None, f"[{group}] {name} = {target}: {stem}.py is not in the wheel"
            tree = ast.parse(wheel.read(path))
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                        if isinstance(t, ast.Name)}
            assert attr in defined, f"[{group}] {name} = {target}: {path} defines no {attr}"
