"""``statediff inspect TRACE``: what a trace holds."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import PATH, emit, json_option


@click.command("inspect", short_help="Show what a trace (or bundle) holds: run, requests, tensors, sizes.")
@click.argument("trace", type=PATH, metavar="TRACE|BUNDLE")
@json_option("the summary")
@click.pass_context
def inspect_cmd(ctx: click.Context, trace: Path, as_json: bool) -> None:
    """Summarise TRACE: format, run metadata, requests, what was captured, sizes.

    For BUNDLE.zip (written by 'statediff extract'): its manifest (root,
    diagnosis, options, sources), its members (size and SHA-256, checked
    against the manifest) and both its traces.
    """
    from statediff.incident.unpack import looks_like_bundle
    from statediff.inspect import inspect_bundle, inspect_trace

    result = inspect_bundle(trace) if looks_like_bundle(trace) else inspect_trace(trace)
    emit(result, as_json)
    ctx.exit(result.exit_code)
