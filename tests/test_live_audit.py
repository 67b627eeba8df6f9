"""``statediff.audit.live`` without an engine: configuration from the environment, the checks the
offline audit runs, fed step by step, the incident line, and the ledger's bound."""

from __future__ import annotations

import json
import logging

import pytest

from statediff.audit.live import LiveAuditor, LiveConfig, prompt_digest
from statediff.trace.summary import Summary

BS = 128
LAYERS = [{"layer": 0, "module": "model.layers.0.linear_attn", "type": "gdn", "group": 0, "block_size": BS},
          {"layer": 1, "module": "model.layers.1.self_attn", "type": "attn", "group": 1, "block_size": BS}]
PREFIX = list(range(10, 10 + 3 * BS))


def s(digest: str, zero: bool = False) -> Summary:
    return Summary(digest=digest * 32 if len(digest) == 1 else digest, sum=0.0 if zero else 1.0,
                   sumsq=0.0 if zero else 1.0, absmax=0.0 if zero else 1.0, n_nan=0, n_inf=0)


def write(a: LiveAuditor, req: int, pos: int, block: int, digest: str, step: int) -> None:
    a.add_digest(s(digest), dtype="float32", shape=(4,), request=req, position=pos, token_start=pos, layer=0,
                 kind="gdn.conv_state", role="checkpoint", module="m", step=step, block=block)


def restore(a: LiveAuditor, req: int, pos: int, block: int, summary: Summary, step: int) -> None:
    a.add_digest(summary, dtype="float32", shape=(4,), request=req, position=pos, token_start=pos, layer=0,
                 kind="gdn.conv_state", role="resumed", module="m", step=step, block=block)


def auditor(tmp_path, prompts: bool = False) -> LiveAuditor:
    a = LiveAuditor({"block_size": BS, "mamba_block_size": BS}, LiveConfig(str(tmp_path / "inc.jsonl"), prompts))
    a.update_run(layers=LAYERS)
    return a


def hit(a: LiveAuditor, idx: int, rid: str, prompt: list[int], blocks: list[int], summary: Summary, step: int) -> None:
    """Request ``idx`` resumes 384 tokens from ``blocks`` (group 0's scheduler row)."""
    a.begin_request(idx, rid, prompt, num_cached_tokens=384)
    a.update_request(idx, hit_block_table={"runner": [blocks, []], "scheduler": [blocks, []]})
    restore(a, idx, 384, 20 + idx, summary, step)
    a.end_step()


def test_a_zeroed_restore_is_one_incident_with_who_wrote_the_expected_value(tmp_path, caplog):
    a = auditor(tmp_path, prompts=True)
    a.begin_request(0, "cmpl-a-0", PREFIX + [1, 2])
    for k, b in enumerate((4, 5, 6)):
        write(a, 0, (k + 1) * BS, b, "abc"[k], step=k)
        a.end_step()
    a.update_request(0, finished=True)  # the writer finished: its prefix is remembered by hash
    hit(a, 1, "cmpl-b-0", PREFIX + [3], [4, 5, 6], s("c"), step=5)  # exact copy: clean
    with caplog.at_level(logging.WARNING, logger="statediff"):
        hit(a, 2, "cmpl-c-0", PREFIX + [4], [4, 5, 6], s("0", zero=True), step=6)
        restore(a, 2, 384, 22, s("0", zero=True), step=7)  # a second violation of the same request
        a.end_step()
    lines = (tmp_path / "inc.jsonl").read_text().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert {k: got[k] for k in ("request_id", "check", "step", "position", "layer", "kind")} == {
        "request_id": "cmpl-c-0", "check": "state", "step": 6, "position": 384, "layer": 0, "kind": "gdn.conv_state"}
    assert got["diagnosis"] == "all zeros: the restored value was never written, or was zeroed"
    assert got["expected"] == {"digest": "c" * 32, "request_id": "cmpl-a-0", "step": 2, "block": 6,
                               "position": 384, "token_start": 384}
    assert got["got"] == {"digest": "0" * 32, "block": 22} and got["prompt_token_ids"] == PREFIX + [4]
    assert got["prompt"] == {"digest": prompt_digest(PREFIX + [4]), "tokens": 385}
    assert [r.getMessage() for r in caplog.records] == [
        f"statediff live audit: request cmpl-c-0 step 6 position 384 layer 0 gdn.conv_state: resumed state differs "
        f"from the checkpoint saved at this boundary; all zeros: the restored value was never written, or was "
        f"zeroed (incident appended to {tmp_path / 'inc.jsonl'})"]
    assert a.close()["incidents"] == 1 and a.close()["restores_checked"] == 2
    # by label, for the engine's /metrics: 2 restores and 2 block-table rows (request 1: one per KV-cache group;
    # request 2 is reported at its restore, its fields are not checked after), 1 violation
    assert dict(a.checked) == {"state": 2, "block_table": 2} and dict(a.violations) == {("state", "gdn.conv_state"): 1}


