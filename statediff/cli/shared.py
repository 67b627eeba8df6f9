"""What the offline commands share, declared once: options and output (how a pair is judged:
``statediff.diff.pair``)."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from statediff.diff.defaults import DEFAULT_FACTOR
from statediff.diff.pair import same_file
from statediff.errors import StatediffError
from statediff.textsafe import for_terminal, one_line

PATH = click.Path(path_type=Path)
OUT_FILE = click.Path(dir_okay=False, path_type=Path)


def refuse_existing(path: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse to replace ``path`` without ``--overwrite``, and ever when it is one of ``inputs``
    (``--overwrite`` would destroy the trace being read), before any work.

    Only a regular file is ever replaced: a symlink, device, FIFO or directory at ``path`` is
    refused even with ``--overwrite`` (replacing ``/dev/stdout`` or blocking on a FIFO is never
    what was meant).

    Raises:
        StatediffError: ``path`` is empty, exists and ``overwrite`` is off, is an input, or is
            not a regular file.
    """
    if str(path) in ("", "."):  # Path("") is "."; an empty -o would read as "'.' is a directory"
        raise StatediffError("the output path is empty: give a file name")
    for src in inputs:
        if path.exists() and same_file(path, src):
            raise StatediffError(f"{path} is one of the inputs: write the output elsewhere")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        what = "a symbolic link" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
        raise StatediffError(f"{path} is {what}: statediff writes only regular files (give a new file name)")
    if path.exists() and not overwrite:
        raise StatediffError(f"{path} already exists (use --overwrite to replace it)")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same directory and a
    rename: a failed write (full disk, unencodable text) leaves an existing file as it was.

    Raises:
        StatediffError: the text cannot be encoded or the file cannot be written (one line).
    """
    try:
        data = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as e:
        raise StatediffError(f"cannot write {path}: {e.reason}") from None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise StatediffError(f"cannot write {path}: {e.strerror or e}") from None


def warn(message: str) -> None:
    """One warning line on stderr (the verdict and exit code stay those of the result); escaped as an
    error line is (``one_line``): a warning may quote a trace's run metadata."""
    click.echo("statediff: warning: " + one_line(" ".join(str(message).split())), err=True)


def emit(result: Any, as_json: bool) -> None:
    """Print a result record: its ``to_json()`` as one indented JSON object, or its ``to_text()``."""
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else for_terminal(result.to_text()))


def progress_wanted(as_json: bool) -> bool:
    """A progress bar only for a person watching: stderr is a terminal and the output is not JSON."""
    return sys.stderr.isatty() and not as_json


def json_option(what: str) -> Callable:
    """``--json``: print ``what`` as one JSON object."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object.")


def compare_options(f: Callable) -> Callable:
    """The options that judge a pair (compare, extract, report), passed on as ``options: CompareOptions``."""
    @functools.wraps(f)
    def wrapper(*args: Any, tol: tuple[str, ...], noise: Path | None, noise_factor: float | None,
                allow_engine_mismatch: bool, allow_noise_in_exact: bool, allow_incomplete: bool,
                strict_hits: bool, **kw: Any) -> Any:
        from statediff.diff.pair import CompareOptions

        if noise_factor is not None and not (math.isfinite(noise_factor) and noise_factor > 0):
            raise StatediffError(f"--noise-factor must be a finite number above 0, not {noise_factor:g}")
        options = CompareOptions(tol=tuple(tol), noise=None if noise is None else str(noise),
                                 noise_factor=noise_factor, allow_engine_mismatch=allow_engine_mismatch,
                                 allow_noise_in_exact=allow_noise_in_exact, allow_incomplete=allow_incomplete,
                                 strict_hits=strict_hits)
        return f(*args, options=options, **kw)

    for opt in reversed([
        click.option("--tol", "tol", multiple=True, metavar="PATTERN=ATOL,RTOL",
                     help="Tolerance rule, repeatable, first match wins, before any default: an fnmatch "
                          "PATTERN against the tensor kind, module name or MODULE:KIND, e.g. "
                          "--tol 'gdn.ssm_state=1e-6,1e-5' --tol 'attn.*=0,0' (0,0 = bit identity). "
                          "A pair diverges where |hit-cold| > ATOL + RTOL*|cold|."),
        click.option("--noise", type=PATH, metavar="NOISE.json",
                     help="Noise file from 'statediff calibrate': allow NOISE_FACTOR x the calibrated max "
                          "abs error of each (layer, kind), plus 0.1 x the dtype default as a floor."),
        click.option("--noise-factor", type=float, default=None,
                     help=f"Allowed multiple of the calibrated noise envelope  [default: {DEFAULT_FACTOR:g}; "
                          "a bundle's own]."),
        click.option("--allow-engine-mismatch", is_flag=True,
                     help="Compare traces of different models/configs; tensors without a counterpart are listed."),
        click.option("--allow-noise-in-exact", is_flag=True,
                     help="Accept --noise although both traces replayed exactly (where bit identity is "
                          "expected)."),
        click.option("--allow-incomplete", is_flag=True,
                     help="Compare a trace whose replay stopped early (or whose recording did not finish) "
                          "instead of refusing it; the report's first line says so."),
        click.option("--strict-hits", is_flag=True,
                     help="Exit 1 on a hit finding too: a prefix-cache hit short of what the shared prefix "
                          "allows (or beyond it), or any hit in the cold run."),
    ]):
        wrapper = opt(wrapper)
    return wrapper
