"""Root versus propagated divergences.

Divergent pairs arrive in causal order (request, position, layer, kind).
The first is a root. A later divergence is *propagated* when an earlier
divergence explains it:

1. same request: an earlier divergence of the same request (an earlier
   position, or the same position and an earlier layer/kind) explains every
   later one of that request;
2. prefix cache: a divergence in request r at position q, the first of r,
   is explained by an earlier request r' whose first divergence sits at f'
   when the cache could have carried r''s corrupted state to r:
   ``f' < q`` (``f' <= q`` when r''s first divergent tensor was one it
   computed itself, a checkpoint or KV block, rather than a resumed state it
   read), and ``q <= shared``, where ``shared`` is the number of leading
   tokens r's prompt shares with r''s prompt + output (when both token
   lists are recorded; otherwise r''s total token count, when known).

Anything else is another root. Every propagated divergence is attributed
to the root of the divergence that explains it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Protocol


class Divergent(Protocol):
    request: int
    position: int
    role_hit: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Classification of one divergence.

    Attributes:
        root: not explained by any earlier divergence.
        root_index: index (into the input list) of the root it is attributed
            to; its own index for a root.
        via: "" for a root, "same request", or "prefix cache from request N".
    """

    root: bool
    root_index: int
    via: str


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` have in common."""
    return len(os.path.commonprefix([list(a), list(b)]))


def _reach(request: dict | None, earlier: dict | None) -> float:
    """Largest position of ``request`` the cache could fill from ``earlier``."""
    request, earlier = request or {}, earlier or {}
    mine = request.get("prompt_token_ids") or []
    prompt = list(earlier.get("prompt_token_ids") or [])
    outputs = list(earlier.get("output_token_ids") or [])
    if mine and prompt:
        return shared_prefix(mine, prompt + outputs)
    total = earlier.get("prompt_len")
    return total + len(outputs) if isinstance(total, int) else float("inf")


def classify(divs: Sequence[Divergent], requests: dict[int, dict]) -> list[Verdict]:
    """Root / propagated verdict of each divergence (see the module docstring).

    Args:
        divs: divergences in causal order; each has ``request``,
            ``position`` and ``role_hit`` (role of the hit-side tensor).
        requests: request records of the hit trace, by request index (for
            token ids / lengths; may be empty).
    """
    first: dict[int, tuple[int, int, str]] = {}  # request -> (index, position, role)
    out: list[Verdict] = []
    for i, d in enumerate(divs):
        if d.request in first:
            out.append(Verdict(False, out[first[d.request][0]].root_index, "same request"))
            continue
        verdict = Verdict(True, i, "")
        for r, (j, f, role) in first.items():
            if r >= d.request:
                continue
            after = d.position > f if role == "resumed" else d.position >= f
            if after and d.position <= _reach(requests.get(d.request), requests.get(r)):
                verdict = Verdict(False, out[j].root_index, f"prefix cache from request {r}")
                break
        first[d.request] = (i, d.position, d.role_hit)
        out.append(verdict)
    return out
