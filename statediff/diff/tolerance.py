"""Tolerances: which elementwise threshold a pair of tensors is judged by.

An element diverges when ``|hit - cold| > atol + rtol * |cold|`` (the cold
run is the reference), or when it is NaN/Inf on one side only. A tolerance
of ``atol == rtol == 0`` means *bit identity*: any differing bit diverges.

The policy picks, for each pair, the first that applies of:

1. ``--tol`` rules, in the order given (first match wins);
2. the noise file's envelope for the pair's (layer, kind) (see ``noise.py``);
3. bit identity, when both traces were recorded with ``replay == "exact"``;
4. the dtype default (``DEFAULTS``); in default replay without a noise file
   (``Policy.band``) the dtype default *and* the default-replay noise model
   (``band.py``), which decides a pair beyond the dtype default by its relative
   L2 error.

Each returned ``Tolerance`` says which of these chose it in ``kind`` (a
``ToleranceKind``); ``source`` is display text only, never decided on.

A tensor no ``--tol`` rule (and no noise envelope) matches is judged by the
policy's explicit default (3 or 4, ``Policy.default_kind``), not refused:
without rules every pair is judged that way, and a rule set meant for some
tensors should not make every other one an error. The report names that
default and counts the pairs it judged (``CompareResult.tolerance_kinds``).

A pair whose two sides have different logical dtypes (vLLM's bf16 SSM state
against transformers' float32 one, or traces from CPUs that chose different
state dtypes) cannot be bit-identical: after ``--tol`` rules it is judged by
the dtype default of the *less precise* of the two dtypes, since that side's
own rounding is the smallest difference it can show (``Policy.for_pair``).

Rule syntax (``--tol``): ``PATTERN=ATOL,RTOL``, e.g. ``gdn.ssm_state=1e-6,1e-5``
or ``attn.*=0,0``. PATTERN is an fnmatch glob matched against the tensor
kind (``gdn.ssm_state``), the module name (``model.layers.3.*``) or
``MODULE:KIND`` (``model.layers.0.*:gdn.conv_state``).
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from typing import TYPE_CHECKING, Protocol

from statediff.errors import StatediffError

if TYPE_CHECKING:
    from statediff.trace.schema import TensorEntry

# logical dtype -> (atol, rtol). Integers and bools must match exactly.
DEFAULTS: dict[str, tuple[float, float]] = {
    "float64": (1e-8, 1e-7),
    "float32": (1e-5, 1e-4),
    "float16": (1e-3, 5e-3),
    "bfloat16": (1e-2, 2e-2),
    "float8_e4m3fn": (6e-2, 1.25e-1),
    "float8_e5m2": (1.25e-1, 2.5e-1),
}


def dtype_default(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for a logical dtype; (0, 0) (exact) for integers and bool."""
    return DEFAULTS.get(dtype, (0.0, 0.0))


class ToleranceKind(enum.Enum):
    """Which rule of the policy chose a pair's tolerance (what ``compare`` decides on; its value is
    the JSON name)."""

    #: a ``--tol`` rule matched the pair
    USER_RULE = "user_rule"
    #: the noise file's envelope of the pair's (layer, kind)
    NOISE_ENVELOPE = "noise_envelope"
    #: bit identity: both traces replayed exactly (or a calibration, which measures every difference)
    EXACT = "exact"
    #: the dtype default alone (a noise file without an envelope for the pair, or two engine versions)
    DTYPE_DEFAULT = "dtype_default"
    #: default replay, no noise file: the dtype default, then ``band.py`` decides a pair beyond it
    REPLAY_BAND = "replay_band"

    def text(self) -> str:
        """How a pair of this kind is judged, in words (the report's name for it)."""
        return _KIND_TEXT[self]


