"""The vLLM adapter: one sub-package per model runner, shared modules beside them.

``plugin`` is the only module that patches vLLM (loaded by vLLM in every process through the
``vllm.general_plugins`` entry point); ``surface`` names every vLLM internal the capture reaches
(version check, patch points, reads). ``v1/`` is the Model Runner V1 adapter; ``cpu/`` holds the
engine patches a CPU needs. Shared by runners: ``effective`` (what the started engine runs with),
``spec_state`` (drafter layer and conv-state helpers), ``replay`` (an in-process engine driven
through a conversation), ``limits`` (what vLLM accepts, checked before an engine starts) and
``log_lines`` (its log format).
"""
