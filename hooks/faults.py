"""Planted faults: corrupt one named state on the cache-hit path only.

A user runs ``statediff record --fault ...`` on their own setup to prove
that the pipeline catches a known restore bug before trusting a clean
result. Each fault fires once, on the first request that resumes from a
prefix-cache hit deep enough for it, after the engine restored the state
and before the forward reads it. The recorder notes in the run metadata
exactly where it fired (request, position, layer, tensor kind).

Spec syntax: ``NAME[:layer=L][:request=R]``, e.g. ``ssm-wrong-block:layer=1``.
"""

from __future__ import annotations

import dataclasses

# name -> (tensor kind it corrupts, minimum hit length in blocks, description)
FAULTS = {
    "ssm-wrong-block": ("gdn.ssm_state", 2, "SSM state resumed from the checkpoint one block too early"),
    "conv-zero": ("gdn.conv_state", 1, "conv state zeroed (as if never written)"),
    "ssm-bf16": ("gdn.ssm_state", 1, "SSM state rounded to bfloat16 on restore"),
    "ssm-nan": ("gdn.ssm_state", 1, "one NaN written into the resumed SSM state"),
    "kv-swap": ("attn.k", 2, "the last two cached KV blocks swapped (K and V)"),
    # speculative decoding (hooks/vllm/spec_v1.py): fires in the first step after the hit
    "drafter-perturb": ("drafter.input", 1, "drafter input features of one tapped layer negated "
                        "at the rows right after the hit boundary, before the drafter reads them"),
}


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A parsed fault spec. ``layer``/``request`` None mean: first eligible."""

    name: str
    layer: int | None = None
    request: int | None = None

    @property
    def kind(self) -> str:
        return FAULTS[self.name][0]

    @property
    def min_blocks(self) -> int:
        return FAULTS[self.name][1]

    @property
    def spec(self) -> str:
        s = self.name
        if self.layer is not None:
            s += f":layer={self.layer}"
        if self.request is not None:
            s += f":request={self.request}"
        return s


def parse_fault(text: str) -> FaultSpec | None:
    """Parse ``NAME[:layer=L][:request=R]``; empty text means no fault.

    Raises:
        ValueError: unknown fault name or malformed option (message lists the valid names).
    """
    text = text.strip()
    if not text:
        return None
    name, *opts = text.split(":")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    kw: dict[str, int] = {}
    for opt in opts:
        key, sep, val = opt.partition("=")
        if not sep or key not in ("layer", "request") or not val.lstrip("-").isdigit():
            raise ValueError(f"bad fault option {opt!r} in {text!r}; expected layer=N or request=N")
        kw[key] = int(val)
    return FaultSpec(name, **kw)
