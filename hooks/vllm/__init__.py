"""vLLM capture: ``plugin`` (the only module that patches vLLM), one adapter
module per runner/version (``v1``: V1 runner, vLLM 0.32), and ``replay``."""
