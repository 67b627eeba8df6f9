"""``compare --plot``: per-request heatmaps of the error over layer x boundary position.

A cell is one (layer, position) of one request, the worst of the tensor
kinds there, coloured by its relative L2 error |hit - cold| / |cold| on a
log scale. White: bit-identical; grey hatched: not captured (no pair
there); a black frame: beyond tolerance; a red X: a root; a dashed line:
where the hit run resumed from the prefix cache. matplotlib is imported
here only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path

import numpy as np

from statediff.errors import StatediffError
from statediff.diff.result import CompareResult

MAX_PANELS = 12  # requests per figure; with more, only those with any difference are shown
MAX_TICKS = 16  # position (and layer) labels per panel; more would overlap
SCALE = (1e-8, 10.0)  # colour range of the relative L2 error; outside it, the end colours


@dataclasses.dataclass(frozen=True)
class Panel:
    """One request's heatmap data.

    Attributes:
        request: request index.
        layers, positions: the rows and columns (sorted; positions in tokens).
        error: float64 [len(layers), len(positions)]: NaN not captured, 0
            bit-identical, > 0 relative L2 error, inf not measurable
            (dtype/shape differ, NaN/Inf on one side only).
        diverged: (layer, position) cells beyond tolerance.
        roots: (layer, position) cells holding a root divergence.
        hit_at: the hit run's cached tokens for this request (0: no hit, None: unknown).
    """

    request: int
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    error: np.ndarray
    diverged: frozenset[tuple[int, int]]
    roots: frozenset[tuple[int, int]]
    hit_at: int | None

    @property
    def differs(self) -> bool:
        return bool(np.nan_to_num(self.error, nan=0.0).any())


def require_matplotlib() -> None:
    """Raise a one-line StatediffError when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise StatediffError("--plot needs matplotlib: pip install 'statediff[plot]' (or matplotlib)")


def panels(result: CompareResult) -> list[Panel]:
    """The heatmap data of ``result``, one panel per request (at most ``MAX_PANELS``, differing ones first)."""
    worst: dict[int, dict[tuple[int, int], float]] = {}
    for row in result.scores:
        request, position, layer = row[0], row[1], row[2]
        rel = row[6] if len(row) > 6 else None
        value = math.inf if rel is None or math.isnan(rel) else rel
        if row[4] == 0:  # identical (severity 0); a pair without metrics has severity inf
            value = 0.0
        cell = worst.setdefault(request, {})
        cell[(layer, position)] = max(cell.get((layer, position), 0.0), value)
    diverged = {(d.request, d.layer, d.position) for d in result.divergences}
    for r, layer, pos in diverged:  # beyond tolerance but 0 relative error (NaN on one side, -0.0): not white
        if worst.get(r, {}).get((layer, pos)) == 0.0:
            worst[r][(layer, pos)] = math.inf
    roots = {(d.request, d.layer, d.position) for d in result.roots}
    hits = {row.request: row.cached[0] for row in result.requests}
    out = []
    for request, cells in sorted(worst.items()):
        layers = tuple(sorted({k[0] for k in cells}))
        positions = tuple(sorted({k[1] for k in cells}))
        grid = np.full((len(layers), len(positions)), np.nan)
        for (layer, pos), v in cells.items():
            grid[layers.index(layer), positions.index(pos)] = v
        out.append(Panel(request, layers, positions, grid,
                         frozenset((lay, p) for r, lay, p in diverged if r == request),
                         frozenset((lay, p) for r, lay, p in roots if r == request), hits.get(request)))
    if len(out) > MAX_PANELS:  # keep the requests that differ at all, first ones first
        out = [p for p in out if p.differs][:MAX_PANELS] or out[:MAX_PANELS]
    return out


def _ticks(n: int, keep: set[int] = frozenset()) -> list[int]:
    """At most ``MAX_TICKS`` evenly spaced indices of ``n`` labels, plus those in ``keep`` (whose
    neighbours closer than half a step give way, so that labels do not overlap)."""
    step = max(1, math.ceil(n / MAX_TICKS))
    keep = {i for i in keep if 0 <= i < n}
    even = {i for i in range(0, n, step) if all(abs(i - k) * 2 >= step for k in keep)}
    return sorted(even | keep)


