"""``statediff inspect TRACE``: what a trace holds."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import PATH, emit, json_option


@click.command("inspect", short_help="Show what a trace holds: run, requests, tensors, sizes.")
@click.argument("trace", type=PATH)
@json_option("the summary")
@click.pass_context
def inspect_cmd(ctx: click.Context, trace: Path, as_json: bool) -> None:
    """Summarise TRACE: format, run metadata, requests, what was captured, sizes."""
    from statediff.inspect import inspect_trace

    result = inspect_trace(trace)
    emit(result, as_json)
    ctx.exit(result.exit_code)
