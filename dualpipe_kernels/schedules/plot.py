"""PNG timelines of schedules (matplotlib's Agg canvas: no display, no pyplot state).

One row per rank (rank 0 on top).  Compute boxes are coloured by kind (F, B,
I, W); an F&B pair is drawn as one box split in two, F on top and its
backward below, so both micro-batch numbers show.  A rank's second (third...)
stage chunk uses a lighter shade of the same colour, so DualPipe's two
directions and DualPipeV's V read apart.  Transfers, when they take time, are
drawn as a thin grey band under the rank's compute row.  Micro-batch numbers
are printed in boxes wide enough to hold them.

:func:`plot_overlay` draws a measured timeline as outlines over a simulated
one drawn as fills, for the benchmark suite.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .simulator import SimEvent, SimResult
from .trace import Timeline, to_events

__all__ = ["KIND_COLOURS", "plot_timeline", "plot_overlay", "plot_comparison", "timeline_title", "write_docs_pictures"]

KIND_COLOURS: dict[str, str] = {
    "F": "#3a7dc9",
    "B": "#e8833a",
    "I": "#d0443e",
    "W": "#4aa35a",
    "F&B": "#8a5cc2",
    "comm": "#9a9a9a",
}
_DPI = 110
_BOX_PX = 19  # pixels for the shortest box: fits a 2-digit label at 7 pt
_LEGEND_IN = 0.45  # inches kept under the axes for the legend
_LEGEND = (("F", "F (forward)"), ("B", "B (full backward)"), ("I", "I (input grad)"), ("W", "W (weight grad)"))


def _shade(colour: str, chunk: int) -> tuple[float, float, float]:
    """Lighter for later chunks: blend toward white by 0.45 per chunk (capped)."""
    r, g, b = to_rgb(colour)
    k = min(0.45 * chunk, 0.7)
    return (r + (1 - r) * k, g + (1 - g) * k, b + (1 - b) * k)


def timeline_title(result: SimResult) -> str:
    return (
        f"{result.schedule}: {result.ranks} ranks, {result.stages} stage chunks, {result.microbatches} micro-batches; "
        f"makespan {float(result.makespan):g}, bubble {float(result.bubble):g} "
        f"({result.bubble_ratio:.1%} of makespan)"
    )


def _width(events: list[SimEvent]) -> float:
    """Figure width (inches) at which the shortest compute box holds a two-digit number (8 to 60 in)."""
    durations = [float(e.end - e.start) for e in events if e.track == "compute" and e.end > e.start]
    span = float(max(e.end for e in events)) - float(min(e.start for e in events))
    shortest = min(durations, default=span) or 1.0
    return min(max(1.8 + span / shortest * _BOX_PX / _DPI, 8.0), 60.0)


def _new_figure(width: float, height: float) -> Figure:
    """A figure drawn by Agg directly: no pyplot, so no global figure registry and no backend switch."""
    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _figure(events: list[SimEvent], ranks: int) -> tuple[Figure, Any]:
    fig = _new_figure(_width(events), _LEGEND_IN + 1.1 + 0.55 * ranks)
    return fig, fig.subplots()


class _Boxes:
    """Collects rectangles and labels, then adds them to an axis in two calls."""

    def __init__(self, ax: Any) -> None:
        self.ax = ax
        self.rects: list[Rectangle] = []
        self.faces: list[Any] = []
        self.edges: list[Any] = []
        self.labels: list[tuple[float, float, str, float, float]] = []

    def add(self, x: float, y: float, w: float, h: float, face: Any, edge: Any, label: str | None = None) -> None:
        self.rects.append(Rectangle((x, y), w, h))
        self.faces.append(face)
        self.edges.append(edge)
        if label is not None:
            self.labels.append((x + w / 2, y + h / 2, label, w, h))

    def draw(self, linewidth: float, fontsize: float) -> None:
        if self.rects:
            coll = PatchCollection(self.rects, facecolors=self.faces, edgecolors=self.edges, linewidths=linewidth)
            self.ax.add_collection(coll)
        # Called after the layout is final, so the (linear) data-to-pixel scale is fixed.
        fig = self.ax.figure
        (x0, y0), (x1, y1) = self.ax.transData.transform([(0.0, 0.0), (1.0, 1.0)])
        sx, sy = abs(x1 - x0), abs(y1 - y0)
        char_px = fontsize * fig.dpi / 72 * 0.62
        line_px = fontsize * fig.dpi / 72 * 1.05
        for cx, cy, text, w, h in self.labels:
            if w * sx >= char_px * len(text) + 2 and h * sy >= line_px:
                self.ax.text(cx, cy, text, ha="center", va="center", fontsize=fontsize, color="black")


def _draw(boxes: _Boxes, events: list[SimEvent], has_comm: bool, outline: bool = False, labels: bool = True) -> None:
    top, height = (-0.42, 0.62) if has_comm else (-0.42, 0.84)
    for e in events:
        x, w = float(e.start), float(e.end - e.start)
        if e.track == "comm":
            if not has_comm or w <= 0 or e.kind.startswith("RECV"):
                continue  # sends show the transfer; a recv's wait shows as the gap before its consumer
            y = e.rank + 0.24
            face = "none" if outline else KIND_COLOURS["comm"]
            boxes.add(x, y, w, 0.16, face, KIND_COLOURS["comm"] if outline else "white")
            continue
        y = e.rank + top
        if e.kind == "F&B":
            half = height / 2
            f_col = _shade(KIND_COLOURS["F"], e.chunk)
            b_col = _shade(KIND_COLOURS[e.backward_kind or "B"], e.chunk2)
            if outline:
                boxes.add(x, y, w, height, "none", KIND_COLOURS["F&B"])
                continue
            boxes.add(x, y, w, half, f_col, "white", str(e.microbatch) if labels else None)
            boxes.add(x, y + half, w, half, b_col, "white", str(e.microbatch2) if labels else None)
            # a frame marks the pair as one overlapped unit
            boxes.add(x, y, w, height, "none", KIND_COLOURS["F&B"])
            continue
        colour = _shade(KIND_COLOURS.get(e.kind, "#777777"), e.chunk)
        if outline:
            boxes.add(x, y, w, height, "none", KIND_COLOURS.get(e.kind, "#777777"))
        else:
            boxes.add(x, y, w, height, colour, "white", str(e.microbatch) if labels else None)


def _has_transfers(events: list[SimEvent]) -> bool:
    """True when some transfer takes time (a receive's wait alone does not count)."""
    return any(e.kind.startswith("SEND") and e.end > e.start for e in events)


def _style_axis(ax: Any, ranks: int, xmax: float, title: str) -> None:
    ax.set_xlim(0, xmax * 1.005 if xmax > 0 else 1)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _legend(fig: Figure, has_comm: bool, extra_legend: Sequence[Patch] = (), top_in: float = 0.0) -> None:
    """One legend under the axes; lays the figure out around it."""
    handles = [Patch(facecolor=KIND_COLOURS[k], label=lbl) for k, lbl in _LEGEND]
    handles.append(Patch(facecolor="white", edgecolor=KIND_COLOURS["F&B"], linewidth=1.5, label="F&B pair (F above)"))
    handles.append(Patch(facecolor=_shade(KIND_COLOURS["F"], 1), label="lighter: rank's 2nd chunk"))
    if has_comm:
        handles.append(Patch(facecolor=KIND_COLOURS["comm"], label="transfer (link busy to arrival)"))
    handles.extend(extra_legend)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    h = fig.get_figheight()
    fig.tight_layout(rect=(0, _LEGEND_IN / h, 1, 1 - top_in / h))


def _finish(ax: Any, ranks: int, xmax: float, title: str, has_comm: bool, extra_legend: Sequence[Patch] = ()) -> None:
    _style_axis(ax, ranks, xmax, title)
    _legend(ax.figure, has_comm, extra_legend)


def plot_timeline(
    timeline: Timeline | SimResult,
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    show_comm: bool = True,
) -> Figure:
    """Draw a simulated result (or any timeline) and save it to ``path`` (PNG) if given."""
    result = timeline if isinstance(timeline, SimResult) else None
    events = result.events if result is not None else to_events(timeline)  # type: ignore[arg-type]
    if not events:
        raise ValueError("cannot plot an empty timeline")
    ranks = 1 + max(e.rank for e in events)
    has_comm = show_comm and _has_transfers(events)
    fig, ax = _figure(events, ranks)
    boxes = _Boxes(ax)
    _draw(boxes, events, has_comm)
    xmax = float(max(e.end for e in events))
    if title is None:
        title = timeline_title(result) if result is not None else f"timeline: {ranks} ranks"
    _finish(ax, ranks, xmax, title, has_comm)
    boxes.draw(linewidth=0.6, fontsize=7)
    if path is not None:
        _save(fig, path)
    return fig


def plot_overlay(
    simulated: Timeline | SimResult,
    measured: Timeline,
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    align_start: bool = True,
) -> Figure:
    """Simulated timeline as fills, measured one as outlines on the same axes.

    Both timelines must be in the same time unit (seconds for the runtime).
    ``align_start`` shifts the measured events so the earliest starts at 0.
    The title gives the measured / simulated makespan ratio.
    """
    sim = simulated.events if isinstance(simulated, SimResult) else to_events(simulated)
    meas = to_events(measured)
    if not sim or not meas:
        raise ValueError("plot_overlay needs two non-empty timelines")
    if align_start:
        t0 = min(e.start for e in meas)
        meas = [
            SimEvent(
                e.rank,
                e.action,
                e.kind,
                e.start - t0,
                e.end - t0,
                e.stage,
                e.microbatch,
                e.track,
                e.peer,
                e.stage2,
                e.microbatch2,
                e.chunk,
                e.backward_kind,
                e.chunk2,
            )
            for e in meas
        ]
    ranks = 1 + max(max(e.rank for e in sim), max(e.rank for e in meas))
    has_comm = _has_transfers(sim) or _has_transfers(meas)
    fig, ax = _figure(sim, ranks)
    fills, lines = _Boxes(ax), _Boxes(ax)
    _draw(fills, sim, has_comm)
    _draw(lines, meas, has_comm, outline=True, labels=False)
    sim_end = float(max(e.end for e in sim))
    meas_end = float(max(e.end for e in meas))
    if title is None:
        title = "simulated (fill) vs measured (outline)"
    title += f"; measured / simulated makespan = {meas_end / sim_end:.3f}" if sim_end > 0 else ""
    outline = Patch(facecolor="none", edgecolor="black", label="measured (outline)")
    _finish(ax, ranks, max(sim_end, meas_end), title, has_comm, [outline])
    fills.draw(linewidth=0.6, fontsize=7)
    lines.draw(linewidth=1.3, fontsize=7)
    if path is not None:
        _save(fig, path)
    return fig


def plot_comparison(
    results: Sequence[SimResult], path: str | os.PathLike[str] | None = None, title: str | None = None
) -> Figure:
    """Several simulated schedules stacked on one shared time axis (one panel each, titled with its bubble)."""
    if not results:
        raise ValueError("plot_comparison needs at least one result")
    events = [r.events for r in results]
    xmax = max(float(r.makespan) for r in results)
    width = _width([e for evs in events for e in evs])
    heights = [0.55 * r.ranks + 0.6 for r in results]
    fig = _new_figure(width, _LEGEND_IN + 0.75 + sum(heights))
    axes = fig.subplots(
        len(results),
        1,
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    has_comm = any(_has_transfers(evs) for evs in events)
    all_boxes = []
    for ax, res, evs in zip(axes[:, 0], results, events, strict=True):
        boxes = _Boxes(ax)
        _draw(boxes, evs, has_comm)
        _style_axis(ax, res.ranks, xmax, timeline_title(res))
        all_boxes.append(boxes)
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    if title:
        fig.suptitle(title, fontsize=11)
    _legend(fig, has_comm, top_in=0.35 if title else 0.0)
    for boxes in all_boxes:
        boxes.draw(linewidth=0.6, fontsize=7)
    if path is not None:
        _save(fig, path)
    return fig


def write_docs_pictures(out_dir: str | os.PathLike[str]) -> list[str]:
    """Regenerate the pictures of docs/schedules.md in ``out_dir``; returns the paths written.

    Costs F=1, B=2, W=1 (so F = B - W = W), F&B=2.5 (the pair hides half an F), no comm:
    the regime where the reference table's bubbles hold exactly.
    """
    from .costs import CostModel
    from .generators import build_schedule
    from .simulator import simulate

    costs = CostModel(f=1, b=2, w=1, fb=Fraction(5, 2))
    written = []
    for name, ranks, n in (("dualpipev", 4, 10), ("dualpipe", 8, 20)):
        path = os.path.join(out_dir, f"{name}_{ranks}x{n}.png")
        plot_timeline(simulate(build_schedule(name, ranks, n), costs), path)
        written.append(path)
    # Same model (8 stages' worth), same 8 devices, 16 micro-batches: DualPipeV's 16 chunks are half stages,
    # so its chunk costs are halved; the others run whole stages.
    whole = CostModel(f=2, b=4, w=2, fb=5)
    half = CostModel(f=1, b=2, w=1, fb=Fraction(5, 2))
    results = [simulate(build_schedule(name, 8, 16), whole) for name in ("1f1b", "zb1p", "dualpipe")]
    results.append(simulate(build_schedule("dualpipev", 8, 16), half))
    path = os.path.join(out_dir, "schedules_8ranks_compared.png")
    plot_comparison(results, path, "one model on 8 devices, 16 micro-batches, no comm cost")
    written.append(path)
    return written


if __name__ == "__main__":
    import sys

    for p in write_docs_pictures(sys.argv[1] if len(sys.argv) > 1 else "docs"):
        print(p)


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Save ``fig`` at exactly ``path``: its suffix names the format, PNG when it names none.

    (matplotlib would otherwise append ``.png`` to a name without a suffix, writing another file.)
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    fig.savefig(path, format=fmt)
