"""statediff_hooks: the engine side of statediff (torch, vLLM, transformers).

Installed under this unique import name from the repository's ``hooks/``
directory. It depends on ``statediff`` (trace writer, conversation files);
``statediff`` never imports it.
"""
