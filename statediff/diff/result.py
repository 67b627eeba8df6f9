"""Result records of ``compare``: one type serves text, JSON and tests.

``CompareResult.to_text()`` is the human report, ``to_json()`` the same
content as one JSON-safe dict (non-finite floats become the strings "inf",
"-inf", "nan"); ``exit_code`` is 0 (no divergence) or 1 (divergence).

Text layout: the diagnosis line first (when there is one), the verdict,
both traces, the tolerance policy, how the traces were paired, then each
root in full, the next divergences one line each, unpaired tensors and the
per-request table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from statediff.jsonutil import jsonable

from .diagnose import Diagnosis
from .metrics import PairMetrics
from .tolerance import Tolerance

MAX_UNPAIRED_LISTED = 5


def _g(x: float | None, spec: str = ".4g") -> str:
    return "?" if x is None else format(x, spec)


@dataclasses.dataclass
class TraceSide:
    """One compared trace: where it is and the run metadata a reader needs."""

    path: str
    partial: bool
    run: dict

    def to_text(self) -> str:
        r = self.run
        state = "partial" if self.partial else "complete"
        return (f"{self.path} [{state}] mode={r.get('mode') or 'unknown'} "
                f"replay={r.get('replay') or 'unknown'} engine={r.get('engine') or 'unknown'} "
                f"model={r.get('model') or 'unknown'}")

    def to_json(self) -> dict:
        keys = ("engine", "engine_version", "model", "mode", "replay", "block_size", "dtype")
        return {"path": self.path, "partial": self.partial} | {k: self.run.get(k) for k in keys}


@dataclasses.dataclass
class Divergence:
    """One pair beyond tolerance, with its root/propagated verdict.

    ``reason`` is "beyond tolerance", "NaN/Inf on one side only" or
    "dtype/shape differ" (then ``metrics`` is None). For a root,
    ``propagated`` counts the divergences attributed to it; for a propagated
    one, ``root_key`` names its root and ``via`` how it was carried.
    """

    request: int
    position: int
    layer: int
    module: str
    kind: str
    role_hit: str
    role_cold: str
    dtype: str
    shape: tuple[int, ...]
    layout_cold: str
    reason: str
    tolerance: Tolerance
    metrics: PairMetrics | None
    root: bool = True
    root_key: tuple | None = None
    via: str = ""
    propagated: int = 0
    propagated_same_request: int = 0

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.request, self.position, self.layer, self.kind)

    @property
    def noise_multiple(self) -> float | None:
        """max abs error / calibrated benign max abs error (None without a noise envelope)."""
        noise = self.tolerance.noise_max_abs
        if noise is None or self.metrics is None:
            return None
        return self.metrics.max_abs / noise if noise > 0 else (math.inf if self.metrics.max_abs else 0.0)

    def where(self) -> str:
        return f"request {self.request}, position {self.position}, layer {self.layer} ({self.module}), {self.kind}"

    def to_text(self) -> str:
        """Full multi-line description (used for roots)."""
        lines = [self.where(),
                 f"  roles: hit {self.role_hit}, cold {self.role_cold}; {self.dtype} {self.shape}; "
                 f"tolerance {self.tolerance.describe()}"]
        m = self.metrics
        if m is None:
            lines.append(f"  dtype/shape differ: hit {self.dtype} {self.shape}, cold {self.layout_cold}")
            return "\n".join(lines)
        if m.n_nonfinite:
            lines.append(f"  NaN/Inf on one side only: {m.n_nonfinite} element(s), first at index "
                         f"{m.first_nonfinite}: hit {_g(m.nonfinite_hit, '.7g')}, "
                         f"cold {_g(m.nonfinite_cold, '.7g')}")
        ulp = "" if m.worst_ulp is None else f" ({m.worst_ulp} ULP)"
        noise = self.noise_multiple
        noise_txt = "" if noise is None else (f" = {noise:.3g}x the noise floor "
                                              f"{self.tolerance.noise_max_abs:.3g}")
        if m.worst_index is None:
            lines.append("  max abs error 0 over the elements finite on both sides")
        else:
            lines.append(f"  max abs error {_g(m.max_abs)}{noise_txt} at index {m.worst_index}: "
                         f"hit {_g(m.hit_value, '.7g')}, cold {_g(m.cold_value, '.7g')}{ulp}")
        max_ulp = "" if m.max_ulp is None else f", max ULP distance {m.max_ulp}"
        lines.append(f"  relative L2 error {_g(m.rel_l2)}, cosine similarity {_g(m.cosine, '.6f')}, "
                     f"{m.n_beyond} of {m.numel} elements beyond tolerance{max_ulp}")
        return "\n".join(lines)

    def short(self) -> str:
        """One line (used for the next divergences)."""
        tag = "root" if self.root else f"propagated, {self.via}"
        head = f"request {self.request} position {self.position} layer {self.layer} {self.kind} [{tag}]"
        m = self.metrics
        if m is None:
            return f"{head} dtype/shape differ"
        nonfin = f" NaN/Inf one side {m.n_nonfinite}" if m.n_nonfinite else ""
        noise = "" if self.noise_multiple is None else f" ({self.noise_multiple:.3g}x noise)"
        return (f"{head} max abs {_g(m.max_abs)}{noise} rel L2 {_g(m.rel_l2)} cos {_g(m.cosine, '.4f')} "
                f"beyond {m.n_beyond}/{m.numel}{nonfin}")

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "request", "position", "layer", "module", "kind", "role_hit", "role_cold", "dtype",
            "shape", "layout_cold", "reason", "root", "root_key", "via", "propagated",
            "propagated_same_request")}
        d["tolerance"] = self.tolerance.to_json()
        d["metrics"] = None if self.metrics is None else self.metrics.to_json()
        d["noise_multiple"] = self.noise_multiple
        return d


@dataclasses.dataclass
class Unpaired:
    """Tensors without a counterpart: counts and the first few of each side."""

    hit_only: int = 0
    cold_only: int = 0
    skipped_by_hit: int = 0  # cold-only at positions <= the hit's cached length: expected
    first_hit_only: list[str] = dataclasses.field(default_factory=list)
    first_cold_only: list[str] = dataclasses.field(default_factory=list)  # unexpected ones

    def to_text(self) -> str:
        unexpected = self.cold_only - self.skipped_by_hit
        txt = (f"unpaired: {self.hit_only} hit-only; {self.cold_only} cold-only "
               f"({self.skipped_by_hit} below a hit boundary: skipped by the cache hit, expected; "
               f"{unexpected} other)")
        for label, items in (("hit-only", self.first_hit_only), ("cold-only", self.first_cold_only)):
            txt += "".join(f"\n  {label}: {s}" for s in items)
        return txt

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RequestRow:
    """One request on both sides: lengths, hit length, outputs, acceptance."""

    request: int
    prompt_len: tuple[int | None, int | None]
    cached: tuple[int | None, int | None]
    outputs_equal: bool | None
    first_output_diff: int | None
    outputs: str
    acceptance: tuple[dict | None, dict | None]

    def to_text(self) -> str:
        p = self.prompt_len[0] if self.prompt_len[0] == self.prompt_len[1] else \
            f"{self.prompt_len[0]}/{self.prompt_len[1]}"
        cached = "/".join("?" if c is None else str(c) for c in self.cached)
        acc = ""
        if any(self.acceptance):
            acc = "  acceptance hit " + "; cold ".join(
                "-" if a is None else " ".join(f"{k}={_acc(v)}" for k, v in sorted(a.items()))
                for a in self.acceptance)
        return f"  {self.request:>7}  {str(p):>6}  {cached:>15}  {self.outputs}{acc}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _acc(v: Any) -> str:
    return format(v, ".4g") if isinstance(v, float) else str(v)


@dataclasses.dataclass
class CompareResult:
    """Everything ``compare`` found; ``exit_code`` 1 when any pair diverged."""

    hit: TraceSide
    cold: TraceSide
    policy: str
    warnings: list[str]
    pairs: int
    identical: int
    divergences: list[Divergence]
    diagnoses: list[Diagnosis]
    unpaired: Unpaired
    requests: list[RequestRow]
    scores: list[tuple[int, int, int, str, float, int | None]] = dataclasses.field(repr=False, default_factory=list)
    max_listed: int = 10
    bit_identity: bool = False  # the policy expects bit identity (exact replay, no noise file)
    stopped_after: int | None = None  # pairs judged when compare stopped at the first divergence (--first)

    @property
    def stopped_early(self) -> bool:
        """compare stopped at the first divergence: later pairs were not judged, nothing after it counted."""
        return self.stopped_after is not None

    @property
    def exit_code(self) -> int:
        return 1 if self.divergences else 0

    @property
    def roots(self) -> list[Divergence]:
        return [d for d in self.divergences if d.root]

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def summary(self) -> str:
        n, roots = len(self.divergences), len(self.roots)
        if self.stopped_early:
            return (f"aligned by (request, position, layer, kind): {self.pairs} pairs; stopped early at the "
                    f"first divergence (--first) after judging {self.stopped_after} ({self.identical} "
                    f"bit-identical, {self.stopped_after - self.identical} read in full): later divergences, "
                    "propagated ones included, were not counted")
        return (f"aligned by (request, position, layer, kind): {self.pairs} pairs, {self.identical} "
                f"bit-identical, {self.pairs - self.identical} read in full; {n} divergent "
                f"({roots} root{'s' if roots != 1 else ''}, {n - roots} propagated)")

    def to_text(self) -> str:
        out = [d.text for d in self.diagnoses[:1]]
        first = self.first
        out.append("DIVERGED: first divergence at " + first.where() if first
                   else f"SAME: no divergence beyond tolerance in {self.pairs} pairs")
        out += [f"hit:  {self.hit.to_text()}", f"cold: {self.cold.to_text()}",
                f"tolerance: {self.policy}", self.summary()]
        out += [f"warning: {w}" for w in self.warnings]
        roots = self.roots
        for i, d in enumerate(roots, 1):
            later = d.propagated - d.propagated_same_request
            head = f"root {i} of {len(roots)}"
            if self.stopped_early:
                head = "first root (--first: later ones not searched)"
            out += ["", f"{head}: " + d.to_text(),
                    "  propagated from it: not counted (stopped early at the first divergence)"
                    if self.stopped_early else
                    f"  propagated from it: {d.propagated} divergent pairs ({d.propagated_same_request} "
                    f"in request {d.request}, {later} in later requests)"]
            out += [f"  {g.text}" for g in self.diagnoses[1:] if g.request == d.request
                    and (g.position, g.layer, g.kind) == (d.position, d.layer, d.kind)]
        rest = self.divergences[1:self.max_listed + 1]
        if rest:
            out += ["", f"next divergences ({len(self.divergences) - 1} more, first {len(rest)} listed):"]
            out += [f"  {d.short()}" for d in rest]
        out += ["", self.unpaired.to_text(), "", "requests:",
                f"  {'request':>7}  {'prompt':>6}  {'cached hit/cold':>15}  outputs"]
        out += [r.to_text() for r in self.requests]
        return "\n".join(out)

    def to_json(self) -> dict:
        first = self.first
        return jsonable({
            "statediff": "compare",
            "exit_code": self.exit_code,
            "verdict": "diverged" if first else "same",
            "diagnosis": self.diagnoses[0].to_json() if self.diagnoses else None,
            "diagnoses": [d.to_json() for d in self.diagnoses],
            "hit": self.hit.to_json(),
            "cold": self.cold.to_json(),
            "tolerance_policy": self.policy,
            "warnings": self.warnings,
            "pairs": self.pairs,
            "stopped_early": self.stopped_early,
            "judged": self.pairs if self.stopped_after is None else self.stopped_after,
            "identical": self.identical,
            "divergent": len(self.divergences),
            "first": first.to_json() if first else None,
            "roots": [d.to_json() for d in self.roots],
            "next": [d.to_json() for d in self.divergences[1:self.max_listed + 1]],
            "unpaired": self.unpaired.to_json(),
            "requests": [r.to_json() for r in self.requests],
        })
