"""One replay of the built-in conversation on ``tiny-tp`` at tensor parallel size 1 or 2, recording or
not (issue 20: the recording overhead at TP=2 against TP=1).

Each call is one fresh engine in this process (its ranks' workers in their own processes); time
whole calls from outside, side by side (A B A B ...), and read the replay time it prints:

    .venv/bin/python benchmarks/bench_tp.py --tp 2 [--trace OUT.h5]

Cold mode, exact replay (one block per step), block size 64 at both sizes (TP=2 raises 32 to 64),
SSM state pinned to float32, eager mode; with ``--trace`` the keep policy is ``none`` (digests and
summaries only: the capture and the digests without the data writes). Prints one line
``RESULT {"tp", "trace", "replay_s", "total_s"}``: ``replay_s`` counts the requests only,
``total_s`` also the engine start and (recording) the wait for every rank's trace.
"""

from __future__ import annotations

import argparse
import json
import os

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, choices=(1, 2), required=True)
    ap.add_argument("--trace", help="record to this trace (keep policy none); omitted: no recording")
    args = ap.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import torch

    from statediff_hooks.drivers.demo import demo_conversation
    from statediff_hooks.recording.keep import KeepSpec
    from statediff_hooks.tiny.catalog import resolve_model
    from statediff_hooks.vllm.replay import engine_kwargs, replay

    torch.set_flush_denormal(True)
    extra = {}
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # as record sets it on 2 cores
        extra["tensor_parallel_size"] = 2
    kw = engine_kwargs(resolve_model("tiny-tp"), block_size=64, max_model_len=4096, enforce_eager=True,
                       mamba_ssm_cache_dtype="float32", extra=extra)
    res = replay(demo_conversation(), kw, trace=args.trace, mode="cold", exact=True, overwrite=True,
                 progress=False, keep=KeepSpec("none") if args.trace else None)
    print("RESULT " + json.dumps({"tp": args.tp, "trace": bool(args.trace), "replay_s": round(res.replay_seconds, 3),
                                  "total_s": round(res.seconds, 3)}))


if __name__ == "__main__":  # the ranks' workers are spawned: they import this module again
    main()
