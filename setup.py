"""Which packages the wheel ships: found under ``statediff/`` and ``hooks/``, never listed by hand.

Everything else about the distribution is in ``pyproject.toml``. The packages are found here
because the engine side installs as ``statediff_hooks`` from the directory ``hooks/``
(``package-dir`` there), and ``[tool.setuptools.packages.find]`` cannot rename a directory: it
would ship ``hooks/`` as a top-level package ``hooks``. A new subpackage (with or without an
``__init__.py``) ships without an edit; ``tests/test_wheel.py`` builds the wheel and checks it.
"""

from setuptools import find_namespace_packages, setup

#: A namespace search takes every directory for a package, bytecode caches included.
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]


def packages_under(directory: str, name: str) -> list[str]:
    """``name`` and every package below ``directory``, named under ``name``."""
    return [name] + [f"{name}.{p}" for p in find_namespace_packages(directory, exclude=NOT_PACKAGES)]


setup(packages=packages_under("statediff", "statediff") + packages_under("hooks", "statediff_hooks"))
