"""The verdict of compare (issue 10): outputs are part of it, only what saw the same tokens is
judged, incomparable runs are refused, digest-only K/V blocks and block tables are judged,
and each side is decoded with its own dtype."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from statediff.diff.align import Pair, StreamPart, effective_config
from statediff.diff.compare import compare
from statediff.diff.outputs import OutputTolerance, first_output_diff
from statediff.errors import MismatchError, NotComparableError
from statediff.trace.digest import digest_array
from statediff.trace.writer import TraceWriter
from synth import BLOCK, KV_SHAPE, clean, run_meta, scenario, to_bf16_bits, write_trace


def _pair(tmp_path, replay="default", hit_requests=None, cold_requests=None, hit_run=None, cold_run=None):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay=replay, requests=hit_requests, **(hit_run or {}))
    cold = write_trace(tmp_path / "cold.h5", "cold", replay=replay, requests=cold_requests, **(cold_run or {}))
    return hit, cold


# -- outputs are part of the verdict --------------------------------------------------

def _outputs_3(hit_token=None, hit_lp=None):
    """Request 3's outputs with logprobs (output 3: logprob -0.625), output 3 optionally replaced."""
    out = list(scenario()[3].output)
    lps = [-0.25 - 0.125 * i for i in range(len(out))]
    if hit_token is not None:
        out[3], lps[3] = hit_token, hit_lp
    return {3: {"output_token_ids": out, "output_logprobs": lps}}


def test_outputs_differ_while_every_tensor_agrees_is_diverged_outside_the_capture(tmp_path):
    cold_out = _outputs_3()
    hit, cold = _pair(tmp_path, replay="exact", hit_requests=_outputs_3(hit_token=999, hit_lp=-0.75),
                      cold_requests=cold_out)
    r = compare(hit, cold)
    assert (r.exit_code, r.cause, r.first, r.divergences) == (1, "outputs", None, [])
    assert r.identical == r.pairs == 78
    d = r.output_diff
    cold_tok = cold_out[3]["output_token_ids"][3]
    assert (d.request, d.index, d.position, d.what, d.hit_token, d.cold_token) == (3, 3, 93, "token", 999, cold_tok)
    lines = r.to_text().splitlines()
    assert lines[0] == (f"DIVERGED: outputs differ at request 3, output 3 (position 93): hit token 999 "
                        f"(logprob -0.75), cold token {cold_tok} (logprob -0.625), while no captured tensor that "
                        "saw the same tokens differs")
    assert lines[1] == ("  the cause lies outside the captured state; to localise it, record both runs again "
                        "with: --activations (the residual stream after every layer, eager mode)")
    assert f"  {3:>7}  {90:>6}" in r.to_text() and f"differ at output 3 (hit 999, cold {cold_tok})" in r.to_text()
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert (doc["exit_code"], doc["verdict"], doc["cause"], doc["first"]) == (1, "diverged", "outputs", None)
    assert doc["output_diff"]["position"] == 93 and doc["outside_capture"] == [
        "--activations (the residual stream after every layer, eager mode)"]
    cli = CliRunner().invoke(__import__("statediff.cli", fromlist=["cli"]).cli, ["compare", str(hit), str(cold)])
    assert cli.exit_code == 1 and cli.stdout.startswith("DIVERGED: outputs differ at request 3, output 3")


def test_a_logprob_is_bit_exact_in_exact_replay_and_toleranced_otherwise(tmp_path):
    same = _outputs_3()
    nudged = {3: dict(same[3], output_logprobs=[v + (0.01 if i == 3 else 0.0)
                                                 for i, v in enumerate(same[3]["output_logprobs"])])}
    (tmp_path / "x").mkdir()
    hit, cold = _pair(tmp_path, replay="exact", hit_requests=nudged, cold_requests=same)
    r = compare(hit, cold)
    assert (r.exit_code, r.cause, r.output_diff.what, r.output_diff.index) == (1, "outputs", "logprob", 3)
    assert "logprobs differ at output 3" in r.requests[3].outputs
    hit, cold = _pair(tmp_path / "x", replay="default", hit_requests=nudged, cold_requests=same)
    r = compare(hit, cold)
    assert (r.exit_code, r.cause, r.output_diff) == (0, None, None)  # 0.01 nats: within 0.05
    assert r.to_text().splitlines()[0] == "SAME: no divergence beyond tolerance in 78 pairs"
    assert ("outputs: equal in every request; judged: token ids exact, log-probabilities within 0.05 nats "
            "(default replay)") in r.to_text()


