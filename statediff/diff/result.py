"""Result records of ``compare``: one type serves text, JSON and tests.

Every record is built complete and frozen. ``CompareResult.to_text()`` is
the human report, ``to_json()`` the same content as one JSON-safe dict
(non-finite floats become the strings "inf", "-inf", "nan"); ``exit_code``
is 0 (SAME) or 1 (DIVERGED).

The verdict (``CompareResult.cause``), first that applies: a captured
tensor diverges ("tensor": DIVERGED at its root); the runner's block table
differs from the scheduler's allocation ("block_table"); a sampled output
or its log-probabilities differ while no captured tensor does ("outputs":
the cause lies outside the captured state); in exact replay, the drafts of a
verification step (ids or acceptance) differ while the sampled tokens agree
("drafts", ``drafts.DraftDiff``); a hit request's drafter acceptance falls
against its cold twin ("acceptance", ``acceptance.AcceptanceFinding``); else SAME. Never SAME while outputs or,
in exact replay, drafts differ.

Text layout: the diagnosis line first (when there is one), the verdict,
both traces, the tolerance policy, how the traces were paired, outputs,
where the token streams part, digests and block tables, warnings, then each
root in full, the next divergences one line each, unpaired tensors and the
per-request table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from statediff.jsonutil import jsonable
from statediff.replay.command import focus_lines
from statediff.replay.focus import focus_text
from statediff.trace.layers import layer_text
from statediff.trace.summary import Estimate

from .align import StreamPart
from .band import BandSummary
from .diagnose import Diagnosis
from .metrics import PairMetrics
from .drafts import DraftDiff
from .outputs import OutputDiff
from .tolerance import Tolerance, ToleranceUse

MAX_UNPAIRED_LISTED = 5


def _g(x: float | None, spec: str = ".4g") -> str:
    return "?" if x is None else format(x, spec)


@dataclasses.dataclass
class TraceSide:
    """One compared trace: where it is, its run metadata and its request records (as the reader gives them).

    ``requests`` (request index -> record: prompt/output token ids, hit
    length, sampling, acceptance) lets the incident record and bundles work
    from the result without opening the trace again; it is not in ``to_json``.
    """

    path: str
    partial: bool
    run: dict
    requests: dict = dataclasses.field(default_factory=dict, repr=False)

    def to_text(self) -> str:
        r = self.run
        state = "partial" if self.partial else "complete"
        return (f"{self.path} [{state}] mode={r.get('mode') or 'unknown'} "
                f"replay={r.get('replay') or 'unknown'} engine={r.get('engine') or 'unknown'} "
                f"{r.get('engine_version') or '(version unknown)'} "
                f"model={r.get('model') or 'unknown'}")

    def to_json(self) -> dict:
        keys = ("engine", "engine_version", "model", "mode", "replay", "block_size", "dtype")
        return {"path": self.path, "partial": self.partial} | {k: self.run.get(k) for k in keys}


@dataclasses.dataclass(frozen=True)
class SketchJudgement:
    """How a pair with no data on a side was judged from the two summaries (``statediff.trace.summary``).

    Attributes:
        estimate: the sketch's estimate of ``||hit - cold||_2`` and its 99% interval.
        budget: the largest L2 norm of a difference within the pair's elementwise
            tolerance (``l2_budget``: ``atol * sqrt(n) + rtol * ||cold||_2``; 0 for bit identity).
            The pair diverges by estimate when ``estimate.low > budget``.
        nonfinite_hit, nonfinite_cold: (NaN count, Inf count) of each side, -1 when unknown.
    """

    estimate: Estimate
    budget: float
    nonfinite_hit: tuple[int, int]
    nonfinite_cold: tuple[int, int]

    @property
    def nonfinite_differ(self) -> bool:
        """Both sides' NaN/Inf counts are known and differ."""
        known = min(*self.nonfinite_hit, *self.nonfinite_cold) >= 0
        return known and self.nonfinite_hit != self.nonfinite_cold

    @property
    def rel_interval(self) -> tuple[float, float]:
        """The 99% interval of the relative L2 error ``||hit - cold|| / ||cold||``."""
        e = self.estimate
        if e.norm_cold > 0:
            return e.low / e.norm_cold, e.high / e.norm_cold
        return (0.0, 0.0) if e.l2 == 0 else (math.inf, math.inf)

    def rel_text(self) -> str:
        """'rel L2 ~ 0.31 (sketch estimate, 99%: 0.21-0.55)'."""
        lo, hi = self.rel_interval
        return f"rel L2 ~ {_g(self.estimate.rel_l2, '.2g')} (sketch estimate, 99%: {_g(lo, '.2g')}-{_g(hi, '.2g')})"

    def l2_text(self) -> str:
        """'L2 error ~ 13 (sketch estimate, 99%: 8.7-22)'."""
        e = self.estimate
        return f"L2 error ~ {_g(e.l2, '.2g')} (sketch estimate, 99%: {_g(e.low, '.2g')}-{_g(e.high, '.2g')})"

    def to_json(self) -> dict:
        lo, hi = self.rel_interval
        return {**self.estimate.to_json(), "rel_low": lo, "rel_high": hi, "confidence": 0.99,
                "budget": self.budget, "nonfinite_hit": list(self.nonfinite_hit),
                "nonfinite_cold": list(self.nonfinite_cold)}


