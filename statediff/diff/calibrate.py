"""``calibrate``: measure the benign differences of two legitimate cold runs.

The envelopes it learns are ``noise.Envelope`` rows written as a noise file
(format in ``noise.py``), which ``compare --noise`` then judges pairs by.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.jsonutil import jsonable
from statediff.trace.reader import Trace, open_trace
from statediff.trace.schema import IDENTITY_KEYS

from .align import align, check_comparable, stream_part
from .metrics import measure_pair
from .noise import FORMAT, VERSION, Envelope
from .tolerance import Tolerance, ToleranceKind

_EXACT = Tolerance(0.0, 0.0, ToleranceKind.EXACT, "calibration")


@dataclasses.dataclass(frozen=True)
class CalibrateResult:
    """Outcome of ``calibrate``: the envelopes and what was skipped."""

    traces: tuple[str, str]
    identity: dict[str, Any]
    envelopes: list[Envelope]
    pairs: int
    identical: int
    warnings: list[str]
    out: str | None = None
    exit_code: int = 0

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "traces": list(self.traces),
                "identity": self.identity, "pairs": self.pairs, "identical": self.identical,
                "warnings": self.warnings,
                "envelopes": [dataclasses.asdict(e) for e in self.envelopes]}

    def to_text(self) -> str:
        lines = [f"calibrated {len(self.envelopes)} (layer, kind) envelopes from {self.pairs} pairs "
                 f"({self.identical} bit-identical) of {self.traces[0]} vs {self.traces[1]}"]
        if self.out:
            lines.append(f"written to {self.out}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append(f"  {'layer':>5}  {'kind':<16} {'dtype':<9} {'pairs':>5}  {'max abs':>10}  "
                     f"{'rel L2':>10}  {'max ULP':>8}  {'min cos':>9}")
        for e in self.envelopes:
            lines.append(f"  {e.layer:>5}  {e.kind:<16} {e.dtype:<9} {e.pairs:>5}  {e.max_abs:>10.3g}  "
                         f"{e.rel_l2:>10.3g}  {'-' if e.max_ulp is None else e.max_ulp:>8}  "
                         f"{e.min_cosine:>9.6f}")
        return "\n".join(lines)


def refuse_copies(a_path: str | Path, b_path: str | Path) -> None:
    """Refuse two files with the same bytes: a copy differs from its original by nothing, so it
    calibrates a noise floor of zero (every real run's rounding would then diverge).

    Raises:
        StatediffError: both are files and byte-identical.
    """
    a, b = Path(a_path), Path(b_path)
    if a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size and filecmp.cmp(a, b, shallow=False):
        raise StatediffError(f"{a_path} and {b_path} are byte-identical copies of one trace: calibration needs "
                             "two cold runs recorded apart (their differences are the noise)")


def refuse_uncalibratable(a: Trace, b: Trace, names: tuple[Any, Any]) -> None:
    """Refuse runs that cannot calibrate noise: a hit run (its differences from a cold run are what
    ``compare`` judges, not noise), or two copies of one recording (identical run metadata,
    creation time included).

    Raises:
        StatediffError: one of the above.
    """
    for t, name in zip((a, b), names):
        if t.run.get("mode") not in (None, "cold"):
            raise StatediffError(f"{name} is a {t.run.get('mode')} run (mode {t.run.get('mode')}): calibration "
                                 "needs two cold runs ('statediff record --mode cold', recorded apart)")
    if a.run.get("created_unix") is not None and a.run == b.run:
        raise StatediffError(f"{names[0]} and {names[1]} are copies of the same trace (identical run metadata, "
                             "recorded at the same time): calibration needs two cold runs recorded apart")


def calibrate(a_path: str | Path, b_path: str | Path, out: str | Path | None = None) -> CalibrateResult:
    """Measure the benign differences of two legitimate cold runs.

    Args:
        a_path, b_path: traces of the same model and replay mode.
        out: where to write the noise file (JSON), or None.

    Raises:
        TraceError, MismatchError: unreadable or incomparable traces.
        StatediffError: what cannot calibrate noise (``refuse_uncalibratable``); the output file
            cannot be written.
    """
    refuse_copies(a_path, b_path)
    with open_trace(a_path) as a, open_trace(b_path) as b:
        refuse_uncalibratable(a, b, (a_path, b_path))
        warnings = check_comparable(a, b, names=("first", "second"),
                                    mismatch_hint="calibrate two cold runs of the same model and config")
        plan = align(a.entries, b.entries)
        parts = {i: stream_part(a.requests, b.requests, i) for i in set(a.requests) | set(b.requests)}
        envs: dict[tuple[int, str], Envelope] = {}
        identical = diverged_tokens = 0
        for p in plan.pairs:
            part = parts.get(p.cold.request)
            if part is not None and p.cold.position > part.position:
                # Once greedy outputs differ, later states summarise other tokens:
                # that is not noise, and would inflate the envelope past real bugs.
                diverged_tokens += 1
                continue
            if not p.same_layout:
                warnings.append(f"skipped {p.cold.label()}: dtype/shape differ")
                continue
            m = measure_pair(a, p.hit, b, p.cold, _EXACT)
            identical += m.identical
            key = (p.cold.layer, p.cold.kind)
            env = envs.setdefault(key, Envelope(p.cold.layer, p.cold.kind, p.cold.module, p.cold.dtype))
            env.add(m)
        if diverged_tokens:
            warnings.append(f"{diverged_tokens} pairs skipped: their token prefixes differ between the runs "
                            "(greedy outputs diverged earlier)")
        n_digest = len(a.digests) + len(b.digests)
        if n_digest:  # an envelope is a max abs error: it needs values, which a summary does not hold
            warnings.append(f"{n_digest} tensors recorded as a digest only (no data) were not calibrated: "
                            "record both cold runs with --keep all to calibrate them")
        n_unpaired = len(plan.hit_only) + len(plan.cold_only)
        if n_unpaired:
            warnings.append(f"{n_unpaired} tensors had no counterpart and were not calibrated")
        for env in envs.values():
            if env.nonfinite:
                warnings.append(f"layer {env.layer} {env.kind}: {env.nonfinite} elements NaN/Inf in one run "
                                "only (always a divergence; not part of the envelope)")
        identity = {k: a.run.get(k) for k in IDENTITY_KEYS + ("replay",)}
        result = CalibrateResult((str(a_path), str(b_path)), identity,
                                 sorted(envs.values(), key=lambda e: (e.layer, e.kind)),
                                 len(plan.pairs), identical, warnings)
    if out is not None:
        try:
            Path(out).write_text(json.dumps(jsonable(result.to_json()), indent=1, sort_keys=True))
        except OSError as e:
            raise StatediffError(f"cannot write noise file {out}: {e.strerror or e}") from None
        result = dataclasses.replace(result, out=str(out))
    return result
