"""``verify``: read every tensor, chunk and digest row of a trace (or of both traces of a bundle) and
check them.

``open_trace`` already validates the metadata (header, run, tables, every
``/index`` and ``/digests`` row, request records) and refuses a file whose
metadata is damaged: that trace is *unreadable* (exit 2). ``verify`` then
reads the data nothing else reads up front: every chunk of every tensor
with data is decoded and its bytes hashed against the index (XXH3-128),
the index fingerprint (NaN/Inf counts, min, max, sum, sum of squares) is
recomputed from the data, and so is the tensor's summary, when it has one
(``/digests`` row: exact digest, bfloat16 digest, moments, sketch:
``statediff.trace.summary.summarize``). A tensor whose bytes do not decode
or hash, or whose fingerprint or summary disagrees with its data, is
*damaged* and named by its key. Digest-only rows have no data to check;
they are counted (they were validated on open).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from statediff.errors import TraceError
from statediff.jsonutil import jsonable
from statediff.trace.fingerprint import fingerprint
from statediff.trace.reader import MAX_TENSOR_BYTES, Trace, open_trace
from statediff.trace.schema import TensorEntry
from statediff.trace.summary import Summary, summarize

MOMENT_RTOL = 1e-9  # float64 sums in another order differ by rounding only
SKETCH_RTOL = 1e-5  # of the tensor's L2 norm: the engine sums in float64 and rounds to float32
MAX_SUMMARY_BYTES = 1 << 30  # bigger tensors: hash and fingerprint only (their summary needs it in memory)


@dataclasses.dataclass(frozen=True)
class Damage:
    """One damaged tensor: its key and dataset, and what is wrong (one line)."""

    request: int
    position: int
    layer: int
    kind: str
    dataset: str
    problem: str

    def to_text(self) -> str:
        return (f"request {self.request} position {self.position} layer {self.layer} {self.kind} "
                f"({self.dataset}): {self.problem}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TraceCheck:
    """What ``verify`` found in one trace.

    Attributes:
        path: the trace (as named to the user).
        tensors: tensors with data, each read in full.
        intact: those whose bytes, fingerprint and summary agree.
        summaries: tensors with data whose summary was recomputed from the data.
        digest_only: ``/digests`` rows without data (validated on open; nothing to read).
        damaged: each damaged tensor, in causal order.
        partial_reason: why the trace is incomplete ("" when complete): not damage.
    """

    path: str
    tensors: int
    intact: int
    summaries: int
    digest_only: int
    damaged: tuple[Damage, ...]
    partial_reason: str = ""

    def to_text(self) -> str:
        state = "INTACT" if not self.damaged else "DAMAGED"
        out = [f"{state}: {self.path}: {self.intact} of {self.tensors} tensors with data intact "
               f"(every chunk decoded, hash checked; {self.summaries} summaries recomputed from the data), "
               f"{self.digest_only} digest-only rows valid"]
        if self.partial_reason:
            out.append(f"  incomplete (not damage): {self.partial_reason}")
        out += [f"  damaged: {d.to_text()}" for d in self.damaged]
        return "\n".join(out)

    def to_json(self) -> dict:
        return {"path": self.path, "intact": not self.damaged, "tensors": self.tensors,
                "intact_tensors": self.intact, "summaries_checked": self.summaries,
                "digest_only": self.digest_only, "damaged": [d.to_json() for d in self.damaged],
                "incomplete": self.partial_reason or None}


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """``verify`` of a trace or a bundle; ``exit_code`` 0 every trace intact, 1 a tensor damaged
    (or, in a bundle, a member whose size or SHA-256 disagrees with the manifest: ``members_damaged``,
    one line each naming ``BUNDLE.zip:folder/member``)."""

    target: str
    traces: tuple[TraceCheck, ...]
    members_damaged: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return 1 if self.members_damaged or any(t.damaged for t in self.traces) else 0

    def to_text(self) -> str:
        out = [f"DAMAGED: {m}" for m in self.members_damaged]
        return "\n".join(out + [t.to_text() for t in self.traces])

    def to_json(self) -> dict:
        return jsonable({"statediff": "verify", "target": self.target, "exit_code": self.exit_code,
                         "intact": self.exit_code == 0, "members_damaged": list(self.members_damaged),
                         "traces": [t.to_json() for t in self.traces]})


def verify(path: str | os.PathLike) -> VerifyResult:
    """Verify a trace (file or ``.parts`` directory) or a bundle (``.zip``: every member's size and
    SHA-256 against its manifest, and both its traces).

    Raises:
        TraceError: a trace cannot be opened (unreadable: missing, not a trace, damaged metadata).
        StatediffError: a bundle that is not a readable bundle.
    """
    from statediff.incident.unpack import looks_like_bundle, open_bundle

    if looks_like_bundle(path):
        with open_bundle(path, strict=False) as b:  # a member that fails its hash is damage, exit 1
            paths = [b.hit, b.cold] + [p for r in sorted(b.ranks) for p in b.ranks[r]]  # + a set's other ranks
            checks = tuple(verify_trace(p, b.name(p.name)) for p in paths  # a damaged trace
                           if not any(d.startswith(b.name(p.name) + " ") for d in b.damaged))  # is named, not read
        return VerifyResult(str(path), checks, b.damaged)
    return VerifyResult(str(path), (verify_trace(path),))


def verify_trace(path: str | os.PathLike, name: str | None = None) -> TraceCheck:
    """Read and check every tensor of one trace (see the module docstring).

    Raises:
        TraceError: the trace cannot be opened.
    """
    damaged, summaries = [], 0
    with open_trace(path) as t:
        for e in t.entries:
            try:
                summaries += check_tensor(t, e)
            except TraceError as err:
                damaged.append(Damage(e.request, e.position, e.layer, e.kind, e.dataset, _problem(err, e)))
        return TraceCheck(name or str(path), len(t.entries), len(t.entries) - len(damaged), summaries,
                          len(t.digests), tuple(damaged), t.partial_reason if t.partial else "")


def _problem(err: TraceError, e: TensorEntry) -> str:
    """The refusal without the file and tensor it starts with (the key names them)."""
    text = str(err)
    label = f"({e.label()})"
    if label in text:
        text = text.split(label, 1)[1]
    return text.removeprefix(" is damaged").lstrip(": ")


def check_tensor(t: Trace, e: TensorEntry) -> int:
    """Check one tensor: every chunk decodes, the bytes hash to the index's hash, the index
    fingerprint and (when it has one) the summary agree with the data.

    Returns:
        1 when its summary was recomputed, else 0.
    Raises:
        TraceError: the tensor is damaged (the message says how).
    """
    if t.nbytes(e) > MAX_TENSOR_BYTES:
        for _ in t.iter_blocks(e):  # hash checked as the pieces go by; too big to summarise here
            pass
        return 0
    with np.errstate(all="ignore"):  # damaged bytes may decode to anything; the checks say so
        arr = t.read(e)  # every chunk decoded, hash checked
        _check_fingerprint(e, fingerprint(arr, e.dtype))
        if e.summary is None or t.nbytes(e) > MAX_SUMMARY_BYTES:
            return 0
        _check_summary(e, e.summary, summarize(arr, e.dtype))
    return 1


def _close(a: float, b: float, scale: float = 0.0, rtol: float = MOMENT_RTOL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), scale) + 1e-300


def _check_fingerprint(e: TensorEntry, fp: dict[str, Any]) -> None:
    bad = [k for k in ("n_nan", "n_inf", "min", "max") if fp[k] != getattr(e, k)
           and not (isinstance(fp[k], float) and math.isnan(fp[k]) and math.isnan(getattr(e, k)))]
    bad += [k for k in ("sum", "sumsq") if not _close(fp[k], getattr(e, k), math.sqrt(abs(fp["sumsq"])))]
    if bad:
        raise TraceError(f"its index fingerprint disagrees with its data on {', '.join(bad)}")


def _check_summary(e: TensorEntry, recorded: Summary, data: Summary) -> None:
    bad = []
    if recorded.digest != data.digest:
        bad.append("digest")
    if recorded.digest_bf16 and recorded.digest_bf16 != data.digest_bf16:
        bad.append("bfloat16 digest")
    for k in ("n_nan", "n_inf"):
        if getattr(recorded, k) >= 0 and getattr(recorded, k) != getattr(data, k):
            bad.append(k)
    norm = math.sqrt(data.sumsq) if data.sumsq >= 0 else 0.0
    if recorded.known_moments:
        bad += [k for k in ("sum", "sumsq", "absmax")
                if not _close(getattr(recorded, k), getattr(data, k), norm, 1e-6)]
    if recorded.sketch is not None and data.sketch is not None and not all(
            _close(a, b, norm, SKETCH_RTOL) for a, b in zip(recorded.sketch, data.sketch)):
        bad.append("sketch")
    if bad:
        raise TraceError(f"its summary (/digests row) disagrees with its data on {', '.join(bad)}")