def test_prompts_off_by_default_and_a_block_rewritten_for_another_prefix(tmp_path):
    a = auditor(tmp_path)
    a.begin_request(0, "r0", PREFIX)
    write(a, 0, 384, 6, "c", step=0)
    a.end_step()
    a.update_request(0, finished=True)
    a.begin_request(1, "r1", [999] * 400)  # block 6 reused for another prefix
    write(a, 1, 384, 6, "d", step=1)
    a.end_step()
    assert len(a.ctx.ledger) == 1  # one write per (layer, kind, block): the old one is gone
    assert sum(len(v) for v in a.ctx.ledger.by_digest.values()) == 1
    hit(a, 2, "r2", PREFIX + [5], [4, 5, 6], s("c"), step=3)  # restores PREFIX from a block now holding r1's
    got = json.loads((tmp_path / "inc.jsonl").read_text())
    assert (got["check"], got["expected"]["request_id"]) == ("block_owner", "r1")
    # no user data by default: the prompt's digest and length, enough to find it in a replay
    assert "prompt_token_ids" not in got and "[999" not in json.dumps(got)
    assert got["prompt"] == {"digest": prompt_digest(PREFIX + [5]), "tokens": 385}
    assert dict(a.violations) == {("block_owner", "gdn.conv_state"): 1}
    for i in (1, 2):
        a.update_request(i, finished=True)
    assert a.requests == {} and a.tokens == {}


@pytest.mark.parametrize("env, error", [
    ({"STATEDIFF_LIVE_AUDIT": "x.jsonl", "STATEDIFF_LIVE_AUDIT_PROMPTS": "no"},
     "STATEDIFF_LIVE_AUDIT_PROMPTS='no': expected 1 (incidents carry the prompt token ids) or 0 (the default: "
     "a digest of the prompt and its length)"),
    ({"STATEDIFF_LIVE_AUDIT_PROMPTS": "0"}, "STATEDIFF_LIVE_AUDIT_PROMPTS is set but STATEDIFF_LIVE_AUDIT is not"),
    ({"STATEDIFF_LIVE_AUDIT": "/nonexistent/dir/x.jsonl"},
     "STATEDIFF_LIVE_AUDIT=/nonexistent/dir/x.jsonl: directory /nonexistent/dir does not exist"),
    ({"STATEDIFF_LIVE_AUDIT": "x.jsonl", "STATEDIFF_TRACE": "t.h5"},
     "STATEDIFF_LIVE_AUDIT and STATEDIFF_TRACE are both set"),
])
def test_bad_configuration_is_one_line(env, error):
    with pytest.raises(ValueError) as e:
        LiveConfig.from_env(env)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_configuration(tmp_path):
    assert LiveConfig.from_env({}) is None
    assert LiveConfig.from_env({"STATEDIFF_LIVE_AUDIT": str(tmp_path / "i.jsonl")}) == LiveConfig(
        str(tmp_path / "i.jsonl"), False)
    assert LiveConfig.from_env({"STATEDIFF_LIVE_AUDIT": "i.jsonl", "STATEDIFF_LIVE_AUDIT_PROMPTS": "0"}).prompts is False
    assert LiveConfig.from_env({"STATEDIFF_LIVE_AUDIT": "i.jsonl", "STATEDIFF_LIVE_AUDIT_PROMPTS": "1"}).prompts is True


def test_prompt_digest_is_of_the_ids_alone():
    # BLAKE2b-128 of little-endian int64 ids: computable from a replay's prompt_token_ids anywhere
    import hashlib

    import numpy as np

    assert prompt_digest([1, 2, 3]) == hashlib.blake2b(b"".join(i.to_bytes(8, "little") for i in (1, 2, 3)),
                                                        digest_size=16).hexdigest()
    assert prompt_digest(np.array([1, 2, 3], dtype=np.int32)) == prompt_digest([1, 2, 3]) != prompt_digest([1, 2])