def test_top_k_alternatives_are_compared_and_a_near_tie_is_named():
    tol = OutputTolerance(exact=False)
    cold = {"prompt_len": 10, "output_token_ids": [5, 6], "output_logprobs": [-0.5, -0.69],
            "output_topk_ids": [[5, 9], [6, 7]], "output_topk_logprobs": [[-0.5, -2.0], [-0.69, -0.70]]}
    flipped = dict(cold, output_token_ids=[5, 7], output_logprobs=[-0.5, -0.68],
                   output_topk_ids=[[5, 9], [7, 6]], output_topk_logprobs=[[-0.5, -2.0], [-0.68, -0.70]])
    d = first_output_diff(Pair(flipped, cold), 0, tol)
    assert (d.what, d.index, d.position, d.hit_token, d.cold_token) == ("token", 1, 11, 7, 6)
    assert d.detail == "the cold run ranks the hit token 0.01 nats below its own (logprob -0.7), a near tie"
    tied = dict(cold, output_topk_logprobs=[[-0.5, -2.0], [-0.69, -0.69]])
    assert first_output_diff(Pair(flipped, tied), 0, tol).detail == \
        "a tie: the cold run gives the hit token the same logprob as its own"
    # same ids and logprobs, an alternative far off: a top-k difference
    other = dict(cold, output_topk_ids=[[5, 3], [6, 7]], output_topk_logprobs=[[-0.5, -1.0], [-0.69, -0.70]])
    d = first_output_diff(Pair(other, cold), 0, tol)
    assert (d.what, d.index) == ("top-k", 0) and d.detail == "token 3 is in the hit top-k only (logprob -1)"
    # two alternatives tied at the top-k boundary may swap: not a difference (default replay)
    edge = dict(cold, output_topk_ids=[[5, 9], [6, 8]], output_topk_logprobs=[[-0.5, -2.0], [-0.69, -0.71]])
    assert first_output_diff(Pair(edge, cold), 0, tol) is None
    assert first_output_diff(Pair(edge, cold), 0, OutputTolerance(exact=True)).what == "top-k"
    # a run that did not finish sampled fewer: not a difference; both finished: "length"
    short = dict(cold, output_token_ids=[5], output_logprobs=[-0.5], output_topk_ids=None,
                 output_topk_logprobs=None, finished=False)
    assert first_output_diff(Pair(short, cold), 0, tol) is None
    d = first_output_diff(Pair(dict(short, finished=True), dict(cold, finished=True)), 0, tol)
    assert (d.what, d.index, d.hit_token, d.cold_token) == ("length", 1, None, 6)


def test_outputs_that_differ_before_any_cache_hit_are_refused(tmp_path):
    out0 = list(scenario()[0].output)
    hit, cold = _pair(tmp_path, hit_requests={0: {"output_token_ids": out0[:5] + [1] + out0[6:]}})
    with pytest.raises(NotComparableError, match=r"^runs not comparable: request 0 differs at output 5 "
                                                 r"\(position 45\), but no request up to it resumed"):
        compare(hit, cold)


# -- compare only what saw the same tokens --------------------------------------------

PROMPT2 = 790
HIT2 = 768


def _decode_trace(path, mode, outputs, *, poison_after=None):
    """One request (index 2): prompt 790 tokens, hit at 768 (hit run), GDN layer 0 states every
    16 tokens from 768 to 832 (the last three inside the decode phase). ``poison_after``: hit-run
    states past that position are perturbed (they saw other tokens)."""
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 1000, PROMPT2)]
    w = TraceWriter(path, run_meta(mode, "exact"))
    w.begin_request(2, "r2", prompt)
    stream = prompt + list(outputs)
    for p in range(HIT2, 833, 16):
        for kind in ("gdn.conv_state", "gdn.ssm_state"):
            arr = clean(tuple(stream[:p]), 0, kind)
            if poison_after is not None and p > poison_after:
                arr = np.zeros_like(arr)
            role = "resumed" if (mode == "hit" and p == HIT2) else "checkpoint"
            w.add(arr, request=2, position=p, layer=0, kind=kind, role=role, module="model.layers.0.linear_attn",
                  dtype="float32" if arr.dtype == np.float32 else "bfloat16")
        w.end_step()
    w.update_request(2, output_token_ids=list(outputs), num_cached_tokens=HIT2 if mode == "hit" else 0,
                     finished=True)
    w.close()
    return path


