"""The built-in tiny models by name: where each lives, built on first use.

``statediff record --model tiny`` (and ``tiny-dense``, ``tiny-eagle3`` in a
``--speculative-config``, ``--drafter dflash``) and ``statediff
build-tiny-model`` name these; the builders are ``tiny.model`` (targets) and
``tiny.draft`` (drafters). They live in ``$STATEDIFF_HOME`` (default
``~/.cache/statediff``), one directory per kind and seed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from statediff.errors import StatediffError

#: ``--model`` names of the built-in models and the kind each builds.
TINY = "tiny"
TINY_DENSE = "tiny-dense"
TINY_EAGLE3 = "tiny-eagle3"
TINY_MTP = "tiny-mtp"  # the tiny hybrid with an MTP head whose drafts are accepted (tiny/mtp.py)
TINY_TP = "tiny-tp"  # the tiny hybrid with 2+ heads of every kind: --tensor-parallel-size 2
TINY_FP8 = "tiny-fp8"  # the tiny hybrid as a compressed-tensors FP8_DYNAMIC target (tiny/formats.py)
TINY_NVFP4 = "tiny-nvfp4"  # the tiny hybrid as a compressed-tensors NVFP4 (W4A4) target
TINY_MTP_FP8 = "tiny-mtp-fp8"  # tiny-mtp with its target FP8_DYNAMIC, the MTP head bf16
TINY_MTP_NVFP4 = "tiny-mtp-nvfp4"  # tiny-mtp with its target NVFP4, the MTP head bf16
KINDS = {TINY: "hybrid", TINY_DENSE: "dense", TINY_EAGLE3: "eagle3", TINY_MTP: "mtp", TINY_TP: "tp",
         TINY_FP8: "hybrid-fp8", TINY_NVFP4: "hybrid-nvfp4", TINY_MTP_FP8: "mtp-fp8", TINY_MTP_NVFP4: "mtp-nvfp4"}
_DIRS = {"hybrid": "tiny-qwen3next", "dense": "tiny-qwen2", "eagle3": "tiny-eagle3-for-qwen2",
         "mtp": "tiny-qwen3next-mtp", "tp": "tiny-qwen3next-tp", "dflash": "tiny-dflash-context-for-qwen3next-mtp",
         "dflash-own-group": "tiny-dflash-context-hd64-for-qwen3next-mtp",
         "dflash-sliding": "tiny-dflash-context-swa-for-qwen3next-mtp",
         "dflash-anchor-only": "tiny-dflash-anchor-only-for-qwen3next-mtp",
         "dflash2": "tiny-dflash2-context-for-qwen3next-mtp", "dspark": "tiny-dspark-context-for-qwen3next-mtp",
         "hybrid-fp8": "tiny-qwen3next-fp8", "hybrid-nvfp4": "tiny-qwen3next-nvfp4",
         "mtp-fp8": "tiny-qwen3next-mtp-fp8", "mtp-nvfp4": "tiny-qwen3next-mtp-nvfp4"}


#: The context-reading DFlash drafters (``tiny/dflash_context.py``) by kind: their builder's options.
DFLASH_CONTEXT_KINDS = {"dflash": {}, "dflash-own-group": {"head_dim": 64},
                        "dflash-sliding": {"sliding_window": 64}, "dflash2": {"variant": "dflash2"},
                        "dspark": {"variant": "dspark"}}


def home() -> Path:
    """Where built-in models are cached: ``$STATEDIFF_HOME``, else ``~/.cache/statediff``."""
    return Path(os.environ.get("STATEDIFF_HOME") or Path.home() / ".cache" / "statediff")


def tiny_model_dir(seed: int = 0, kind: str = "hybrid") -> Path:
    """Where a built-in tiny model lives.

    ``kind``: "hybrid" (Qwen3-Next), "dense" (Qwen2), "eagle3" (the drafter for "dense") or
    "mtp" (the hybrid with an MTP head whose drafts are accepted), "dflash" (vLLM's DFlash
    drafter for "mtp" whose drafts are read from its context K/V, built to be accepted:
    ``tiny/dflash_context.py``; "dflash-own-group" with 4 KV heads of 64, "dflash-sliding" with a
    sliding window; "dflash2" / "dspark" the Model Runner V2 variants), "dflash-anchor-only" (the DFlash drafter that copies the anchor and gives its
    context no attention: ``tiny/dflash.py``), "tp" (the hybrid with 2 heads
    of every kind, for ``--tensor-parallel-size 2``) or "hybrid-fp8" / "hybrid-nvfp4" (the hybrid
    as a compressed-tensors FP8_DYNAMIC / NVFP4 target, routed experts bf16: ``tiny/formats.py``),
    "mtp-fp8" / "mtp-nvfp4" (the "mtp" hybrid so, its MTP head bf16).
    """
    return home() / f"{_DIRS[kind]}-seed{seed}"


def build_tiny(kind: str, out: str | Path | None = None, seed: int = 0, *, target: str | None = None,
               overwrite: bool = False) -> Path:
    """Build (or reuse) a built-in tiny model of ``kind``; the eagle3 drafter's target
    defaults to the built-in dense model, the dflash drafter's to the built-in MTP hybrid.

    Raises:
        FileExistsError: ``out`` is non-empty and holds something else.
        FileNotFoundError: an eagle3 ``target`` without ``config.json``.
        ValueError: a bad target for the drafter.
    """
    from .model import build_tiny_dense_model, build_tiny_model

    out = out or tiny_model_dir(seed, kind)
    if kind == "hybrid":
        return build_tiny_model(out, seed=seed, overwrite=overwrite)
    if kind == "dense":
        return build_tiny_dense_model(out, seed, overwrite=overwrite)
    if kind == "tp":
        from .model import build_tiny_tp_model

        return build_tiny_tp_model(out, seed=seed, overwrite=overwrite)
    if kind in ("hybrid-fp8", "hybrid-nvfp4", "mtp-fp8", "mtp-nvfp4"):
        from .formats import build_tiny_quantized_model

        base, fmt = kind.split("-")
        return build_tiny_quantized_model(out, fmt, seed=seed, overwrite=overwrite, mtp=base == "mtp")
    if kind == "mtp":
        from .mtp import build_tiny_mtp_model

        return build_tiny_mtp_model(out, seed=seed, overwrite=overwrite)
    if kind == "dflash-anchor-only":
        from .dflash import build_tiny_vllm_dflash

        return build_tiny_vllm_dflash(out, target or build_tiny("mtp", seed=seed), seed, overwrite=overwrite)
    if kind in DFLASH_CONTEXT_KINDS:
        from .dflash_context import build_tiny_vllm_dflash_context

        return build_tiny_vllm_dflash_context(out, target or build_tiny("mtp", seed=seed), seed, overwrite=overwrite,
                                              **DFLASH_CONTEXT_KINDS[kind])
    from .draft import build_tiny_eagle3

    return build_tiny_eagle3(out, target or build_tiny("dense", seed=seed), seed, overwrite=overwrite)


def resolve_model(model: str, seed: int = 0) -> str:
    """``tiny`` / ``tiny-dense`` / ``tiny-eagle3`` / ``tiny-mtp`` / ``tiny-tp`` / ``tiny-fp8`` /
    ``tiny-nvfp4`` / ``tiny-mtp-fp8`` / ``tiny-mtp-nvfp4`` -> the built-in model's directory
    (built on first use); anything else unchanged."""
    kind = KINDS.get(model)
    return model if kind is None else str(build_tiny(kind, seed=seed))


def tiny_dflash_for(model_dir: str, seed: int = 0) -> Path:
    """The tiny random DFlash drafter of a local target directory, built on first use
    (``--drafter dflash``), named by the target's ``config.json`` digest and the seed.

    Raises:
        StatediffError: ``model_dir`` is not a local model directory.
    """
    from .draft import build_tiny_dflash

    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        raise StatediffError(f"--drafter dflash builds a tiny drafter from the target's config.json, "
                             f"and {model_dir} is not a local model directory")
    out = home() / f"tiny-dflash-{hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]}-seed{seed}"
    return build_tiny_dflash(out, model_dir, seed)