def test_an_incident_file_that_is_not_a_regular_writable_file_is_refused(tmp_path):
    import os

    fifo = tmp_path / "incidents.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as e:
        LiveConfig.from_env({"STATEDIFF_LIVE_AUDIT": str(fifo)})
    assert str(e.value) == f"STATEDIFF_LIVE_AUDIT={fifo}: not a regular file (name a file to append incidents to)"
    with pytest.raises(ValueError, match="^STATEDIFF_LIVE_AUDIT=/dev/null: not a regular file"):
        LiveConfig.from_env({"STATEDIFF_LIVE_AUDIT": "/dev/null"})


def test_the_plugin_refuses_a_bad_value_in_one_line_before_the_engine(monkeypatch, capsys):
    from statediff_hooks.vllm import plugin

    monkeypatch.setenv("STATEDIFF_LIVE_AUDIT", "i.jsonl")
    monkeypatch.setenv("STATEDIFF_LIVE_AUDIT_PROMPTS", "yes")
    monkeypatch.delenv("STATEDIFF_DISABLE", raising=False)
    with pytest.raises(SystemExit) as e:
        plugin.register()
    assert e.value.code == 2
    assert capsys.readouterr().err == ("statediff: error: STATEDIFF_LIVE_AUDIT_PROMPTS='yes': expected 1 (incidents "
                                       "carry the prompt token ids) or 0 (the default: a digest of the prompt and "
                                       "its length)\n")


def test_a_hit_requests_falling_acceptance_is_an_incident(tmp_path):
    """Issue 34: the live audit reports a hit request whose drafter acceptance falls against the
    engine's finished requests without a hit (three pooled counters)."""
    a = auditor(tmp_path)

    def acc(drafts, drafted, accepted):
        return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}
    a.begin_request(0, "cmpl-a-0", PREFIX)
    a.update_request(0, acceptance=acc(6, 18, 13))
    a.update_request(0, finished=True)
    a.begin_request(1, "cmpl-b-0", PREFIX + [3], num_cached_tokens=384)
    a.update_request(1, acceptance=acc(6, 18, 12))  # as good as the pool: no incident
    a.update_request(1, finished=True)
    a.begin_request(2, "cmpl-c-0", PREFIX + [4], num_cached_tokens=384)
    a.update_request(2, finished=True, acceptance=acc(16, 48, 0))
    (line,) = (tmp_path / "inc.jsonl").read_text().splitlines()
    got = json.loads(line)
    assert (got["request_id"], got["check"], got["position"], got["num_cached_tokens"]) == ("cmpl-c-0", "acceptance",
                                                                                           384, 384)
    assert got["what"] == ("acceptance falls to 0 of 48 drafted tokens accepted (0%), mean acceptance length 1.00, "
                           "against 13 of 18 drafted tokens accepted (72%), mean acceptance length 3.17 in the "
                           "engine's requests without a hit")


def test_kv_read_from_a_block_nobody_wrote_is_a_read_before_write_incident(tmp_path):
    """Issue 34: the live audit names "read, never written" (a K/V block read at a hit from a block no
    write of this engine filled, while the tokens' K/V were written elsewhere)."""
    a = auditor(tmp_path)
    a.begin_request(0, "cmpl-a-0", PREFIX + [1, 2])
    for kind in ("attn.k", "attn.v"):
        a.add_digest(s("a" if kind == "attn.k" else "b"), dtype="bfloat16", shape=(4,), request=0, position=BS,
                     token_start=0, layer=1, kind=kind, role="kv_block", module="m1", step=0, block=7)
    a.end_step()
    a.begin_request(1, "cmpl-b-0", PREFIX + [3], num_cached_tokens=BS)
    a.update_request(1, hit_block_table={"runner": [[], [30]], "scheduler": [[], [7]]})
    a.add_digest(s("0", zero=True), dtype="bfloat16", shape=(4,), request=1, position=BS, token_start=0, layer=1,
                 kind="attn.k", role="resumed", module="m1", step=3, block=30)
    a.end_step()
    got = [json.loads(x) for x in (tmp_path / "inc.jsonl").read_text().splitlines()]
    assert [(g["request_id"], g["check"], g["position"], g["layer"], g["kind"]) for g in got] == [
        ("cmpl-b-0", "read_before_write", BS, 1, "attn.k")]
    assert got[0]["what"] == ("read, never written: KV-cache group 1 reads tokens [0, 128) from block 30, which "
                              "nothing in this run wrote before step 3; these tokens' K/V were written by request "
                              "0 at step 0 into block 7")
