"""The Model Runner V2 adapter (vLLM 0.32, ``v1/worker/gpu/``): ``surface`` (every V2 internal it reaches,
by name), ``capture`` (what to read and when: the V1 capture's records, read where V2 keeps them),
``faults`` (planted faults' targets in V2's state)."""
