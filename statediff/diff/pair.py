"""One hit/cold pair judged once: the options that judge it (``CompareOptions``) and the call every
command that judges a pair makes (``compare_pair``: ``compare``, ``report``, ``extract``, and
``statediff.verdict.check_pair``, which ``statediff check`` calls).

``CompareOptions`` also travels with a result: into the reproduce lines and a bundle's manifest
(``statediff.incident``), and back into ``compare`` when a bundle is checked.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from statediff.errors import StatediffError

from .defaults import DEFAULT_FACTOR

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """The ``compare`` options that judge a pair (the seven shared by compare, extract and report).

    Attributes:
        tol: ``--tol`` rules as given (``PATTERN=ATOL,RTOL``), first match wins.
        noise: path of a noise file from ``calibrate``, or None.
        noise_factor: allowed multiple of the noise envelope; None: the
            default (``DEFAULT_FACTOR``, or a bundle's own factor).
        allow_engine_mismatch, allow_noise_in_exact, allow_incomplete,
        strict_hits: as for ``compare``.
    """

    tol: tuple[str, ...] = ()
    noise: str | None = None
    noise_factor: float | None = None
    allow_engine_mismatch: bool = False
    allow_noise_in_exact: bool = False
    allow_incomplete: bool = False
    strict_hits: bool = False

    FLAGS = ("allow_engine_mismatch", "allow_noise_in_exact", "allow_incomplete", "strict_hits")

    @property
    def factor(self) -> float:
        """The noise factor in effect."""
        return DEFAULT_FACTOR if self.noise_factor is None else self.noise_factor

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``statediff.diff.compare.compare``."""
        return dict(tol=list(self.tol), noise=self.noise, noise_factor=self.factor,
                    **{flag: getattr(self, flag) for flag in self.FLAGS})

    def argv(self, noise_name: str | None = None) -> list[str]:
        """The options that change the verdict, as command-line words (``noise_name`` replaces the path)."""
        words: list[str] = []
        for rule in self.tol:
            words += ["--tol", str(rule)]
        if self.noise:
            words += ["--noise", noise_name or str(self.noise), "--noise-factor", f"{self.factor:g}"]
        words += [f"--{flag.replace('_', '-')}" for flag in ("strict_hits", "allow_incomplete")
                  if getattr(self, flag)]
        return words


def same_file(a: PathLike, b: PathLike) -> bool:
    """The same file by path or by inode (a hard link, a symlink, ``./x`` and ``x``)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _stderr_warning(message: str) -> None:
    print("statediff: warning: " + " ".join(str(message).split()), file=sys.stderr)


def compare_pair(hit: PathLike, cold: PathLike, options: CompareOptions = CompareOptions(), *,
                 warn: Callable[[str], None] = _stderr_warning, **kw: Any) -> Any:
    """``compare`` HIT against COLD once.

    Refuses a trace paired with itself: the same file (path or inode), or a
    copy of it (identical run metadata, creation time included). Warns when
    both traces were recorded in the same mode (two hit runs compare a run
    with itself, not a hit with a cold run).

    Args:
        options: the ``CompareOptions`` that judge the pair.
        warn: receives the one-line warning (default: ``statediff: warning: ...`` on stderr).
        kw: further ``compare`` keywords (``progress``, ``max_listed``, ``stop_at_first``).
    Returns:
        the ``CompareResult``.
    Raises:
        StatediffError: ``--noise-factor`` without ``--noise``; the same trace twice; as ``compare``
            otherwise.
    """
    from .compare import compare

    if options.noise_factor is not None and options.noise is None:
        raise StatediffError(f"--noise-factor {options.noise_factor:g} needs --noise NOISE.json: it multiplies the "
                             "calibrated envelopes, and without --noise nothing would use it")
    if same_file(hit, cold):
        raise StatediffError(f"{hit} and {cold} are the same file: give a cache-hit trace and a cold trace "
                             "of the same conversation")
    result = compare(hit, cold, **options.kwargs(), **kw)
    h, c = result.hit.run, result.cold.run
    if h.get("created_unix") is not None and h == c:
        raise StatediffError(f"{hit} and {cold} are copies of the same trace (identical run metadata, "
                             "recorded at the same time): give a cache-hit trace and a cold trace")
    if h.get("mode") is not None and h.get("mode") == c.get("mode"):
        warn(f"both traces are {h['mode']} runs (mode {h['mode']}): a cache-hit trace is compared with a "
             "cold trace ('statediff record --mode hit' and '--mode cold')")
    return result
