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

from statediff.errors import MismatchError, StatediffError
from .defaults import DEFAULT_FACTOR
from .tolerance import Tolerance, ToleranceKind, dtype_default
from statediff.trace.schema import IDENTITY_KEYS

if TYPE_CHECKING:
    from statediff.trace.reader import Trace

    from .metrics import PairMetrics
    from statediff.trace.schema import TensorEntry

FORMAT = "statediff.noise"
VERSION = 1
MAX_NOISE_BYTES = 64 << 20  # a noise file holds one small record per (layer, kind)
FLOOR_SCALE = 0.1


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

    def add(self, m: "PairMetrics") -> None:
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
                         ToleranceKind.NOISE_ENVELOPE, f"noise x{self.factor:g}", noise_max_abs=env.max_abs)

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
        if Path(path).exists() and not Path(path).is_file():  # a FIFO would block the read forever
            raise StatediffError(f"noise file {path} is not a regular file")
        if Path(path).stat().st_size > MAX_NOISE_BYTES:  # a bundle's noise.json comes from a stranger
            raise StatediffError(f"noise file {path} is over {MAX_NOISE_BYTES} bytes")
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise StatediffError(f"cannot read noise file {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError):
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
    except (KeyError, TypeError, OverflowError):
        raise StatediffError(f"noise file {path} has a malformed envelope list") from None
    identity = doc.get("identity") if isinstance(doc.get("identity"), dict) else {}
    return NoiseModel(str(path), envs, identity, factor)
