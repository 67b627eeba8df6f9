"""Run one replay of the built-in conversation in this process and dump JSON.

Used by the vLLM tests in a subprocess (a fresh engine per run):
``python tests/vllm_driver.py MODEL OUT.json --mode hit [--trace T] [--exact] [--fault F]
[--logprobs K]``. Without --trace nothing is recorded (the plugin is not
installed; with --exact it only sets the scheduler's per-step budget): the
no-perturbation baseline.
"""

import argparse
import dataclasses
import json

import torch

from statediff_hooks.drivers.demo import demo_conversation
from statediff_hooks.vllm.replay import engine_kwargs, replay

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--mode", required=True)
    ap.add_argument("--trace")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--fault", default="")
    ap.add_argument("--logprobs", type=int, default=5)
    a = ap.parse_args()
    torch.set_flush_denormal(True)
    kw = engine_kwargs(a.model, block_size=32, max_model_len=4096, enforce_eager=True,
                       mamba_ssm_cache_dtype="float32")
    res = replay(demo_conversation(), kw, trace=a.trace, mode=a.mode, exact=a.exact,
                 fault=a.fault, overwrite=True, progress=False, logprobs=a.logprobs)
    with open(a.out, "w") as f:
        json.dump(dataclasses.asdict(res), f)