def test_pairs_past_the_parting_of_the_token_streams_are_listed_never_roots(tmp_path):
    cold_out = list(range(100, 150))
    hit_out = cold_out[:10] + [7] + cold_out[11:]  # output 10 = token 800 of the stream differs
    hit = _decode_trace(tmp_path / "hit.h5", "hit", hit_out, poison_after=800)
    cold = _decode_trace(tmp_path / "cold.h5", "cold", cold_out)
    r = compare(hit, cold)
    assert r.divergences == [] and r.roots == [] and r.first is None
    assert r.inputs_differ.parts == (StreamPart(2, 800, 7, 110, False),)
    assert r.inputs_differ.count == 4  # positions 816 and 832, conv + SSM state: zeros, not judged
    assert r.pairs == 10 and r.identical == 6
    assert r.requests[0].stream_part == StreamPart(2, 800, 7, 110, False)
    # the sampled token itself differs: DIVERGED on the outputs, at the same position
    assert (r.exit_code, r.cause) == (1, "outputs")
    assert (r.output_diff.request, r.output_diff.index, r.output_diff.position) == (2, 10, 800)
    text = r.to_text()
    assert ("inputs differ: token streams part at request 2, position 800 (in the sampled outputs): hit token 7, "
            "cold token 110; 4 later pairs saw other tokens: listed, not judged, never roots") in text
    assert "  inputs differ: request 2 position 816 layer 0 (model.layers.0.linear_attn) gdn.conv_state" in text
    doc = r.to_json()
    assert doc["inputs_differ"]["parts"] == [{"request": 2, "position": 800, "hit_token": 7, "cold_token": 110,
                                              "in_prompt": False}]
    # --first stops only at a judged pair: here none diverges
    fast = compare(hit, cold, stop_at_first=True)
    assert fast.first is None and fast.stopped_after is None and fast.cause == "outputs"


def test_a_root_before_the_parting_is_still_named(tmp_path):
    cold_out = list(range(100, 150))
    hit = _decode_trace(tmp_path / "hit.h5", "hit", cold_out[:10] + [7] + cold_out[11:], poison_after=784)
    cold = _decode_trace(tmp_path / "cold.h5", "cold", cold_out)
    r = compare(hit, cold)
    assert [d.key for d in r.roots] == [(2, 800, 0, "gdn.conv_state")]  # saw the same 800 tokens: judged
    assert [d.key for d in r.divergences] == [(2, 800, 0, "gdn.conv_state"), (2, 800, 0, "gdn.ssm_state")]
    assert r.cause == "tensor" and r.inputs_differ.count == 4


# -- comparability first -------------------------------------------------------------

EFF = {"block_size": 16, "mamba_block_size": 16, "max_num_batched_tokens": 64, "chunked_prefill": True,
       "kv_cache_groups": [{"group": 0, "spec": "MambaSpec", "block_size": 16, "num_layers": 3},
                           {"group": 1, "spec": "FullAttentionSpec", "block_size": 16, "num_layers": 1}],
       "ssm_state_dtype": "float32"}


def test_exact_pair_scheduled_differently_is_refused_naming_each_field(tmp_path):
    cold_eff = EFF | {"max_num_batched_tokens": 96, "chunked_prefill": False}
    hit, cold = _pair(tmp_path, replay="exact", hit_run={"effective": EFF}, cold_run={"effective": cold_eff})
    with pytest.raises(MismatchError) as err:
        compare(hit, cold)
    assert str(err.value) == (
        "both runs replayed exactly but were scheduled differently: chunked_prefill (hit True, cold False); "
        "max_num_batched_tokens (hit 64, cold 96); an exact pair must run with the same effective block size "
        "and step token budget (record both with the same engine arguments)")
    cli = CliRunner().invoke(__import__("statediff.cli", fromlist=["cli"]).cli, ["compare", str(hit), str(cold)])
    assert cli.exit_code == 2 and len(cli.stderr.splitlines()) == 1 and "max_num_batched_tokens" in cli.stderr


