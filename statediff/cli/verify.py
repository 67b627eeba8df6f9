"""``statediff verify TRACE|BUNDLE``: read every tensor and check it against its hash and summaries."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import PATH, emit, json_option


@click.command("verify", short_help="Read every tensor of a trace or bundle and check its data.")
@click.argument("target", type=PATH, metavar="TRACE|BUNDLE")
@json_option("the result")
@click.pass_context
def verify_cmd(ctx: click.Context, target: Path, as_json: bool) -> None:
    """Read every tensor, chunk and digest row of TRACE (or of both traces of BUNDLE.zip) and check them.

    Every chunk is decoded and every tensor's bytes are hashed against the
    index; its fingerprint (NaN/Inf counts, min, max, moments) and summary
    (digests, moments, sketch) are recomputed from the data. Prints what is
    intact and names each damaged tensor by its key. For BUNDLE.zip each
    member's size and SHA-256 are also checked against its manifest (a
    mismatch is damage). Exit 0 intact, 1 a tensor or bundle member is
    damaged, 2 unreadable (the trace cannot be opened, or the bundle is
    refused: docs/bundles.md).
    """
    from statediff.verify import verify

    result = verify(target)
    emit(result, as_json)
    ctx.exit(result.exit_code)
