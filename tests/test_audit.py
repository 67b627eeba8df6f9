"""``statediff audit``: restores checked against what the same run saved, from digests alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit_synth import write_hit_run
from statediff.audit import audit_trace
from statediff.cli import cli

TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("keep", ["none", "all", None])
def test_a_fault_free_run_audits_clean(tmp_path, keep):
    r = audit_trace(write_hit_run(tmp_path / "hit.h5", keep=keep))
    assert r.exit_code == 0 and r.findings == ()
    assert r.hits == 2 and r.requests == 4
    # request 1: 2 states + 2 K/V blocks x (K, V); request 3: 2 states + 3 blocks x 2
    assert r.checked["state"] == 4 and r.checked["kv"] == 10 and r.unchecked_count == 0
    assert r.checked["block_table"] == (4 if keep is not None else 0)
    assert r.checked["first_chunk"] == (4 if keep is not None else 0)
    assert r.checked["group_hit"] == (2 if keep is not None else 0)
    assert r.headline().startswith("CLEAN: 14 restored tensor(s) of 2 hit(s)")


def _first(tmp_path, fault, keep="none"):
    r = audit_trace(write_hit_run(tmp_path / "hit.h5", fault=fault, keep=keep))
    assert r.exit_code == 1
    f = r.first
    return r, f, (f.check, f.request, f.position, f.layer, f.kind)


def test_ssm_wrong_block_names_the_checkpoint_one_block_earlier(tmp_path):
    r, f, key = _first(tmp_path, "ssm-wrong-block")
    assert key == ("state", 3, 48, 0, "gdn.ssm_state")
    assert len(r.findings) == 1
    assert f.expected == {"request": 1, "position": 48, "token_start": 48, "step": 5, "block": 4}
    assert f.diagnosis == ("equals the checkpoint saved at position 32 of the same prefix (1 block(s) earlier), "
                           "written by request 0 at step 0 into block 2")


def test_conv_zero_is_all_zeros(tmp_path):
    r, f, key = _first(tmp_path, "conv-zero")
    assert key == ("state", 3, 48, 0, "gdn.conv_state")
    assert f.diagnosis.startswith("all zeros")


def test_ssm_bf16_is_the_saved_state_rounded(tmp_path):
    r, f, key = _first(tmp_path, "ssm-bf16")
    assert key == ("state", 3, 48, 0, "gdn.ssm_state")
    assert f.diagnosis == "equals the saved value rounded to bfloat16"


def test_ssm_nan_counts_the_nan(tmp_path):
    r, f, key = _first(tmp_path, "ssm-nan")
    assert key == ("state", 3, 48, 0, "gdn.ssm_state")
    assert f.diagnosis == "1 NaN/Inf element(s), where the saved value has none"


def test_kv_stale_names_the_block_and_the_table(tmp_path):
    r, f, key = _first(tmp_path, "kv-stale")
    assert key == ("kv", 3, 48, 1, "attn.k")
    assert f.expected == {"request": 1, "position": 48, "token_start": 32, "step": 5, "block": 13}
    assert f.what == ("K/V read through the runner's block table (block 11) differ from what was written "
                      "into block 13 for tokens [32, 48)")
    assert f.diagnosis == ("equals the K/V written for tokens [16, 32) of the same prefix (1 block(s) earlier), "
                           "written by request 0 at step 0 into block 11")
    assert [(g.check, g.kind) for g in r.findings] == [("kv", "attn.k"), ("kv", "attn.v"),
                                                        ("block_table", "block_table")]
    assert r.findings[-1].what == ("KV-cache group 1, logical block 2: the runner's block table maps physical "
                                   "block 11, the scheduler allocated 13")


def test_kv_swap_first_at_the_earlier_block(tmp_path):
    r, f, key = _first(tmp_path, "kv-swap")
    assert key == ("kv", 3, 32, 1, "attn.k")
    assert "tokens [32, 48) of the same prefix (1 block(s) later)" in f.diagnosis
    table = [g for g in r.findings if g.check == "block_table"]
    assert len(table) == 1 and table[0].position == 32 and "(2 logical blocks of this row differ)" in table[0].what


def test_another_requests_state(tmp_path):
    r, f, key = _first(tmp_path, "other-request")
    assert key == ("state", 3, 48, 0, "gdn.conv_state")
    assert f.diagnosis == ("equals request 2's state at position 32 (another prefix), written at step 7 "
                           "into block 20")


def test_a_block_whose_content_was_replaced_before_the_hit(tmp_path):
    r, f, key = _first(tmp_path, "reused-block")
    assert key == ("block_owner", 3, 48, 0, "gdn.conv_state")
    assert f.what == ("the scheduler restored it from block 4, whose last write (request 2, position 32, "
                      "step 7) holds another token prefix")
    assert f.expected["request"] == 2


def test_without_block_tables_the_prefix_finds_the_saved_state(tmp_path):
    r, f, key = _first(tmp_path, "ssm-wrong-block", keep=None)
    assert key == ("state", 3, 48, 0, "gdn.ssm_state")
    assert f.expected["request"] == 1 and "position 32 of the same prefix" in f.diagnosis


def test_reference_traces():
    assert audit_trace(TRACES / "hit.h5").exit_code == 0
    cold = audit_trace(TRACES / "cold.h5")
    assert cold.exit_code == 0 and cold.hits == 0 and "nothing restored" in cold.headline()
    r = audit_trace(TRACES / "hit-ssm-bf16.h5")
    assert (r.first.request, r.first.position, r.first.layer, r.first.kind) == (1, 448, 2, "gdn.ssm_state")
    assert r.first.expected == {"request": 0, "position": 448, "token_start": 448, "step": 0, "block": 3}


def test_cli_exit_codes_and_json(tmp_path):
    runner = CliRunner()
    clean = write_hit_run(tmp_path / "clean.h5")
    bad = write_hit_run(tmp_path / "bad.h5", fault="conv-zero")
    assert runner.invoke(cli, ["audit", str(clean)]).exit_code == 0
    res = runner.invoke(cli, ["audit", str(bad), "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["first"]["request"] == 3 and doc["first"]["position"] == 48
    assert doc["first"]["layer"] == 0 and doc["first"]["kind"] == "gdn.conv_state"
    assert doc["verdict"] == "violation" and doc["exit_code"] == 1
    missing = runner.invoke(cli, ["audit", str(tmp_path / "nope.h5")])
    assert missing.exit_code == 2 and missing.output.strip().endswith("nope.h5 does not exist")


def test_recycled_slot_is_named_at_position_zero(tmp_path):
    r, f, key = _first(tmp_path, "recycled-slot")
    assert key == ("initial", 2, 0, 0, "gdn.conv_state")
    assert [(g.check, g.kind) for g in r.findings] == [("initial", "gdn.conv_state"), ("initial", "gdn.ssm_state")]
    assert f.what == ("a request without a prefix-cache hit has its first chunk treated as a decode, so the kernel "
                      "reads state slot 20, which is not zeros")
    assert f.diagnosis == "recycled slot: holds request 0's state at position 32 (written at step 0 into block 2)"


def test_a_hit_whose_first_chunk_ignores_the_restored_state(tmp_path):
    r, f, key = _first(tmp_path, "hit-ignores-state")
    assert key == ("first_chunk", 3, 48, 0, "gdn.conv_state") and len(r.findings) == 1
    assert "kernel ignores the state restored into slot 6" in f.what


def test_a_group_shortfall_is_named_with_both_lengths(tmp_path):
    r, f, key = _first(tmp_path, "group-shortfall")
    assert key == ("group_hit", 3, 48, 1, "group_hit") and len(r.findings) == 1
    assert f.what == ("KV-cache groups disagree on the final prefix-cache hit: group 1 covers 32 tokens, group 0 "
                      "covers 48 (the engine reported 48); tokens [32, 48) are neither cached in the shorter group "
                      "nor recomputed")


@pytest.mark.parametrize("keep", ["none", "all"])
def test_kv_read_from_a_block_nobody_wrote_is_read_before_write(tmp_path, keep):
    """Issue 34: a restored block that holds no write of this run (a drafter's blocks a connector
    restoring only the target left empty) is "read, never written", not "not checkable"."""
    r, f, key = _first(tmp_path, "kv-unwritten", keep)
    assert key == ("read_before_write", 3, 48, 1, "attn.k")
    assert [(g.check, g.kind) for g in r.findings] == [("read_before_write", "attn.k"),
                                                       ("read_before_write", "attn.v"),
                                                       ("block_table", "block_table")]
    assert f.what == ("read, never written: KV-cache group 1 reads tokens [32, 48) from block 30, which nothing "
                      "in this run wrote before step 10; these tokens' K/V were written by request 1 at step 5 "
                      "into block 13")
    assert f.expected == {"request": 1, "position": 48, "token_start": 32, "step": 5, "block": 13}
    assert f.diagnosis == "block 30 is in no recorded allocation of this run (no hit_block_table row holds it)"
    assert r.unchecked_count == 0 and r.checked["kv"] == 10
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "hit.h5")])
    assert res.exit_code == 1
    assert "finding 1 (read_before_write): request 3 position 48 layer 1 (model.layers.1.self_attn) attn.k: " \
        "read, never written" in res.stdout


@pytest.mark.parametrize("keep", ["none", None])
def test_a_restore_whose_saved_value_was_not_recorded_is_not_checkable(tmp_path, keep):
    r = audit_trace(write_hit_run(tmp_path / "hit.h5", keep=keep, omit_checkpoint=True))
    assert r.exit_code == 0 and r.findings == ()
    assert r.unchecked_count == 2 and r.checked["state"] == 2
    why = ("nothing recorded was written into block 4 before step 10" if keep else
           "no state of this prefix was recorded as saved")
    assert r.unchecked[0] == f"request 3 position 48 layer 0 gdn.conv_state: {why}"
    assert "not checkable: 2 restored tensor(s)" in r.to_text()


def test_hits_with_no_checkable_restore_are_not_checked_not_clean(tmp_path):
    """Every restore 'not checkable' used to print CLEAN, exit 0: now an explicit NOT CHECKED, exit 2."""
    from audit_synth import _Run, prompts

    (p0, o0), (p1, o1) = prompts()[:2]
    run = _Run(tmp_path / "hit.h5", "none", None)
    for i, p in enumerate((p0, p1)):
        run.w.begin_request(i, f"req-{i}", list(p))
    run.state(p1 + o1, 1, 32, 5, 4, role="resumed")  # what it resumed from was never recorded
    run.w.end_step()
    run.w.update_request(1, num_cached_tokens=32)
    run.w.end_step()
    run.w.close()
    r = audit_trace(tmp_path / "hit.h5")
    assert (r.exit_code, r.verdict, r.hits, r.unchecked_count) == (2, "not_checked", 1, 2)
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "hit.h5")])
    assert res.exit_code == 2
    assert res.stdout.splitlines()[0] == (
        "NOT CHECKED: 1 hit(s) restored 2 tensor(s), none of them checkable (the trace holds no write of the "
        "values they restore): nothing checkable, so not clean")
    doc = json.loads(CliRunner().invoke(cli, ["audit", str(tmp_path / "hit.h5"), "--json"]).stdout)
    assert (doc["verdict"], doc["exit_code"]) == ("not_checked", 2)


def test_a_drafter_layer_that_never_wrote_restored_tokens_is_read_before_write():
    """Issue 34: a restore that filled the target's blocks only (a KV connector restoring the target's
    layers; vLLM #47930's DFlash context never computed for restored tokens): the drafter's layer 5
    has writes of its own (tokens it computed) but none of the restored tokens, the target's layer 1 has."""
    from statediff.audit.checks import Context, check_restore
    from statediff.audit.ledger import Rec

    def rec(layer, start, end, role, step, block, request, digest="a" * 32):
        return Rec(request=request, position=end, token_start=start, layer=layer, kind="attn.k", role=role,
                   module=f"m{layer}", step=step, block=block, digest=digest, scheme="digest")
    prompt = list(range(100, 164))
    reqs = {0: {"prompt_token_ids": prompt[:40]}, 1: {"prompt_token_ids": prompt}}
    recs = [rec(1, 0, 32, "kv_block", 0, 3, 0),  # the target wrote request 0's first block
            rec(5, 32, 64, "kv_block", 4, 9, 1)]  # the drafter wrote only what request 1 computed
    run = {"layers": [{"layer": 1, "group": 0, "block_size": 32}, {"layer": 5, "group": 1, "block_size": 32}]}
    ctx = Context(run, reqs, recs)
    found, why = check_restore(ctx, rec(5, 0, 32, "resumed", 4, 3, 1, digest="0" * 32))
    assert why is None and found.check == "read_before_write"
    assert found.what == ("read, never written: KV-cache group 1 reads tokens [0, 32) from block 3, which nothing "
                          "in this run wrote before step 4; this layer never wrote these tokens' K/V in this run, "
                          "while layer 1's were written by request 0 at step 0 into block 3")
    # the target's own restore of that block is no finding; a layer with no captured write stays unchecked
    assert check_restore(ctx, rec(1, 0, 32, "resumed", 4, 3, 1)) == (None, None)
    assert check_restore(Context(run, reqs, recs[:1]), rec(5, 0, 32, "resumed", 4, 3, 1))[0] is None


