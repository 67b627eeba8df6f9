"""The ``statediff record`` command line stored with each trace (``record_argv``)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from statediff_hooks.recording.provenance import record_argv


@click.command()
@click.argument("conversation", required=False)
@click.option("-o", "--output", required=True)
@click.option("--mode", type=click.Choice(["hit", "cold"]), required=True)
@click.option("--exact/--default-chunking", default=False)
@click.option("--model", default="tiny")
@click.option("--block-size", type=int, default=None)
@click.option("--engine-arg", "engine_args", multiple=True)
@click.option("--overwrite", is_flag=True)
@click.option("--sweep-boundaries", is_flag=True)
def cmd(**kw):
    click.echo(" ".join(record_argv(click.get_current_context())))


def test_non_default_options_in_declaration_order_without_output_and_mode():
    r = CliRunner().invoke(cmd, ["--block-size", "32", "conv.jsonl", "-o", "x.h5", "--mode", "hit", "--overwrite",
                                 "--engine-arg", "a=1", "--engine-arg", "b=2", "--exact", "--model", "/m"])
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["conv.jsonl", "--exact", "--model", "/m", "--block-size", "32",
                                "--engine-arg", "a=1", "--engine-arg", "b=2"]


def test_defaults_are_left_out():
    r = CliRunner().invoke(cmd, ["-o", "x.h5", "--mode", "cold", "--sweep-boundaries", "--default-chunking"])
    assert r.output.split() == ["--sweep-boundaries"]