_KIND_TEXT = {
    ToleranceKind.USER_RULE: "a --tol rule",
    ToleranceKind.NOISE_ENVELOPE: "the noise file's envelope",
    ToleranceKind.EXACT: "bit identity (exact replay)",
    ToleranceKind.DTYPE_DEFAULT: "the dtype default",
    ToleranceKind.REPLAY_BAND: "the dtype default, then the default-replay noise model (relative L2 error: "
                               "<= 8u noise, > 16u divergence, between: cannot judge)",
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The threshold one pair is judged by, and which rule chose it.

    Attributes:
        atol, rtol: absolute (in the tensor's units) and relative thresholds.
        kind: the policy rule that chose it; ``compare`` decides on this (``REPLAY_BAND``:
            a pair beyond ``atol``/``rtol`` goes to the default-replay noise model).
        source: human-readable origin for the report, e.g. "dtype default bfloat16",
            "--tol attn.*", "exact replay", "noise x4" (display only).
        noise_max_abs: the calibrated benign max abs error of this
            (layer, kind), when a noise envelope applied (else None).
    """

    atol: float
    rtol: float
    kind: ToleranceKind
    source: str
    noise_max_abs: float | None = None

    @property
    def exact(self) -> bool:
        """True when any differing bit counts as a divergence."""
        return self.atol == 0.0 and self.rtol == 0.0

    def describe(self) -> str:
        if self.exact:
            return f"bit identity ({self.source})"
        return f"atol {self.atol:.3g} rtol {self.rtol:.3g} ({self.source})"

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"kind": self.kind.value, "exact": self.exact}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One ``--tol`` rule: an fnmatch pattern and its (atol, rtol)."""

    pattern: str
    atol: float
    rtol: float

    def matches(self, entry: "TensorEntry") -> bool:
        names = (entry.kind, entry.module, f"{entry.module}:{entry.kind}")
        return any(fnmatch.fnmatchcase(n, self.pattern) for n in names)

    def __str__(self) -> str:
        return f"{self.pattern}={self.atol:g},{self.rtol:g}"


def parse_rule(text: str) -> Rule:
    """Parse ``PATTERN=ATOL,RTOL`` (see the module docstring).

    Raises:
        StatediffError: malformed text, or a negative / non-finite number.
    """
    pattern, sep, nums = text.partition("=")
    parts = nums.split(",")
    if not sep or not pattern.strip() or len(parts) != 2:
        raise StatediffError(f"--tol {text!r}: expected PATTERN=ATOL,RTOL (e.g. 'gdn.ssm_state=1e-6,1e-5')")
    try:
        atol, rtol = (float(p) for p in parts)
    except ValueError:
        raise StatediffError(f"--tol {text!r}: ATOL and RTOL must be numbers") from None
    if not (0 <= atol < float("inf") and 0 <= rtol < float("inf")):
        raise StatediffError(f"--tol {text!r}: ATOL and RTOL must be finite and >= 0")
    return Rule(pattern.strip(), atol, rtol)


class Envelopes(Protocol):
    """What the policy needs of calibrated noise (``noise.NoiseModel`` implements it)."""

    def tolerance_for(self, entry: "TensorEntry") -> "Tolerance | None":
        """The tolerance for a pair whose cold side is ``entry``; None without an envelope."""

    def describe(self) -> str:
        """One line naming the noise file and factor."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """Chooses the tolerance of each pair (order in the module docstring).

    Attributes:
        rules: ``--tol`` rules, first match wins.
        exact: both traces replayed exactly: expect bit identity.
        noise: calibrated noise envelopes, or None.
        band: the default-replay noise model judges what the dtype default would call a
            divergence (``REPLAY_BAND``): default replay, no noise file, one engine version
            (the model was measured on one). Ignored with ``exact`` or ``noise``.
    """

    rules: tuple[Rule, ...] = ()
    exact: bool = False
    noise: "Envelopes | None" = None
    band: bool = False

    @property
    def default_kind(self) -> ToleranceKind:
        """What judges a pair no ``--tol`` rule and no noise envelope matches (same dtypes)."""
        if self.exact:
            return ToleranceKind.EXACT
        return ToleranceKind.REPLAY_BAND if self.band and self.noise is None else ToleranceKind.DTYPE_DEFAULT

    def _rule(self, entry: "TensorEntry") -> Tolerance | None:
        for rule in self.rules:
            if rule.matches(entry):
                return Tolerance(rule.atol, rule.rtol, ToleranceKind.USER_RULE, f"--tol {rule.pattern}")
        return None

    def _dtype_default(self, dtype: str, source: str) -> Tolerance:
        kind = ToleranceKind.REPLAY_BAND if self.default_kind is ToleranceKind.REPLAY_BAND else \
            ToleranceKind.DTYPE_DEFAULT
        return Tolerance(*dtype_default(dtype), kind, source)

    def for_entry(self, entry: "TensorEntry") -> Tolerance:
        """Tolerance for the pair whose cold side is ``entry``."""
        tol = self._rule(entry)
        if tol is not None:
            return tol
        if self.noise is not None:
            tol = self.noise.tolerance_for(entry)
            if tol is not None:
                return tol
        if self.exact:
            return Tolerance(0.0, 0.0, ToleranceKind.EXACT, "exact replay")
        return self._dtype_default(entry.dtype, f"dtype default {entry.dtype}")

    def for_pair(self, hit: "TensorEntry", cold: "TensorEntry") -> Tolerance:
        """Tolerance for an aligned pair: ``for_entry(cold)``, unless the dtypes differ.

        With different logical dtypes: the first matching ``--tol`` rule, else
        the dtype default of the less precise dtype (the larger atol), never
        bit identity nor a noise envelope (calibrated on one dtype); in default
        replay without a noise file the noise model judges beyond it (``REPLAY_BAND``).
        """
        if hit.dtype == cold.dtype:
            return self.for_entry(cold)
        tol = self._rule(cold)
        if tol is not None:
            return tol
        narrow = max((hit.dtype, cold.dtype), key=lambda d: dtype_default(d))
        return self._dtype_default(narrow, f"dtype default {narrow}: hit {hit.dtype} vs cold {cold.dtype}, "
                                           "each decoded with its own dtype")

    def describe(self) -> str:
        """One line naming the policy, as the report states it."""
        if self.noise is not None:
            base = self.noise.describe()
            if self.exact:
                base += " (exact replay: bit identity where the file has no envelope)"
        elif self.exact:
            base = "exact: bit identity (both traces replay=exact)"
        else:
            base = "dtype defaults (" + "; ".join(
                f"{d} atol {a:g} rtol {r:g}" for d, (a, r) in DEFAULTS.items()
                if d in ("float32", "bfloat16", "float16")) + "; integers exact)"
        if self.rules:
            base += "; --tol rules first: " + ", ".join(str(r) for r in self.rules)
        return base


#: The kinds a pair gets when no ``--tol`` rule and no noise envelope matched it: the policy's default.
DEFAULT_KINDS = (ToleranceKind.EXACT, ToleranceKind.DTYPE_DEFAULT, ToleranceKind.REPLAY_BAND)


@dataclasses.dataclass(frozen=True)
class ToleranceUse:
    """Which rule of the policy judged how many pairs of one comparison (what the report names).

    Attributes:
        kinds: judged pairs per ``ToleranceKind`` value (JSON names), kinds that judged none left out.
        default: what judges a pair no rule and no envelope matches (``Policy.default_kind``).
        rules: how many ``--tol`` rules were given.
        noise: a noise file gave envelopes.
    """

    kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    default: ToleranceKind = ToleranceKind.DTYPE_DEFAULT
    rules: int = 0
    noise: bool = False

    @property
    def by_default(self) -> int:
        """Judged pairs no ``--tol`` rule and no noise envelope matched."""
        return sum(self.kinds.get(k.value, 0) for k in DEFAULT_KINDS)

    def to_text(self) -> str:
        """One line when ``--tol`` rules were given and some judged pair matched none of them: how
        many, and by what they were judged instead; '' otherwise (the policy line names the default)."""
        if not self.rules or not self.by_default:
            return ""
        total = sum(self.kinds.values())
        how = ", ".join(f"{self.kinds[k.value]} by {k.text()}" for k in DEFAULT_KINDS if self.kinds.get(k.value))
        rest = " and no noise envelope" if self.noise else ""
        return f"tolerance default: {self.by_default} of {total} judged pairs matched no --tol rule{rest}: {how}"

    def to_json(self) -> dict:
        return {"kinds": dict(self.kinds), "default": self.default.value, "default_text": self.default.text(),
                "by_default": self.by_default}
