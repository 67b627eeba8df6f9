"""Which captured tensors keep their data in a trace (``record --keep``, ``--focus``).

Every captured tensor gets a summary (digest, moments, sketch: a ``/digests``
row); the keep policy decides which of them also keep their full data (an
``/index`` row and a dataset). Pure Python: no torch, no trace I/O; the
recorder (``statediff_hooks.recording.recorder``) asks ``KeepPolicy.keep`` once per
tensor, in capture order.

Policies (``--keep``):

- ``hits`` (default): per request, with anchors ``A`` = {``num_cached_tokens``,
  ``expected_hit_tokens``, the align-mode expected hit; each expected one
  minus a block too when the drafter makes vLLM drop the last matched block}
  (those > 0; a hit run knows them all, a cold run the expected ones from hit
  accounting, so both runs keep the same keys; the recorder computes them,
  ``Recorder.begin_request``):

  * role ``resumed`` (GDN state, drafter row at the hit): kept;
  * GDN checkpoints (role ``checkpoint``): kept at ``position == a`` and the
    first checkpoint of each ``(layer, kind)`` with ``position > a``;
  * K/V blocks (``attn.k``/``attn.v``, any role): kept when
    ``token_start == a`` or ``position == a`` (the blocks on both sides of
    the boundary);
  * drafter inputs/logits and hidden rows: kept when
    ``a < position <= a + block_size``.

- ``all``: everything (the behaviour before digests), except *copies*: the
  cached K/V blocks a hit reads below its last block, which the request that
  computed them recorded already (digest only, as before).
- ``none``: nothing.
- ``BYTES`` (``budget``): the ``hits`` selection while the kept total stays
  ``<= BYTES``, every other tensor (copies excepted) while it stays
  ``<= BYTES / 2``: half the budget is reserved for hit tensors that come later.

Focus (``--focus``): only request ``R`` keeps data: tensors of the listed
layers (all when none are listed) with ``P - block_size <= position <= P +
block_size``, copies included, plus the first checkpoint of each ``(layer,
kind)`` after ``P``; everything else is digest only. With a byte budget the
focus selection is capped at ``BYTES``; ``all``/``none`` with a focus are refused.

Kept bytes are the tensors' storage bytes (``numel * element size``, before
compression).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from statediff.replay.focus import focus_text

POLICIES = ("hits", "all", "none")
GDN_KINDS = ("gdn.conv_state", "gdn.ssm_state")
KV_KINDS = ("attn.k", "attn.v")
ROW_KINDS = ("drafter.input", "drafter.model_input", "drafter.logits", "hidden")  # per-token rows: the window rule

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"500MB"`` -> 500000000, ``"2GiB"`` -> 2147483648, ``"123456"`` -> 123456.

    Units (case-insensitive): none or B, kB/MB/GB/TB (powers of 1000),
    KiB/MiB/GiB/TiB (powers of 1024); a decimal number is rounded down to whole bytes.

    Raises:
        ValueError: not a number with a known unit, or below 1 byte.
    """
    m = _BYTES_RE.match(text or "")
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: expected e.g. 123456, 500MB or 2GiB")
    n = math.floor(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ValueError(f"{text!r} is below one byte")
    return n


@dataclasses.dataclass(frozen=True)
class Focus:
    """Where a focused re-record keeps data: request ``request`` around token ``position``.

    ``layers``: the layer numbers to keep (trace ``layer``; -1 = drafter logits),
    or None for every layer.
    """

    request: int
    position: int
    layers: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        return {"request": self.request, "position": self.position,
                "layers": None if self.layers is None else list(self.layers)}

    @property
    def spec(self) -> str:
        """The ``--focus`` text form: ``request=R,position=P[,layers=L1/L2]`` (``statediff.replay.focus``)."""
        return focus_text(self.to_json())

    @classmethod
    def from_json(cls, d: Any, where: str = "focus") -> "Focus":
        """From ``{"request": R, "position": P, "layers": [..] | null}``.

        Raises:
            ValueError: a missing key, or R/P not non-negative integers, or layers not integers >= -1.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected an object with request and position")
        r, p, layers = d.get("request"), d.get("position"), d.get("layers")
        for name, v in (("request", r), ("position", p)):
            if not _is_int(v) or v < 0:
                raise ValueError(f"{where}: {name} must be a non-negative integer, not {v!r}")
        if layers is not None:
            if isinstance(layers, int) and not isinstance(layers, bool):
                layers = [layers]
            if not isinstance(layers, (list, tuple)) or not all(_is_int(x) and x >= -1 for x in layers):
                raise ValueError(f"{where}: layers must be a list of layer numbers, not {layers!r}")
            layers = tuple(sorted(set(int(x) for x in layers))) or None
        return cls(int(r), int(p), layers)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_focus_spec(text: str) -> Focus:
    """``request=R,position=P[,layers=L1/L2/...]`` -> ``Focus``.

    Raises:
        ValueError: an unknown or repeated key, a missing request/position, or a value
            that is not a non-negative integer (layers: integers >= -1, separated by "/").
    """
    fields: dict[str, Any] = {}
    for part in (text or "").split(","):
        key, sep, val = part.strip().partition("=")
        key, val = key.strip(), val.strip()
        if not sep or key not in ("request", "position", "layers") or key in fields:
            raise ValueError(f"{text!r}: expected request=R,position=P[,layers=L1/L2]")
        if key == "layers":
            items = [x.strip() for x in val.split("/")]
            if not all(re.fullmatch(r"-?\d+", x) for x in items):
                raise ValueError(f"{text!r}: layers={val} must be layer numbers separated by '/'")
            fields[key] = [int(x) for x in items]
        else:
            if not re.fullmatch(r"\d+", val):
                raise ValueError(f"{text!r}: {key}={val} must be a non-negative integer")
            fields[key] = int(val)
    if "request" not in fields or "position" not in fields:
        raise ValueError(f"{text!r}: expected request=R,position=P[,layers=L1/L2]")
    return Focus.from_json(fields, where=repr(text))


@dataclasses.dataclass(frozen=True)
class KeepSpec:
    """A keep policy as configured: ``policy`` in ``hits``/``all``/``none``/``budget``.

    ``budget_bytes``: the cap of ``budget`` (and optionally of a focus); ``focus``: a
    focused re-record (then ``policy`` is ``hits`` or ``budget``).
    """

    policy: str = "hits"
    budget_bytes: int | None = None
    focus: Focus | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES + ("budget",):
            raise ValueError(f"keep policy {self.policy!r}: expected hits, all, none or a byte budget")
        if (self.policy == "budget") != (self.budget_bytes is not None):
            raise ValueError("a byte budget goes with policy 'budget' only")
        if self.focus is not None and self.policy in ("all", "none"):
            raise ValueError(f"--focus chooses what is kept: combine it with --keep hits (default) or a byte "
                             f"budget, not --keep {self.policy}")

    @classmethod
    def parse(cls, keep: str, focus: Focus | None = None) -> "KeepSpec":
        """``hits``/``all``/``none``/``BYTES`` (see ``parse_bytes``).

        Raises:
            ValueError: anything else, or ``all``/``none`` with a focus.
        """
        text = (keep or "").strip()
        if text.lower() in POLICIES:
            return cls(text.lower(), None, focus)
        try:
            n = parse_bytes(text)
        except ValueError:
            raise ValueError(f"{keep!r}: expected hits, all, none or a byte budget such as 500MB or 2GiB") from None
        return cls("budget", n, focus)

    @property
    def keep_text(self) -> str:
        """The ``--keep`` / ``STATEDIFF_KEEP`` form (a budget in bytes)."""
        return str(self.budget_bytes) if self.policy == "budget" else self.policy

    def to_env(self) -> dict[str, str]:
        env = {"STATEDIFF_KEEP": self.keep_text}
        if self.focus is not None:
            env["STATEDIFF_FOCUS"] = json.dumps(self.focus.to_json())
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KeepSpec":
        """From ``STATEDIFF_KEEP`` (default ``hits``) and ``STATEDIFF_FOCUS`` (JSON, optional).

        Raises:
            ValueError: a bad value (message names the variable).
        """
        focus = None
        raw = env.get("STATEDIFF_FOCUS") or ""
        if raw:
            try:
                focus = Focus.from_json(json.loads(raw), "STATEDIFF_FOCUS")
            except json.JSONDecodeError as e:
                raise ValueError(f"STATEDIFF_FOCUS: invalid JSON ({e})") from None
        try:
            return cls.parse(env.get("STATEDIFF_KEEP") or "hits", focus)
        except ValueError as e:
            raise ValueError(f"STATEDIFF_KEEP: {e}") from None


class KeepPolicy:
    """The selection of one recording; stateful (first checkpoints, byte totals).

    Args:
        spec: the configured policy.
        block_size: the run's block size in tokens (drafter-row and focus windows);
            None or 0 when unknown (then those windows are empty).
    """

    def __init__(self, spec: KeepSpec, block_size: int | None) -> None:
        self.spec = spec
        self.block_size = int(block_size or 0)
        self.anchors: dict[int, tuple[int, ...]] = {}
        self._first_done: set[tuple[int, int, int, str]] = set()  # (request, anchor, layer, kind)
        self.kept_bytes = 0
        self.kept_tensors = 0
        self.digest_only_tensors = 0

    def begin_request(self, request: int, anchors: Iterable[int | None]) -> None:
        """Register a request's hit anchors (token counts; None and values <= 0 are ignored)."""
        self.anchors[request] = tuple(sorted({int(a) for a in anchors if a is not None and int(a) > 0}))

    def keep(self, *, request: int, position: int, layer: int, kind: str, role: str,
             token_start: int | None = None, nbytes: int = 0, copy: bool = False) -> bool:
        """Whether this tensor keeps its data; counts it either way.

        Args:
            request, position, layer, kind, role, token_start: the trace key of the tensor
                (``token_start`` defaults to ``position``).
            nbytes: its storage bytes.
            copy: a tensor recorded elsewhere already (a hit's cached K/V blocks below the
                last one): kept only under a focus.
        """
        ok = self._select(request, position, layer, kind, role,
                          position if token_start is None else token_start, nbytes, copy)
        if ok:
            self.kept_bytes += nbytes
            self.kept_tensors += 1
        else:
            self.digest_only_tensors += 1
        return ok

    def _select(self, request: int, position: int, layer: int, kind: str, role: str,
                start: int, nbytes: int, copy: bool) -> bool:
        spec = self.spec
        cap = spec.budget_bytes
        if spec.focus is not None:
            chosen = self._focused(request, position, layer, kind, role)
            return chosen and (cap is None or self.kept_bytes + nbytes <= cap)
        if spec.policy == "none":
            return False
        if spec.policy == "all":
            return not copy
        chosen = self._hits(request, position, kind, role, start, layer)
        if spec.policy == "hits":
            return chosen
        if chosen:
            return self.kept_bytes + nbytes <= cap
        return not copy and self.kept_bytes + nbytes <= cap // 2

    def _first_after(self, request: int, anchor: int, position: int, layer: int, kind: str) -> bool:
        """The first checkpoint of (layer, kind) past ``anchor`` in this request (marks it seen)."""
        key = (request, anchor, layer, kind)
        if position <= anchor or key in self._first_done:
            return False
        self._first_done.add(key)
        return True

    def _hits(self, request: int, position: int, kind: str, role: str, start: int, layer: int) -> bool:
        anchors = self.anchors.get(request, ())
        if kind in KV_KINDS:
            return any(start == a or position == a for a in anchors)
        if role == "resumed":
            return True
        if kind in GDN_KINDS:
            if role != "checkpoint":
                return False
            # evaluate every anchor: each marks its own first checkpoint
            firsts = [self._first_after(request, a, position, layer, kind) for a in anchors]
            return position in anchors or any(firsts)
        if kind in ROW_KINDS:
            return any(a < position <= a + self.block_size for a in anchors)
        return False

    def _focused(self, request: int, position: int, layer: int, kind: str, role: str) -> bool:
        f = self.spec.focus
        if request != f.request or (f.layers is not None and layer not in f.layers):
            return False
        first = role == "checkpoint" and self._first_after(request, f.position, position, layer, kind)
        return f.position - self.block_size <= position <= f.position + self.block_size or first

    def to_json(self) -> dict:
        """Run metadata ``keep``."""
        return {"policy": self.spec.policy, "budget_bytes": self.spec.budget_bytes,
                "focus": None if self.spec.focus is None else self.spec.focus.to_json(),
                "kept_bytes": self.kept_bytes, "kept_tensors": self.kept_tensors,
                "digest_only_tensors": self.digest_only_tensors}
