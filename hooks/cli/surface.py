"""``statediff engine-surface``: the click command over ``statediff_hooks.vllm.surface_check.check``.

Registered in the ``statediff.commands`` entry-point group (pyproject.toml). It reads vLLM's
source with ``ast`` (the installed vLLM, or wheel files that are not installed) and imports
neither torch nor vLLM, so it runs in the light install too.
"""

from __future__ import annotations

import json

import click

from ..vllm.surface_check import FINGERPRINTS, InstalledTree, WheelTree, check, load_store


@click.command("engine-surface",
               short_help="Compare vLLM's patch points with the verified versions'.")
@click.option("--wheel", "wheels", multiple=True, type=click.Path(dir_okay=False), metavar="PATH",
              help="A vLLM wheel file to check without installing it (pip download --no-deps vllm==X); "
                   "repeatable. Without it: the installed vLLM.")
@click.option("--brief", is_flag=True, help="One verdict line per runner, no per-point lines.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
@click.pass_context
def engine_surface(ctx: click.Context, wheels: tuple[str, ...], brief: bool, as_json: bool) -> None:
    """Fingerprint every vLLM patch point statediff uses (module, signature, body) and compare them with the
    versions statediff verified.

    Per runner (Model Runner V1; V2 where its adapter names points), one line: "verified 0.32.0", "patch
    points identical to 0.32.0", "reviewed from 0.33.0's source", or "refused" naming each changed
    (signature, body) and missing point; then one line per point. Exit 0: every runner accepted;
    1: a point changed or is missing; 2: no vLLM here, or a file that is not a vLLM wheel.
    """
    store = load_store(FINGERPRINTS)
    trees = [WheelTree(w) for w in wheels] or [InstalledTree()]
    reports = [check(t, store) for t in trees]
    if as_json:
        click.echo(json.dumps([r.to_json() for r in reports], indent=1))
    else:
        click.echo("\n\n".join(r.to_text(details=not brief) for r in reports))
    ctx.exit(max(r.exit_code for r in reports))
