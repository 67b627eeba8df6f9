"""``compare``: name the first divergent tensor between a hit and a cold trace.

Stages, in order: open both traces -> refuse incomparable ones
(``align.check_comparable``) -> choose the tolerance policy -> pair by key
(``align.align``) -> judge each pair (hash first, streamed full compare
only where hashes differ) -> root vs propagated (``diverge.classify``) ->
diagnose the roots (``diagnose.diagnose``) -> per-request table -> one
``CompareResult``. With ``stop_at_first`` the judging stops at the first
divergent pair in causal order, which is always the first root (nothing
earlier can explain it), so the root is the one a full compare reports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tqdm import tqdm

from .align import Pair, Plan, align, both_exact, check_comparable
from .diagnose import diagnose
from .diverge import classify
from statediff.errors import MismatchError, StatediffError
from .metrics import measure_pair
from .noise import DEFAULT_FACTOR, load_noise
from statediff.diff.result import MAX_UNPAIRED_LISTED, CompareResult, Divergence, RequestRow, TraceSide, Unpaired
from .tolerance import Policy, Rule, parse_rule
from statediff.trace.reader import Trace, open_trace

MAX_DIAGNOSED = 5

PathLike = str | os.PathLike


def compare(hit_path: PathLike, cold_path: PathLike, *, tol: Sequence[str | Rule] = (),
            noise: PathLike | None = None, noise_factor: float = DEFAULT_FACTOR,
            allow_engine_mismatch: bool = False, allow_noise_in_exact: bool = False,
            max_listed: int = 10, progress: bool = False, stop_at_first: bool = False) -> CompareResult:
    """Compare a cache-hit trace against its cold trace.

    Args:
        hit_path, cold_path: trace files (or ``.parts`` directories).
        tol: ``--tol`` rules (``PATTERN=ATOL,RTOL`` text or ``Rule``), first match wins.
        noise: a noise file from ``calibrate``; pairs are judged against its envelopes.
        noise_factor: allowed multiple of the calibrated envelope.
        allow_engine_mismatch: compare traces whose model/config identity differs.
        allow_noise_in_exact: accept a noise file although both traces replayed exactly
            (and although it was calibrated on traces of another replay mode).
        max_listed: how many divergences after the first the report lists.
        progress: show a progress bar on stderr for the full compares.
        stop_at_first: stop judging at the first divergent pair (the first root,
            the same a full compare names) and diagnose it; later divergences,
            propagated ones included, are then neither judged nor counted
            (``result.stopped_after`` says how many pairs were judged).

    Returns:
        the result; ``result.exit_code`` is 0 (same) or 1 (divergence).

    Raises:
        TraceError: a trace is missing, unreadable or damaged.
        MismatchError: different model/config, replay mode, swapped arguments,
            or a noise file from other traces.
        StatediffError: bad ``--tol`` text, unreadable noise file, noise file in
            exact mode without ``allow_noise_in_exact``.
    """
    rules = tuple(parse_rule(r) if isinstance(r, str) else r for r in tol)
    model = load_noise(noise, noise_factor) if noise is not None else None
    with open_trace(hit_path) as hit, open_trace(cold_path) as cold:
        warnings = check_comparable(hit, cold, allow_engine_mismatch=allow_engine_mismatch)
        if hit.run.get("mode") == "cold" and cold.run.get("mode") == "hit":
            raise MismatchError(f"arguments look swapped: {hit_path} is a cold run and {cold_path} "
                                "a hit run (usage: statediff compare HIT COLD)")
        exact = both_exact(hit, cold)
        if model is not None:
            if exact and not allow_noise_in_exact:
                raise StatediffError(
                    f"both traces replayed exactly, where any differing bit is a finding; refusing "
                    f"noise file {noise} (use --allow-noise-in-exact to judge by it anyway)")
            model.check_matches(cold, check_replay=not allow_noise_in_exact)
        policy = Policy(rules, exact, model)
        plan = align(hit.entries, cold.entries)
        divs, scores, identical, unjudged = _judge(plan, hit, cold, policy, progress, stop_at_first)
        stopped_after = len(scores) if stop_at_first and len(scores) < len(plan.pairs) else None
        if unjudged:
            warnings.append(f"{unjudged} pairs have no envelope in the noise file: judged by "
                            f"{'bit identity' if exact else 'dtype defaults'}")
        _attribute(divs, hit.requests)
        diagnoses = []
        for d, pair in [(d, p) for d, p in divs if d.root and d.metrics is not None][:MAX_DIAGNOSED]:
            found = diagnose(pair, hit, cold, policy)
            if found is not None:
                diagnoses.append(found)
        return CompareResult(
            hit=TraceSide(str(hit_path), hit.partial, dict(hit.run)),
            cold=TraceSide(str(cold_path), cold.partial, dict(cold.run)),
            policy=policy.describe(), warnings=warnings, pairs=len(plan.pairs),
            identical=identical, divergences=[d for d, _ in divs], diagnoses=diagnoses,
            unpaired=_unpaired(plan, hit), requests=_requests(hit, cold), scores=scores,
            max_listed=max_listed, bit_identity=exact and model is None, stopped_after=stopped_after)


def _judge(plan: Plan, hit: Trace, cold: Trace, policy: Policy, progress: bool, stop_at_first: bool = False):
    """Judge every pair (or up to the first divergent one); returns (divergences with
    their pairs, plot scores (one per judged pair), #identical, #unjudged)."""
    divs: list[tuple[Divergence, Pair]] = []
    scores = []
    identical = unjudged = 0
    for p in tqdm(plan.pairs, desc="comparing", unit="pair", disable=not progress, leave=False):
        tol = policy.for_entry(p.cold)
        if policy.noise is not None and tol.noise_max_abs is None and not tol.source.startswith("--tol"):
            unjudged += 1
        h, c = p.hit, p.cold
        m = measure_pair(hit, h, cold, c, tol) if p.same_layout else None
        if m is not None and m.identical:
            identical += 1
        scores.append((c.request, c.position, c.layer, c.kind,
                       m.severity if m is not None else float("inf"),
                       m.max_ulp if m is not None else None))  # PairMetrics is falsy when beyond tolerance
        if m is not None and m.within:
            continue
        reason = ("dtype/shape differ" if m is None else
                  "NaN/Inf on one side only" if m.n_nonfinite else "beyond tolerance")
        divs.append((Divergence(
            request=c.request, position=c.position, layer=c.layer, module=c.module or h.module,
            kind=c.kind, role_hit=h.role, role_cold=c.role, dtype=h.dtype, shape=h.shape,
            layout_cold=f"{c.dtype} {c.shape}", reason=reason, tolerance=tol, metrics=m), p))
        if stop_at_first:
            break
    return divs, scores, identical, unjudged


def _attribute(divs: list[tuple[Divergence, Pair]], requests: dict[int, dict]) -> None:
    """Set root/propagated fields from ``diverge.classify``."""
    only = [d for d, _ in divs]
    for d, v in zip(only, classify(only, requests)):
        d.root, d.via = v.root, v.via
        if not v.root:
            root = only[v.root_index]
            d.root_key = root.key
            root.propagated += 1
            root.propagated_same_request += d.request == root.request


def _unpaired(plan: Plan, hit: Trace) -> Unpaired:
    def cached(r: int) -> int:
        n = (hit.requests.get(r) or {}).get("num_cached_tokens")
        return n if isinstance(n, int) else -1

    skipped = [e for e in plan.cold_only if e.position <= cached(e.request)]
    unexpected = [e for e in plan.cold_only if e.position > cached(e.request)]
    return Unpaired(
        hit_only=len(plan.hit_only), cold_only=len(plan.cold_only), skipped_by_hit=len(skipped),
        first_hit_only=[f"{e.label()} [{e.role}]" for e in plan.hit_only[:MAX_UNPAIRED_LISTED]],
        first_cold_only=[f"{e.label()} [{e.role}]" for e in unexpected[:MAX_UNPAIRED_LISTED]])


def _requests(hit: Trace, cold: Trace) -> list[RequestRow]:
    rows = []
    for i in sorted(set(hit.requests) | set(cold.requests)):
        h, c = hit.requests.get(i) or {}, cold.requests.get(i) or {}
        ho, co = h.get("output_token_ids"), c.get("output_token_ids")
        equal, first, text = None, None, "missing in the " + ("hit" if not h else "cold") + " trace"
        if h and c:
            n = min(len(ho), len(co))
            first = next((k for k in range(n) if ho[k] != co[k]), None)
            if first is not None:
                equal, text = False, f"differ at output {first} (hit {ho[first]}, cold {co[first]})"
            elif len(ho) != len(co):
                equal, first = False, n
                text = f"hit has {len(ho)} tokens, cold {len(co)} (equal up to {n})"
            else:
                equal, text = True, f"equal ({len(ho)} tokens)"
        rows.append(RequestRow(
            request=i, prompt_len=(h.get("prompt_len"), c.get("prompt_len")),
            cached=(h.get("num_cached_tokens"), c.get("num_cached_tokens")),
            outputs_equal=equal, first_output_diff=first, outputs=text,
            acceptance=tuple(a if isinstance(a, dict) else None
                             for a in (h.get("acceptance"), c.get("acceptance")))))
    return rows
