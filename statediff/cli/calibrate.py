"""``statediff calibrate A B -o NOISE.json``: the noise floor of two legitimate cold runs."""

from __future__ import annotations

from pathlib import Path

import click

from statediff.errors import StatediffError

from .shared import OUT_FILE, PATH, emit, json_option, refuse_existing, same_file, warn


@click.command("calibrate", short_help="Learn the noise floor of two cold runs (NOISE.json).")
@click.argument("a", type=PATH)
@click.argument("b", type=PATH)
@click.option("-o", "--output", type=OUT_FILE, required=True, metavar="NOISE.json",
              help="Where to write the noise file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing noise file.")
@json_option("the envelopes")
@click.pass_context
def calibrate_cmd(ctx: click.Context, a: Path, b: Path, output: Path, overwrite: bool, as_json: bool) -> None:
    """Record the benign differences of two legitimate cold runs A and B.

    Writes, per (layer, kind), the largest max abs error, relative L2 error
    and ULP distance seen, for 'statediff compare --noise'. Warnings go to
    stderr (with --json they are in the JSON too).
    """
    import dataclasses

    from statediff.diff.calibrate import calibrate

    if same_file(a, b):
        raise StatediffError(f"{a} and {b} are the same file: give two cold runs recorded apart")
    refuse_existing(output, overwrite, inputs=(a, b))
    result = calibrate(a, b, output)
    if as_json:
        emit(result, as_json)
    else:
        emit(dataclasses.replace(result, warnings=[]), as_json)
        for w in result.warnings:
            warn(w)
    ctx.exit(result.exit_code)
