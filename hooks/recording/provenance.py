"""How a trace was recorded: the ``statediff record`` command line, rebuilt from click.

Stored in the run metadata as ``record_argv`` (a list of strings, without
``-o``, ``--overwrite``, ``--no-progress``, ``--engine-log``, ``--mode``, ``--split-like``, ``--keep``,
``--focus``, ``--focus-check``), so that ``statediff report`` can print the exact commands that
reproduce a trace (what is kept does not change what is replayed; a report adds its own ``--focus``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click

# options that name where/how this one recording is written, not what was run
SKIP = ("output", "overwrite", "no_progress", "engine_log", "mode", "split_like", "keep", "focus", "focus_check")


def record_argv(ctx: click.Context) -> list[str]:
    """Options of the running command that differ from their defaults, as command-line words,
    without those in ``SKIP`` (``command_words``)."""
    return command_words(ctx.command.params, ctx.params, skip=SKIP)


def command_words(params: Sequence[click.Parameter], values: Mapping[str, Any], *,
                  skip: Iterable[str] = ()) -> list[str]:
    """Command-line words for ``values`` (parameter name -> value) of a command with ``params``.

    Arguments come first, then options that differ from their defaults, in
    declaration order; a boolean flag pair (``--exact/--default-chunking``)
    gives its on or off form, a repeatable option one word pair per value.
    Parameters in ``skip`` or missing from ``values`` give no words.
    """
    skipped = set(skip)
    args: list[str] = []
    opts: list[str] = []
    for p in params:
        if p.name in skipped or p.name not in values:
            continue
        v = values[p.name]
        if isinstance(p, click.Argument):
            args += [str(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None]
            continue
        if not isinstance(p, click.Option) or v == p.default or v is None or v == ():
            continue
        if p.is_flag and p.is_bool_flag:
            names = p.opts if v else p.secondary_opts
            if names:
                opts.append(names[0])
            continue
        for x in (v if p.multiple else [v]):
            opts += [max(p.opts, key=len), str(x)]
    return args + opts
