"""JSON helpers shared by every package (below everything else in statediff)."""

from __future__ import annotations

import math
from typing import Any


def jsonable(x: Any) -> Any:
    """Recursively: tuples to lists, non-finite floats to strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
