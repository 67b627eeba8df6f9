"""``compare --plot``: per-request heatmaps of error over layer x boundary position.

Each cell is the worst pair of that (layer, position) over tensor kinds:
its error as a multiple of the threshold it was judged by (``severity``:
1 = at tolerance, or at the allowed multiple of the noise floor with a
noise file), on a log scale. Where the policy is bit identity (exact
replay), the cell shows the ULP distance instead. Bit-identical cells are
blank; roots are marked with a red X. At most ``MAX_PANELS`` requests are drawn
(those with any difference first). matplotlib is imported here only.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections import defaultdict

import numpy as np

from statediff.errors import StatediffError
from statediff.diff.result import CompareResult

MAX_PANELS = 12  # requests per figure; with more, only those with any difference are shown


def require_matplotlib() -> None:
    """Raise a one-line StatediffError when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise StatediffError("--plot needs matplotlib: pip install 'statediff[plot]' (or matplotlib)")


def plot(result: CompareResult, out: str | os.PathLike, *, ulp: bool | None = None) -> None:
    """Write the heatmaps of ``result`` to ``out`` (format from its extension, e.g. PNG).

    Args:
        ulp: colour by max ULP distance instead of severity; default: when
            the policy was bit identity (exact replay, no noise file).
    Raises:
        StatediffError: matplotlib missing, nothing to plot, or ``out`` unwritable.
    """
    require_matplotlib()
    ulp = result.bit_identity if ulp is None else ulp
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    cells: dict[int, dict[tuple[int, int], float]] = defaultdict(dict)
    for request, position, layer, _kind, severity, max_ulp in result.scores:
        value = float(max_ulp or 0) if ulp else severity
        key = (layer, position)
        cells[request][key] = max(cells[request].get(key, 0.0), value)
    if not cells:
        raise StatediffError("--plot: the traces have no aligned pairs to plot")
    if len(cells) > MAX_PANELS:  # keep the requests that differ at all, first ones first
        keep = [r for r in sorted(cells) if any(v > 0 for v in cells[r].values())][:MAX_PANELS]
        cells = {r: cells[r] for r in keep or sorted(cells)[:MAX_PANELS]}
    roots = {(d.request, d.layer, d.position) for d in result.roots}
    fig = Figure(figsize=(10, 2.2 * len(cells) + 0.6), layout="constrained")
    axes = fig.subplots(len(cells), 1, squeeze=False)[:, 0]
    finite = [v for c in cells.values() for v in c.values() if v > 0 and math.isfinite(v)]
    vmax = max([math.log10(v) for v in finite] + [1.0])
    vmin = min([math.log10(v) for v in finite] + [-1.0])
    label = "log10 ULP distance" if ulp else "log10 (error / allowed)"
    image = None
    for ax, (request, c) in zip(axes, sorted(cells.items())):
        layers = sorted({k[0] for k in c})
        positions = sorted({k[1] for k in c})
        grid = np.full((len(layers), len(positions)), np.nan)
        for (layer, pos), v in c.items():
            if v > 0:
                grid[layers.index(layer), positions.index(pos)] = math.log10(v) if math.isfinite(v) else vmax
        image = ax.imshow(grid, aspect="auto", cmap="magma_r", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(f"request {request}", fontsize=9, loc="left")
        ax.set_yticks(range(len(layers)), [str(x) for x in layers])
        ax.set_xticks(range(len(positions)), [str(p) for p in positions], fontsize=7, rotation=90)
        ax.set_ylabel("layer")
        for (r, layer, pos) in roots:
            if r == request and layer in layers and pos in positions:
                ax.plot(positions.index(pos), layers.index(layer), "x", color="red", markersize=12, mew=3)
    axes[-1].set_xlabel("boundary position (tokens)")
    fig.colorbar(image, ax=list(axes), label=label)
    fig.suptitle(f"statediff compare: {result.hit.path} vs {result.cold.path} "
                 "(blank: bit-identical; X: root)", fontsize=9)
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise StatediffError(f"cannot write plot {out}: {e.strerror or e}") from None
