"""What the offline CLI answers to bad or doubtful input (issue 12): help, self-pairs, bad bundles, plots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.diff.noise import DEFAULT_FACTOR
from statediff.diff.plot import panels
from synth import Fault, write_trace

ROOT = Path(__file__).resolve().parents[2]
DIVERGED = ("DIVERGED: first divergence at request 2, position 80, layer 1 (model.layers.1.linear_attn), "
            "gdn.ssm_state")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("answers")
    return {"cold": write_trace(d / "cold.h5", "cold"),
            "clean": write_trace(d / "clean.h5", "hit"),
            "fault": write_trace(d / "fault.h5", "hit", faults=[Fault("prev_block", 2, 1)]),
            "dir": d}


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(r, text: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [f"statediff: error: {text}"], r.stderr


def run_process(*args: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "statediff", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


# -- help ----------------------------------------------------------------------------

def test_bare_statediff_prints_its_help_and_exits_0():
    p = run_process()
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.startswith("Usage: statediff [OPTIONS] COMMAND [ARGS]...\n")
    assert "\nCommands:\n" in p.stdout


def test_every_command_says_what_it_does():
    r = run("--help")
    assert r.exit_code == 0
    lines = [line.rstrip() for line in r.stdout.splitlines()]
    assert lines[lines.index("Commands:") + 1:lines.index("Commands:") + 10] == [
        "  audit      Check one run's restores against what it saved.",
        "  calibrate  Learn the noise floor of two cold runs (NOISE.json).",
        "  compare    Name the first divergent tensor of HIT vs COLD.",
        "  doctor     Known engine bugs a vLLM configuration meets (no engine started).",
        "  extract    Write the smallest bundle (.zip) that shows the root.",
        "  inspect    Show what a trace (or bundle) holds: run, requests, tensors, sizes.",
        "  recover    Make one trace file of an interrupted recording.",
        "  report     Write the incident record (Markdown) of HIT vs COLD.",
        "  verify     Read every tensor of a trace or bundle and check its data."]
    # engine-side commands, described from their source without importing torch (test_no_torch checks that)
    engine = lines[lines.index("Engine-side commands (need torch and vLLM; loaded on use):") + 1:]
    assert engine == [
        "  ablate            Run setups as hit/cold pairs; print a PASS/FAIL table.",
        "  build-tiny-model  Write a built-in tiny model (random weights).",
        "  check             Record a hit run, audit it, record a cold run, compare them.",
        "  engine-surface    Compare vLLM's patch points with the verified versions'.",
        "  record            Replay a conversation on vLLM and record a trace."]
    assert not any(line.endswith("...") for line in lines[1:])  # no description cut short


def test_the_noise_factor_default_in_help_is_the_library_default():
    from statediff.cli import shared
    from statediff.diff import defaults, noise

    assert noise.DEFAULT_FACTOR is defaults.DEFAULT_FACTOR is shared.DEFAULT_FACTOR  # one owner
    assert DEFAULT_FACTOR == 4.0
    assert "[default: 4; a bundle's own]" in " ".join(run("compare", "--help").stdout.split())


# -- compare: a trace with itself, two traces of one mode ------------------------------

def test_a_trace_with_itself_is_refused(traces, tmp_path):
    fault = traces["fault"]
    one_line_error(run("compare", fault, fault),
                   f"{fault} and {fault} are the same file: give a cache-hit trace and a cold trace of the "
                   "same conversation")
    link = tmp_path / "link.h5"
    os.link(fault, link)  # the same inode under another name
    one_line_error(run("compare", fault, link),
                   f"{fault} and {link} are the same file: give a cache-hit trace and a cold trace of the "
                   "same conversation")
    copy = tmp_path / "copy.h5"
    shutil.copyfile(fault, copy)  # another file, the same recording
    one_line_error(run("compare", fault, copy),
                   f"{fault} and {copy} are copies of the same trace (identical run metadata, recorded at the "
                   "same time): give a cache-hit trace and a cold trace")
    one_line_error(run("report", fault, fault), f"{fault} and {fault} are the same file: give a cache-hit "
                                                "trace and a cold trace of the same conversation")


def test_two_hit_traces_warn_and_keep_the_verdict(traces):
    r = run("compare", traces["fault"], traces["clean"])
    assert r.exit_code == 1
    assert r.stdout.splitlines()[1] == DIVERGED
    assert r.stderr.splitlines() == [
        "statediff: warning: both traces are hit runs (mode hit): a cache-hit trace is compared with a cold "
        "trace ('statediff record --mode hit' and '--mode cold')"]
    assert run("compare", traces["fault"], traces["cold"]).stderr == ""


# -- compare BUNDLE.zip: say what is wrong with the zip -----------------------------------

def test_a_bad_bundle_argument_says_what_is_wrong(traces, tmp_path):
    missing = tmp_path / "missing.zip"
    one_line_error(run("compare", missing), f"bundle {missing} does not exist")
    text = tmp_path / "notes.zip"
    text.write_text("not a zip\n")
    one_line_error(run("compare", text), f"bundle {text} is not a readable zip file: damaged, truncated or not "
                                         "a zip (File is not a zip file)")
    folder = tmp_path / "folder.zip"
    folder.mkdir()
    one_line_error(run("compare", folder), f"bundle {folder} is not a file (a bundle is the .zip 'statediff "
                                           "extract' writes)")
    good = tmp_path / "b.zip"
    assert run("extract", traces["fault"], traces["cold"], "-o", good, "--no-plot").exit_code == 0
    cut = tmp_path / "cut.zip"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # an interrupted download
    one_line_error(run("compare", cut), f"bundle {cut} is not a readable zip file: damaged, truncated or not "
                                        "a zip (File is not a zip file)")
    flipped = tmp_path / "flipped.zip"
    with zipfile.ZipFile(good) as z:
        info = z.getinfo("b/hit.h5")
    raw = bytearray(data)
    raw[info.header_offset + 30 + len(info.filename) + 100] ^= 0xFF  # one byte of the stored hit.h5
    flipped.write_bytes(bytes(raw))
    one_line_error(run("compare", flipped), f"bundle {flipped}: cannot read b/hit.h5, the zip is damaged "
                                            "(Bad CRC-32 for file 'b/hit.h5')")
    # a trace (not a zip) with no second argument is still a usage error
    r = run("compare", traces["fault"])
    assert r.exit_code == 2 and "Missing argument 'COLD' (give HIT COLD traces, or one bundle" in r.stderr


def test_a_trace_named_zip_is_read_as_the_trace_it_is(traces, tmp_path):
    renamed = tmp_path / "hit-from-an-issue.zip"
    renamed.write_bytes(Path(traces["fault"]).read_bytes())
    r = run("inspect", renamed)
    assert r.exit_code == 0 and r.stdout.splitlines()[:2] == [f"trace: {renamed}", "format: statediff.trace v1, complete"]
    assert run("verify", renamed).stdout.startswith(f"INTACT: {renamed}: ")
    assert run("compare", renamed, traces["cold"]).exit_code == run("compare", traces["fault"], traces["cold"]).exit_code
    r = run("compare", renamed)  # one argument: a trace, so COLD is missing (not "not a readable zip")
    assert r.exit_code == 2 and "Missing argument 'COLD'" in r.stderr


# -- compare --plot --------------------------------------------------------------------

def test_plot_says_where_it_wrote_the_picture(traces, tmp_path):
    out = tmp_path / "err.png"
    r = run("compare", "--json", "--plot", out, traces["fault"], traces["cold"])
    assert r.exit_code == 1
    assert json.loads(r.stdout)["exit_code"] == 1  # stdout stays one JSON object
    assert r.stderr.splitlines() == [f"statediff: wrote the heatmap to {out}"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_plot_is_a_warning_and_keeps_the_exit_code(traces, tmp_path):
    out = tmp_path / "no-such-dir" / "err.png"
    r = run("compare", "--plot", out, traces["fault"], traces["cold"])
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[1] == DIVERGED
    assert r.stderr.splitlines() == [
        f"statediff: warning: no plot written: cannot write plot {out}: No such file or directory"]
    r = run("compare", "--plot", out, traces["clean"], traces["cold"])
    assert r.exit_code == 0 and "no plot written" in r.stderr


def test_heatmap_tells_not_captured_from_identical_and_colours_by_error(traces):
    result = compare(traces["fault"], traces["cold"])
    by_request = {p.request: p for p in panels(result)}
    assert sorted(by_request) == [0, 1, 2, 3]
    p = by_request[2]
    assert (p.layers, p.positions, p.hit_at) == ((0, 1, 2, 3), (64, 80, 96), 80)
    err = p.error
    # position 64 is before the hit: the GDN layers' states there were not captured in the hit run
    # (the cache restored them); the attention layer's last cached block was, and is bit-identical
    assert np.isnan(err[0:3, 0]).all() and err[3, 0] == 0.0
    assert err[0, 1] == err[2, 1] == err[3, 1] == 0.0  # bit-identical at the hit, except the wrong layer
    assert err[1, 1] == pytest.approx(1.4137, abs=1e-4)  # the root: SSM state one block too early
    assert 0.1 < err[3, 2] < err[0, 2] < err[1, 1]  # propagated errors, each its own magnitude
    assert p.roots == {(1, 80)}
    assert p.diverged == {(1, 80), (0, 96), (1, 96), (2, 96), (3, 96)}
    assert not by_request[0].differs and by_request[0].hit_at == 0


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["audit"]])
def test_a_plain_directory_or_the_root_is_named_as_a_directory(tmp_path, command):
    # "." and "/" have no file name: they used to get "unexpected ValueError ... has an empty name"
    for d in (tmp_path, Path("/")):
        r = run(*command, str(d))
        one_line_error(r, f"{d} is a directory, not a trace (nor a recording's TRACE.h5.parts directory)")


def test_an_existing_plot_needs_overwrite_and_an_empty_name_is_refused(traces, tmp_path):
    out = tmp_path / "kept.png"
    out.write_text("precious")
    one_line_error(run("compare", "--plot", out, traces["fault"], traces["cold"]),
                   f"{out} already exists (use --overwrite to replace it)")
    assert out.read_text() == "precious"
    one_line_error(run("compare", "--plot", "", traces["fault"], traces["cold"]),
                   "--plot '.': give a file name, such as heatmap.png")
    r = run("compare", "--plot", out, "--overwrite", traces["fault"], traces["cold"])
    assert r.exit_code == 1 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["report", "calibrate"])
def test_an_output_that_is_an_input_is_refused_even_with_overwrite(traces, tmp_path, command):
    cold = tmp_path / "cold.h5"
    shutil.copyfile(traces["cold"], cold)
    before = cold.read_bytes()
    first = traces["fault"] if command == "report" else traces["cold"]
    one_line_error(run(command, first, cold, "-o", cold, "--overwrite"),
                   f"{cold} is one of the inputs: write the output elsewhere")
    assert cold.read_bytes() == before


def test_a_damaged_tensor_is_one_line_and_no_numpy_warning(tmp_path):
    # issue 19: a damaged tensor printed numpy RuntimeWarnings before its line. A real trace (traces/),
    # 16 bytes of request 1's K block at 544 flipped: compare reads it and must say so in one line.
    bad = tmp_path / "hit.h5"
    data = bytearray((ROOT / "traces" / "hit-ssm-bf16.h5").read_bytes())
    for i in range(1_200_000, 1_200_016):
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    p = run_process("compare", bad, ROOT / "traces" / "cold.h5")
    assert (p.returncode, p.stderr.splitlines()) == (2, [
        f"statediff: error: {bad}: tensor t000000054 (request 1 position 544 layer 3 "
        "(model.layers.3.self_attn.attn) attn.k) is damaged: its bytes do not match the hash in the index"])
