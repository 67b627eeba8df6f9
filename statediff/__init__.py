"""statediff: record and diff inference-engine state around prefix-cache hits.

This package is the offline side (trace format, alignment, metrics, first
divergence, reports, CLI). It imports numpy, h5py, hdf5plugin, zstandard and
click only; never torch or vllm. The engine side lives in ``statediff_hooks``.
One pair's verdict (the hit trace's audit, the comparison, the record):
``statediff.check_pair(hit, cold)`` (``statediff.verdict``).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``statediff.check_pair`` and ``statediff.PairVerdict`` (``statediff.verdict``), imported on first
    use: ``import statediff`` stays light."""
    if name in ("check_pair", "PairVerdict"):
        from statediff import verdict

        return getattr(verdict, name)
    raise AttributeError(f"module 'statediff' has no attribute {name!r}")
