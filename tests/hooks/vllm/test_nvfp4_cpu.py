"""The NVFP4 CPU stand-in (``hooks/vllm/cpu/nvfp4.py``) without an engine start: where it registers,
what the trace lists, and how a checkpoint's format is named."""

from __future__ import annotations

import json
import types

import pytest

pytestmark = pytest.mark.engine


@pytest.mark.vllm
def test_install_registers_vllms_emulation_kernel_for_cpu_once(monkeypatch):
    from vllm.model_executor.kernels import linear as kl
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    from statediff_hooks.vllm.cpu import nvfp4 as nvfp4_cpu

    monkeypatch.setattr(nvfp4_cpu, "_installed", [])
    monkeypatch.setitem(kl._POSSIBLE_NVFP4_KERNELS, PlatformEnum.CPU, [])
    got = nvfp4_cpu.install()
    assert kl._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] == [EmulationNvFp4LinearKernel]
    assert [(p["name"], p["replaces"], p["kernel"]) for p in got] == [(
        "cpu-nvfp4-linear-emulation", ["vllm.model_executor.kernels.linear.init_nvfp4_linear_kernel"],
        "vllm.model_executor.kernels.linear.nvfp4.emulation.EmulationNvFp4LinearKernel")]
    assert nvfp4_cpu.install() == got  # idempotent: registered once
    assert kl._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] == [EmulationNvFp4LinearKernel]
    # a runner lists it only when one of its layers runs the emulation kernel
    emu_layer = types.SimpleNamespace(scheme=types.SimpleNamespace(kernel=EmulationNvFp4LinearKernel.__new__(
        EmulationNvFp4LinearKernel)))
    runner = types.SimpleNamespace(model=types.SimpleNamespace(modules=lambda: [object(), emu_layer]))
    assert nvfp4_cpu.linear_kernels(runner) == {"SimpleNamespace": "EmulationNvFp4LinearKernel"}
    assert nvfp4_cpu.installed(runner) == got
    plain = types.SimpleNamespace(model=types.SimpleNamespace(modules=lambda: [object()]))
    assert nvfp4_cpu.installed(plain) == [] and nvfp4_cpu.linear_kernels(plain) == {}


@pytest.mark.vllm
def test_install_leaves_a_platform_that_has_a_cpu_nvfp4_kernel_alone(monkeypatch):
    from vllm.model_executor.kernels import linear as kl
    from vllm.platforms import PlatformEnum

    from statediff_hooks.vllm.cpu import nvfp4 as nvfp4_cpu

    monkeypatch.setattr(nvfp4_cpu, "_installed", [])
    theirs = [type("VllmOwnCpuNvFp4Kernel", (), {})]
    monkeypatch.setitem(kl._POSSIBLE_NVFP4_KERNELS, PlatformEnum.CPU, theirs)
    assert nvfp4_cpu.install() == [] and kl._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] == theirs


def test_checkpoint_format_names_the_target_format():
    from statediff_hooks.tiny.formats import quantization_config
    from statediff_hooks.vllm.cpu.nvfp4 import checkpoint_format

    assert checkpoint_format({"dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_format({"quantization_config": quantization_config("nvfp4")}) == "nvfp4"
    assert checkpoint_format({"quantization_config": quantization_config("fp8")}) == "fp8"
    assert checkpoint_format({"quantization_config": {"quant_method": "awq", "format": None}}) == "awq:None"


@pytest.mark.vllm
def test_an_nvfp4_checkpoint_without_a_kernel_registry_is_refused_in_one_line(monkeypatch, tmp_path):
    from statediff_hooks.tiny.formats import quantization_config
    from statediff_hooks.vllm.cpu import nvfp4 as nvfp4_cpu

    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 1,
                                                      "quantization_config": quantization_config("nvfp4")}))
    assert nvfp4_cpu.check_checkpoint(tmp_path) is None
    monkeypatch.setattr(nvfp4_cpu, "_registry", lambda: (None, None))
    monkeypatch.setattr(nvfp4_cpu, "_installed", [])
    import vllm

    assert nvfp4_cpu.check_checkpoint(tmp_path) == (
        f"{tmp_path}: NVFP4 needs a CPU NVFP4 linear kernel; vLLM {vllm.__version__} has none and no "
        "vllm.model_executor.kernels.linear.register_linear_kernel to add EmulationNvFp4LinearKernel (written for 0.32)")
    assert nvfp4_cpu.check_checkpoint(tmp_path / "missing") is None
