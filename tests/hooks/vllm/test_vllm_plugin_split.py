"""A deployment's own recording judged exactly (issue 19): an LLM(...) program recorded through the
plugin (STATEDIFF_TRACE, no statediff code in it), then `statediff record --mode cold --exact-split
--split-like PROGRAM.h5` (no conversation file: the trace's own prompts), compared bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from statediff.trace import open_trace

from conftest import ENGINE_ENV, PIN, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

PROGRAM = """from vllm import LLM, SamplingParams
def main():
    llm = LLM(model={model!r}, enable_prefix_caching=True, enforce_eager=True, block_size=32,
              max_model_len=2048, dtype='bfloat16', mamba_ssm_cache_dtype='float32')
    base = list(range(3, 200))
    for n in (0, 60, 100):
        o = llm.generate([{{'prompt_token_ids': base + list(range(300, 305 + n))}}],
                         SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
        print('cached', o.num_cached_tokens)
if __name__ == '__main__':
    main()
"""


def test_a_plugin_trace_gets_a_cold_run_shaped_like_it(tmp_path, tiny_model):
    script = tmp_path / "served.py"
    script.write_text(PROGRAM.format(model=str(tiny_model)))
    served = tmp_path / "served.h5"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env=os.environ | ENGINE_ENV | {"STATEDIFF_TRACE": str(served)})
    assert r.returncode == 0, r.stderr[-3000:]
    cold = tmp_path / "cold.h5"
    r = run_cli("record", "--model", str(tiny_model), "--block-size", "32", *PIN, "--max-model-len", "2048",
                "--enforce-eager", "--mode", "cold", "--exact-split", "--split-like", str(served),
                "-o", str(cold), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    with open_trace(served) as h, open_trace(cold) as c:
        assert (h.run["mode"], h.run["replay"]) == (None, None)
        assert [h.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 192, 256]
        assert c.run["exact_form"] == "split" and c.run["split_plan"]["1"] == [192, 256]
        assert [c.requests[i]["prompt_token_ids"] for i in range(3)] == [h.requests[i]["prompt_token_ids"]
                                                                         for i in range(3)]
    r = run_cli("compare", "--json", str(served), str(cold))
    out = json.loads(r.stdout)
    assert (r.returncode, out["verdict"], out["roots"]) == (0, "same", []), r.stdout[-3000:]
    assert out["tolerance_policy"] == "exact: bit identity (both traces replay=exact)"
    assert out["identical"] == out["pairs"] > 0
