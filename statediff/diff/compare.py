"""``compare``: the verdict on a cache-hit trace against its cold trace.

Stages, in order: open both traces -> refuse incomparable ones (model
identity and replay mode: ``align.check_comparable``; effective scheduling:
``align.check_scheduling``) -> choose the tolerance policy -> pair by key,
digest-only rows included (``align.align``) -> judge each pair both runs
reached with the same tokens (hash first, streamed float64 compare only
where hashes differ; a pair with no data on a side by the two summaries:
digest, NaN/Inf counts, then the sketch's L2 estimate against the
tolerance); pairs past the point
where a request's token streams part are listed, not judged -> root vs
propagated (``diverge.classify``), then the frozen ``Divergence`` records ->
refuse runs whose first difference lies before any cache hit -> outputs
(``outputs.first_output_diff``) and block tables -> diagnose the roots ->
one ``CompareResult``, whose ``cause`` is the verdict. With
``stop_at_first`` the judging stops at the first divergent pair in causal
order, which is always the first root (nothing earlier can explain it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from statediff.errors import MismatchError, NotComparableError, StatediffError
from statediff.replay.hits import account_run
from statediff.trace.damage import DamageCheck
from statediff.trace.layers import drafter_index
from statediff.trace.reader import Trace, open_trace
from statediff.trace.schema import DigestEntry
from statediff.trace.summary import Summary, estimate_l2, l2_budget

from .align import (Entry, Pair, Plan, StreamPart, align, both_exact, check_comparable, check_scheduling,
                    stream_part, versions_differ)
from .band import BandSummary, band
from .diagnose import DigestCache, diagnose, has_data, match_block
from .diverge import classify
from .metrics import PairMetrics, measure_pair
from .defaults import DEFAULT_FACTOR
from .noise import load_noise
from statediff.trace.acceptance import acceptance_findings
from .drafts import DraftDiff, first_drafts_diff
from .outputs import OutputDiff, OutputTolerance, first_output_diff
from .result import (MAX_UNPAIRED_LISTED, BlockTableFinding, CompareResult, DigestSummary, Divergence,
                     InputsDiffer, RequestRow, SketchJudgement, TraceSide, Unpaired)
from .tolerance import Policy, Rule, Tolerance, ToleranceKind, ToleranceUse, parse_rule

MAX_DIAGNOSED = 5
NEIGHBOUR_BLOCKS = 4  # default replay: a differing digest is checked against the 4 nearest cold blocks

PathLike = str | os.PathLike


def compare(hit_path: PathLike, cold_path: PathLike, *, tol: Sequence[str | Rule] = (),
            noise: PathLike | None = None, noise_factor: float = DEFAULT_FACTOR,
            allow_engine_mismatch: bool = False, allow_noise_in_exact: bool = False,
            max_listed: int = 10, progress: bool = False, stop_at_first: bool = False,
            allow_incomplete: bool = False, strict_hits: bool = False) -> CompareResult:
    """Compare a cache-hit trace against its cold trace.

    Args:
        hit_path, cold_path: trace files (or ``.parts`` directories).
        tol: ``--tol`` rules (``PATTERN=ATOL,RTOL`` text or ``Rule``), first match wins.
        noise: a noise file from ``calibrate``; pairs are judged against its envelopes.
        noise_factor: allowed multiple of the calibrated envelope.
        allow_engine_mismatch: compare traces whose model/config identity or
            effective scheduling differs (also lifts the "runs not comparable"
            refusal: different engines differ before any hit).
        allow_noise_in_exact: accept a noise file although both traces replayed exactly
            (and although it was calibrated on traces of another replay mode).
        max_listed: how many divergences after the first the report lists.
        progress: show a progress bar on stderr for the full compares.
        stop_at_first: stop judging at the first divergent pair (the first root,
            the same a full compare names) and diagnose it; later divergences,
            propagated ones included, are then neither judged nor counted
            (``result.stopped_after`` says how many pairs were judged).
        allow_incomplete: compare a trace that is incomplete (the replay stopped
            early, or the recording did not finish) instead of refusing it.
        strict_hits: a hit accounting finding (a prefix-cache hit short of what
            the shared prefix allows, a hit in the cold run: ``statediff.replay.hits``)
            makes ``exit_code`` 1.

    Returns:
        the result; ``result.exit_code`` is 0 (SAME) or 1 (DIVERGED: a captured
        tensor, the block table, or the outputs differ; ``result.cause``).

    Raises:
        TraceError: a trace is missing, unreadable or damaged.
        MismatchError: different model/config, replay mode, swapped arguments,
            an exact pair scheduled differently, or a noise file from other traces.
        NotComparableError: (a MismatchError) the first difference lies in a
            request that, like every request before it, had no cache hit.
        StatediffError: bad ``--tol`` text, unreadable noise file, noise file in
            exact mode without ``allow_noise_in_exact``, an incomplete trace
            without ``allow_incomplete``.
    """
    rules = tuple(parse_rule(r) if isinstance(r, str) else r for r in tol)
    model = load_noise(noise, noise_factor) if noise is not None else None
    paths = Pair(hit_path, cold_path)
    with contextlib.ExitStack() as stack:
        traces = paths.map(lambda p: stack.enter_context(open_trace(p)))
        incomplete = _incomplete(paths, traces, allow_incomplete)
        warnings, exact = _comparable(paths, traces, allow_engine_mismatch)
        policy = _policy(rules, exact, model, noise, traces, allow_noise_in_exact)
        plan = align(*traces.map(lambda t: [*t.entries, *getattr(t, "digests", ())]))
        indices = sorted(set(traces.hit.requests) | set(traces.cold.requests))
        parts = {i: p for i in indices if (p := stream_part(traces.hit.requests, traces.cold.requests, i)) is not None}
        digests = DigestCache()
        judged = _judge(plan, traces, policy, parts, digests, progress, stop_at_first)
        warnings += _judging_warnings(judged, exact)
        divergences = _divergences(judged.found, classify(judged.found, traces.hit.requests), traces.hit.run)
        out_tol = OutputTolerance(exact=exact and model is None)
        rows, hit_findings = _hits(traces, _requests(traces, indices, parts, out_tol))
        output_diff = next((r.output_diff for r in rows if r.output_diff is not None and not r.output_diff.near_tie), None)
        near_ties = tuple(r.output_diff for r in rows if r.output_diff is not None and r.output_diff.near_tie)
        draft_diff = _drafts(traces, indices) if out_tol.exact and output_diff is None else None
        if not allow_engine_mismatch:
            _refuse_before_any_hit(traces.hit, divergences, output_diff)
        return CompareResult(
            hit=_side(paths.hit, traces.hit), cold=_side(paths.cold, traces.cold),
            policy=policy.describe(), warnings=warnings, pairs=len(plan.pairs),
            identical=judged.identical, divergences=divergences,
            diagnoses=_diagnose(judged.found, divergences, traces, policy, digests),
            unpaired=_unpaired(plan, traces.hit), requests=rows, scores=judged.scores,
            max_listed=max_listed, bit_identity=exact and model is None,
            stopped_after=judged.judged if judged.stopped else None,
            outputs_policy=out_tol.describe(), output_diff=output_diff, draft_diff=draft_diff,
            inputs_differ=_inputs_differ(judged, parts, max_listed), digests=_digest_summary(judged),
            block_tables=_block_tables(traces), outside_capture=_outside_capture(traces.hit),
            hit_findings=hit_findings, strict_hits=strict_hits, incomplete=incomplete, near_ties=near_ties,
            band=BandSummary(judged.band_noise, tuple(judged.band_unsure), policy.default_kind is ToleranceKind.REPLAY_BAND),
            tolerances=_tolerance_use(judged, policy),
            acceptance=acceptance_findings(traces.hit.requests, traces.cold.requests))


def _tolerance_use(judged: "_Judging", policy: Policy) -> ToleranceUse:
    """How many judged pairs each rule of the policy judged, and its default (what the report names)."""
    return ToleranceUse({k.value: judged.kinds[k] for k in ToleranceKind if judged.kinds[k]},
                        policy.default_kind, len(policy.rules), policy.noise is not None)


def _judging_warnings(judged: "_Judging", exact: bool) -> list[str]:
    """What judging found worth a warning: damaged data under a verdict that did not decode it
    (``statediff.trace.damage``), pairs without a noise envelope."""
    out = judged.damage.warnings()
    if judged.no_envelope:
        out.append(f"{judged.no_envelope} pairs have no envelope in the noise file: judged by "
                   f"{'bit identity' if exact else 'dtype defaults'}")
    return out


def _incomplete(paths: Pair, traces: Pair[Trace], allow: bool) -> tuple[str, ...]:
    """One line per incomplete trace; refused unless ``allow`` (``--allow-incomplete``)."""
    incomplete = tuple(f"the {side} trace {path} is incomplete: {t.partial_reason}"
                       for side, path, t in zip(("hit", "cold"), paths, traces) if t.partial)
    if incomplete and not allow:
        raise StatediffError(f"{incomplete[0]}; refusing to compare it (--allow-incomplete compares "
                             "the requests it holds)")
    return incomplete


def _comparable(paths: Pair, traces: Pair[Trace], allow_engine_mismatch: bool) -> tuple[list[str], bool]:
    """Refuse incomparable traces (model identity and replay mode, swapped arguments, effective
    scheduling); returns the warnings and whether both replayed exactly."""
    hit, cold = traces
    warnings = check_comparable(hit, cold, allow_engine_mismatch=allow_engine_mismatch)
    if hit.run.get("mode") == "cold" and cold.run.get("mode") == "hit":
        raise MismatchError(f"arguments look swapped: {paths.hit} is a cold run and {paths.cold} "
                            "a hit run (usage: statediff compare HIT COLD)")
    exact = both_exact(hit, cold)
    warnings += check_scheduling(hit, cold, exact=exact, allow_engine_mismatch=allow_engine_mismatch)
    return warnings, exact


def _policy(rules: tuple[Rule, ...], exact: bool, model, noise: PathLike | None, traces: Pair[Trace],
            allow_noise_in_exact: bool) -> Policy:
    """The tolerance policy; a noise file is refused in exact mode (unless allowed) and when it was
    calibrated on other traces. In default replay without a noise file the dtype default comes with
    the default-replay noise model (``band``), unless the engine versions differ: it was measured on one."""
    if model is not None:
        if exact and not allow_noise_in_exact:
            raise StatediffError(
                f"both traces replayed exactly, where any differing bit is a finding; refusing "
                f"noise file {noise} (use --allow-noise-in-exact to judge by it anyway)")
        model.check_matches(traces.cold, check_replay=not allow_noise_in_exact)
    return Policy(rules, exact, model, band=not versions_differ(traces.hit.run, traces.cold.run))


def _side(path: PathLike, t: Trace) -> TraceSide:
    return TraceSide(str(path), t.partial, dict(t.run), dict(t.requests))


def _inputs_differ(judged: "_Judging", parts: dict[int, StreamPart], max_listed: int) -> InputsDiffer:
    return InputsDiffer(tuple(parts[i] for i in sorted(parts)), len(judged.inputs_differ),
                        tuple(f"{p.cold.label()} [{p.hit.role}]" for p in judged.inputs_differ[:max_listed]))


def _digest_summary(judged: "_Judging") -> DigestSummary:
    return DigestSummary(judged.digest_pairs, judged.digest_identical, len(judged.unjudged),
                         tuple(p.cold.label() for p in judged.unjudged[:MAX_UNPAIRED_LISTED]),
                         by_digest=judged.digest_by_digest, by_estimate=judged.digest_by_estimate,
                         beyond_estimate=judged.digest_beyond_estimate)


@dataclasses.dataclass(frozen=True)
class _Found:
    """A divergent pair before its root/propagated verdict (what ``diverge.classify`` reads)."""

    pair: Pair[Entry]
    tol: Tolerance
    metrics: PairMetrics | None
    reason: str
    digests: tuple[str, str] | None = None
    sketch: SketchJudgement | None = None

    @property
    def request(self) -> int:
        return self.pair.cold.request

    @property
    def position(self) -> int:
        return self.pair.cold.position

    @property
    def role_hit(self) -> str:
        return self.pair.hit.role


@dataclasses.dataclass
class _Judging:
    """Running tallies of ``_judge`` (internal; the result records are built from it once)."""

    found: list[_Found] = dataclasses.field(default_factory=list)
    scores: list[tuple] = dataclasses.field(default_factory=list)
    identical: int = 0
    judged: int = 0
    no_envelope: int = 0
    stopped: bool = False
    inputs_differ: list[Pair[Entry]] = dataclasses.field(default_factory=list)
    digest_pairs: int = 0
    digest_identical: int = 0
    digest_by_digest: int = 0  # judged by digest (equal, or differing where that decides) or layout
    digest_by_estimate: int = 0  # judged by the sketch estimate against the tolerance
    digest_beyond_estimate: int = 0
    unjudged: list[Pair[Entry]] = dataclasses.field(default_factory=list)
    band_noise: int = 0  # default replay: beyond the dtype default, within the noise model (band.py)
    band_unsure: list[tuple] = dataclasses.field(default_factory=list)
    kinds: Counter = dataclasses.field(default_factory=Counter)  # judged pairs per ToleranceKind
    damage: DamageCheck = dataclasses.field(default_factory=DamageCheck)  # data under unread verdicts

    def by_band(self, c: Entry, rel_l2: float | None, high: float | None = None) -> bool:
        """Whether the noise model (``band``) clears a default-replay pair of relative L2 error ``rel_l2``
        (an estimate: its interval ``rel_l2``..``high``) that its dtype default would call divergent:
        rounding noise, or between noise and a fault."""
        b = band(rel_l2, high)
        if b == "noise":
            self.band_noise += 1
        elif b == "unsure":
            self.band_unsure.append((c.request, c.position, c.layer, c.kind, float(rel_l2)))
        return b != "beyond"


def _judge(plan: Plan, traces: Pair[Trace], policy: Policy, parts: dict[int, StreamPart],
           digests: DigestCache, progress: bool, stop_at_first: bool) -> _Judging:
    """Judge every pair both runs reached with the same tokens (or up to the first divergent one)."""
    hit, cold = traces
    j = _Judging()
    for p in tqdm(plan.pairs, desc="comparing", unit="pair", disable=not progress, leave=False):
        c = p.cold
        part = parts.get(c.request)
        if part is not None and c.position > part.position:  # saw other tokens: not judged, never a root
            j.inputs_differ.append(p)
            continue
        if stop_at_first and j.found:
            j.stopped = True
            break
        j.judged += 1
        tol = policy.for_pair(p.hit, c)
        j.kinds[tol.kind] += 1
        if policy.noise is not None and tol.kind not in (ToleranceKind.USER_RULE, ToleranceKind.NOISE_ENVELOPE):
            j.no_envelope += 1
        use_band = tol.kind is ToleranceKind.REPLAY_BAND
        if p.digest_only:
            f = _judge_digest(p, traces, tol, digests, j, use_band)
        else:
            f = _judge_values(p, hit, cold, tol, j, use_band)
            if f is None and p.hit.hash == c.hash and p.hit.dtype == c.dtype:  # judged by hash: data unread
                j.damage.check_pair(hit, p.hit, cold, c)
        if f is not None:
            j.found.append(f)
    return j


def _judge_values(p: Pair[Entry], hit: Trace, cold: Trace, tol: Tolerance, j: _Judging,
                  use_band: bool = False) -> _Found | None:
    c = p.cold
    m = measure_pair(hit, p.hit, cold, c, tol) if p.same_shape else None
    if m is not None and m.identical:
        j.identical += 1
    j.scores.append((c.request, c.position, c.layer, c.kind,
                     m.severity if m is not None else float("inf"),
                     m.max_ulp if m is not None else None,
                     m.rel_l2 if m is not None else None))
    if m is not None and m.within:
        return None
    reason = ("dtype/shape differ" if m is None else
              "NaN/Inf on one side only" if m.n_nonfinite else "beyond tolerance")
    if reason == "beyond tolerance" and use_band and j.by_band(c, m.rel_l2):
        return None
    return _Found(p, tol, m, reason)


def _judge_digest(p: Pair[Entry], traces: Pair[Trace], tol: Tolerance, digests: DigestCache,
                  j: _Judging, use_band: bool = False) -> _Found | None:
    """A pair with no data on at least one side, judged by the two tensors' summaries
    (``statediff.trace.summary``; the side with data gives its recorded summary, or one computed
    from its data in traces older than format version 3).

    Equal digests are bit-identical. A differing NaN/Inf count diverges. Otherwise, when bit
    identity is expected, a differing digest diverges; else the sketches estimate the L2 norm of
    the difference, which diverges when even the low end of its 99% interval exceeds the
    largest L2 norm the pair's elementwise tolerance allows (``l2_budget``), and is within
    otherwise. Without summaries on both sides (a version-2 digest row) a differing digest
    diverges when bit identity is expected, or when the hit block equals another cold block bit
    for bit (no rounding does that); otherwise it cannot be judged and is listed as unjudged."""
    c = p.cold
    j.digest_pairs += 1
    if not p.same_layout:
        j.digest_by_digest += 1
        j.scores.append((c.request, c.position, c.layer, c.kind, float("inf"), None, None))
        return _Found(p, tol, None, "dtype/shape differ")
    known = Pair(digests.known(traces.hit, p.hit), digests.known(traces.cold, c))
    sums = None
    if known.hit is None or known.hit != known.cold:  # equal recorded digests need nothing more
        sums = _summaries(p, traces, digests)
        known = Pair(digests.of(traces.hit, p.hit), digests.of(traces.cold, c)) if sums is None else Pair(
            sums.hit.digest, sums.cold.digest)
    hd, cd = known
    if hd == cd:
        j.identical += 1
        j.digest_identical += 1
        j.digest_by_digest += 1
        j.scores.append((c.request, c.position, c.layer, c.kind, 0.0, None, None))
        return None
    est = None if sums is None else estimate_l2(sums.hit, sums.cold)
    if est is None:  # no summary (or no sketch) on a side: digests only, as in format version 2
        if tol.exact or match_block(p, traces.hit, traces.cold, digests, nearest=NEIGHBOUR_BLOCKS) is not None:
            j.digest_by_digest += 1
            j.scores.append((c.request, c.position, c.layer, c.kind, float("inf"), None, None))
            return _Found(p, tol, None, "digest differs", (hd, cd))
        j.unjudged.append(p)
        return None
    budget = l2_budget(tol.atol, tol.rtol, c.numel, est.norm_cold)
    sketch = SketchJudgement(est, budget, _counts(sums.hit), _counts(sums.cold))
    severity = est.l2 / budget if budget > 0 else math.inf
    j.scores.append((c.request, c.position, c.layer, c.kind, severity, None, est.rel_l2))
    if sketch.nonfinite_differ:
        j.digest_by_digest += 1
        return _Found(p, tol, None, "NaN/Inf on one side only", (hd, cd), sketch)
    if tol.exact:
        j.digest_by_digest += 1
        return _Found(p, tol, None, "digest differs", (hd, cd), sketch)
    j.digest_by_estimate += 1
    if est.low > budget and use_band and est.norm_cold > 0 and j.by_band(  # default replay: the noise model
            c, est.low / est.norm_cold, est.high / est.norm_cold):
        return None  # counted by the band (rounding noise, or cannot be judged), not as beyond
    if est.low > budget:
        j.digest_beyond_estimate += 1
        return _Found(p, tol, None, "beyond tolerance (sketch estimate)", (hd, cd), sketch)
    return None


def _summaries(p: Pair[Entry], traces: Pair[Trace], digests: DigestCache) -> Pair[Summary] | None:
    """Both sides' summaries, or None when a digest-only side has none (a version-2 row: then the
    side with data is not summarised, which would read it for nothing)."""
    if any(isinstance(e, DigestEntry) and e.summary is None for e in p):
        return None
    sums = Pair(digests.summary(traces.hit, p.hit), digests.summary(traces.cold, p.cold))
    return None if sums.hit is None or sums.cold is None else sums


def _counts(s: Summary) -> tuple[int, int]:
    """(NaN count, Inf count) of a summary (-1: unknown)."""
    return (s.n_nan, s.n_inf)


def _divergences(found: list[_Found], verdicts, run: Mapping[str, Any]) -> list[Divergence]:
    """The complete, frozen records: the root/propagated verdicts are known before any is built;
    ``run``: the hit trace's run metadata (which layers are the drafter's, ``trace.layers``)."""
    attributed = [v.root_index for v in verdicts if not v.root]
    same_request = [v.root_index for f, v in zip(found, verdicts)
                    if not v.root and f.request == found[v.root_index].request]
    n, n_same = Counter(attributed), Counter(same_request)
    out = []
    for i, (f, v) in enumerate(zip(found, verdicts)):
        h, c = f.pair
        out.append(Divergence(
            request=c.request, position=c.position, layer=c.layer, module=c.module or h.module,
            kind=c.kind, role_hit=h.role, role_cold=c.role, dtype=h.dtype, shape=h.shape,
            layout_cold=f"{c.dtype} {c.shape}", reason=f.reason, tolerance=f.tol, metrics=f.metrics,
            root=v.root, root_key=None if v.root else found[v.root_index].pair.key, via=v.via,
            propagated=n[i] if v.root else 0, propagated_same_request=n_same[i] if v.root else 0,
            digests=f.digests, sketch=f.sketch,
            data=(has_data(h), has_data(c)), drafter_layer=drafter_index(run, c.layer, c.kind)))
    return out


def _diagnose(found: list[_Found], divs: list[Divergence], traces: Pair[Trace], policy: Policy,
              digests: DigestCache) -> list:
    """Diagnoses of the first ``MAX_DIAGNOSED`` roots that have something to search with
    (a root whose dtype or shape differs between the runs has not)."""
    out = []
    roots = [(f, d) for f, d in zip(found, divs) if d.root and (d.metrics is not None or d.digests is not None)]
    for f, d in roots[:MAX_DIAGNOSED]:
        g = diagnose(f.pair, traces.hit, traces.cold, policy, digests)
        if g is not None:
            out.append(g)
    return out


def _cached(t: Trace, request: int) -> int | None:
    n = (t.requests.get(request) or {}).get("num_cached_tokens")
    return n if isinstance(n, int) else None


def _refuse_before_any_hit(hit: Trace, divs: list[Divergence], output: OutputDiff | None) -> None:
    """A first difference in a request that, like every request before it, had no cache hit.

    Such a request was computed from scratch in both runs, so a restore bug
    cannot explain it: the runs were not scheduled or configured alike.
    Applies to hit-mode traces whose hit lengths are all known.

    Raises:
        NotComparableError: one line naming where and why.
    """
    if hit.run.get("mode") != "hit":
        return

    def before_any_hit(r: int) -> bool:
        hits = [_cached(hit, i) for i in sorted(hit.requests) if i <= r]
        return r in hit.requests and all(n == 0 for n in hits)

    first = divs[0] if divs else None
    what = None
    if first is not None and before_any_hit(first.request):
        what = (f"request {first.request} differs at position {first.position}, {first.layer_text(False)}, "
                f"{first.kind}")
    elif output is not None and before_any_hit(output.request):
        what = f"request {output.request} differs at output {output.index} (position {output.position})"
    if what is not None:
        raise NotComparableError(
            f"runs not comparable: {what}, but no request up to it resumed from a prefix-cache hit "
            "(num_cached_tokens 0), so both runs computed it from scratch and a restore bug cannot explain "
            "it: the runs were not scheduled or configured alike (check max_num_batched_tokens, chunked "
            "prefill, block sizes and state dtypes with 'statediff inspect')")


def _requests(traces: Pair[Trace], indices: list[int], parts: dict[int, StreamPart],
              tol: OutputTolerance) -> list[RequestRow]:
    rows = []
    for i in indices:
        recs = traces.map(lambda t: t.requests.get(i))
        h, c = recs.map(lambda r: r or {})
        ho, co = h.get("output_token_ids") or [], c.get("output_token_ids") or []
        diff = first_output_diff(recs, i, tol)
        equal, text = None, "missing in the " + ("hit" if not h else "cold") + " trace"
        if h and c:
            equal, text = _outputs_text(diff, ho, co)
        rows.append(RequestRow(
            request=i, prompt_len=(h.get("prompt_len"), c.get("prompt_len")),
            cached=(h.get("num_cached_tokens"), c.get("num_cached_tokens")),
            outputs_equal=equal, first_output_diff=None if diff is None else diff.index, outputs=text,
            acceptance=tuple(a if isinstance(a, dict) else None
                             for a in (h.get("acceptance"), c.get("acceptance"))),
            output_diff=diff, stream_part=parts.get(i)))
    return rows


def _drafts(traces: Pair[Trace], indices: list[int]) -> DraftDiff | None:
    """Exact replay: the first verification step or drafter call whose drafts differ (``drafts.first_drafts_diff``)."""
    return next((d for i in indices if (d := first_drafts_diff(traces.map(lambda t: t.requests.get(i)), i))), None)


def _hits(traces: Pair[Trace], rows: list[RequestRow]) -> tuple[list[RequestRow], tuple[str, ...]]:
    """Hit accounting of both runs (``statediff.replay.hits``): the hit run's expected hit on each
    row, and every finding (hit-run shortfalls or hits beyond the shared prefix; cold-run hits)."""
    acc = traces.map(lambda t: {a.request: a for a in account_run(t.run, t.requests)})
    out = []
    for r in rows:
        a = acc.hit.get(r.request)
        out.append(r if a is None else dataclasses.replace(
            r, expected_hit=a.expected, expected_source=a.source, hit_finding=a.finding))
    found = [f"{side} run: {a.finding}" for side, by in zip(("hit", "cold"), acc)
             for _, a in sorted(by.items()) if a.finding]
    return out, tuple(found)


def _outputs_text(diff: OutputDiff | None, ho: list, co: list) -> tuple[bool | None, str]:
    """(outputs_equal, the outputs column of the request table)."""
    n = min(len(ho), len(co))
    if diff is None:
        if len(ho) == len(co):
            return True, f"equal ({len(ho)} tokens)"
        return None, f"hit has {len(ho)} tokens, cold {len(co)} (equal up to {n}; a run did not finish)"
    k = diff.index
    if diff.what == "token":
        return False, f"differ at output {k} (hit {diff.hit_token}, cold {diff.cold_token})"
    if diff.what == "logprob":
        return False, (f"logprobs differ at output {k} (token {diff.hit_token}: hit {diff.hit_logprob:.7g}, "
                       f"cold {diff.cold_logprob:.7g})")
    if diff.what == "top-k":
        return False, f"top-k differs at output {k} ({diff.detail})"
    return False, f"hit has {len(ho)} tokens, cold {len(co)} (equal up to {n})"


def _block_tables(traces: Pair[Trace]) -> tuple[BlockTableFinding, ...]:
    """Requests whose ``hit_block_table`` rows (runner vs scheduler) differ, per KV-cache group.

    Rows are compared over the logical blocks both hold (a row may carry
    padding past the request's blocks).
    """
    out = []
    for side, t in zip(("hit", "cold"), traces):
        for i in sorted(t.requests):
            table = t.requests[i].get("hit_block_table")
            if not isinstance(table, dict):
                continue
            runner, sched = table.get("runner"), table.get("scheduler")
            if not isinstance(runner, list) or not isinstance(sched, list):
                continue
            for g, (rr, ss) in enumerate(zip(runner, sched)):
                if not isinstance(rr, list) or not isinstance(ss, list):
                    continue
                bad = [k for k, (a, b) in enumerate(zip(rr, ss)) if a != b]
                if bad:
                    out.append(BlockTableFinding(side, i, g, bad[0], rr[bad[0]], ss[bad[0]], len(bad)))
    return tuple(out)


def _outside_capture(hit: Trace) -> tuple[str, ...]:
    """The captures that would look further when outputs differ but no captured tensor does."""
    cap = hit.run.get("capture") if isinstance(hit.run.get("capture"), dict) else {}
    kinds = {e.kind for e in hit.entries}
    add = []
    if not cap.get("activations") and "hidden" not in kinds:
        add.append("--activations (the residual stream after every layer, eager mode)")
    if hit.run.get("speculative_method") not in (None, "none") and "drafter.input" not in kinds:
        add.append("drafter inputs (a --speculative-config method statediff captures: eagle3, eagle, mtp, "
                   "dflash)")
    if cap.get("kv") not in (None, "all"):
        add.append("--kv all (the K/V of every completed block, not only at hit boundaries)")
    return tuple(add)


def _unpaired(plan: Plan, hit: Trace) -> Unpaired:
    def cached(r: int) -> int:
        n = _cached(hit, r)
        return -1 if n is None else n

    skipped = [e for e in plan.cold_only if e.position <= cached(e.request)]
    unexpected = [e for e in plan.cold_only if e.position > cached(e.request)]
    return Unpaired(
        hit_only=len(plan.hit_only), cold_only=len(plan.cold_only), skipped_by_hit=len(skipped),
        first_hit_only=[f"{e.label()} [{e.role}]" for e in plan.hit_only[:MAX_UNPAIRED_LISTED]],
        first_cold_only=[f"{e.label()} [{e.role}]" for e in unexpected[:MAX_UNPAIRED_LISTED]])