def test_default_mode_warns_and_other_effective_fields_warn(tmp_path):
    cold_eff = EFF | {"max_num_batched_tokens": 96, "ssm_state_dtype": "bfloat16",
                      "kv_cache_groups": [{"block_size": 32}, {"block_size": 32}]}
    hit, cold = _pair(tmp_path, hit_run={"effective": EFF}, cold_run={"effective": cold_eff})
    r = compare(hit, cold)
    assert r.exit_code == 0
    assert r.warnings == [
        "the runs were scheduled differently (kv_cache_group_block_sizes (hit [16, 16], cold [32, 32]); "
        "max_num_batched_tokens (hit 64, cold 96)): they split prefills at different tokens, so states differ "
        "by rounding; judge with a noise file",
        "effective ssm_state_dtype differs (hit 'float32', cold 'bfloat16')"]


def test_traces_without_effective_fall_back_to_the_top_level_keys(tmp_path):
    hit, cold = _pair(tmp_path, replay="exact", hit_run={"max_num_batched_tokens": 64},
                      cold_run={"max_num_batched_tokens": 96})
    with pytest.raises(MismatchError, match=r"max_num_batched_tokens \(hit 64, cold 96\)"):
        compare(hit, cold)
    assert effective_config({"block_size": 16, "max_num_batched_tokens": 64, "effective": None}) == {
        "block_size": 16, "max_num_batched_tokens": 64}


# -- block digests and block tables --------------------------------------------------

ATTN = 3
SHARED = tuple(range(3, 51))  # request 0's 48 prompt tokens; request 1 shares them


def _kv(prefix: tuple, kind: str) -> np.ndarray:
    return clean(prefix, ATTN, kind)


def _digest_trace(path, mode, replay, *, stale: np.ndarray | None = None, table=None):
    """Requests 0 (48 tokens) and 1 (64 tokens, sharing request 0's 48; hit run resumes at 48).
    The cold run records every K/V block in full; the hit run reads request 1's cached blocks
    [0, 16) and [16, 32) as digests only, [32, 48) in full. ``stale`` replaces the hit's
    digest of the block at position 32 (logical block 1) by that array's digest."""
    w = TraceWriter(path, run_meta(mode, replay))
    prompts = {0: SHARED, 1: SHARED + tuple(range(900, 916))}
    for r, prompt in prompts.items():
        w.begin_request(r, f"r{r}", list(prompt))
        hit = 48 if (mode == "hit" and r == 1) else 0
        for p in range(BLOCK, len(prompt) + 1, BLOCK):
            for kind in ("attn.k", "attn.v"):
                arr = _kv(prompt[:p], kind)
                meta = dict(request=r, position=p, layer=ATTN, kind=kind, module="model.layers.3.self_attn",
                            dtype="bfloat16", token_start=p - BLOCK)
                if hit and p < hit:  # a cached block far from the boundary: digest only
                    data = stale if (stale is not None and p == 32 and kind == "attn.k") else arr
                    w.add_digest(digest_array(data), role="resumed", shape=arr.shape, **meta)
                else:
                    w.add(arr, role="resumed" if hit and p == hit else "kv_block", **meta)
            w.end_step()
        fields = {"hit_block_table": table} if (table and r == 1) else {}
        w.update_request(r, num_cached_tokens=hit, output_token_ids=[1, 2], finished=True, **fields)
    w.close()
    return path


def test_digest_row_holding_the_previous_block_is_named_with_its_logical_blocks(tmp_path):
    stale = _kv(SHARED[:16], "attn.k")  # the cold run's block 0
    hit = _digest_trace(tmp_path / "hit.h5", "hit", "exact", stale=stale)
    cold = _digest_trace(tmp_path / "cold.h5", "cold", "exact")
    r = compare(hit, cold)
    assert (r.exit_code, r.cause) == (1, "tensor")
    d = r.first
    assert (d.key, d.reason, d.metrics, d.role_hit, d.root) == (
        (1, 32, ATTN, "attn.k"), "digest differs", None, "resumed", True)
    assert d.digests == (digest_array(stale), digest_array(_kv(SHARED[:32], "attn.k")))
    assert r.diagnoses[0].text == (
        "diagnosis: request 1 layer 3 attn.k at position 32 matches the cold KV block one block earlier "
        "(position 16, 16 tokens), bit for bit: the block read as logical block 1 holds the cold run's block 0")
    assert (r.diagnoses[0].finding, r.diagnoses[0].match_position) == ("other_position", 16)
    assert (r.digests.pairs, r.digests.identical, r.digests.unjudged) == (4, 3, 0)
    text = r.to_text()
    assert f"  digest differs: hit {d.digests[0]}, cold {d.digests[1]} (recorded as a digest only" in text
    assert ("digests: 4 pairs with a side recorded as a digest only (no data): 4 judged by digest (3 "
            "bit-identical), 0 by sketch estimate (0 beyond tolerance), 0 unjudged") in text
    # default replay: a digest cannot be held against a tolerance, but matching another cold
    # block bit for bit is no rounding: still a divergence, with the same diagnosis
    d2 = tmp_path / "default"
    d2.mkdir()
    r = compare(_digest_trace(d2 / "hit.h5", "hit", "default", stale=stale),
                _digest_trace(d2 / "cold.h5", "cold", "default"))
    assert r.first.key == (1, 32, ATTN, "attn.k") and r.diagnoses[0].match_position == 16


