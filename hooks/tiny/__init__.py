"""Built-in tiny models with random weights, fully offline, for tests and the demo: targets
(``model``: a Qwen3-Next hybrid and a dense Qwen2), drafters (``draft``: EAGLE-3 for vLLM, DFlash
for transformers), and where each lives by name (``catalog``: ``--model tiny``, built on first use)."""
