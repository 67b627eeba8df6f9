"""Run ``statediff ARGS...`` in this process with an engine error planted at request N (tests only).

``python tests/plant_engine_error.py N record CONV.jsonl ...``: the model
runner's ``execute_model`` raises ``RuntimeError`` in the first engine step
that schedules request N (0-based, in replay order), inside the engine
core, after statediff's capture registered the request: an engine failure
in the middle of a replay, as an out-of-range input or a kernel error
would cause.
"""

import sys

from statediff_hooks.vllm import plugin


def _plant(n: int) -> None:
    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    if getattr(runner.execute_model, "_planted", False):
        return
    orig = runner.execute_model
    scheduled = [0]

    def execute_model(self, scheduler_output, *a, **kw):
        scheduled[0] += len(scheduler_output.scheduled_new_reqs)
        if scheduled[0] > n:
            raise RuntimeError(f"planted engine error at request {n}")
        return orig(self, scheduler_output, *a, **kw)

    execute_model._planted = True
    runner.execute_model = execute_model


if __name__ == "__main__":
    n = int(sys.argv[1])
    register = plugin.register

    def register_with_error() -> None:  # vLLM is imported only when the replay starts the engine
        _plant(n)
        register()

    plugin.register = register_with_error
    from statediff.cli import main

    sys.argv = ["statediff", *sys.argv[2:]]
    main()
