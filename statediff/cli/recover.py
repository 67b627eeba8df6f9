"""``statediff recover PARTS -o TRACE.h5``: one file from an interrupted recording's parts directory."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import OUT_FILE, PATH, refuse_existing


@click.command("recover", short_help="Make one trace file of an interrupted recording.")
@click.argument("parts", type=PATH)
@click.option("-o", "--output", type=OUT_FILE, required=True, metavar="TRACE.h5",
              help="The trace file to create (marked partial).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def recover_cmd(parts: Path, output: Path, overwrite: bool) -> None:
    """Turn the PARTS directory (<trace>.parts) an interrupted recording left into one trace file.

    Every completed step is kept; the file is marked partial. PARTS itself is
    already readable by inspect and compare; this makes it one file to share.
    """
    from statediff.trace import recover

    refuse_existing(output, overwrite, inputs=(parts,))
    stats = recover(parts, output, overwrite=overwrite)
    click.echo(f"recovered {stats.get('tensors', 0)} tensors from {stats.get('segments', 0)} "
               f"completed steps into {output} (partial)")
