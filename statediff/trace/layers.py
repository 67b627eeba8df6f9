"""Whose layer a recorded layer number is: the target's or the drafter's, from run metadata alone.

A speculative drafter's own layers (an MTP head, an EAGLE/EAGLE-3 drafter) are recorded under numbers
past the target's decoder layers (vLLM numbers them so: MTP ``mtp.layers.i`` as ``num_hidden_layers + i``,
an EAGLE-3 drafter on a 4-layer target as ``model.layers.4``). Only the number would tell a reader; this
module names them as the drafter's ("drafter layer 0 (layer 4, model.layers.4.self_attn.attn)").

Sources (``docs/trace-format.md``): run field ``layers`` (entries with ``"drafter": true``) and run
field ``drafter.model_input.layer`` (the drafter's first layer, where the rows its forward receives
are recorded). Traces without them read as before: every layer is the target's. Kind
``drafter.input`` (the rows the runner hands the drafter) is numbered by the *target* layer it was
tapped from, so it is never labelled as the drafter's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Kinds whose layer number is the target's even when it equals a drafter layer's number.
TARGET_NUMBERED = ("drafter.input",)


def drafter_layers(run: Mapping[str, Any]) -> dict[int, int]:
    """Recorded layer number -> index among the drafter's own layers (0 = its first), from run metadata;
    empty when the run names none."""
    own: set[int] = set()
    for d in run.get("layers") or ():
        if isinstance(d, Mapping) and d.get("drafter") is True and type(d.get("layer")) is int:
            own.add(d["layer"])
    dr = run.get("drafter")
    mi = dr.get("model_input") if isinstance(dr, Mapping) else None
    if isinstance(mi, Mapping) and type(mi.get("layer")) is int:
        own.add(mi["layer"])
    return {layer: i for i, layer in enumerate(sorted(own))}


def drafter_index(run: Mapping[str, Any], layer: int, kind: str) -> int | None:
    """The drafter-layer index of a tensor of ``kind`` at recorded ``layer``; None: a target layer."""
    if kind in TARGET_NUMBERED:
        return None
    return drafter_layers(run).get(layer)


def layer_text(layer: int, drafter: int | None, module: str | None = None) -> str:
    """"layer 3 (model.layers.3.self_attn.attn)" for a target layer; "drafter layer 0 (layer 4,
    model.layers.4.self_attn.attn)" for the drafter's (``drafter``: its index, or None);
    without ``module``: "layer 3", "drafter layer 0 (layer 4)"."""
    if drafter is None:
        return f"layer {layer}" + (f" ({module})" if module else "")
    return f"drafter layer {drafter} (layer {layer}" + (f", {module})" if module else ")")


def label(run: Mapping[str, Any], layer: int, kind: str, module: str | None = None) -> str:
    """``layer_text`` of a tensor of ``kind`` at ``layer`` in a run with metadata ``run``."""
    return layer_text(layer, drafter_index(run, layer, kind), module)
