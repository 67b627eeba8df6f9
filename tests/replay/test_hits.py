"""Hit accounting (statediff/replay/hits.py): exact numbers, offline."""

from __future__ import annotations

from statediff.replay.hits import HitLedger, account_run, expected_hits_align, findings, summary_lines

B = 64


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def req(prompt, outputs=(), cached=None, **extra) -> dict:
    return {"prompt_token_ids": list(prompt), "output_token_ids": list(outputs),
            "prompt_len": len(prompt), "num_cached_tokens": cached, **extra}


def test_shared_prefix_counts_whole_blocks():
    led = HitLedger(B)
    led.add(0, seq(1000, 300))
    e = led.expect(seq(1000, 130) + seq(5000, 50))  # shares 130 tokens
    assert (e.tokens, e.tokens // B, e.source) == (128, 2, 0)


def test_sampled_outputs_are_part_of_the_earlier_stream_except_the_last():
    led = HitLedger(B)
    led.add(0, seq(1000, 100), outputs=seq(1100, 40))  # computed: 100 prompt + 39 outputs = 139
    assert led.expect(seq(1000, 140) + [7]).tokens == 128  # 130 shared, 2 whole blocks
    assert led.expect(seq(1000, 200)).tokens == 128  # stream ends at 139: a third block is not there
    led2 = HitLedger(B)
    led2.add(0, seq(1000, 100), outputs=seq(1100, 29))  # 100 + 28 = 128 computed: exactly 2 blocks
    assert led2.expect(seq(1000, 129) + [7]).tokens == 128
    led3 = HitLedger(B)
    led3.add(0, seq(1000, 100), outputs=seq(1100, 28))  # 127 computed: the last sampled token is not
    assert led3.expect(seq(1000, 129) + [7]).tokens == 64


def test_hit_never_covers_the_last_prompt_token():
    led = HitLedger(B)
    led.add(0, seq(0, 256))
    assert led.expect(seq(0, 128)).tokens == 64  # 127 tokens at most: one block
    assert led.expect(seq(0, 129)).tokens == 128


def test_source_is_the_earliest_request_holding_the_prefix():
    led = HitLedger(B)
    led.add(0, seq(0, 200))
    led.add(1, seq(9000, 100))
    led.add(2, seq(0, 64) + seq(3000, 100))
    e = led.expect(seq(0, 64) + seq(3000, 70) + [1])
    assert (e.tokens, e.source) == (128, 2)  # the second block exists only in request 2's stream
    e = led.expect(seq(0, 65))
    assert (e.tokens, e.source) == (64, 0)


def test_align_model_keeps_one_checkpoint_per_prefill():
    led = HitLedger(B)
    led.add(0, seq(0, 200))  # replay boundary 192: 3 blocks, state kept at 192 only
    e = led.expect(seq(0, 128) + seq(5000, 30))
    assert (e.tokens, e.source, e.align, e.align_source) == (128, 0, 0, None)
    led.add(1, seq(0, 100))  # keeps 64
    e = led.expect(seq(0, 128) + seq(5000, 30))
    assert (e.tokens, e.align, e.align_source) == (128, 64, 1)


def test_sweep_expected_hits_are_the_align_special_case():
    assert expected_hits_align([100, 50, 70], 32) == [0, 0, 32]
    assert expected_hits_align([67, 65, 64], 32) == [0, 64, 0]


def run_meta(**kw) -> dict:
    return {"block_size": B, "mode": "hit", "mamba_cache_mode": "align", "cold_policy": None} | kw


def issue_conversation(cached2: int) -> dict[int, dict]:
    """Request 0 of 200 tokens, 1 unrelated, 2 shares the first 2 blocks of 0."""
    return {0: req(seq(0, 200), seq(7000, 8), cached=0),
            1: req(seq(9000, 90), seq(7100, 8), cached=0),
            2: req(seq(0, 128) + seq(5000, 40), seq(7200, 8), cached=cached2)}


def test_align_shortfall_is_a_named_finding():
    acc = account_run(run_meta(), issue_conversation(0))
    assert [(a.request, a.measured, a.expected, a.source, a.align) for a in acc] == [
        (0, 0, 0, None, 0), (1, 0, 0, None, 0), (2, 0, 128, 0, 0)]
    a = acc[2]
    assert a.kind == "shortfall" and a.blocks == 2
    assert a.finding == (
        "request 2 shares 128 tokens (2 blocks) with request 0 but resumed from 0; likely reason: mamba "
        "align mode keeps one recurrent-state checkpoint per prefill, at its last block boundary: "
        "request 0's prefill of 200 tokens kept position 192; no checkpoint lies on the shared prefix")
    assert findings(acc) == [a.finding]


def test_full_hit_has_no_finding_and_recorded_values_win():
    acc = account_run(run_meta(), issue_conversation(128))
    assert acc[2].finding is None and acc[2].expected == 128
    recs = issue_conversation(64)
    recs[2] |= {"expected_hit_tokens": 64, "expected_hit_source": 0}  # what the recorder saw
    assert account_run(run_meta(), recs)[2].finding is None


def test_cold_run_expects_no_hit():
    acc = account_run(run_meta(mode="cold", cold_policy="cache_salt"), issue_conversation(0))
    assert findings(acc) == []
    acc = account_run(run_meta(mode="cold", cold_policy="cache_salt"), issue_conversation(64))
    assert acc[2].kind == "cold-hit"
    assert acc[2].finding == ("request 2 resumed from 64 cached tokens in a cold run: the cold policy "
                              "(cache_salt) should have forced a miss")


def test_other_reasons_and_beyond():
    recs = issue_conversation(0)
    recs[0]["cache_salt"], recs[2]["cache_salt"] = "a", "b"
    assert account_run(run_meta(), recs)[2].reason == (
        "cache_salt differs (request 2 'b', request 0 'a'): the engine never shares cached blocks "
        "across salts")
    small = run_meta(mamba_cache_mode=None, num_gpu_blocks=4)
    assert account_run(small, issue_conversation(0))[2].reason == (
        "the KV cache is likely too small to keep it: about 256 tokens per request against 304 tokens "  # 207 + 97
        "computed from request 0 to request 1")
    plain = account_run(run_meta(mamba_cache_mode=None), issue_conversation(0))[2]
    assert plain.reason == "" and plain.finding.endswith("no reason found in the trace (not align-mode "
                                                         "retention, a speculative last-block drop, a "
                                                         "cache_salt difference or cache size)")
    beyond = account_run(run_meta(), issue_conversation(192))[2]
    assert beyond.kind == "beyond" and beyond.finding.startswith(
        "request 2 resumed from 192 tokens but shares only 128 tokens (2 blocks)")


def test_unknown_block_size_and_summary_lines():
    acc = account_run({"mode": "hit"}, issue_conversation(0))
    assert [a.expected for a in acc] == [None, None, None] and findings(acc) == []
    lines = summary_lines(account_run(run_meta(), issue_conversation(0)), "hit")
    assert lines[2:5] == ["          0     200         0         0  -",
                          "          1      90         0         0  -",
                          "          2     168         0       128  request 0"]
    assert lines[5].startswith("  HIT FINDING: request 2 shares 128 tokens (2 blocks) with request 0 but "
                               "resumed from 0")


def test_a_hit_through_the_last_sampled_token_is_not_beyond():
    # 40 prompt + 8 sampled tokens = 48 at block 16, but only 47 were fed to the model:
    # expected 2 blocks; an engine that resumes from 3 has not reused foreign tokens
    recs = {0: req(seq(0, 40), seq(500, 8), cached=0),
            1: req(seq(0, 40) + seq(500, 8) + seq(900, 30), seq(600, 8), cached=48)}
    acc = account_run({"block_size": 16, "mode": "hit"}, recs)
    assert (acc[1].expected, acc[1].source, acc[1].finding) == (32, 0, None)
    recs[1]["num_cached_tokens"] = 64
    assert account_run({"block_size": 16, "mode": "hit"}, recs)[1].finding.startswith(
        "request 1 resumed from 64 tokens but shares only 48 tokens (3 blocks)")


def test_the_drafters_last_block_drop_is_expected_and_a_missing_drop_is_a_finding():
    dense = run_meta(mamba_cache_mode=None, speculative_method="eagle3", engine="vllm")
    dropped = account_run(dense, issue_conversation(64))[2]  # shares 128: vLLM drops the last block
    assert (dropped.expected, dropped.finding, dropped.kind) == (64, None, None)
    kept = account_run(dense, issue_conversation(128))[2]
    assert kept.kind == "no-drop" and kept.finding == (
        "request 2 resumed from 128 tokens, 64 more than the 64 expected: vLLM drops the last matched block "
        "of every hit for a eagle3 drafter (it recomputes that block's hidden states), and this hit kept it")
    short = account_run(dense, issue_conversation(0))[2]
    assert short.kind == "shortfall" and short.expected == 64
    ngram = account_run(run_meta(mamba_cache_mode=None, speculative_method="ngram"), issue_conversation(128))[2]
    assert (ngram.expected, ngram.finding) == (128, None)  # drafters not fed hidden states drop nothing
    other = account_run(dense | {"engine": "transformers"}, issue_conversation(128))[2]
    assert (other.expected, other.finding) == (128, None)


def test_a_concurrent_replay_accounts_each_cache_salt_apart():
    """Two copies of one conversation side by side (``concurrency`` 2, request ``2 * i + k`` is copy k's):
    copy 1 never shares blocks with copy 0, so its first request expects no hit."""
    one = issue_conversation(0)
    recs = {}
    for i, rec in sorted(one.items()):
        for k in range(2):
            recs[2 * i + k] = dict(rec) | {"cache_salt": f"run/{k}",
                                           "num_cached_tokens": 0 if i < 2 else 128}
    acc = account_run(run_meta(concurrency=2), recs)
    assert [(a.request, a.expected, a.source) for a in acc] == [
        (0, 0, None), (1, 0, None), (2, 0, None), (3, 0, None), (4, 128, 0), (5, 128, 1)]
    assert findings(acc) == []
    # the same records without the run field: copy 1's first request "shares" copy 0's prompt
    assert account_run(run_meta(), recs)[1].kind == "shortfall"


def _dflash_run(groups):
    return {"block_size": 96, "mode": "hit", "speculative_method": "dflash", "mamba_cache_mode": "align",
            "version_facts": {"eagle_block_drop": True},
            "effective": {"kv_cache_groups": [{"group": g, "block_size": bs} for g, bs in enumerate(groups)]}}


def test_hits_align_to_the_lcm_of_the_groups_block_sizes_and_the_dflash_drop_is_named():
    """Issue 34: the hybrid with a drafter of its own KV shape: target attention 192 (page-size
    unification), mamba and drafter groups 96. Hits land on multiples of 192 and the drop is 192."""
    from statediff.replay.hits import drop_note, hit_alignment

    run = _dflash_run([96, 192, 96])
    assert hit_alignment(run) == 192 and hit_alignment({"block_size": 32}) == 32
    base = list(range(500))
    reqs = {0: {"prompt_token_ids": base[:400], "output_token_ids": [1, 2], "num_cached_tokens": 0},
            1: {"prompt_token_ids": base[:480], "output_token_ids": [1], "num_cached_tokens": 192}}
    acc = account_run(run, reqs)
    assert (acc[1].expected, acc[1].finding) == (192, None)  # 384 shared, less one 192-token block
    assert acc[1].reason == drop_note(run) and "vLLM #57032's fallback" in acc[1].reason
    assert "#54163 / #57110" in acc[1].reason
    assert summary_lines(acc, "hit")[-2:] == ["  every request resumed from the hit expected",
                                              f"  note: {drop_note(run)}"]
    assert drop_note(dict(run, speculative_method="mtp")) is None
    # the recorder's expected hit (counted in its own 96-token blocks) is rounded to the alignment too
    reqs[1]["expected_hit_tokens"], reqs[1]["expected_hit_source"] = 480 - 96, 0
    assert account_run(run, reqs)[1].expected == 192
