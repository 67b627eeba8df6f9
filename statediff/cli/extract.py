"""``statediff extract HIT COLD -o BUNDLE.zip``: the smallest pair of traces that shows the root."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import OUT_FILE, PATH, compare_options, emit, json_option, progress_wanted, refuse_existing


@click.command("extract", short_help="Write the smallest bundle (.zip) that shows the root.")
@click.argument("hit", type=PATH)
@click.argument("cold", type=PATH)
@click.option("-o", "--output", type=OUT_FILE, required=True, metavar="BUNDLE.zip", help="The bundle to write.")
@click.option("--max-mb", type=float, default=25.0, show_default=True,
              help="Refuse a bundle over this many MB (GitHub's attachment limit is 25).")
@click.option("--neighbours", type=click.IntRange(0), default=1, show_default=True,
              help="Boundaries kept on each side of the root position.")
@click.option("--no-neighbours", is_flag=True,
              help="Keep only the root tensor (both traces) and the diagnosis match: the smallest bundle.")
@click.option("--no-plot", is_flag=True, help="Leave out the heatmap PNG.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@compare_options
@json_option("the summary")
@click.pass_context
def extract_cmd(ctx: click.Context, hit: Path, cold: Path, output: Path, max_mb: float, neighbours: int,
                no_neighbours: bool, no_plot: bool, overwrite: bool, options, as_json: bool) -> None:
    """Write BUNDLE.zip: the smallest hit/cold trace pair that shows the root divergence.

    The bundle holds the first divergent tensor on both sides, the same
    layer's states at the neighbouring boundaries of that request, the cold
    tensor the diagnosis matched, every run and request record, report.md
    (the incident record), the heatmap and the replayed prompts. It is
    checked before it is written: same fingerprints as the originals, and
    'statediff compare BUNDLE.zip' names the same root and diagnosis.
    Tensor-parallel recordings: give each set's rank-0 trace; hit.h5 and
    cold.h5 hold the root rank's tensors, hit.rankR.h5 and cold.rankR.h5
    every other rank's shards of the root tensor, and nothing more.
    Exit 0 written; 2 on error, including when HIT and COLD do not diverge
    (nothing to extract) and when the bundle does not fit --max-mb.
    """
    from statediff.incident.bundle import check_output, write_bundle

    from .compare import compare_set_or_pair

    check_output(output, overwrite=overwrite, max_mb=max_mb)  # before the comparison, which can take minutes
    _refuse_set_against_single(hit, cold)
    refuse_existing(output, overwrite, inputs=(hit, cold))
    result = compare_set_or_pair(hit, cold, options, progress=progress_wanted(as_json))
    bundle = write_bundle(result, output, options, max_mb=max_mb, neighbours=0 if no_neighbours else neighbours,
                          siblings=not no_neighbours, plot=not no_plot, overwrite=overwrite)
    emit(bundle, as_json)
    ctx.exit(bundle.exit_code)


def _refuse_set_against_single(hit: Path, cold: Path) -> None:
    """A tensor-parallel set against one trace is compared on unsharded tensors merged in a temporary
    file: a bundle of that is not built; refused in one line."""
    from statediff.diff.ranks import rank_set
    from statediff.errors import StatediffError
    from statediff.trace import open_trace

    sets = []
    for p in (hit, cold):
        with open_trace(p) as t:
            sets.append(rank_set(p, t.run) is not None)
    if sets[0] != sets[1]:
        one, other = (hit, cold) if sets[0] else (cold, hit)
        raise StatediffError(f"{one} is a tensor-parallel set and {other} one trace: extract needs two sets of the "
                             "same size (rank by rank) or two single traces; compare them instead")
