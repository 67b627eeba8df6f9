"""Damaged data under a verdict that did not read it (``compare``, ``audit``).

``compare`` judges a pair with equal index hashes, or equal recorded digests,
without decoding either tensor: the hash and the digest were computed when
the tensor was recorded, so the verdict stands for what the engine held. But
the file's copy of the data may have been damaged since (a disk, a download,
a hand), and a SAME over damaged data must not be silent. So, for each pair
judged identical that way (and, in ``audit``, for each restore equal to its saved write):

- both sides with data: their stored (compressed) bytes are compared, chunk
  by chunk, without decoding (``Trace.stored_frames``): equal bytes of two
  tensors with the same hash are both intact or both damaged alike, which
  no accident does. Only when they differ (another chunking or compression
  level, or damage) is each side decoded and its hash checked;
- one side with data (the other a digest row): ``audit`` decodes that side
  and checks its hash; ``compare`` does not (judging such pairs from the
  recorded summaries, without decoding the data side, is what makes a
  digest-only hit trace cheap to compare: docs/digest-first.md).

A tensor whose data fails is named in one warning line (``DamageCheck.warnings``)
that suggests ``statediff verify``; the verdict, from the hash or digest, is kept.
"""

from __future__ import annotations

import dataclasses
import itertools

from typing import Any

from statediff.errors import TraceError, first_line

from .reader import Trace
from .schema import TensorEntry


@dataclasses.dataclass
class DamageCheck:
    """Running tally of ``check_pair`` over one compare.

    Attributes:
        damaged: one line per damaged tensor (the reader's refusal), each tensor once.
        decoded: tensors decoded to check their hash (their stored bytes did not settle it).
    """

    damaged: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (trace path, refusal)
    decoded: int = 0
    _seen: set = dataclasses.field(default_factory=set)

    def warnings(self) -> list[str]:
        """One warning line per damaged tensor, for ``CompareResult.warnings``."""
        return [f"{d}; the verdict on it rests on the digest recorded with it, not on its data "
                f"('statediff verify {path}' lists every damaged tensor)" for path, d in self.damaged]

    def check_pair(self, a: Trace, ea: Any, b: Trace, eb: Any) -> None:
        """Check the data of two tensors (``TensorEntry`` or digest rows) judged equal without
        reading it (see the module docstring)."""
        if isinstance(ea, TensorEntry) and isinstance(eb, TensorEntry):
            if _same_storage(a, ea, b, eb):
                return
            sides = ((a, ea), (b, eb))
        else:
            sides = tuple((t, e) for t, e in ((a, ea), (b, eb)) if isinstance(e, TensorEntry))
        for t, e in sides:
            key = (id(t), e.dataset)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.decoded += 1
            try:
                for _ in t.iter_blocks(e):  # the hash is checked after the last piece
                    pass
            except TraceError as err:
                self.damaged.append((str(t.path), first_line(err, 400)))


def _same_storage(a: Trace, ea: TensorEntry, b: Trace, eb: TensorEntry) -> bool:
    """Whether two tensors' stored bytes are equal (False too when either cannot be located)."""
    try:
        for x, y in itertools.zip_longest(a.stored_frames(ea), b.stored_frames(eb)):
            if x != y:
                return False
    except TraceError:
        return False
    return True
