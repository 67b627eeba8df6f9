"""``statediff compare HIT COLD`` (or ``compare BUNDLE.zip``): name the first divergent tensor."""

from __future__ import annotations

from pathlib import Path

import click

from .shared import OUT_FILE, PATH, compare_options, emit, json_option, progress_wanted, refuse_existing, warn


def compare_set_or_pair(hit: Path, cold: Path, options, **kw):
    """Two tensor-parallel sets rank by rank (``statediff.diff.ranks``: a ``RankedResult``), else the
    pair (``statediff.diff.pair.compare_pair``)."""
    from statediff.diff.pair import compare_pair
    from statediff.diff.ranks import compare_ranks
    from statediff.trace import open_trace

    kw = dict(kw, warn=warn)
    ranked = compare_ranks(hit, cold, open_trace(hit).run, open_trace(cold).run,
                           lambda h, c: compare_pair(h, c, options, **kw),
                           lambda s, n, single, side: _merged_compare(s, n, single, side, options, **kw))
    return ranked if ranked is not None else compare_pair(hit, cold, options, **kw)


def _merged_compare(set0: Path, size: int, single: Path, side: str, options, **kw):
    """A tensor-parallel set against a single trace: the set's unsharded tensors
    (``ranks.merge_set``, in a temporary directory) against it, by tolerance
    (``--allow-engine-mismatch`` required: the layouts and the reduction order differ)."""
    import dataclasses
    import tempfile

    from statediff.diff.pair import compare_pair
    from statediff.diff.ranks import merge_set
    from statediff.errors import StatediffError

    if not options.allow_engine_mismatch:
        raise StatediffError(f"{set0} is a {size}-rank tensor-parallel set and {single} one trace: give "
                             "--allow-engine-mismatch to compare the set's unsharded tensors with it by tolerance "
                             "(the layout and the reduction order differ, so bit identity cannot hold)")
    with tempfile.TemporaryDirectory(prefix="statediff-merged-") as tmp:
        merged = Path(tmp) / f"{set0.stem}.merged.h5"
        field = merge_set(set0, merged)
        hit, cold = (merged, single) if side == "hit" else (single, merged)
        result = compare_pair(hit, cold, options, **kw)
    note = (f"tensor parallel: the {side} side is {set0} ({size} ranks), unsharded (each kind's shards placed by "
            f"run field tensor_parallel.shards; the conv state's q, k and v parts each where they belong): "
            f"{field['merged']} tensors merged, {field['left_out']} left out (digest only on a rank, whose digests "
            "cannot be combined); judged by tolerance against one rank's layout")
    return dataclasses.replace(result, warnings=[note, *result.warnings])


@click.command("compare", short_help="Name the first divergent tensor of HIT vs COLD.")
@click.argument("hit", type=PATH)
@click.argument("cold", type=PATH, required=False)  # omitted: HIT is a bundle .zip (statediff extract)
@compare_options
@json_option("the report")
@click.option("--plot", type=OUT_FILE, metavar="OUT.png",
              help="Also write per-request heatmaps of the error over layer x position (needs matplotlib); "
                   "a plot that cannot be written is a warning and leaves the exit code alone; an existing "
                   "file needs --overwrite.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --plot file.")
@click.option("--max-listed", type=click.IntRange(0), default=10, show_default=True,
              help="How many divergences after the first to list.")
@click.option("--first", is_flag=True,
              help="Fail fast: stop at the first divergence (the same root a full compare names) and "
                   "diagnose it; later divergences are neither judged nor counted.")
@click.pass_context
def compare_cmd(ctx: click.Context, hit: Path, cold: Path | None, options, as_json: bool, plot: Path | None,
                overwrite: bool, max_listed: int, first: bool) -> None:
    """Name the first tensor where the HIT trace diverges from the COLD trace.

    Pairs tensors by (request, position, layer, kind), judges each pair
    against the tolerance policy (--tol rules, else --noise envelopes, else
    bit identity when both traces replayed exactly, else dtype defaults:
    float32 atol 1e-5 rtol 1e-4, float16 1e-3/5e-3, bfloat16 1e-2/2e-2,
    integers exact), reports the first divergence in causal order, its
    propagated consequences and what the wrong tensor matches instead.
    A pair with no data on a side (record --keep hits/none) is judged from
    the recorded summaries: digests, NaN/Inf counts and, in default replay,
    the sketch's estimate of the L2 error against the tolerance; when the
    root has no data, the report prints the two 'statediff record --focus'
    commands that record it (--json: "focus" and "focus_commands").
    Exit 0 no divergence, 1 divergence, 2 error or CANNOT JUDGE (--json:
    "verdict": "cannot-judge"; an error prints no JSON, one line on stderr).

    Tensor-parallel recordings (record --tensor-parallel-size N): give each
    set's rank-0 trace; rank r is compared with rank r, shard by shard, and
    the root names its rank.

    'statediff compare BUNDLE.zip' compares the two traces of a bundle
    written by 'statediff extract', with the options it was extracted with.
    """
    from statediff.diff.plot import require_matplotlib, write_plot
    from statediff.errors import StatediffError
    from statediff.incident.bundle import compare_bundle, looks_like_bundle

    if plot is not None:
        if not plot.name:  # "" and "." are no file name: it would write a hidden ".png"
            raise StatediffError(f"--plot {str(plot)!r}: give a file name, such as heatmap.png")
        refuse_existing(plot, overwrite, inputs=(hit,) if cold is None else (hit, cold))
        require_matplotlib()
    kw = dict(max_listed=max_listed, progress=progress_wanted(as_json), stop_at_first=first)
    if cold is not None:
        result = compare_set_or_pair(hit, cold, options, **kw)
    elif looks_like_bundle(hit):
        result = compare_bundle(hit, options, **kw)
    else:
        raise click.UsageError("Missing argument 'COLD' (give HIT COLD traces, or one bundle .zip "
                               "written by 'statediff extract')")
    emit(result, as_json)
    if plot is not None:
        try:
            where = write_plot(getattr(result, "root", result), plot)  # a set: its root rank's heatmap
        except StatediffError as e:  # the verdict above stands, and so does its exit code
            warn(f"no plot written: {e}")
        else:  # on stderr: stdout holds the report (one JSON object with --json)
            click.echo(f"statediff: wrote the heatmap to {where}", err=True)
    ctx.exit(result.exit_code)
