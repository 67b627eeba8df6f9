"""Outputs are only ever regular files: a symlink, FIFO or device at the output path is refused
even with --overwrite; an output is never one of the inputs; a failed write keeps the old file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.cli.shared import write_text_atomic
from statediff.errors import StatediffError
from synth import write_trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("outputs")
    return {"cold": write_trace(d / "cold.h5", "cold"), "cold_b": write_trace(d / "cold-b.h5", "cold", noise_seed=1),
            "hit": write_trace(d / "hit.h5", "hit")}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _inputs(traces, command):
    return (traces["cold"], traces["cold_b"]) if command == "calibrate" else (traces["hit"], traces["cold"])


@pytest.mark.parametrize("command", ["calibrate", "report", "extract"])
def test_a_fifo_output_is_refused_even_with_overwrite(traces, tmp_path, command):
    out = tmp_path / "out.zip"
    os.mkfifo(out)
    r = run(command, *_inputs(traces, command), "-o", out, "--overwrite")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {out} is not a regular file: statediff writes only regular files (give a new file name)"])
    assert out.is_fifo()


@pytest.mark.parametrize("command", ["calibrate", "report", "extract"])
def test_a_symlink_output_is_refused_and_left_alone(traces, tmp_path, command):
    target = tmp_path / "target"
    target.write_text("kept")
    out = tmp_path / "link.zip"
    out.symlink_to(target)
    r = run(command, *_inputs(traces, command), "-o", out, "--overwrite")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {out} is a symbolic link: statediff writes only regular files (give a new file name)"])
    assert out.is_symlink() and target.read_text() == "kept"


@pytest.mark.parametrize("command", ["calibrate", "report", "extract"])
def test_an_empty_output_path_is_named_as_empty(traces, command):
    r = run(command, *_inputs(traces, command), "-o", "")
    want = ("give a .zip file name, e.g. incident.zip" if command == "extract" else "give a file name")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: the output path is empty: {want}"])


def test_recover_refuses_a_device_output(tmp_path):
    r = run("recover", tmp_path, "-o", "/dev/null", "--overwrite")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        "statediff: error: /dev/null is not a regular file: statediff writes only regular files (give a new file name)"])
    assert Path("/dev/null").is_char_device()


def test_extract_never_overwrites_its_own_input(traces, tmp_path):
    hit = tmp_path / "hin.zip"
    hit.write_bytes(traces["hit"].read_bytes())
    r = run("extract", hit, traces["cold"], "-o", hit, "--overwrite")
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {hit} is one of the inputs: write the output elsewhere"])
    assert hit.read_bytes() == traces["hit"].read_bytes()


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "r.md"
    out.write_text("ORIG")

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(StatediffError, match=r"^cannot write .*r\.md: No space left on device$"):
        write_text_atomic(out, "new report")
    monkeypatch.undo()
    assert out.read_text() == "ORIG" and sorted(p.name for p in tmp_path.iterdir()) == ["r.md"]


def test_write_text_atomic_keeps_undecodable_file_name_bytes(tmp_path):
    out = tmp_path / "r.md"
    write_text_atomic(out, "hit x\udcff.h5\n")
    assert out.read_bytes() == b"hit x\xff.h5\n"


def test_a_fifo_noise_file_is_refused_not_read(traces, tmp_path):
    fifo = tmp_path / "noise.json"
    os.mkfifo(fifo)
    r = run("compare", traces["hit"], traces["cold"], "--noise", fifo)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [f"statediff: error: noise file {fifo} is not a regular file"])


@pytest.mark.parametrize("name", ["..zip", "...zip", "sub/..zip"])
def test_extract_refuses_a_zip_without_a_name_before_its_suffix(traces, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    r = run("extract", traces["hit"], traces["cold"], "-o", name)
    assert r.exit_code == 2
    assert r.stderr == (f"statediff: error: bundle {name}: give the .zip a name before '.zip' (it names the "
                        "folder inside), e.g. incident.zip\n")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub"]  # no temporary directory left behind


def test_extract_refuses_an_undecodable_output_name(traces, tmp_path):
    out = os.fsdecode(bytes(tmp_path) + b"/b\xff.zip")
    r = run("extract", traces["hit"], traces["cold"], "-o", out)
    assert r.exit_code == 2
    assert r.stderr.endswith("b\\udcff.zip: the file name is not valid UTF-8; give a UTF-8 name\n"), r.stderr
    assert list(tmp_path.iterdir()) == []
