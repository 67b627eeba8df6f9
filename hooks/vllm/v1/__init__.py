"""The Model Runner V1 adapter (vLLM 0.29-0.33, ``vllm/v1/worker/gpu_model_runner.py`` and its CPU
subclass ``vllm/v1/worker/cpu_model_runner.py``).

``capture`` (GDN state and K/V at hits and block boundaries, outputs), ``spec`` (drafter inputs,
acceptance), ``proposer`` (the rows the drafter model receives inside the proposer), ``faults``
(planted faults' targets), ``activations`` (opt-in hooks), ``sched`` (exact replay's scheduling),
``group_hits`` (each KV-cache group's final hit, read in the scheduler), ``tp`` (tensor parallel
ranks and shard layouts). Each reads vLLM only through ``..surface``.
"""
