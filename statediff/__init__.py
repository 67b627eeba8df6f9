"""statediff: record and diff inference-engine state around prefix-cache hits.

This package is the offline side (trace format, alignment, metrics, first
divergence, reports, CLI). It imports numpy, h5py, hdf5plugin, zstandard and
click only; never torch or vllm. The engine side lives in ``statediff_hooks``.
"""

__version__ = "0.1.0"
