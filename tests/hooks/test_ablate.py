"""statediff ablate: matrix files, record arguments, the table, and a real matrix on the tiny hybrid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff_hooks.drivers.ablate import AblationResult, Row, load_matrix, variant_argv

from conftest import run_cli

GOOD = """
title = "t"
[base]
model = "tiny"
conversation = "sweep"
sweep_blocks = 1
block_size = 32
max_tokens = 4
enforce_eager = true
engine_args = { gpu_memory_utilization = 0.5 }
speculative_config = { method = "ngram", num_speculative_tokens = 2 }

[[variant]]
name = "base"

[[variant]]
name = "fault"
fault = "ssm-wrong-block:layer=1"
expect = "fail"
expect_root = { layer = 1, kind = "gdn.ssm_state" }

[[variant]]
name = "miss"
forced_miss = true
fault = "conv-zero"
engine_args = { kv_cache_dtype = "auto" }
speculative_config = false
replay = "exact-split"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "m.toml"
    p.write_text(text)
    return p


def test_variants_override_and_merge_the_base(tmp_path):
    m = load_matrix(write(tmp_path, GOOD))
    assert m.title == "t" and [v.name for v in m.variants] == ["base", "fault", "miss"]
    base, fault, miss = m.variants
    assert (base.expect, base.changes) == ("pass", "base")
    assert (fault.expect, fault.expect_root, fault.changes) == (
        "fail", {"layer": 1, "kind": "gdn.ssm_state"}, "fault=ssm-wrong-block:layer=1")
    assert miss.settings["engine_args"] == {"gpu_memory_utilization": 0.5, "kv_cache_dtype": "auto"}
    assert "speculative_config" not in miss.settings
    assert miss.changes == ('forced_miss=true, fault=conv-zero, engine_args={"kv_cache_dtype":"auto"}, '
                            "speculative_config=false, replay=exact-split")


def test_record_arguments_of_each_run(tmp_path):
    m = load_matrix(write(tmp_path, GOOD))
    base, fault, miss = m.variants
    common = ["--sweep-boundaries", "--sweep-blocks", "1", "--model", "tiny", "--exact", "--block-size", "32",
              "--max-tokens", "4", "--enforce-eager", "--engine-arg", "gpu_memory_utilization=0.5"]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    assert variant_argv(fault.settings, "hit", Path("h.h5"), tmp_path) == [
        "record", *common, *spec, "--fault", "ssm-wrong-block:layer=1",
        "--mode", "hit", "-o", "h.h5", "--overwrite", "--no-progress"]
    assert variant_argv(fault.settings, "cold", Path("c.h5"), tmp_path) == [
        "record", *common, *spec, "--mode", "cold", "-o", "c.h5", "--overwrite", "--no-progress"]
    # a forced miss records its hit run cold, and plants nothing (a fault fires on cache hits only)
    hit = variant_argv(miss.settings, "hit", Path("h.h5"), tmp_path, hit_trace=Path("h.h5"))
    assert hit[hit.index("--mode"):] == ["--mode", "cold", "-o", "h.h5", "--overwrite", "--no-progress"]
    assert "--fault" not in hit and "--exact-split" in hit and "--split-like" not in hit
    cold = variant_argv(miss.settings, "cold", Path("c.h5"), tmp_path, hit_trace=Path("h.h5"))
    assert cold[cold.index("--split-like"):cold.index("--split-like") + 2] == ["--split-like", "h.h5"]
    assert ["--engine-arg", 'kv_cache_dtype="auto"'] == cold[cold.index('kv_cache_dtype="auto"') - 1:
                                                            cold.index('kv_cache_dtype="auto"') + 1]


def test_relative_paths_are_relative_to_the_matrix(tmp_path):
    (tmp_path / "conv.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    m = load_matrix(write(tmp_path, '[base]\nmodel = "model"\nconversation = "conv.jsonl"\n'
                                    '[[variant]]\nname = "a"\n'))
    argv = variant_argv(m.variants[0].settings, "hit", Path("h.h5"), tmp_path)
    assert argv[1] == str(tmp_path / "conv.jsonl") and argv[2:4] == ["--model", str(tmp_path / "model")]
    (tmp_path / "eagle3").mkdir()
    m = load_matrix(write(tmp_path, '[base]\nspeculative_config = { method = "eagle3", model = "eagle3" }\n'
                                    '[[variant]]\nname = "a"\n[[variant]]\nname = "b"\n'
                                    'speculative_config = { method = "eagle3", model = "hub/id" }\n'))
    specs = [json.loads(argv[argv.index("--speculative-config") + 1])["model"] for argv in
             (variant_argv(v.settings, "hit", Path("h.h5"), tmp_path) for v in m.variants)]
    assert specs == [str(tmp_path / "eagle3"), "hub/id"]  # a drafter beside the matrix; a hub id left alone


