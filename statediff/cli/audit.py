"""``statediff audit TRACE``: check every restore of one hit run against what the same run saved."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import PATH, emit, json_option


@click.command("audit", short_help="Check one run's restores against what it saved.")
@click.argument("trace", type=PATH)
@json_option("the audit")
@click.pass_context
def audit_cmd(ctx: click.Context, trace: Path, as_json: bool) -> None:
    """Check every prefix-cache restore of TRACE against what the same run saved.

    Copies are exact, so inside one run: each resumed GDN conv/SSM state must
    equal the checkpoint saved at that boundary (whichever request saved it),
    each K/V block read through the runner's block table at a hit must equal
    what was written into the block the scheduler allocated for those
    tokens, and the runner's block table must equal the scheduler's
    allocation. Digests only: works on '--keep none' traces, in any chunking.
    Names the first violation (request, position, layer, tensor), which
    request and step wrote the expected value, and what the restored value
    matches instead. Exit 0 clean, 1 violation, 2 error or NOT CHECKED (requests
    hit the prefix cache but no restored tensor was checkable: nothing vouched for).
    """
    from statediff.audit import audit_trace

    result = audit_trace(trace)
    emit(result, as_json)
    ctx.exit(result.exit_code)
