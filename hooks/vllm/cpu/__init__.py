"""CPU engine patches: what an engine needs to run at all on a CPU (``triton_interpreter``: Model
Runner V2's Triton kernels in Triton's interpreter)."""
