"""A focused re-record (``record --focus``): where to focus, the checks before the engine, the check after.

A focused re-record replays the run that diverged again, keeping full data
only around one position (``keep.Focus``), and is then checked digest by
digest against the earlier trace of the same mode: a replay that differs is
not the one that diverged. Here: the focus read from a ``statediff compare
--json`` result (``focus_from_compare``), the ``--keep``/``--focus``/
``--focus-check`` options checked before any engine starts
(``keep_options``: the earlier trace exists, has this mode, and was recorded
with the same arguments), and the digest check after the replay
(``check_replay`` -> ``ReplayCheck``). Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.replay.focus import focus_from_compare as compare_focus
from .keep import Focus, KeepSpec, parse_focus_spec


def focus_from_compare(doc: Any) -> tuple[Focus, str | None, str | None]:
    """The focus and the two trace paths of a ``statediff compare --json`` result
    (``statediff.replay.focus.focus_from_compare`` reads it), the focus checked as a ``Focus``.

    Returns:
        (focus, hit trace path, cold trace path); a path is None when the result has none.

    Raises:
        ValueError: not a compare result, one without a divergence to focus on, or a bad focus.
    """
    focus, where, hit, cold = compare_focus(doc)
    return Focus.from_json(focus, where), hit, cold


def keep_options(keep: str, focus: str | None, focus_check: str | None, *, mode: str, output: str,
                 record_argv: Sequence[str] | None = None) -> tuple[KeepSpec, str | None]:
    """``--keep``, ``--focus``, ``--focus-check`` checked before any engine starts.

    ``record_argv``: this recording's command line as stored (``provenance.record_argv``);
    given, it must equal the earlier trace's (``_same_arguments``).

    Returns:
        (``keep.KeepSpec``, the earlier trace to check a focused re-record against, or None).

    Raises:
        StatediffError: a bad size or policy, an unreadable or malformed RESULT.json, a bad
            ``request=R,position=P`` form, ``--focus-check`` without ``--focus``, or an earlier
            trace that is missing, not a trace, of the other mode, or the output itself.
    """
    from statediff.errors import TraceError
    from statediff.trace import open_trace

    target, reference = None, None
    if focus_check and not focus:
        raise StatediffError("--focus-check goes with --focus (it checks a focused re-record)")
    if focus:
        result = Path(focus)
        if result.is_file() or "=" not in focus:
            try:
                doc = json.loads(result.read_text())
            except OSError as e:
                raise StatediffError(f"--focus {focus}: cannot read it ({e.strerror or e}); expected RESULT.json "
                                     "or request=R,position=P[,layers=L1/L2]") from None
            except ValueError as e:
                raise StatediffError(f"--focus {focus}: not JSON ({e})") from None
            try:
                target, hit_path, cold_path = focus_from_compare(doc)
            except ValueError as e:
                raise StatediffError(f"--focus {focus}: {e}") from None
            named = hit_path if mode == "hit" else cold_path
            if named and not focus_check:
                p = Path(named)
                if not p.is_absolute() and not p.exists() and (result.parent / p).exists():
                    p = result.parent / p  # compare ran elsewhere: relative to RESULT.json
                reference = str(p)
        else:
            try:
                target = parse_focus_spec(focus)
            except ValueError as e:
                raise StatediffError(f"--focus: {e}") from None
    try:
        spec = KeepSpec.parse(keep, target)
    except ValueError as e:
        raise StatediffError(str(e) if target is not None and "--focus" in str(e) else f"--keep {e}") from None
    reference = focus_check or reference
    if reference is not None:
        if Path(reference).exists() and Path(output).exists() and Path(reference).samefile(output):
            raise StatediffError(f"--focus-check {reference} is the output: write the re-record elsewhere")
        try:
            with open_trace(reference) as t:
                ref_mode, ref_argv = t.run.get("mode"), t.run.get("record_argv")
        except TraceError as e:
            raise StatediffError(f"the earlier trace to check the replay against: {e}") from None
        if ref_mode != mode:
            raise StatediffError(f"{reference} is a {ref_mode}-mode trace; a --mode {mode} re-record is checked "
                                 f"against the {mode}-mode trace (--focus-check OLD.h5)")
        _same_arguments(reference, ref_argv, record_argv)
    return spec, reference


def _same_arguments(reference: str, ref_argv: Any, now: Sequence[str] | None) -> None:
    """Refuse, before any engine starts, a focused re-record whose arguments differ from those
    ``reference`` was recorded with (its ``record_argv``): it would replay another run, and its
    digest check could only say so after the whole replay.

    Raises:
        StatediffError: the first differing argument, and the command line to use.
    """
    if now is None or not isinstance(ref_argv, list) or not all(isinstance(w, str) for w in ref_argv):
        return  # no command line to compare, or recorded by another writer: the digest check after the replay decides
    now = list(now)
    if now == ref_argv:
        return
    k = next((i for i, (a, b) in enumerate(zip(now, ref_argv)) if a != b), min(len(now), len(ref_argv)))
    if 0 < k < len(now) and not now[k].startswith("-") and now[k - 1].startswith("--"):
        k -= 1  # a differing value: show it with its option
    here, there = (" ".join(w[k:k + 2]) or "nothing" for w in (now, ref_argv))
    raise StatediffError(
        f"--focus-check {reference} was recorded with other arguments ({there!r} where this command has "
        f"{here!r}): a focused re-record must replay the same run; use: statediff record "
        f"{shlex.join(ref_argv)} --mode ... -o ... --focus ... --focus-check {reference}")


@dataclasses.dataclass(frozen=True)
class ReplayCheck:
    """A re-recording checked against an earlier trace of the same replay, digest by digest.

    Attributes:
        reference: the earlier trace's path, as given.
        total: keys ``(request, position, layer, kind)`` in either trace (a key recorded
            several times counts once per record).
        equal: keys whose digests are equal in both.
        first: the first differing key in causal order (request, position, layer, kind), or None.
        why: how it differs: "digest differs", "only in the new trace", "only in the reference".
    """

    reference: str
    total: int
    equal: int
    first: tuple[int, int, int, str] | None = None
    why: str = ""

    @property
    def identical(self) -> bool:
        return self.first is None

    def to_text(self) -> str:
        if self.first is None:
            return f"replay identical to {self.reference}: {self.equal} of {self.total} digests equal"
        r, p, layer, kind = self.first
        return (f"replay differs from {self.reference}: first at request {r} position {p} layer {layer} "
                f"{kind} ({self.why}; {self.equal} of {self.total} digests equal)")


def trace_digests(path: str) -> dict[tuple[int, int, int, str], list[str]]:
    """Every tensor's digest in a trace, by key ``(request, position, layer, kind)``, in record order.

    Tensors with data but no recorded digest (traces before format version 3)
    are digested from their data (``statediff.trace.digest.digest_array``).

    Raises:
        TraceError: the file is not a readable trace.
    """
    from statediff.trace import open_trace
    from statediff.trace.digest import digest_array

    out: dict[tuple[int, int, int, str], list[str]] = {}
    with open_trace(path) as t:
        for e in sorted([*t.entries, *t.digests], key=lambda e: (e.step, e.block, e.token_start)):
            d = e.digest_value
            if d is None:
                d = digest_array(t.read(e))
            out.setdefault((e.request, e.position, e.layer, e.kind), []).append(d)
    return out


def check_replay(new: str, reference: str) -> ReplayCheck:
    """Compare every digest of trace ``new`` with trace ``reference`` (same conversation and mode).

    Raises:
        TraceError: either file is not a readable trace.
    """
    from statediff.trace.schema import KIND_RANK

    a, b = trace_digests(new), trace_digests(reference)
    total = equal = 0
    first, why = None, ""
    # causal order (schema._Keyed.causal_order): request, position, layer, kind
    for key in sorted(a.keys() | b.keys(), key=lambda k: (k[0], k[1], k[2], KIND_RANK.get(k[3], 99))):
        da, db = a.get(key, []), b.get(key, [])
        for i in range(max(len(da), len(db))):
            total += 1
            if i < len(da) and i < len(db) and da[i] == db[i]:
                equal += 1
            elif first is None:
                first = key
                why = ("digest differs" if i < len(da) and i < len(db)
                       else "only in the new trace" if i < len(da) else "only in the reference")
    return ReplayCheck(reference, total, equal, first, why)
