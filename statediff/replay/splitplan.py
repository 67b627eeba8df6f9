"""Exact replay, split form: where a cold run must split each prefill so that
every state it computes went through the same chunk boundaries as in the hit run.

A hit run's state at token ``p`` of request ``r`` was computed in pieces:
``r`` itself computed ``(h_r, p]`` in the chunks the trace records, and the
state it resumed from at its hit ``h_r`` was computed by an earlier request
``r'`` (the first one that checkpointed ``h_r`` with the same tokens), in
``r'``'s chunks, resuming from ``r'``'s own hit, and so on. A cold run that
prefills ``r`` from token 0 reproduces those numerics bit for bit only if it
splits at all of those chunk ends (chunked GDN and conv kernels are not
split-invariant). ``cold_splits`` computes them from the hit trace.

One limit remains: if an ancestor computed tokens by *decode* (its own
output tokens re-used as a later prompt), a cold prefill of the same tokens
still differs; ``cold_splits`` reports those positions.
"""

from __future__ import annotations

from statediff.errors import StatediffError


def _tokens(rec: dict) -> list[int]:
    return list(rec.get("prompt_token_ids") or []) + list(rec.get("output_token_ids") or [])


def _ends(rec: dict) -> list[int]:
    return [int(e) for _s, e in rec.get("chunks") or []]


def ancestor(requests: dict[int, dict], r: int, h: int) -> int:
    """Earliest request before ``r`` that checkpointed position ``h`` with ``r``'s tokens; failing
    that, the earliest that computed position ``h`` inside one of its chunks.

    A hit on attention blocks alone (a dense target, or a hidden-state drafter's hit one block
    short of the prompt's last full block: the EAGLE last-block drop) resumes at a block boundary
    that need not be a chunk end: the K/V of ``[0, h)`` were computed inside a longer chunk. The
    cold run then splits at ``h`` (the hit request computes from there) and at the ancestor's
    chunk ends below ``h``. A GDN state cannot resume inside a chunk (its checkpoints are chunk ends
    in vLLM's ``align`` mode), so a chunk end is preferred.

    Raises:
        StatediffError: no recorded request computed that position (the hit came
            from blocks cached before the recording started).
    """
    want = _tokens(requests[r])[:h]
    earlier = [q for q in sorted(requests) if q < r and _tokens(requests[q])[:h] == want]
    for q in earlier:
        if h in _ends(requests[q]):
            return q
    for q in earlier:
        if any(int(s) < h < int(e) for s, e in requests[q].get("chunks") or []):
            return q
    raise StatediffError(
        f"request {r} resumed at token {h}, but no earlier request in the hit trace computed "
        "that boundary: record the hit run on a fresh engine"
    )


def history(requests: dict[int, dict], r: int, upto: int) -> set[int]:
    """Chunk ends through which the hit run's state of request ``r`` at ``upto`` was computed."""
    rec = requests[r]
    hit = int(rec.get("num_cached_tokens") or 0)
    ends = {e for e in _ends(rec) if hit < e <= upto}
    if hit > 0:
        ends.add(hit)
        ends |= history(requests, ancestor(requests, r, hit), hit)
    return ends


def cold_splits(requests: dict[int, dict]) -> dict[int, list[int]]:
    """Prefill split points (token counts) per request for the cold run.

    Args:
        requests: the hit trace's request records (``Trace.requests``): token
            ids, ``num_cached_tokens`` and the ``chunks`` each request ran with.

    Returns:
        {request index: sorted chunk ends strictly inside its prompt}.
    """
    plan = {}
    for r, rec in sorted(requests.items()):
        prompt_len = len(rec.get("prompt_token_ids") or [])
        plan[r] = sorted(e for e in history(requests, r, prompt_len) if 0 < e < prompt_len)
    return plan


def decode_filled(requests: dict[int, dict]) -> dict[int, list[int]]:
    """Per request, hit boundaries whose state an ancestor computed partly by decode.

    There a cold prefill cannot be bit-identical even in exact mode.
    """
    out: dict[int, list[int]] = {}
    for r, rec in sorted(requests.items()):
        hit = int(rec.get("num_cached_tokens") or 0)
        if hit <= 0:
            continue
        q = ancestor(requests, r, hit)
        if hit > len(requests[q].get("prompt_token_ids") or []):
            out.setdefault(r, []).append(hit)
    return out