@pytest.mark.parametrize("text,message", [
    ("[base\n", "invalid TOML"),
    ('[base]\nblok_size = 3\n[[variant]]\nname = "a"\n', "[base]: unknown key 'blok_size' (known: "),
    ('[[variant]]\nname = "a"\nblock_size = "32"\n', "variant 1 ('a'): block_size = '32' is not a int"),
    ('[[variant]]\nname = "a"\nenforce_eager = 1\n', "variant 1 ('a'): enforce_eager = 1 is not a bool"),
    ("[base]\n", "no [[variant]] tables"),
    ('[[variant]]\nname = "a"\n[[variant]]\nname = "a"\n', "variant 2 ('a'): the name 'a' is used twice"),
    ('[[variant]]\nfault = "x"\n', "variant 1: needs a name"),
    ('[[variant]]\nname = "a"\nexpect = "green"\n', "expect = 'green', expected one of pass, fail, error"),
    ('[[variant]]\nname = "a"\nexpect_root = { layer = 1 }\n', "expect_root needs expect = \"fail\""),
    ('[[variant]]\nname = "a"\nexpect = "fail"\nexpect_root = { slot = 1 }\n',
     "expect_root must be a table of request, position, layer (integers) and kind (a string)"),
    ('[[variant]]\nname = "a"\nreplay = "fast"\n', "replay = 'fast', expected one of exact, exact-split, default"),
    ('[[variant]]\nname = "a"\nspeculative_config = true\n', "give a table, or false to remove it"),
    ('colour = 1\n[[variant]]\nname = "a"\n', "unknown top-level key 'colour'"),
])
def test_bad_matrix_is_one_line_exit_2_before_anything_runs(tmp_path, text, message):
    p = write(tmp_path, text)
    r = CliRunner().invoke(cli, ["ablate", str(p)])
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"statediff: error: {p}: ") and message in lines[0], lines
    assert r.stdout == ""


def test_missing_matrix_file(tmp_path):
    r = CliRunner().invoke(cli, ["ablate", str(tmp_path / "none.toml")])
    assert r.exit_code == 2 and r.stderr.startswith(f"statediff: error: cannot read matrix file {tmp_path}")


def test_hit_acceptance_sums_the_requests_acceptance_fields():
    from statediff_hooks.drivers.ablate import acceptance_text, hit_acceptance

    fields = [{"num_accepted_tokens": 12, "num_draft_tokens": 12}, None,
              {"num_accepted_tokens": 9, "num_draft_tokens": 18}]
    assert hit_acceptance(fields) == (21, 30) and acceptance_text((21, 30)) == "21/30 (70%)"
    assert hit_acceptance([None, {}]) is None and acceptance_text(None) == "-"


def test_table_and_exit_code(tmp_path):
    m = load_matrix(write(tmp_path, GOOD))
    base, fault, miss = m.variants
    rows = [Row(1, base, "PASS", True, hits=[0, 32], engine="vllm 0.32.0", acceptance=(50, 93)),
            Row(2, fault, "FAIL", True, root="request 4, position 64, layer 1 (m), gdn.ssm_state",
                root_key=(4, 64, 1, "gdn.ssm_state"), diagnosis="diagnosis: zeros", hits=[0, 32]),
            Row(3, miss, "ERROR", False, error="hit run: the engine failed to start: TypeError: x")]
    res = AblationResult("t", "m.toml", rows)
    assert res.exit_code == 1
    text = res.to_text().splitlines()
    assert text[0] == "ablation: t (m.toml)"
    assert text[1].split() == ["#", "variant", "changes", "engine", "hit", "tokens", "per", "request", "accepted",
                               "/", "drafted", "(hit", "run)", "result", "expected", "root", "divergence"]
    assert text[2].split()[-7:] == ["50/93", "(54%)", "PASS", "PASS", "ok", "no", "divergence"]  # accepted / drafted
    assert text[2].split()[:7] == ["1", "base", "base", "vllm", "0.32.0", "[0,", "32]", "PASS"][:7]
    assert text[3].endswith("FAIL    FAIL      ok          root: request 4, position 64, layer 1 (m), "
                            "gdn.ssm_state; diagnosis: zeros")
    assert text[4].endswith("ERROR   PASS      UNEXPECTED  error: hit run: the engine failed to start: TypeError: x")
    assert text[5] == "3 variants: 1 PASS, 1 FAIL, 1 ERROR; 1 not as expected: miss"
    md = res.to_markdown().splitlines()
    assert md[2] == ("| # | variant | changes | engine | hit tokens per request | accepted / drafted (hit run) | "
                     "result | expected | as expected | root divergence |")
    assert md[5] == "| 2 | fault | fault=ssm-wrong-block:layer=1 | - | [0, 32] | - | FAIL | FAIL | ok | " \
                    "root: request 4, position 64, layer 1 (m), gdn.ssm_state; diagnosis: zeros |"
    rows[2].matched = True
    assert res.exit_code == 0


