"""statediff_hooks: the engine side of statediff (torch, vLLM, transformers).

Installed under this unique import name from the repository's ``hooks/``
directory. It depends on ``statediff`` (trace writer, conversation files,
compare); ``statediff`` never imports it. Imports inside this package are
relative. Map (``docs/architecture.md``):

- ``recording/``: the engine-agnostic recording side (options to result,
  prechecks, the recorder and its digest and keep policy, planted faults).
- ``vllm/``: the vLLM adapter (plugin, surface, one sub-package per model
  runner, CPU engine patches, replay driver); ``transformers/``: the
  transformers adapter.
- ``tiny/``: built-in tiny models; ``drivers/``: check, ablation, sweeps, the
  built-in conversation; ``cli/``: the engine-side commands.
"""
