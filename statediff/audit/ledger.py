"""What one run wrote into its cache blocks, and which token prefix each write holds.

The audit's ground truth inside one trace: every ``checkpoint`` (a GDN
conv/SSM state the engine saved into a block at a block boundary) and every
``kv_block`` (the K or V rows of a KV-cache block when its tokens were
computed) is a *write*: (layer, kind, physical block, step) -> the digest of
what the block held right after that step. A restore (role ``resumed``) must
read exactly what was last written into the block it restores from.

Digests: a version-3 trace summarises every tensor (``/digests``: an exact
128-bit digest, with or without data); older traces have the index's
fingerprint hash of each stored tensor. Both are exact over the storage
bytes, but they are different functions, so a digest is compared only with
one of the same ``scheme``.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from statediff.trace.schema import DigestEntry, TensorEntry

#: Roles that write into a cache block (the audit's ground truth).
WRITE_ROLES = ("checkpoint", "kv_block")


@dataclasses.dataclass(frozen=True)
class Rec:
    """One captured tensor as the audit sees it: its key, where it was read, and its digest.

    Attributes:
        request, position, token_start, layer, kind, role, module: as in ``/index``
            (a K/V block covers tokens ``[token_start, position)``; a state has
            ``token_start == position``).
        step: engine step that read it (-1: unknown).
        block: physical cache block it was read from (-1: unknown).
        digest: exact digest of its storage bytes (32 hex digits).
        scheme: "digest" (a ``/digests`` row) or "hash" (the index fingerprint of an
            older trace); digests of different schemes are never compared.
        digest_bf16: digest of the tensor rounded to bfloat16 (float32 tensors of a
            version-3 trace), else "".
        zero: every element is 0 (None: unknown).
        nonfinite: NaN + Inf elements (-1: unknown).
        prefix: live audit only: a hash of the token prefix (and cache_salt) the tensor
            summarises, "" when unknown (``statediff.audit.live``).
        origin: live audit only: the engine's request id of ``request``.
    """

    request: int
    position: int
    token_start: int
    layer: int
    kind: str
    role: str
    module: str
    step: int
    block: int
    digest: str
    scheme: str
    digest_bf16: str = ""
    zero: bool | None = None
    nonfinite: int = -1
    prefix: str = ""
    origin: str = ""

    @property
    def is_state(self) -> bool:
        return self.kind.startswith("gdn.")

    def span(self) -> str:
        """"position P" for a state, "tokens [a, b)" for a K/V block."""
        return f"position {self.position}" if self.is_state else f"tokens [{self.token_start}, {self.position})"


def rec_from(e: TensorEntry | DigestEntry) -> Rec:
    """The audit's view of an index entry (with data) or a digest-only row."""
    s = e.summary
    key = dict(request=e.request, position=e.position, token_start=e.token_start, layer=e.layer,
               kind=e.kind, role=e.role, module=e.module, step=e.step, block=e.block)
    if s is not None:
        return rec_from_summary(s, **key)
    if isinstance(e, DigestEntry):  # a version-2 row: the digest alone
        return Rec(**key, digest=e.digest, scheme="digest")
    zero = e.n_nan == 0 and e.n_inf == 0 and e.sumsq == 0.0
    return Rec(**key, digest=e.hash, scheme="hash", zero=zero, nonfinite=e.n_nan + e.n_inf)


def rec_from_summary(s: Any, **key: Any) -> Rec:
    """The audit's view of one tensor's ``Summary`` (``statediff.trace.summary``) under ``key``
    (the ``Rec`` fields before ``digest``, and optionally ``prefix``, ``origin``)."""
    return Rec(**key, digest=s.digest, scheme="digest", digest_bf16=s.digest_bf16,
               zero=s.is_zero if s.known_moments else None,
               nonfinite=s.n_nan + s.n_inf if s.n_nan >= 0 and s.n_inf >= 0 else -1)


class Streams:
    """Token streams of a trace's requests: what each request's cache blocks summarise.

    A request's stream is its prompt then its sampled tokens; its state or K/V at
    position ``p`` summarises ``stream[:p]``. Two requests share a cached prefix of
    ``n`` tokens when those tokens and their ``cache_salt`` agree.
    """

    def __init__(self, requests: dict[int, dict[str, Any]]) -> None:
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.stream: dict[int, tuple[int, ...]] = {}
        self.salt: dict[int, Any] = {}
        self._common: dict[tuple[int, int], int] = {}
        for i, r in requests.items():
            p = tuple(int(x) for x in (r.get("prompt_token_ids") if r.get("prompt_token_ids") is not None else ()))
            o = tuple(int(x) for x in (r.get("output_token_ids") if r.get("output_token_ids") is not None else ()))
            self.prompt[i], self.stream[i], self.salt[i] = p, p + o, r.get("cache_salt")

    def same_prefix(self, a: int, b: int, n: int) -> bool:
        """Requests ``a`` and ``b`` hold the same first ``n`` tokens (and the same cache_salt)."""
        if a not in self.stream or b not in self.stream or self.salt[a] != self.salt[b]:
            return False
        return self.common(a, b) >= n

    def common(self, a: int, b: int) -> int:
        """Length of the longest common prefix of the two streams (tokens; computed once per pair)."""
        key = (a, b) if a <= b else (b, a)
        got = self._common.get(key)
        if got is None:
            sa, sb = self.stream[a], self.stream[b]
            n = min(len(sa), len(sb))
            diff = np.flatnonzero(np.asarray(sa[:n], dtype=np.int64) != np.asarray(sb[:n], dtype=np.int64))
            got = self._common[key] = int(diff[0]) if diff.size else n
        return got


class Ledger:
    """Every write of one trace, by physical block and by content, in step order."""

    def __init__(self, recs: list[Rec]) -> None:
        writes = sorted((r for r in recs if r.role in WRITE_ROLES), key=lambda r: (r.step, r.request))
        self.by_block: dict[tuple, list[Rec]] = defaultdict(list)
        self.by_key: dict[tuple, list[Rec]] = defaultdict(list)
        self.by_digest: dict[tuple, list[Rec]] = defaultdict(list)
        for w in writes:
            if w.block >= 0:
                self.by_block[(w.layer, w.kind, w.block)].append(w)
            self.by_key[(w.layer, w.kind, w.position, w.token_start)].append(w)
            self.by_digest[(w.layer, w.kind, w.scheme, w.digest)].append(w)
        self._steps = {k: [w.step for w in v] for k, v in self.by_block.items()}

    def last_into(self, layer: int, kind: str, block: int, before: int) -> Rec | None:
        """The last write into ``block`` of ``layer``'s ``kind`` cache at a step before ``before``."""
        key = (layer, kind, block)
        steps = self._steps.get(key)
        if not steps:
            return None
        i = bisect.bisect_left(steps, before) if before >= 0 else len(steps)
        return self.by_block[key][i - 1] if i else None

    def matching(self, r: Rec, before: int) -> list[Rec]:
        """Writes (same layer and kind) whose digest equals ``r``'s, at steps before ``before``."""
        return [w for w in self.by_digest.get((r.layer, r.kind, r.scheme, r.digest), ())
                if before < 0 or w.step < before]

    def at(self, layer: int, kind: str, position: int, token_start: int, before: int) -> list[Rec]:
        """Writes of ``(layer, kind)`` covering exactly ``[token_start, position)``, before step ``before``."""
        return [w for w in self.by_key.get((layer, kind, position, token_start), ())
                if before < 0 or w.step < before]