def _nonfinite(counts: tuple[int, int]) -> str:
    return ", ".join(f"{'?' if n < 0 else n} {what}" for n, what in zip(counts, ("NaN", "Inf")))


def no_data_text(data: tuple[bool, bool]) -> str:
    """'' when both sides have data, else 'no data in the hit trace (recorded digest only)' (or cold, or either)."""
    where = {(False, True): "the hit trace", (True, False): "the cold trace", (False, False): "either trace"}
    return "" if all(data) else f"no data in {where[tuple(data)]} (recorded digest only)"


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One pair beyond tolerance, with its root/propagated verdict.

    ``reason`` is "beyond tolerance", "NaN/Inf on one side only", "digest
    differs", "beyond tolerance (sketch estimate)" or "dtype/shape differ".
    ``data`` says which sides hold the tensor's data (hit, cold); a pair
    with no data on a side is judged from the two summaries: ``metrics`` is
    None, ``digests`` holds the hit and cold digests and ``sketch`` (when
    both summaries have sketches) the L2 estimate and the budget it was held
    against. For a root, ``propagated`` counts the divergences attributed to
    it; for a propagated one, ``root_key`` names its root and ``via`` how it
    was carried.
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
    digests: tuple[str, str] | None = None
    sketch: SketchJudgement | None = None
    data: tuple[bool, bool] = (True, True)
    drafter_layer: int | None = None

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.request, self.position, self.layer, self.kind)

    def layer_text(self, module: bool = True) -> str:
        """"layer 3 (model.layers.3...)", or "drafter layer 0 (layer 4, ...)" for a layer of the drafter."""
        return layer_text(self.layer, self.drafter_layer, self.module if module else None)

    @property
    def noise_multiple(self) -> float | None:
        """max abs error / calibrated benign max abs error (None without a noise envelope)."""
        noise = self.tolerance.noise_max_abs
        if noise is None or self.metrics is None:
            return None
        return self.metrics.max_abs / noise if noise > 0 else (math.inf if self.metrics.max_abs else 0.0)

    def where(self) -> str:
        return f"request {self.request}, position {self.position}, {self.layer_text()}, {self.kind}"

    def to_text(self) -> str:
        """Full multi-line description (used for roots)."""
        lines = [self.where(),
                 f"  roles: hit {self.role_hit}, cold {self.role_cold}; {self.dtype} {self.shape}; "
                 f"tolerance {self.tolerance.describe()}"]
        m = self.metrics
        if m is None and self.digests is not None:
            return "\n".join(lines + self._summary_lines())
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

    def _summary_lines(self) -> list[str]:
        """What the summaries say of a pair with no data on a side."""
        sk, (hd, cd) = self.sketch, self.digests
        if self.reason == "NaN/Inf on one side only" and sk is not None:
            out = [f"  NaN/Inf on one side only: hit {_nonfinite(sk.nonfinite_hit)}; cold "
                   f"{_nonfinite(sk.nonfinite_cold)} (from the summaries: no values to locate them)"]
        elif self.reason == "beyond tolerance (sketch estimate)":
            return [f"  beyond tolerance (sketch estimate): {sk.l2_text()}, above {_g(sk.budget)}, the largest "
                    f"L2 error the tolerance allows over {math.prod(self.shape)} elements", f"  {sk.rel_text()}",
                    *self._no_data()]
        else:
            out = [f"  digest differs: hit {hd}, cold {cd} (recorded as a digest only: bit-level, no values "
                   "to measure)"]
        if sk is not None:
            out.append(f"  {sk.rel_text()}, {sk.l2_text()}")
        return out + self._no_data()

    def _no_data(self) -> list[str]:
        return [f"  {no_data_text(self.data)}: judged from the summaries"] if not all(self.data) else []

    def short(self) -> str:
        """One line (used for the next divergences)."""
        tag = "root" if self.root else f"propagated, {self.via}"
        head = f"request {self.request} position {self.position} {self.layer_text(False)} {self.kind} [{tag}]"
        m = self.metrics
        if m is None and self.sketch is not None:
            return f"{head} {self.reason}: {self.sketch.rel_text()}"
        if m is None:
            return f"{head} {self.reason}"
        nonfin = f" NaN/Inf one side {m.n_nonfinite}" if m.n_nonfinite else ""
        noise = "" if self.noise_multiple is None else f" ({self.noise_multiple:.3g}x noise)"
        return (f"{head} max abs {_g(m.max_abs)}{noise} rel L2 {_g(m.rel_l2)} cos {_g(m.cosine, '.4f')} "
                f"beyond {m.n_beyond}/{m.numel}{nonfin}")

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "request", "position", "layer", "module", "kind", "role_hit", "role_cold", "dtype",
            "shape", "layout_cold", "reason", "root", "root_key", "via", "propagated",
            "propagated_same_request", "digests", "drafter_layer")}
        d["data"] = {"hit": self.data[0], "cold": self.data[1]}
        d["sketch"] = None if self.sketch is None else self.sketch.to_json()
        d["tolerance"] = self.tolerance.to_json()
        d["metrics"] = None if self.metrics is None else self.metrics.to_json()
        d["noise_multiple"] = self.noise_multiple
        return d


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class RequestRow:
    """One request on both sides: lengths, hit length, outputs, acceptance.

    ``output_diff`` is the request's first differing output (token id,
    log-probability or top-k; ``first_output_diff`` is its index), and
    ``stream_part`` where its token streams part (None when they do not).
    """

    request: int
    prompt_len: tuple[int | None, int | None]
    cached: tuple[int | None, int | None]
    outputs_equal: bool | None
    first_output_diff: int | None
    outputs: str
    acceptance: tuple[dict | None, dict | None]
    output_diff: OutputDiff | None = None
    stream_part: StreamPart | None = None
    # hit accounting of the hit run (statediff.replay.hits): the hit a perfect prefix cache could
    # give, the earlier request it shares that prefix with, and the finding when the hit is off
    expected_hit: int | None = None
    expected_source: int | None = None
    hit_finding: str | None = None

    def to_text(self) -> str:
        p = self.prompt_len[0] if self.prompt_len[0] == self.prompt_len[1] else \
            "/".join("?" if n is None else str(n) for n in self.prompt_len)  # "?": not in that trace
        cached = "/".join("?" if c is None else str(c) for c in self.cached)
        exp = "?" if self.expected_hit is None else str(self.expected_hit)
        acc = ""
        if any(self.acceptance):
            acc = "  acceptance hit " + "; cold ".join(
                "-" if a is None else " ".join(f"{k}={_acc(v)}" for k, v in sorted(a.items()))
                for a in self.acceptance)
        return f"  {self.request:>7}  {str(p):>6}  {cached:>15}  {exp:>8}  {self.outputs}{acc}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {
            "output_diff": None if self.output_diff is None else self.output_diff.to_json(),
            "stream_part": None if self.stream_part is None else self.stream_part.to_json()}


