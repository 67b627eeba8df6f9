"""``statediff report HIT COLD``: the incident record, in Markdown ready to paste into an issue."""

from __future__ import annotations

from pathlib import Path

import click

from statediff.textsafe import for_terminal

from .shared import OUT_FILE, PATH, compare_options, emit, json_option, refuse_existing, write_text_atomic


@click.command("report", short_help="Write the incident record (Markdown) of HIT vs COLD.")
@click.argument("hit", type=PATH)
@click.argument("cold", type=PATH)
@click.option("-o", "--output", type=OUT_FILE, metavar="REPORT.md",
              help="Write the Markdown here instead of printing it.")
@click.option("--overwrite", is_flag=True, help="Replace an existing REPORT.md.")
@compare_options
@json_option("the record")
@click.pass_context
def report_cmd(ctx: click.Context, hit: Path, cold: Path, output: Path | None, overwrite: bool, options,
               as_json: bool) -> None:
    """The incident record of HIT vs COLD, in Markdown ready to paste into an issue.

    Engine version and commit, checkpoint and quantization, drafter, method
    and speculative tokens, prompt tokens and prefix-cache hit per turn,
    mamba cache mode, acceptance, seed and sampling, forced cache misses,
    replay mode, block size, the root divergence and its diagnosis, and the
    commands that reproduce it; 'unknown' where the traces do not say.
    Tensor-parallel recordings: give each set's rank-0 trace; the record is the
    root rank's, its title names the rank.
    Exit codes are those of 'statediff compare': 0 no divergence, 1 divergence, 2 error
    or CANNOT JUDGE (--json: "verdict": "cannot-judge"; an error prints no JSON).
    """
    from statediff.incident.record import build_report

    from .compare import compare_set_or_pair

    if output is not None:
        refuse_existing(output, overwrite, inputs=(hit, cold))
    report = build_report(compare_set_or_pair(hit, cold, options), options)
    if output is not None:
        write_text_atomic(output, report.to_markdown())
        click.echo(for_terminal(f"wrote {output}: {report.title}"))
    else:
        emit(report, as_json)
    ctx.exit(report.exit_code)
