"""The vLLM adapter (vLLM 0.32, V1 model runner).

``entry`` is what vLLM calls in every process (the ``vllm.general_plugins``
entry point: it imports the rest only when a ``STATEDIFF_*`` variable asks);
``plugin`` is the only module that patches vLLM; ``surface`` names every
vLLM internal the capture reaches (version check, patch points, reads);
the capture modules decide what to read and when: ``v1`` (GDN state and
K/V at hits and block boundaries, outputs), ``spec_v1`` (drafter inputs,
acceptance), ``faults_v1`` (planted faults' targets), ``activations_v1``
(opt-in hooks), ``effective`` (what the started engine runs with),
``sched_v1`` (exact replay's scheduling). ``replay`` drives an in-process
engine through a conversation; ``limits`` (what vLLM accepts, checked
before an engine starts) and ``log_lines`` (its log format) are vLLM 0.32
facts the other modules use.
"""
