"""Noise floor: calibrate benign differences, then judge pairs against them.

``calibrate(a, b)`` compares two legitimate cold runs (same model, same
replay, e.g. different chunking or batch) and records, per (layer, kind),
an *envelope* of their differences: the largest max abs error, relative L2
error and ULP distance, and the smallest cosine similarity, over every
position and request. ``compare --noise FILE`` then judges each pair by

    atol = factor * envelope.max_abs + FLOOR_SCALE * dtype_default_atol
    rtol =                             FLOOR_SCALE * dtype_default_rtol

(``factor`` defaults to 4). The floor keeps a tensor that showed no noise at
all in calibration from being judged by bit identity: it is a tenth of the
dtype default. A (layer, kind) the file has no envelope for falls back to
the next policy (exact replay or dtype defaults) and the report counts them.

File format (JSON): ``{"format": "statediff.noise", "version": 1, "traces":
[A, B], "identity": {...}, "envelopes": [{"layer", "kind", "module",
"dtype", "pairs", "max_abs", "rel_l2", "max_ulp", "min_cosine",
"nonfinite"}]}``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .align import align, check_comparable
from .errors import MismatchError, StatediffError
from .metrics import PairMetrics, measure_pair
from .report import jsonable
from .tolerance import Tolerance, dtype_default
from .trace.reader import open_trace
from .trace.schema import IDENTITY_KEYS

if TYPE_CHECKING:
    from .trace.reader import Trace
    from .trace.schema import TensorEntry

FORMAT = "statediff.noise"
VERSION = 1
DEFAULT_FACTOR = 4.0
FLOOR_SCALE = 0.1
_EXACT = Tolerance(0.0, 0.0, "calibration")


@dataclasses.dataclass
class Envelope:
    """Benign differences of one (layer, kind) between two legitimate runs."""

    layer: int
    kind: str
    module: str
    dtype: str
    pairs: int = 0
    max_abs: float = 0.0
    rel_l2: float = 0.0
    max_ulp: int | None = None
    min_cosine: float = 1.0
    nonfinite: int = 0

    def add(self, m: PairMetrics) -> None:
        self.pairs += 1
        self.max_abs = max(self.max_abs, m.max_abs)
        self.rel_l2 = max(self.rel_l2, m.rel_l2)
        self.min_cosine = min(self.min_cosine, m.cosine)
        self.nonfinite += m.n_nonfinite
        if m.max_ulp is not None:
            self.max_ulp = max(self.max_ulp or 0, m.max_ulp)


@dataclasses.dataclass
class NoiseModel:
    """Loaded envelopes and the rule that turns them into tolerances."""

    path: str
    envelopes: dict[tuple[int, str], Envelope]
    identity: dict[str, Any]
    factor: float = DEFAULT_FACTOR

    def tolerance_for(self, entry: "TensorEntry") -> Tolerance | None:
        """Tolerance for a pair of this (layer, kind), or None without an envelope."""
        env = self.envelopes.get((entry.layer, entry.kind))
        if env is None or env.dtype != entry.dtype:
            return None
        atol0, rtol0 = dtype_default(entry.dtype)
        return Tolerance(self.factor * env.max_abs + FLOOR_SCALE * atol0, FLOOR_SCALE * rtol0,
                         f"noise x{self.factor:g}", noise_max_abs=env.max_abs)

    def describe(self) -> str:
        return (f"noise file {self.path} (allowed: {self.factor:g} x the calibrated max abs error "
                f"of each (layer, kind), plus {FLOOR_SCALE:g} x the dtype default)")

    def check_matches(self, trace: "Trace", *, check_replay: bool = True) -> None:
        """Refuse a noise file calibrated on another model, config (or replay mode).

        Raises:
            MismatchError: an identity key known on both sides differs.
        """
        for key in IDENTITY_KEYS + (("replay",) if check_replay else ()):
            mine, theirs = self.identity.get(key), trace.run.get(key)
            if mine is not None and theirs is not None and mine != theirs:
                raise MismatchError(f"noise file {self.path} was calibrated on traces with "
                                    f"{key}={mine!r}, but {trace.path} has {key}={theirs!r}")


def load_noise(path: str | Path, factor: float = DEFAULT_FACTOR) -> NoiseModel:
    """Read a noise file written by ``calibrate``.

    Raises:
        StatediffError: missing or unreadable file, not a statediff noise
            file, newer version, malformed envelope, bad factor.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise StatediffError(f"--noise-factor {factor!r} must be a positive number")
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise StatediffError(f"cannot read noise file {path}: {e.strerror or e}") from None
    except ValueError:
        raise StatediffError(f"noise file {path} is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StatediffError(f"{path} is not a statediff noise file (write one with 'statediff calibrate')")
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise StatediffError(f"noise file {path} has version {doc.get('version')!r}; this statediff reads {VERSION}")
    envs = {}
    try:
        for raw in doc["envelopes"]:
            env = Envelope(**raw)
            if not (isinstance(env.layer, int) and isinstance(env.kind, str)
                    and isinstance(env.max_abs, (int, float)) and 0 <= env.max_abs < math.inf):
                raise TypeError
            envs[(env.layer, env.kind)] = env
    except (KeyError, TypeError):
        raise StatediffError(f"noise file {path} has a malformed envelope list") from None
    identity = doc.get("identity") if isinstance(doc.get("identity"), dict) else {}
    return NoiseModel(str(path), envs, identity, factor)


@dataclasses.dataclass
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


def _same_tokens(ra: dict[int, dict], rb: dict[int, dict], request: int, position: int) -> bool:
    """Both runs fed request ``request`` the same first ``position`` tokens (prompt + outputs)."""
    x, y = ra.get(request), rb.get(request)
    if x is None or y is None:
        return True  # no token record: cannot tell, keep the pair

    def toks(r: dict) -> list[int]:
        return list(r.get("prompt_token_ids") or []) + list(r.get("output_token_ids") or [])

    return toks(x)[:position] == toks(y)[:position]


def calibrate(a_path: str | Path, b_path: str | Path, out: str | Path | None = None) -> CalibrateResult:
    """Measure the benign differences of two legitimate cold runs.

    Args:
        a_path, b_path: traces of the same model and replay mode.
        out: where to write the noise file (JSON), or None.

    Raises:
        TraceError, MismatchError: unreadable or incomparable traces.
        StatediffError: the output file cannot be written.
    """
    with open_trace(a_path) as a, open_trace(b_path) as b:
        warnings = check_comparable(a, b, names=("first", "second"))
        for t in (a, b):
            if t.run.get("mode") not in (None, "cold"):
                warnings.append(f"{t.path} is a {t.run.get('mode')!r} run, not a cold run")
        plan = align(a.entries, b.entries)
        envs: dict[tuple[int, str], Envelope] = {}
        identical = diverged_tokens = 0
        for p in plan.pairs:
            if not _same_tokens(a.requests, b.requests, p.cold.request, p.cold.position):
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
        result.out = str(out)
    return result
