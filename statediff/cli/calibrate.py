"""``statediff calibrate A B -o NOISE.json``: the noise floor of two legitimate cold runs."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import OUT_FILE, PATH, emit, json_option


@click.command("calibrate", short_help="Learn the noise floor of two cold runs (NOISE.json).")
@click.argument("a", type=PATH)
@click.argument("b", type=PATH)
@click.option("-o", "--output", type=OUT_FILE, required=True, metavar="NOISE.json",
              help="Where to write the noise file.")
@json_option("the envelopes")
@click.pass_context
def calibrate_cmd(ctx: click.Context, a: Path, b: Path, output: Path, as_json: bool) -> None:
    """Record the benign differences of two legitimate cold runs A and B.

    Writes, per (layer, kind), the largest max abs error, relative L2 error
    and ULP distance seen, for 'statediff compare --noise'.
    """
    from statediff.diff.calibrate import calibrate

    result = calibrate(a, b, output)
    emit(result, as_json)
    ctx.exit(result.exit_code)
