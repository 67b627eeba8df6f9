"""Engine side of ``statediff record --sweep-boundaries``.

``statediff.replay.sweep`` generates the replay from three numbers; this module
reads them from the engine and the model: the block size vLLM will really
use (``vllm.limits.actual_block_size``: hybrids raise the requested one),
the number of speculative tokens of ``speculative_config``, and the
vocabulary size from the model's ``config.json`` (special token ids listed
by its tokenizer files are never drawn).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.replay.sweep import Sweep, boundary_sweep, expected_hits

BUILTIN_NAME = "builtin:sweep-boundaries"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def model_vocab_size(model: str) -> int:
    """Vocabulary size of ``model`` (a directory's ``config.json``, else the HF config).

    Raises:
        StatediffError: no config, or no ``vocab_size`` in it (nor in ``text_config``).
    """
    cfg = _read_json(Path(model) / "config.json") if Path(model).is_dir() else None
    if cfg is None:
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model).to_dict()
        except Exception as e:  # noqa: BLE001 - any failure means: no readable config
            raise StatediffError(f"--sweep-boundaries: cannot read the config of model {model}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int) and c["vocab_size"] > 0:
            return int(c["vocab_size"])
    raise StatediffError(f"--sweep-boundaries: the config of model {model} has no vocab_size")


def special_token_ids(model: str) -> set[int]:
    """Ids of special/added tokens listed in a model directory's tokenizer files (empty if none)."""
    out: set[int] = set()
    tok = _read_json(Path(model) / "tokenizer.json")
    if isinstance(tok, dict):
        for t in tok.get("added_tokens") or []:
            if isinstance(t, dict) and t.get("special") and isinstance(t.get("id"), int):
                out.add(t["id"])
    cfg = _read_json(Path(model) / "tokenizer_config.json")
    if isinstance(cfg, dict) and isinstance(cfg.get("added_tokens_decoder"), dict):
        for k, t in cfg["added_tokens_decoder"].items():
            if isinstance(t, dict) and t.get("special") and str(k).isdigit():
                out.add(int(k))
    return out


def engine_sweep(kw: dict, *, blocks: int = 2, max_tokens: int = 16, seed: int = 0) -> Sweep:
    """The boundary sweep for the engine ``vllm.LLM(**kw)`` would start.

    Args:
        kw: ``vllm.LLM`` keyword arguments (``replay.engine_kwargs`` plus
            ``speculative_config``); nothing is started.
        blocks: boundaries to straddle (``2B .. (blocks + 1)B``).
        max_tokens: output tokens per request.
        seed: seed of the token draw.

    Raises:
        StatediffError: unreadable model config, or parameters that cannot make a sweep.
    """
    from ..vllm.limits import actual_block_size

    spec = kw.get("speculative_config")
    k = int(spec.get("num_speculative_tokens") or 0) if isinstance(spec, dict) else 0
    model = str(kw["model"])
    try:
        block = actual_block_size(kw)
    except Exception as e:  # noqa: BLE001 - vLLM raises many types for bad engine arguments
        raise StatediffError(f"--sweep-boundaries: cannot size the engine's blocks: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return boundary_sweep(block, model_vocab_size(model), num_speculative_tokens=k, blocks=blocks,
                          max_tokens=max_tokens, seed=seed, exclude=special_token_ids(model))


def summary(sweep: Sweep, hits: list[int], mode: str, engine_block: int | None = None) -> list[str]:
    """Lines ``statediff record`` prints after a sweep: lengths, expected vs measured hits.

    ``mode`` "cold" expects no hit at all (a unique cache_salt per request). ``engine_block``: the
    block size the started engine runs with (the run's ``block_size``); where it is not the one the
    sweep was sized for (read before the engine starts: a hybrid's raise at engine start, and in
    vLLM 0.33 its rounding up to the mamba prefill-checkpoint alignment, are not applied then) the
    expected hits are those of the engine's block size, and a line says so.
    """
    cold = mode == "cold"
    lines = [f"  sweep (block size {sweep.block_size}, {sweep.num_speculative_tokens} speculative tokens): "
             + ", ".join(f"{r.label}={r.length}" for r in sweep.requests)]
    if engine_block and engine_block != sweep.block_size:
        sized = sweep.block_size
        want = expected_hits(sweep.lengths, engine_block)
        sweep = dataclasses.replace(sweep, block_size=engine_block, requests=[
            dataclasses.replace(r, expected_hit=w) for r, w in zip(sweep.requests, want)])
        lines.append(f"  the engine runs with block size {engine_block}, not the {sized} the sweep was sized "
                     "for (raised at engine start): expected hits are those of its block size")
    lines.append(f"  expected hit tokens per request:     {[0] * len(hits) if cold else sweep.expected_hits}")
    bad = sweep.check(hits, cold=cold)
    lines += [f"  UNEXPECTED HIT: {b}" for b in bad] or ["  every request hit as expected"]
    return lines