MATRIX = """
title = "tiny hybrid, boundary sweep, exact replay"
[base]
model = "{model}"
conversation = "sweep"
sweep_blocks = 1
replay = "exact"
block_size = 32
max_tokens = 4
enforce_eager = true

[[variant]]
name = "no fault"

[[variant]]
name = "planted fault"
fault = "ssm-wrong-block:layer=1"
expect = "fail"
expect_root = {{ request = 4, position = 64, layer = 1, kind = "gdn.ssm_state" }}

[[variant]]
name = "forced miss"
forced_miss = true

[[variant]]
name = "block size 64"
block_size = 64

[[variant]]
name = "bad engine arg"
engine_args = {{ no_such_engine_arg = 1 }}
expect = "error"
"""


@pytest.mark.vllm
def test_matrix_on_the_tiny_hybrid(tiny_model, tmp_path):
    m = tmp_path / "matrix.toml"
    m.write_text(MATRIX.format(model=tiny_model))
    md = tmp_path / "table.md"
    r = run_cli("ablate", str(m), "--markdown", str(md), "-d", str(tmp_path / "work"), "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    rows = {row["name"]: row for row in out["rows"]}
    assert [(row["name"], row["status"], row["matched"]) for row in out["rows"]] == [
        ("no fault", "PASS", True), ("planted fault", "FAIL", True), ("forced miss", "PASS", True),
        ("block size 64", "PASS", True), ("bad engine arg", "ERROR", True)]
    assert rows["no fault"]["hits"] == [0, 32, 32, 32, 64]
    assert rows["planted fault"]["root_key"] == [4, 64, 1, "gdn.ssm_state"]
    assert rows["planted fault"]["root"] == "request 4, position 64, layer 1 (model.layers.1.linear_attn), gdn.ssm_state"
    assert rows["forced miss"]["hits"] == [0, 0, 0, 0, 0]
    assert rows["block size 64"]["hits"] == [0, 64, 64, 64, 128]
    assert "no_such_engine_arg" in rows["bad engine arg"]["error"]
    assert rows["bad engine arg"]["error"].startswith("hit run: ")
    # one cold baseline: the fault variant and the forced miss's first run reuse "no fault"'s cold run
    cold = rows["no fault"]["traces"][1]
    assert rows["planted fault"]["traces"][1] == cold == rows["forced miss"]["traces"][0]
    assert rows["forced miss"]["traces"][1] != cold
    traces = sorted(p.name for p in (tmp_path / "work").glob("*.h5"))
    assert traces == [
        "01-no-fault-cold.h5", "01-no-fault-hit.h5", "02-planted-fault-hit.h5", "03-forced-miss-cold.h5",
        "04-block-size-64-cold.h5", "04-block-size-64-hit.h5"]
    assert all((tmp_path / "work" / f"{t}.log").is_file() for t in traces)  # each run's engine log beside it
    table = md.read_text().splitlines()
    assert table[0] == "## Ablation: tiny hybrid, boundary sweep, exact replay"
    assert table[4] == ("| 1 | no fault | base | vllm 0.32.0 | [0, 32, 32, 32, 64] | PASS | PASS | ok | "
                        "no divergence |")
    assert table[5].startswith("| 2 | planted fault | fault=ssm-wrong-block:layer=1 | vllm 0.32.0 | "
                               "[0, 32, 32, 32, 64] | FAIL | "
                               "FAIL | ok | root: request 4, position 64, layer 1 (model.layers.1.linear_attn), "
                               "gdn.ssm_state")
    assert table[-1] == "5 variants: 3 PASS, 1 FAIL, 1 ERROR; every row as expected"


FAKE_RECORD = '''"""Stands in for `python -m statediff record ...` of an installed engine version: writes a
synthetic trace (tests/synth.py) whose run names that version; --fault plants a wrong-block fault."""
import sys
sys.path.insert(0, {tests!r})
from synth import Fault, write_trace

version, argv = sys.argv[1], sys.argv[2:]  # argv: -m statediff record ...
out, mode = argv[argv.index("-o") + 1], argv[argv.index("--mode") + 1]
faults = [Fault("prev_block", 2, 1)] if "--fault" in argv else []
with open(out + ".calls", "a") as f:
    f.write(version + "\\n")
write_trace(out, mode, faults=faults, replay="exact", engine="vllm", engine_version=version)
'''


def fake_interpreter(tmp_path: Path, version: str) -> Path:
    """A venv directory whose bin/python records as vLLM ``version`` would (FAKE_RECORD)."""
    import sys

    script = tmp_path / "fake_record.py"
    script.write_text(FAKE_RECORD.format(tests=str(Path(__file__).resolve().parents[1])))
    venv = tmp_path / f"vllm-{version}"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" {version} "$@"\n')
    exe.chmod(0o755)
    return venv


VERSIONS_MATRIX = """
title = "engine version as an axis"
[base]
model = "tiny"
replay = "exact"

[[variant]]
name = "vLLM 0.29"
python = "vllm-0.29.0"

[[variant]]
name = "vLLM 0.30"
python = "vllm-0.30.0/bin/python"

[[variant]]
name = "vLLM 0.30, fault"
python = "vllm-0.30.0"
fault = "ssm-wrong-block:layer=1"
expect = "fail"
expect_root = {{ request = 2, layer = 1, kind = "gdn.ssm_state" }}
"""


def test_variants_that_differ_in_the_interpreter_are_one_row_per_engine_version(tmp_path):
    from statediff_hooks.drivers.ablate import run_matrix

    for v in ("0.29.0", "0.30.0"):
        fake_interpreter(tmp_path, v)
    m = load_matrix(write(tmp_path, VERSIONS_MATRIX.format()))
    assert [v.settings["python"] for v in m.variants] == [
        str(tmp_path / "vllm-0.29.0/bin/python"), str(tmp_path / "vllm-0.30.0/bin/python"),
        str(tmp_path / "vllm-0.30.0/bin/python")]
    said: list[str] = []
    res = run_matrix(m, work_dir=tmp_path / "work", say=said.append)
    assert [r.engine for r in res.rows] == ["vllm 0.29.0", "vllm 0.30.0", "vllm 0.30.0"]
    assert [r.status for r in res.rows] == ["PASS", "PASS", "FAIL"]
    assert all(r.matched for r in res.rows) and res.exit_code == 0
    assert res.rows[2].root_key == (2, 80, 1, "gdn.ssm_state")
    # each version records its own cold baseline; the 0.30 fault row reuses 0.30's
    assert said.count("[3] vLLM 0.30, fault: the cold run reuses 02-vllm-0-30-cold.h5 (same record arguments)") == 1
    assert (tmp_path / "work" / "01-vllm-0-29-cold.h5.calls").read_text() == "0.29.0\n"
    assert (tmp_path / "work" / "02-vllm-0-30-cold.h5.calls").read_text() == "0.30.0\n"
    text = res.to_text().splitlines()
    assert text[2].split()[:5] == ["1", "vLLM", "0.29", "python=vllm-0.29.0", "vllm"]
    assert "vllm 0.29.0" in text[2] and "vllm 0.30.0" in text[3] and "vllm 0.30.0" in text[4]


def test_a_python_setting_without_an_interpreter_is_refused_before_anything_runs(tmp_path):
    r = CliRunner().invoke(cli, ["ablate", str(write(tmp_path, VERSIONS_MATRIX.format()))])
    assert r.exit_code == 2
    assert r.stderr == (f"statediff: error: {tmp_path / 'm.toml'}: variant 1 ('vLLM 0.29'): python = 'vllm-0.29.0': "
                        "no Python executable there (give an interpreter or a venv directory)\n")


FORMATS_MATRIX = """
title = "drafter x prefix hit x format"
[base]
model = "tiny"
replay = "exact"

[[axis]]
name = "drafter"
values = [{{ label = "none" }},
          {{ label = "MTP", model = "tiny-mtp", speculative_config = {{ method = "mtp", num_speculative_tokens = 3 }} }}]

[[axis]]
name = "prefix hit"
values = [{{ label = "hit" }}, {{ label = "forced miss", forced_miss = true }}]

[[axis]]
name = "format"
values = [{{ label = "bf16", format = "bf16" }}, {{ label = "FP8", format = "fp8" }},
          {{ label = "NVFP4", format = "nvfp4" }}]
{variants}"""

FAKE_FORMAT_RECORD = '''"""Stands in for `python -m statediff record ...`: a synthetic trace whose run names the target
format of the --model given (tiny-fp8 -> fp8, tiny-nvfp4 -> nvfp4, else bf16)."""
import sys
sys.path.insert(0, {tests!r})
from synth import write_trace

argv = sys.argv[1:]
out, mode, model = argv[argv.index("-o") + 1], argv[argv.index("--mode") + 1], argv[argv.index("--model") + 1]
fmt = "fp8" if model.endswith("-fp8") else "nvfp4" if model.endswith("-nvfp4") else "bf16"
with open(out + ".argv", "w") as f:
    f.write(" ".join(argv))
write_trace(out, mode, replay="exact", engine="vllm", engine_version="0.32.0", target_format=fmt)
'''


def test_axes_multiply_the_rows_drafter_by_hit_by_format(tmp_path):
    m = load_matrix(write(tmp_path, FORMATS_MATRIX.format(variants="")))
    assert [v.name for v in m.variants] == [
        f"base / {d} / {h} / {f}" for d in ("none", "MTP") for h in ("hit", "forced miss")
        for f in ("bf16", "FP8", "NVFP4")]
    v = m.variants[10]  # MTP, forced miss, FP8
    assert v.name == "base / MTP / forced miss / FP8"
    assert v.changes == ('model=tiny-mtp, speculative_config={"method":"mtp","num_speculative_tokens":3}, '
                         "forced_miss=true, format=fp8")
    assert (v.settings["model"], v.settings["forced_miss"], v.settings["format"]) == ("tiny-mtp", True, "fp8")
    words = variant_argv(m.variants[2].settings, "hit", tmp_path / "o.h5", tmp_path)
    assert words[words.index("--model") + 1] == "tiny-nvfp4"
    assert words[words.index("--mode") + 1] == "hit"
    words = variant_argv(m.variants[4].settings, "hit", tmp_path / "o.h5", tmp_path)  # forced miss, FP8
    assert (words[words.index("--model") + 1], words[words.index("--mode") + 1]) == ("tiny-fp8", "cold")
    # variants times axes: two variants give twice the rows, the variant's name first
    m = load_matrix(write(tmp_path, FORMATS_MATRIX.format(
        variants='[[variant]]\nname = "a"\n[[variant]]\nname = "b"\nblock_size = 64\n')))
    assert len(m.variants) == 24 and m.variants[12].name == "b / none / hit / bf16"
    assert m.variants[12].changes == "block_size=64, format=bf16"


def test_format_column_and_a_format_the_model_lacks_is_an_error_row(tmp_path):
    import sys

    from statediff_hooks.drivers.ablate import run_matrix

    script = tmp_path / "fake_record.py"
    script.write_text(FAKE_FORMAT_RECORD.format(tests=str(Path(__file__).resolve().parents[1])))
    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{script}" "$@"\n')  # drops "-m statediff"
    exe.chmod(0o755)
    text = FORMATS_MATRIX.format(variants="").replace('replay = "exact"', 'replay = "exact"\npython = "venv"')
    m = load_matrix(write(tmp_path, text))
    res = run_matrix(m, work_dir=tmp_path / "work")
    assert [(r.variant.name, r.status, r.format) for r in res.rows[:3]] == [
        ("base / none / hit / bf16", "PASS", "bf16"), ("base / none / hit / FP8", "PASS", "fp8"),
        ("base / none / hit / NVFP4", "PASS", "nvfp4")]
    assert [(r.status, r.format) for r in res.rows[6:9]] == [("PASS", "bf16"), ("PASS", "fp8"), ("PASS", "nvfp4")]
    assert (tmp_path / "work" / "09-base---mtp---hit---nvfp4-hit.h5.argv").read_text().split()[:3] == [
        "record", "--model", "tiny-mtp-nvfp4"]
    assert (tmp_path / "work" / "01-base---none---hit---bf16-hit.h5.argv").read_text().split()[:3] == [
        "record", "--model", "tiny"]
    lines = res.to_text().splitlines()
    assert lines[1].split()[:5] == ["#", "variant", "changes", "engine", "format"]
    assert lines[3].split()[:8] == ["2", "base", "/", "none", "/", "hit", "/", "FP8"]
    assert lines[3].split()[9:12] == ["vllm", "0.32.0", "fp8"]
    md = res.to_markdown().splitlines()
    assert md[2].startswith("| # | variant | changes | engine | format | hit tokens per request | "
                            "accepted / drafted (hit run) | result |")
    assert md[5].startswith("| 2 | base / none / hit / FP8 | format=fp8 | vllm 0.32.0 | fp8 | ")
    assert res.to_json()["rows"][2]["format"] == "nvfp4"
    # a model without builds in that format: an ERROR row naming it, the matrix goes on
    m = load_matrix(write(tmp_path, '[base]\nmodel = "tiny-dense"\npython = "venv"\n'
                                    '[[variant]]\nname = "dense fp8"\nformat = "fp8"\n'
                                    '[[variant]]\nname = "dense"\n'))
    res = run_matrix(m, work_dir=tmp_path / "work2")
    assert [(r.status, r.format) for r in res.rows] == [("ERROR", None), ("PASS", "bf16")]
    assert res.rows[0].error == ("format = 'fp8': no fp8 build of model 'tiny-dense' (built-in formats: "
                                 "tiny (bf16, fp8, nvfp4), tiny-mtp (bf16, fp8, nvfp4))")


@pytest.mark.parametrize("axis,message", [
    ('[[axis]]\nvalues = [{ label = "x" }]\n', "axis 1: needs a name"),
    ('[[axis]]\nname = "f"\nvalues = []\n', "axis 1 ('f'): values must be a non-empty array of tables, each with a label"),
    ('[[axis]]\nname = "f"\nvalues = [{ format = "fp8" }]\n', "axis 1 ('f'): every value needs a label, each used once"),
    ('[[axis]]\nname = "f"\nvalues = [{ label = "x", format = "fp4" }]\n',
     "axis 1 ('f'), value 'x': format = 'fp4', expected one of bf16, fp8, nvfp4"),
    ('[[axis]]\nname = "f"\nvalues = [{ label = "x", colour = 1 }]\n', "axis 1 ('f'), value 'x': unknown key 'colour'"),
])
def test_a_bad_axis_is_one_line_exit_2(tmp_path, axis, message):
    r = CliRunner().invoke(cli, ["ablate", str(write(tmp_path, axis))])
    assert r.exit_code == 2
    assert r.stderr.startswith(f"statediff: error: {tmp_path / 'm.toml'}: {message}")


def test_env_is_merged_key_by_key_and_reaches_each_recording_with_its_own_reuse_key(tmp_path, monkeypatch):
    from statediff_hooks.drivers import ablate

    m = load_matrix(write(tmp_path, '[base]\nmodel = "tiny"\nenv = { A = "1" }\n'
                                    '[[variant]]\nname = "v1"\nenv = { VLLM_USE_V2_MODEL_RUNNER = "0" }\n'
                                    '[[variant]]\nname = "v2"\nenv = { VLLM_USE_V2_MODEL_RUNNER = "1" }\n'))
    assert [v.settings["env"] for v in m.variants] == [{"A": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"},
                                                       {"A": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}]
    assert m.variants[1].changes == 'env={"VLLM_USE_V2_MODEL_RUNNER":"1"}'
    calls: list[tuple[str, dict]] = []

    def fake(argv, timeout, python=None, env=None):
        calls.append((argv[argv.index("--mode") + 1], env))
        return "stop" if len(calls) % 2 == 0 else None  # the cold run fails: nothing is compared

    monkeypatch.setattr(ablate, "_record", fake)
    reuse: dict = {}
    rows = [ablate.run_variant(v, i, tmp_path, tmp_path, reuse=reuse) for i, v in enumerate(m.variants, 1)]
    assert [r.error for r in rows] == ["cold run: stop"] * 2
    # the V2 variant's hit run does not reuse the V1 one's (same record arguments, another environment)
    assert calls == [("hit", m.variants[0].settings["env"]), ("cold", m.variants[0].settings["env"]),
                     ("hit", m.variants[1].settings["env"]), ("cold", m.variants[1].settings["env"])]


def test_an_env_value_that_is_not_a_string_is_refused(tmp_path):
    p = write(tmp_path, '[[variant]]\nname = "a"\nenv = { VLLM_USE_V2_MODEL_RUNNER = 1 }\n')
    r = CliRunner().invoke(cli, ["ablate", str(p)])
    assert r.exit_code == 2 and "variant 1 ('a'): env values must be strings" in r.stderr, r.output
