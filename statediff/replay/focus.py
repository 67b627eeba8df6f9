"""The focus of a re-record: where ``statediff record --focus`` keeps data, as text and as compare says it.

A trace recorded with ``--keep hits`` or ``--keep none`` holds every
tensor's summary but the data of few: ``compare`` names the root from the
summaries, and when the root has no data on a side it prints the focus
(request ``R``, position ``P``, optionally layers) and the two commands
that record both runs again keeping data around it
(``statediff.replay.command``). The engine side parses the text form into
its keep policy (``statediff_hooks.recording.keep``); this module owns writing it and
reading a focus out of ``compare --json``. Pure Python: no engine, no trace I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def focus_text(focus: Mapping[str, Any]) -> str:
    """The ``--focus`` text form: ``request=R,position=P[,layers=L1/L2]`` (layers left out when none).

    Args:
        focus: ``{"request": R, "position": P, "layers": [...] | None}`` (``CompareResult.focus``).
    """
    words = [f"request={focus['request']}", f"position={focus['position']}"]
    layers = focus.get("layers") or []
    if layers:
        words.append("layers=" + "/".join(str(layer) for layer in layers))
    return ",".join(words)


def focus_from_compare(doc: Any) -> tuple[Any, str, str | None, str | None]:
    """The focus and the two trace paths of a ``statediff compare --json`` result.

    The focus is ``doc["focus"]`` when present, else the first root
    (``doc["roots"][0]``, else ``doc["first"]``): its request and position, every
    layer (a focused re-record keeps all layers around the root's position).

    Returns:
        (the focus ``{"request", "position"[, "layers"]}`` as the result holds it, unchecked: the
        caller validates it; where it came from, "focus" or "first root", for the caller's
        messages; the hit trace path; the cold trace path), a path None when the result has none.

    Raises:
        ValueError: not a compare result, or one without a divergence to focus on.
    """
    if not isinstance(doc, Mapping) or doc.get("statediff") != "compare":
        raise ValueError("not the output of `statediff compare --json`")
    paths = []
    for side in ("hit", "cold"):
        info = doc.get(side)
        p = info.get("path") if isinstance(info, Mapping) else None
        paths.append(p if isinstance(p, str) and p else None)
    if doc.get("focus") is not None:
        focus = doc["focus"]
        return (dict(focus) if isinstance(focus, Mapping) else focus), "focus", paths[0], paths[1]
    roots = doc.get("roots")
    first = roots[0] if isinstance(roots, list) and roots else doc.get("first")
    if first is None:
        raise ValueError("the compare result has no divergence to focus on (verdict: same)")
    first = first if isinstance(first, Mapping) else {}
    return {"request": first.get("request"), "position": first.get("position")}, "first root", paths[0], paths[1]