def write_plot(result: CompareResult, out: str | os.PathLike) -> Path:
    """Write the heatmaps of ``result`` to ``out`` (format from its extension, e.g. PNG).

    Returns:
        the path written.
    Raises:
        StatediffError: matplotlib missing, nothing to plot, or ``out`` unwritable.
    """
    require_matplotlib()
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    data = panels(result)
    if not data:
        raise StatediffError("--plot: the traces have no aligned pairs to plot")
    heights = [min(5.0, max(1.4, 0.12 * len(p.layers) + 0.9)) for p in data]
    fig = Figure(figsize=(11, sum(heights) + 1.2), layout="constrained")
    axes = fig.subplots(len(data), 1, squeeze=False, height_ratios=heights)[:, 0]
    norm = LogNorm(*SCALE, clip=True)
    cmap = "magma_r"
    image = None
    hatch = dict(facecolor="#e6e6e6", edgecolor="#a8a8a8", hatch="///", linewidth=0)
    for ax, p in zip(axes, data):
        ny, nx = p.error.shape
        ax.add_patch(Rectangle((-0.5, -0.5), nx, ny, zorder=-1, **hatch))  # shows where nothing was captured
        identical = np.ma.masked_where(p.error != 0, np.ones_like(p.error))
        ax.imshow(identical, aspect="auto", cmap=ListedColormap(["white"]), interpolation="nearest")
        errors = np.ma.masked_where(~(p.error > 0), np.minimum(p.error, SCALE[1]))
        image = ax.imshow(errors, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        for layer, pos in p.diverged:
            ax.add_patch(Rectangle((p.positions.index(pos) - 0.5, p.layers.index(layer) - 0.5), 1, 1,
                                   fill=False, edgecolor="black", linewidth=1.6))
        for layer, pos in p.roots:
            ax.plot(p.positions.index(pos), p.layers.index(layer), "x", color="red", markersize=11, mew=3)
        keep = set()
        if p.hit_at:
            col = next((i for i, pos in enumerate(p.positions) if pos >= p.hit_at), nx)
            ax.axvline(col - 0.5, color="#1f77b4", linestyle="--", linewidth=1.5)
            keep.add(col)
        hit = "no cache hit" if p.hit_at == 0 else "" if p.hit_at is None else f"cache hit: {p.hit_at} tokens"
        ax.set_title(f"request {p.request}" + (f"  ({hit})" if hit else ""), fontsize=9, loc="left")
        xt = _ticks(nx, keep)
        ax.set_xticks(xt, [str(p.positions[i]) for i in xt], fontsize=8)
        for i, label in zip(xt, ax.get_xticklabels()):
            if i in keep:  # the line sits on the panel's edge when the hit run starts at the hit
                label.set(color="#1f77b4", fontweight="bold")
        yt = _ticks(ny)
        ax.set_yticks(yt, [str(p.layers[i]) for i in yt], fontsize=8)
        ax.set_xlim(-0.5, nx - 0.5)
        ax.set_ylim(ny - 0.5, -0.5)
        ax.set_ylabel("layer", fontsize=8)
    axes[-1].set_xlabel("boundary position (tokens)", fontsize=9)
    fig.colorbar(image, ax=list(axes), extend="both", shrink=min(1.0, 6 / max(1.0, sum(heights))),
                 label="relative L2 error |hit - cold| / |cold|")
    legend = [Patch(facecolor="white", edgecolor="#808080", label="bit-identical"),
              Patch(label="not captured", **hatch),
              Patch(facecolor="none", edgecolor="black", linewidth=1.6, label="beyond tolerance"),
              Line2D([], [], marker="x", color="red", linestyle="none", markersize=9, mew=2.5, label="root"),
              Line2D([], [], color="#1f77b4", linestyle="--", label="hit run resumes here (blue position)")]
    fig.legend(handles=legend, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(f"statediff compare: {Path(result.hit.path).name} (hit) vs {Path(result.cold.path).name} (cold)",
                 fontsize=10)
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as e:  # ValueError: an extension matplotlib does not write
        raise StatediffError(f"cannot write plot {out}: {getattr(e, 'strerror', None) or e}") from None
    return Path(out)
