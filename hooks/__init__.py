"""statediff_hooks: the engine side of statediff (torch, vLLM, transformers).

Installed under this unique import name from the repository's ``hooks/``
directory. It depends on ``statediff`` (trace writer, conversation files,
compare); ``statediff`` never imports it. Map (``docs/architecture.md``):

- ``recording``: one recording, options to result (``statediff record``);
  ``precheck``: what is checked before an engine starts; ``refocus``: focused
  re-records; ``provenance``: the stored command line.
- ``recorder`` (+ ``recorder_config``, ``digest``, ``keep``): tensors in, trace
  records out, the only owner of a trace writer; ``faults``: planted faults;
  ``shared``: what every adapter records alike; ``enginelog``: the terminal
  while an engine runs.
- ``vllm/``: the vLLM adapter (plugin, capture, replay, the vLLM surface);
  ``transformers/``: the transformers adapter; ``tiny/``: built-in tiny
  models; ``drivers/``: ablation, sweeps, the built-in conversation;
  ``cli/``: the engine-side commands.
"""
