"""An installed statediff never stops a vLLM that did not ask for it (issue 32).

vLLM calls every ``vllm.general_plugins`` entry point in every process and does not catch what
it raises. Here statediff is broken as the wheel that left out ``statediff.audit`` broke it (a
finder makes the package unimportable, in the engine's process only): with no ``STATEDIFF_*``
variable set, a plain ``vllm.LLM`` program starts its engine on the tiny model and generates;
with ``STATEDIFF_TRACE`` set, loading the plugins as vLLM does stops the process with one line
and exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ENGINE_ENV

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

BREAK_AUDIT = """import importlib.abc, sys
class WithoutAudit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "statediff.audit" or name.startswith("statediff.audit."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, WithoutAudit())
"""

PLAIN_PROGRAM = BREAK_AUDIT + """import importlib.metadata, json
from statediff_hooks.vllm import entry
calls, register = [], entry.register
def counted():
    calls.append(1)
    register()
entry.register = counted  # what vLLM's plugin loader gets from the entry point
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, block_size=32, max_model_len=256, dtype="bfloat16",
          mamba_ssm_cache_dtype="float32")
out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=2, temperature=0),
                   use_tqdm=False)
plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
print("RESULT=" + json.dumps({"tokens": len(out[0].outputs[0].token_ids), "register_calls": len(calls),
                             "plugin": plugins.get("statediff"),
                             "statediff": sorted(m for m in sys.modules if m.partition(".")[0] == "statediff")}))
"""


def without_statediff_variables(**env: str) -> dict[str, str]:
    return {k: v for k, v in (os.environ | ENGINE_ENV).items() if not k.startswith("STATEDIFF_")} | env


def test_a_broken_statediff_does_not_stop_a_vllm_that_did_not_ask_for_it(tiny_model):
    r = subprocess.run([sys.executable, "-c", PLAIN_PROGRAM, str(tiny_model)], capture_output=True, text=True,
                       env=without_statediff_variables(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT=")]
    assert json.loads(line[len("RESULT="):]) == {
        "tokens": 2,  # the engine started and generated
        "register_calls": 1,  # vLLM found the entry point and called it
        "plugin": "statediff_hooks.vllm.entry:register",
        # and it imported nothing of statediff but the known-bug check's data (issue 35), which reads the config
        "statediff": ["statediff", "statediff.enginebugs"],
    }


def test_a_broken_statediff_asked_to_record_stops_with_one_line_and_exit_2(tmp_path):
    code = BREAK_AUDIT + "from vllm.plugins import load_general_plugins\nload_general_plugins()\nprint('vLLM went on')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=without_statediff_variables(STATEDIFF_TRACE=str(tmp_path / "t.h5")))
    assert (r.returncode, r.stdout) == (2, ""), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if "statediff" in ln] == [
        "statediff: error: STATEDIFF_TRACE is set, but statediff cannot start in this vLLM process: "
        "ModuleNotFoundError: No module named 'statediff.audit' (a broken install? STATEDIFF_DEBUG=1 shows the "
        "traceback; unset STATEDIFF_TRACE to run vLLM without statediff)"]