def test_the_text_is_the_one_rendering_of_findings_full_or_brief(tmp_path):
    """``to_text`` is what ``audit``, ``check`` (``brief``: under its own heading) and the check's report print:
    the first ``limit`` findings, then how many more and where they are."""
    r = audit_trace(write_hit_run(tmp_path / "hit.h5", fault="kv-stale"))
    head = ("RESTORE VIOLATION: first at request 3 position 48 layer 1 (model.layers.1.self_attn) attn.k "
            "(3 finding(s))")
    full = r.to_text(limit=1, more="audit.json lists them all").splitlines()
    assert full[:3] == [head, f"trace: {tmp_path / 'hit.h5'}",
                        "requests: 4, hits: 2; checked: state 4, kv 10, block_table 4, first_chunk 4, group_hit 2"]
    assert full[3].startswith("finding 1 (kv): request 3 position 48 layer 1 (model.layers.1.self_attn) attn.k: ")
    assert full[-1] == "... 2 more finding(s) (audit.json lists them all)"
    brief = r.to_text(limit=2, brief=True).splitlines()
    assert brief[0] == head and brief[-1] == "... 1 more finding(s) (--json lists them all)"
    assert [line.split(":")[0] for line in brief if line.startswith("finding")] == [
        "finding 1 (kv)", "finding 2 (kv)"]
    assert not any(line.startswith(("trace: ", "requests: ")) for line in brief)
