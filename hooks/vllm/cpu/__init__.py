"""Engine patches that make vLLM run on a CPU where its stock build cannot.

Each is recorded in the run field ``engine_patches`` and installed by ``..plugin`` only where it is
needed: ``mamba_align`` (torch stand-ins for the two Triton-only mamba align kernels),
``kernel_overrides_v030`` (0.31's kernel override registry backported to 0.29/0.30),
``gdn_ragged_fix`` (the opt-in ``--engine-fix gdn-ragged-drafts``), ``nvfp4`` (vLLM's NVFP4
emulation kernel registered for CPU), ``triton_interpreter`` (Model Runner V2: vLLM's own
Triton kernels in Triton's interpreter; ``triton_site/`` starts it in spawned engine processes).
"""