@dataclasses.dataclass(frozen=True)
class InputsDiffer:
    """Pairs not judged because the runs fed different tokens before their position.

    A state at position p summarises tokens [0, p); past the point where a
    request's token streams part (``parts``), hit and cold states differ
    because their inputs do, so such pairs are listed, never judged, never roots.
    """

    parts: tuple[StreamPart, ...] = ()
    count: int = 0
    first: tuple[str, ...] = ()

    def to_text(self) -> str:
        if not self.parts:
            return ""
        head = self.parts[0].text()
        n = len(self.parts) - 1
        more = "" if not n else f" (and in {n} more request{'s' if n > 1 else ''})"
        if not self.count:
            return f"{head}{more}; no captured pair lies past it"
        txt = (f"inputs differ: {head}{more}; {self.count} later pairs saw other tokens: listed, "
               "not judged, never roots")
        return txt + "".join(f"\n  inputs differ: {label}" for label in self.first)

    def to_json(self) -> dict:
        return {"parts": [p.to_json() for p in self.parts], "count": self.count, "first": list(self.first)}


@dataclasses.dataclass(frozen=True)
class DigestSummary:
    """Pairs with a side recorded as a digest only (no data): how each was judged.

    ``pairs`` counts them; ``by_digest`` those decided by the digests
    (``identical`` of them bit-identical; the rest differ where that decides:
    bit identity expected, a NaN/Inf count differs, a layout differs, or the
    hit block equals another cold block); ``by_estimate`` those judged by the
    sketch's L2 estimate against the tolerance (``beyond_estimate`` of them
    beyond it); ``unjudged`` those whose digests differ in default replay
    without sketches on both sides (version-2 digest rows), which a digest
    cannot hold against a tolerance; ``first_unjudged`` labels the first few.
    """

    pairs: int = 0
    identical: int = 0
    unjudged: int = 0
    first_unjudged: tuple[str, ...] = ()
    by_digest: int = 0
    by_estimate: int = 0
    beyond_estimate: int = 0

    def to_text(self) -> str:
        if not self.pairs:
            return ""
        txt = (f"digests: {self.pairs} pairs with a side recorded as a digest only (no data): "
               f"{self.by_digest} judged by digest ({self.identical} bit-identical), {self.by_estimate} by "
               f"sketch estimate ({self.beyond_estimate} beyond tolerance), {self.unjudged} unjudged")
        if self.unjudged:
            txt += (f"; {self.unjudged} differ but cannot be judged in default replay (a digest holds no "
                    "values to hold against a tolerance, and these rows have no sketch): unjudged, digest "
                    "only; record both runs with --exact to judge them")
            txt += "".join(f"\n  unjudged: {label}" for label in self.first_unjudged)
        return txt

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BlockTableFinding:
    """A request whose block table row as the runner held it differs from the scheduler's allocation.

    From the request record's ``hit_block_table`` (``{"runner": [[...]],
    "scheduler": [[...]]}``, one row of physical block ids per KV-cache
    group, logical block order; vLLM 0.32 ``v1/worker/block_table.py`` vs the
    scheduler output's ``block_ids``). The attention kernel reads through
    the runner's row, so a difference is itself a finding.

    Attributes:
        side: "hit" or "cold" (the trace whose record it is).
        request, group: request index, KV-cache group index.
        logical: first logical block whose physical ids differ.
        runner, scheduler: the two physical block ids there.
        differing: how many logical blocks of that row differ.
    """

    side: str
    request: int
    group: int
    logical: int
    runner: int
    scheduler: int
    differing: int

    def text(self) -> str:
        more = "" if self.differing == 1 else f" ({self.differing} logical blocks of this row differ)"
        return (f"request {self.request}, KV-cache group {self.group}, logical block {self.logical}: the runner's "
                f"block table maps physical block {self.runner}, the scheduler allocated {self.scheduler}{more}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"text": self.text()}


def _acc(v: Any) -> str:
    return format(v, ".4g") if isinstance(v, float) else str(v)


@dataclasses.dataclass(frozen=True)
class CompareResult:
    """Everything ``compare`` found; ``exit_code`` 1 for any verdict but SAME (see ``cause``).

    Attributes beyond the pairing counts: ``outputs_policy`` (how outputs
    were judged), ``output_diff`` (the first differing output over all
    requests, in request order), ``inputs_differ`` (pairs past a parting of
    the token streams), ``digests`` (digest-only blocks), ``block_tables``
    (runner vs scheduler block table findings), ``outside_capture`` (the
    captures to add when only outputs differ).
    """

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
    # one row per judged pair, for the heatmap: (request, position, layer, kind, severity, max ULP, rel L2)
    scores: list[tuple[int, int, int, str, float, int | None, float | None]] = dataclasses.field(
        repr=False, default_factory=list)
    max_listed: int = 10
    bit_identity: bool = False  # the policy expects bit identity (exact replay, no noise file)
    stopped_after: int | None = None  # pairs judged when compare stopped at the first divergence (--first)
    outputs_policy: str = ""
    output_diff: OutputDiff | None = None
    draft_diff: DraftDiff | None = None  # exact replay: the first verification step whose drafts differ
    inputs_differ: InputsDiffer = InputsDiffer()
    digests: DigestSummary = DigestSummary()
    block_tables: tuple[BlockTableFinding, ...] = ()
    outside_capture: tuple[str, ...] = ()
    # hit accounting (statediff.replay.hits): one line per hit that is off; with strict_hits
    # (--strict-hits) any of them makes the exit code 1, whatever the verdict
    hit_findings: tuple[str, ...] = ()
    strict_hits: bool = False
    # one line per trace that is incomplete (compared anyway: --allow-incomplete)
    incomplete: tuple[str, ...] = ()
    # default replay: requests whose outputs part at a near-tie (OutputDiff.near_tie; not a divergence)
    near_ties: tuple[OutputDiff, ...] = ()
    # default replay: what the noise model (band.py) cleared or could not judge
    band: BandSummary = BandSummary()
    # which policy rule judged how many pairs; the default that judged pairs no rule matched
    tolerances: ToleranceUse = ToleranceUse()
    # hit requests whose drafter acceptance falls against their cold twin (statediff.trace.acceptance)
    acceptance: tuple = ()

    @property
    def stopped_early(self) -> bool:
        """compare stopped at the first divergence: later pairs were not judged, nothing after it counted."""
        return self.stopped_after is not None

    @property
    def cause(self) -> str | None:
        """"tensor", "block_table", "outputs", "drafts", "acceptance" (first that applies), or None (SAME)."""
        if self.divergences:
            return "tensor"
        if self.block_tables:
            return "block_table"
        if self.output_diff is not None:
            return "outputs"
        if self.draft_diff is not None:
            return "drafts"
        if self.acceptance:
            return "acceptance"
        return None

    @property
    def cannot_judge(self) -> bool:
        """Nothing diverged, but default-replay pairs lie between rounding noise and a fault (``band``)."""
        return self.cause is None and bool(self.band.unsure)

    @property
    def verdict(self) -> str:
        """"diverged", "cannot-judge", "near-tie" (outputs part at a near-tie only) or "same"."""
        if self.cause is not None:
            return "diverged"
        return "cannot-judge" if self.band.unsure else "near-tie" if self.near_ties else "same"

    @property
    def exit_code(self) -> int:
        """0 same (a near-tie included), 1 divergence (or a hit finding with ``strict_hits``), 2 cannot judge."""
        if self.cause is None and self.strict_hits and self.hit_findings:
            return 1
        return {"diverged": 1, "cannot-judge": 2}.get(self.verdict, 0)

    @property
    def roots(self) -> list[Divergence]:
        return [d for d in self.divergences if d.root]

    @property
    def first(self) -> Divergence | None:
        """The first divergent captured tensor (always a root), or None."""
        return self.divergences[0] if self.divergences else None

    def headline(self) -> str:
        """The verdict line: 'DIVERGED: ...' or 'SAME: ...'."""
        first, cause = self.first, self.cause
        if cause == "tensor":
            return "DIVERGED: first divergence at " + first.where()
        if cause == "block_table":
            return ("DIVERGED: the runner's block table differs from the scheduler's allocation at "
                    + self.block_tables[0].text() + "; no captured tensor differs")
        if cause == "outputs":
            return (f"DIVERGED: outputs differ at {self.output_diff.text()}, while no captured tensor that "
                    "saw the same tokens differs")
        if cause == "drafts":
            return (f"DIVERGED: drafts differ at {self.draft_diff.text()}, while the sampled tokens agree "
                    "(exact replay: the drafter saw other inputs or state)")
        if cause == "acceptance":
            return (f"DIVERGED: the drafter's acceptance falls after a prefix-cache hit at "
                    f"{self.acceptance[0].text()}, while no captured tensor and no output differs")
        if self.cannot_judge:
            n = len(self.band.unsure)
            return (f"CANNOT JUDGE: {n} pair{'' if n == 1 else 's'} differ{'s' if n == 1 else ''} by more than rounding noise of differently "
                    "chunked runs and less than a fault stands out (default replay); make them judgeable: "
                    "'statediff check CONVERSATION --model M -o DIR' (exact, split form), or 'statediff calibrate "
                    "COLD_A COLD_B -o noise.json' then 'statediff compare --noise noise.json'")
        if self.near_ties:
            return (f"NEAR-TIE: no divergence beyond tolerance in {self.pairs} pairs; the outputs part at a near-tie "
                    f"at {self.near_ties[0].text()} (default replay: rounding can flip it; not a divergence)")
        return f"SAME: no divergence beyond tolerance in {self.pairs} pairs"

    def outside_text(self) -> str:
        """Why an outputs-only verdict points outside the captured state, and what to capture."""
        if self.cause != "outputs":
            return ""
        add = "; ".join(self.outside_capture) if self.outside_capture else (
            "nothing more can be captured: the difference arises after the last captured state "
            "(LM head, logits processing, sampling)")
        txt = f"  the cause lies outside the captured state; to localise it, record both runs again with: {add}"
        if self.hit.run.get("replay") != "exact":
            txt += ("\n  (default replay: chunking alone can flip a near-tied token; record both runs with --exact "
                    "to tell a fault from rounding)")
        return txt

    def outputs_text(self) -> str:
        """One line: how outputs were judged and what was found."""
        if not self.requests:
            return "outputs: no request records"
        d = self.output_diff
        found = (f"first differ at {d.text()}" if d is not None else
                 "equal in every request" if all(r.outputs_equal for r in self.requests) else
                 "equal wherever both traces have them")
        return f"outputs: {found}; judged: {self.outputs_policy}"

    def summary(self) -> str:
        n, roots = len(self.divergences), len(self.roots)
        # pairs with no data on a side that were not bit-identical: judged from summaries, not read
        by_summary = self.digests.pairs - self.digests.identical
        judged = self.pairs if self.stopped_after is None else self.stopped_after
        how = f"{self.identical} bit-identical, {judged - self.identical - by_summary} read in full"
        if by_summary:
            how += f", {by_summary} judged from summaries (no data on a side)"
        if self.stopped_early:
            return (f"aligned by (request, position, layer, kind): {self.pairs} pairs; stopped early at the "
                    f"first divergence (--first) after judging {self.stopped_after} ({how}): later divergences, "
                    "propagated ones included, were not counted")
        return (f"aligned by (request, position, layer, kind): {self.pairs} pairs, {how}; {n} divergent "
                f"({roots} root{'s' if roots != 1 else ''}, {n - roots} propagated)")

    def diagnosis_for(self, key: tuple[int, int, int, str]) -> Diagnosis | None:
        """The diagnosis of the root with ``key`` (request, position, layer, kind), or None (not a
        diagnosed root: only the first ``MAX_DIAGNOSED`` roots are searched, and a search may find nothing)."""
        return next((g for g in self.diagnoses if g.key == tuple(key)), None)

    @property
    def focus(self) -> dict | None:
        """Where a focused re-record keeps data (``statediff record --focus``): the first root's
        request and position, in every layer (``layers`` empty: the layers around a root explain
        it too); None without a divergent tensor."""
        first = self.first
        if first is None:
            return None
        return {"request": first.request, "position": first.position, "layers": []}

    def focus_commands(self) -> list[str]:
        """The two ``statediff record`` lines that replay both runs keeping data around the first root."""
        return [line.text for line in self._focus_lines()]

    def _focus_lines(self) -> list:
        f = self.focus
        return [] if f is None else focus_lines(self.hit.run, self.cold.run, f, (self.hit.path, self.cold.path))

    def no_data_lines(self) -> list[str]:
        """When the first root has no data on a side: that line and the commands that record it."""
        first = self.first
        if first is None or all(first.data):
            return []
        lines = self._focus_lines()
        rebuilt = ([] if all(line.exact for line in lines) else
                   ["    (arguments rebuilt from the run metadata: the traces do not store the record command line)"])
        return ([f"  the root has {no_data_text(first.data)}; record it again keeping data around it "
                 f"(--focus {focus_text(self.focus)}), both runs:"]
                + [f"    {line.text}" for line in lines] + rebuilt)

    def to_text(self) -> str:
        out = [f"INCOMPLETE: {t}" for t in self.incomplete]
        out += [d.text for d in self.diagnoses[:1]]
        out.append(self.headline())
        if self.outside_text():
            out.append(self.outside_text())
        out += [f"hit:  {self.hit.to_text()}", f"cold: {self.cold.to_text()}",
                f"tolerance: {self.policy}", *filter(None, [self.tolerances.to_text()]), self.summary(),
                self.outputs_text()]
        out += [t for t in (self.inputs_differ.to_text(), self.digests.to_text(), self.band.to_text()) if t]
        out += [f"block table: {b.text()} ({b.side} run)" for b in self.block_tables]
        out += [f"warning: {w}" for w in self.warnings]
        out += [f"hit finding: {f}" for f in self.hit_findings]
        out += [f"acceptance: {a.text()}" for a in self.acceptance]
        if self.strict_hits and self.hit_findings:
            out.append(f"--strict-hits: {len(self.hit_findings)} hit finding(s), exit code 1")
        roots = self.roots
        for i, d in enumerate(roots, 1):
            later = d.propagated - d.propagated_same_request
            head = f"root {i} of {len(roots)}"
            if self.stopped_early:
                head = "first root (--first: later ones not searched)"
            out += ["", f"{head}: " + d.to_text(),
                    "  propagated from it: not counted (stopped early at the first divergence)"
                    if self.stopped_early else
                    f"  propagated from it: {d.propagated} divergent pair{'' if d.propagated == 1 else 's'} ({d.propagated_same_request} "
                    f"in request {d.request}, {later} in later requests)"]
            g = self.diagnosis_for(d.key)
            if g is not None and g is not self.diagnoses[0]:  # the first is the report's first line
                out.append(f"  {g.text}")
            if i == 1:
                out += self.no_data_lines()
        rest = self.divergences[1:self.max_listed + 1]
        if rest:
            out += ["", f"next divergences ({len(self.divergences) - 1} more, first {len(rest)} listed):"]
            out += [f"  {d.short()}" for d in rest]
        out += ["", self.unpaired.to_text(), "", "requests:",
                f"  {'request':>7}  {'prompt':>6}  {'cached hit/cold':>15}  {'expected':>8}  outputs"]
        out += [r.to_text() for r in self.requests]
        return "\n".join(out)

    def to_json(self) -> dict:
        first = self.first
        return jsonable({
            "statediff": "compare",
            "exit_code": self.exit_code,
            "verdict": self.verdict,
            "band": self.band.to_json(),
            "near_ties": [d.to_json() for d in self.near_ties],
            "cause": self.cause,
            "headline": self.headline(),
            "outside_capture": list(self.outside_capture) if self.cause == "outputs" else [],
            "diagnosis": self.diagnoses[0].to_json() if self.diagnoses else None,
            "diagnoses": [d.to_json() for d in self.diagnoses],
            "hit": self.hit.to_json(),
            "cold": self.cold.to_json(),
            "tolerance_policy": self.policy,
            "tolerances": self.tolerances.to_json(),
            "outputs_policy": self.outputs_policy,
            "warnings": self.warnings,
            "pairs": self.pairs,
            "stopped_early": self.stopped_early,
            "judged": self.pairs if self.stopped_after is None else self.stopped_after,
            "identical": self.identical,
            "divergent": len(self.divergences),
            "first": first.to_json() if first else None,
            "focus": self.focus,
            "focus_commands": self.focus_commands() if first is not None and not all(first.data) else [],
            "roots": [d.to_json() for d in self.roots],
            "next": [d.to_json() for d in self.divergences[1:self.max_listed + 1]],
            "output_diff": None if self.output_diff is None else self.output_diff.to_json(),
            "draft_diff": None if self.draft_diff is None else self.draft_diff.to_json(),
            "inputs_differ": self.inputs_differ.to_json(),
            "digests": self.digests.to_json(),
            "block_tables": [b.to_json() for b in self.block_tables],
            "unpaired": self.unpaired.to_json(),
            "requests": [r.to_json() for r in self.requests],
            "incomplete": list(self.incomplete),
            "hit_findings": list(self.hit_findings),
            "strict_hits": self.strict_hits,
            "acceptance": [a.to_json() for a in self.acceptance],
        })
