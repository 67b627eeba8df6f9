"""The Model Runner V2 adapter (vLLM 0.32, ``vllm/v1/worker/gpu/model_runner.py`` and its CPU subclass
``vllm/v1/worker/cpu/model_runner.py``).

``surface`` (every V2 internal it reaches, by name: patch points and reads), ``capture`` (what to read
and when: the V1 capture's records, read where V2 keeps them), ``spec`` (drafter inputs and acceptance at
``speculator.propose``), ``faults`` (planted faults' targets in V2's device block tables). The scheduler
side (hit accounting, exact replay) is the runners' common ``..v1.group_hits`` and ``..v1.sched``.
"""
