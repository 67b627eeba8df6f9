"""``statediff ablate``: the click command over ``statediff_hooks.drivers.ablate``.

Registered in the ``statediff.commands`` entry-point group (pyproject.toml),
so ``statediff`` loads it only when invoked.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from statediff.errors import StatediffError

from ..drivers.ablate import DEFAULT_TIMEOUT, load_matrix, run_matrix


@click.command("ablate", short_help="Run setups as hit/cold pairs; print a PASS/FAIL table.")
@click.argument("matrix", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--markdown", "markdown", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.md",
              help="Also write the table as Markdown (to paste into an issue).")
@click.option("-d", "--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the traces here (default: a temporary directory, removed at the end).")
@click.option("--timeout", type=click.FloatRange(min=1), default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds one 'statediff record' may run.")
@click.option("--no-reuse", is_flag=True,
              help="Record every run afresh, even when an earlier variant recorded one with the same arguments.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as one JSON object.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")
@click.pass_context
def ablate(ctx: click.Context, matrix: Path, markdown: Path | None, work_dir: Path | None, timeout: float,
           no_reuse: bool, as_json: bool, quiet: bool) -> None:
    """Run every variant of MATRIX (TOML) as a hit/cold pair and print the PASS/FAIL table.

    Each variant overrides the [base] settings (engine args, fault,
    speculative config, block size, forced miss = both runs cold, ...), is
    recorded on fresh engines ('statediff record' subprocesses) and
    compared; a variant that cannot record is an ERROR row. A run whose
    record arguments equal an earlier variant's reuses its trace. The matrix
    format is described in statediff_hooks/drivers/ablate.py. Exit 0 when every row
    matched its expectation (expect = "pass" by default), 1 otherwise, 2
    for a bad matrix file.
    """
    m = load_matrix(matrix)
    if markdown is not None and not (markdown.parent if str(markdown.parent) else Path(".")).is_dir():
        raise StatediffError(f"cannot write {markdown}: its directory does not exist")
    say = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
    result = run_matrix(m, work_dir=work_dir, timeout=timeout, say=say, reuse=not no_reuse)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else result.to_text())
    if markdown is not None:
        try:
            markdown.write_text(result.to_markdown(), encoding="utf-8")
        except OSError as e:
            raise StatediffError(f"cannot write {markdown}: {e.strerror or e}") from None
    ctx.exit(result.exit_code)
