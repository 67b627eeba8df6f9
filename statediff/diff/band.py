"""The default-replay noise model: how far apart two differently chunked, fault-free runs' states are.

A hit run and a cold run in default replay split their prefills at different
tokens; chunked GDN and conv1d kernels are not split-invariant, so a state can
differ by rounding. Measured on real pairs (docs/replay.md, "Default replay:
the noise model"), the relative L2 error ``||hit - cold|| / ||cold||`` of a
captured state stayed at or below ``4.46 u`` (``u = 2**-8``, the bfloat16
unit roundoff), so, when a pair's tolerance is the policy's ``REPLAY_BAND``
rule (``tolerance.Policy``: its dtype default in default replay, no ``--tol``
rule matched, no noise file, one engine version) and it exceeds that
elementwise, its relative L2 error decides:

- ``<= NOISE_MAX`` (8 u): rounding noise of different chunking, not a divergence;
- ``> ROOT_MIN`` (16 u): beyond the noise model, a divergence (it can be a root);
- in between: cannot be judged in default replay; the verdict says so and names
  the commands that make it judgeable (``statediff check``, or ``calibrate`` +
  ``compare --noise``).

NaN/Inf on one side only and dtype/shape differences are always divergences.
Pure Python; no numpy needed.
"""

from __future__ import annotations

import dataclasses

#: bfloat16's unit roundoff (2**-8): the unit the bands are given in.
U = 2.0 ** -8
#: Relative L2 error at or below which a default-replay difference is rounding noise (8 u).
NOISE_MAX = 8 * U
#: Relative L2 error above which a default-replay difference stands out of the noise (16 u).
ROOT_MIN = 16 * U


def band(rel_l2: float | None, high: float | None = None) -> str:
    """``"noise"``, ``"unsure"`` or ``"beyond"`` for a pair's relative L2 error (None or NaN:
    ``"beyond"``, nothing to measure it by). An estimate (digest-only pairs: the sketches' 99%
    interval, ``trace.summary.estimate_l2``) passes its interval as ``rel_l2`` (low end) and
    ``high``: noise only when all of it is within ``NOISE_MAX``, beyond only when all of it
    exceeds ``ROOT_MIN``."""
    if rel_l2 is None or rel_l2 != rel_l2:  # NaN: not measurable
        return "beyond"
    hi = rel_l2 if high is None else high
    if hi <= NOISE_MAX:
        return "noise"
    return "beyond" if rel_l2 > ROOT_MIN else "unsure"


@dataclasses.dataclass(frozen=True)
class BandSummary:
    """What the noise model decided in one comparison.

    Attributes:
        noise: pairs beyond their dtype default but within ``NOISE_MAX`` (not divergences).
        unsure: (request, position, layer, kind, relative L2 error) of the pairs between
            ``NOISE_MAX`` and ``ROOT_MIN``, in causal order.
        active: the band judged this comparison (default replay, no noise file).
    """

    noise: int = 0
    unsure: tuple[tuple[int, int, int, str, float], ...] = ()
    active: bool = False

    def to_text(self) -> str:
        """One line ('' when the band did not apply or decided nothing)."""
        if not self.active or not (self.noise or self.unsure):
            return ""
        head = (f"default-replay noise model (relative L2 error <= {NOISE_MAX:.4g} = 8u is rounding noise, "
                f"> {ROOT_MIN:.4g} = 16u a divergence, u = 2^-8): {self.noise} pair{'' if self.noise == 1 else 's'} "
                "within the noise")
        if self.unsure:
            r, p, layer, kind, e = self.unsure[0]
            head += (f", {len(self.unsure)} cannot be judged (first: request {r}, position {p}, layer {layer}, "
                     f"{kind}, relative L2 error {e:.4g} = {e / U:.1f}u)")
        return head

    def to_json(self) -> dict:
        return {"active": self.active, "noise": self.noise, "noise_max": NOISE_MAX, "root_min": ROOT_MIN,
                "unsure": [{"request": r, "position": p, "layer": la, "kind": k, "rel_l2": e}
                           for r, p, la, k, e in self.unsure]}