def test_a_differing_digest_in_default_replay_is_unjudged_and_zeros_are_named(tmp_path):
    noisy = to_bf16_bits((_kv(SHARED[:32], "attn.k").astype(np.uint32) << 16).view(np.float32) + 0.01)
    r = compare(_digest_trace(tmp_path / "hit.h5", "hit", "default", stale=noisy),
                _digest_trace(tmp_path / "cold.h5", "cold", "default"))
    assert (r.exit_code, r.divergences) == (0, [])
    assert (r.digests.pairs, r.digests.identical, r.digests.unjudged) == (4, 3, 1)
    assert r.digests.first_unjudged == ("request 1 position 32 layer 3 (model.layers.3.self_attn) attn.k",)
    assert "1 differ but cannot be judged in default replay" in r.to_text()
    d = tmp_path / "zeros"
    d.mkdir()
    r = compare(_digest_trace(d / "hit.h5", "hit", "exact", stale=np.zeros(KV_SHAPE, np.uint16)),
                _digest_trace(d / "cold.h5", "cold", "exact"))
    assert r.diagnoses[0].text == ("diagnosis: request 1 layer 3 attn.k at position 32 is all zeros: "
                                   "never written / zeroed")


def test_runner_block_table_differing_from_the_scheduler_is_a_finding(tmp_path):
    table = {"runner": [[4, 5, 5, 9], [4, 5, 6]], "scheduler": [[4, 5, 6, 9], [4, 5, 6]]}
    hit = _digest_trace(tmp_path / "hit.h5", "hit", "exact", table=table)
    cold = _digest_trace(tmp_path / "cold.h5", "cold", "exact")
    r = compare(hit, cold)
    assert (r.exit_code, r.cause, r.divergences) == (1, "block_table", [])
    b = r.block_tables[0]
    assert (b.side, b.request, b.group, b.logical, b.runner, b.scheduler, b.differing) == ("hit", 1, 0, 2, 5, 6, 1)
    assert r.to_text().splitlines()[0] == (
        "DIVERGED: the runner's block table differs from the scheduler's allocation at request 1, KV-cache "
        "group 0, logical block 2: the runner's block table maps physical block 5, the scheduler allocated 6; "
        "no captured tensor differs")
    assert r.to_json()["block_tables"][0]["logical"] == 2


# -- each side decoded with its own dtype --------------------------------------------

def _one(path, mode, arr, dtype):
    w = TraceWriter(path, run_meta(mode, "exact"))
    w.add(arr, request=0, position=16, layer=1, kind="gdn.ssm_state", role="checkpoint",
          module="model.layers.1.linear_attn", dtype=dtype)
    w.close()
    return path


def test_a_bf16_state_against_a_float32_one_is_compared_in_float64(tmp_path):
    x = (np.random.default_rng(0).standard_normal((2, 8, 8)) * 0.1).astype(np.float32)
    cold = _one(tmp_path / "cold.h5", "cold", x, "float32")
    r = compare(_one(tmp_path / "hit.h5", "hit", to_bf16_bits(x), "bfloat16"), cold)
    assert (r.exit_code, r.divergences, r.identical) == (0, [], 0)  # bf16 rounding: within bf16 defaults
    worse = to_bf16_bits(x + 0.5)
    r = compare(_one(tmp_path / "hit2.h5", "hit", worse, "bfloat16"), cold, allow_engine_mismatch=True)
    d = r.first
    assert (d.reason, d.dtype, d.layout_cold) == ("beyond tolerance", "bfloat16", "float32 (2, 8, 8)")
    assert d.tolerance.source == ("dtype default bfloat16: hit bfloat16 vs cold float32, each decoded with "
                                  "its own dtype")
    assert 0.49 < d.metrics.max_abs < 0.51 and d.metrics.max_ulp is None and d.metrics.worst_ulp is None
    assert d.metrics.cosine < 0.5
