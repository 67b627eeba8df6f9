"""Run field ``engine_patches`` (``statediff/trace/patches.py``): ``inspect`` and ``report`` name the
patches a recording ran with and what a patched run cannot show; a malformed value is refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.incident.record import build_report
from statediff.trace.patches import describe_patches
from statediff.trace.schema import run_problem
from synth import write_trace

PATCH = {"name": "cpu-mamba-align-kernels", "by": "statediff_hooks.vllm.cpu.mamba_align",
         "replaces": ["vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
                      "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"],
         "written_for": "vllm 0.32.0 v1/worker/mamba_utils.py", "engine_version": "0.32.0",
         "why": "Triton kernels with no CPU backend (hybrid target + drafter + prefix caching)",
         "note": "a bug inside the Triton kernels themselves cannot be seen on a CPU"}
NAMED = ("cpu-mamba-align-kernels (replaces postprocess_mamba_fused_kernel, precopy_mamba_align_fused_kernel; "
         "a bug inside the Triton kernels themselves cannot be seen on a CPU)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("patches")
    return (write_trace(d / "hit.h5", "hit", engine_patches=[PATCH]),
            write_trace(d / "cold.h5", "cold", engine_patches=[PATCH]),
            write_trace(d / "plain.h5", "cold", engine_patches=[]))


def test_inspect_names_the_patches_and_what_they_hide(pair):
    r = CliRunner().invoke(cli, ["inspect", str(pair[0])])
    assert r.exit_code == 0, r.output
    assert f"  engine_patches         {NAMED}" in r.output.splitlines()
    r = CliRunner().invoke(cli, ["inspect", str(pair[2])])
    assert "  engine_patches         none (the engine's own code ran)" in r.output.splitlines()


def test_report_names_the_patches_of_both_runs(pair):
    assert dict(build_report(compare(pair[0], pair[1])).fields)["engine patches"] == NAMED
    assert dict(build_report(compare(pair[0], pair[2])).fields)["engine patches"] == (
        f"hit run: {NAMED}; cold run: none (the engine's own code ran)")


def test_a_malformed_engine_patches_field_is_named():
    assert run_problem({"engine_patches": [{"replaces": []}]}) == (
        "run field 'engine_patches' is not a list of objects {name: string, ...} or null")
    assert run_problem({"engine_patches": None}) is None
    assert describe_patches(None) == "unknown (not recorded)"
