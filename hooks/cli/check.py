"""``statediff check``: the click command over ``statediff_hooks.drivers.check.run_check``.

Registered in the ``statediff.commands`` entry-point group (pyproject.toml). Its
recording options are ``statediff record``'s own parameters (the same names, help
and defaults), less those ``check`` sets per run (``NOT_FROM_RECORD``).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from statediff.errors import StatediffError

from ..drivers.check import CheckOptions, RecordFailed, run_check
from .record import engine_side_needed, options_from_params, record

#: ``record`` parameters ``check`` sets itself (per run) or does not take.
NOT_FROM_RECORD = ("conversation", "output", "mode", "exact", "exact_split", "split_like", "focus",
                   "focus_check", "overwrite", "engine", "drafter", "sweep_boundaries", "sweep_blocks",
                   "tensor_parallel_size")  # check audits and compares one trace per run: not a rank set


@click.command("check", short_help="Record a hit run, audit it, record a cold run, compare them.")
@click.argument("conversation", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output_dir", required=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Directory to write hit.h5, cold.h5 (engine logs *.h5.log), audit.json, compare.json and report.md.")
@click.option("--exact", is_flag=True,
              help="One block per step in both runs, instead of the split form (the hit run with the "
                   "engine's own chunking, the cold run split where the hit run's state was computed).")
@click.option("--overwrite", is_flag=True, help="Replace the check files of an existing DIR.")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=int, default=None, hidden=True)
@click.pass_context
def check(ctx: click.Context, output_dir: str, exact: bool, overwrite: bool, tensor_parallel_size: int | None,
          **params: Any) -> None:
    """Replay CONVERSATION (JSONL; default: the built-in 5-request agent
    conversation) twice on fresh vLLM engines and compare: the hit run with the
    engine's own chunking (as deployed), the cold run shaped like it (the split
    form of exact replay), so a fault-free pair is bit-identical and the first
    differing bit is the bug.

    Between the two runs the hit run is audited alone ('statediff audit': every
    restore against what the same run saved); a finding is a divergence on its
    own, named first, and the cold run and compare still run.

    Writes DIR/hit.h5, DIR/cold.h5, DIR/audit.json (what 'statediff audit
    --json' prints), DIR/compare.json (what 'statediff compare --json' prints)
    and DIR/report.md (what 'statediff report' writes, with the audit), and
    prints both verdicts. --fault plants in the hit run only. Every option, the
    conversation and the model are checked before the first engine starts.

    --concurrency N (N > 1): the hit run replays N copies side by side
    (engine's own chunking) and is audited; the cold run and compare are
    skipped, said so in one line: compare pairs only runs of the same N, and
    N batched copies are not bit-identical to a cold run, so the audit is the
    check. DIR then holds hit.h5, hit.h5.log and audit.json.

    Exit codes: 0 the audit is clean and compare finds no divergence, 1 either
    finds one, 2 error, or neither finds one while one vouches for nothing
    (audit NOT CHECKED, compare CANNOT JUDGE: audit.json's and compare.json's
    "verdict" say which).
    """
    if tensor_parallel_size is not None and tensor_parallel_size != 1:  # taken only to say why not
        raise StatediffError("check takes no --tensor-parallel-size: it audits and compares one trace per run; "
                             "record each run with 'statediff record --tensor-parallel-size N' and compare the sets")
    base = options_from_params({**params, "output": "", "mode": "hit"})
    options = CheckOptions(output_dir=output_dir, base=base, exact=exact, overwrite=overwrite)
    say = (lambda s: click.echo(s, err=True))
    try:
        with engine_side_needed("check"):
            result = run_check(options, say=say, progress=sys.stderr.isatty())
    except RecordFailed:  # the recording printed its one error line
        ctx.exit(2)
    click.echo("\n".join(result.lines()))
    ctx.exit(result.exit_code)


check.params.extend(p for p in record.params if p.name not in NOT_FROM_RECORD)
