"""The vLLM adapter: one sub-package per model runner, shared modules beside them.

``entry`` is the ``vllm.general_plugins`` entry point vLLM calls in every process (it imports
the rest only when a ``STATEDIFF_*`` variable asks); ``plugin`` is the only module that patches
vLLM; ``surface`` names every vLLM internal the capture reaches (version check, patch points,
reads). ``v1/`` is the Model Runner V1 adapter, ``v2/`` the Model Runner V2 adapter (its reads in
``v2/surface.py``; the plugin picks the adapter by the runner vLLM starts); ``cpu/`` holds the
engine patches a CPU needs (``cpu/triton_interpreter``: V2's Triton kernels in Triton's
interpreter). Shared by runners: ``effective`` (what the started engine runs with),
``spec_state`` (drafter layer and conv-state helpers), ``replay`` (an in-process engine driven
through a conversation), ``limits`` (what vLLM accepts, checked before an engine starts) and
``log_lines`` (its log format).
"""
