"""The pipeline's plots: accuracy vs training time, and the memory plot (the method table is
edgeflux.summary's).

Works on what the stages wrote, handed over by the report stage, which owns the file paths:
accuracy-vs-time curves as CSV paths or (times, accs). BarPanel / plot_bar_panels draw grouped bars
(memory per unit, peak per block) for the report stage and the benchmarks alike.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeflux.colours import method_colour
from edgeflux.memory import OUTSIDE_UNITS, MiB

# An accuracy-vs-time curve: a CSV with time_s, cpu_s and val_acc columns (as the training stages write
# them; a path that does not exist is no curve), or its (times, accs) already read.
Curve = Path | tuple[list[float], list[float]]


def time_to_target(times: list[float], accs: list[float], target: float) -> float | None:
    return next((t for t, a in zip(times, accs) if a >= target), None)


def read_curve(path: Path, x: str = "cpu_s") -> tuple[list[float], list[float]]:
    """(x, val_acc) of a curve CSV; x is the process's CPU time by default (steady on a loaded machine),
    the wall clock (time_s) where the file has no CPU time."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    column = x if rows and all(r.get(x) not in (None, "") for r in rows) else "time_s"
    return [float(r[column]) for r in rows], [float(r["val_acc"]) for r in rows]


def _points(curve: Curve | None) -> tuple[list[float], list[float]] | None:
    """(times, accs) of `curve`; None where there is none (not given, or its file not written)."""
    if curve is None or isinstance(curve, tuple):
        return curve
    return read_curve(Path(curve)) if Path(curve).exists() else None


def plot_accuracy_vs_time(curves: dict[str, Curve], out: Path, target_acc: float | None = None) -> None:
    """Validation accuracy against training CPU time (evaluation excluded), one line per curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, curve in curves.items():
        if (points := _points(curve)) is not None:
            # a composition thin, dashed and on top of a wide line for its method: its curve may lie on the
            # method's (MobileTL + BitTrain trains as MobileTL), which then still shows at both edges
            dashed = " + " in label or " on " in label
            ax.plot(*points, marker="o", markersize=3 if dashed else 5, label=label, color=method_colour(label),
                    linestyle="--" if dashed else "-", linewidth=1.2 if dashed else 2.4, zorder=3 if dashed else 2)
    if target_acc is not None:
        ax.axhline(target_acc, color="grey", linestyle="--", linewidth=1, label=f"target {target_acc:.0%}")
    ax.set(xlabel="training CPU time (s, every thread; the wall clock stretches on a loaded machine)",
           ylabel="validation accuracy", title="Accuracy vs training CPU time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- bar charts (memory per unit)


@dataclass
class BarPanel:
    """One grouped bar chart: at each category (a unit, a block) one bar per series."""

    title: str
    categories: list[str]
    series: dict[str, list[float]]            # label -> one value per category (bytes, unless scale says otherwise)
    ylabel: str = "MiB"
    scale: float = MiB                        # values are divided by this before drawing
    line: tuple[str, float] | None = None     # a horizontal reference (label, value), e.g. the budget
    points: dict[str, list[list[float]]] | None = None   # label -> per category the values behind the bar (seeds)

    def __post_init__(self) -> None:
        for label, values in self.series.items():
            if len(values) != len(self.categories):
                raise ValueError(f"bar panel {self.title!r}: series {label!r} has {len(values)} values for "
                                 f"{len(self.categories)} categories")


def draw_bars(ax: Any, panel: BarPanel) -> list:
    """Draw `panel` on matplotlib axes `ax`, series and line labelled but no legend (the caller places it
    where it covers nothing: bar_panels_figure puts it below the axes); returns the bar containers, one
    per series."""
    n = max(len(panel.series), 1)
    width = 0.8 / n
    containers = []
    for k, (label, values) in enumerate(panel.series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(panel.categories))]
        containers.append(ax.bar(xs, [v / panel.scale for v in values], width=width, label=label))
        for x, points in zip(xs, (panel.points or {}).get(label, [])):   # each seed's value on its bar
            ax.plot([x] * len(points), [p / panel.scale for p in points], "o", color="black", markersize=3)
    if panel.line is not None:
        label, value = panel.line
        ax.axhline(value / panel.scale, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_xticks(range(len(panel.categories)), panel.categories,
                  rotation=45 if len(panel.categories) > 6 else 0, ha="right" if len(panel.categories) > 6 else "center",
                  fontsize=8)
    ax.set(ylabel=panel.ylabel, title=panel.title)
    ax.grid(axis="y", alpha=0.3)
    return containers


def bar_panels_figure(panels: Sequence[BarPanel], title: str | None = None, ncols: int = 2) -> Any:
    """The matplotlib figure of plot_bar_panels (the caller closes it). Rows of at most `ncols` panels,
    as even as can be (3 panels in 2 columns: 2 + 1), each row's panels sharing its width equally: no
    cell is left empty. Each panel's legend sits below its axes, outside them,
    so it covers no bar and no budget line (the bars and the line both reach the top of the axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("nothing to plot: no panels")
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    sizes = [len(panels) // nrows + (r < len(panels) % nrows) for r in range(nrows)]
    fig = plt.figure(figsize=(6.5 * ncols, 4.9 * nrows), layout="constrained")
    rows = fig.subfigures(nrows, 1, squeeze=False)[:, 0]
    start = 0
    for row, size in zip(rows, sizes):
        chunk = panels[start:start + size]
        start += size
        cells = row.subfigures(1, size, squeeze=False)[0]
        for cell, panel in zip(cells, chunk):
            ax = cell.subplots()
            draw_bars(ax, panel)
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                cell.legend(handles, labels, loc="outside lower center", ncols=len(handles), fontsize=8,
                            frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def plot_bar_panels(panels: Sequence[BarPanel], out: Path, title: str | None = None, ncols: int = 2) -> None:
    """The panels in one PNG, at most ncols per row (bar_panels_figure)."""
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError(f"nothing to plot in {out}: no panels")
    fig = bar_panels_figure(panels, title, ncols)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def memory_panels(train_bp_memory: dict | None = None, train_blocks: dict | None = None) -> list[BarPanel]:
    """The pipeline's memory plot: what train_bp's step saves for backward per unit (measured; with
    BitTrain on, also what plain autograd would have held), and train_blocks' measured peak per
    block against the budget. Arguments: memory/train_bp.json and metrics/train_blocks.json as dicts."""
    panels = []
    if train_bp_memory is not None:
        step = train_bp_memory["step_memory"]
        fit = train_bp_memory.get("batch_fit") or {}
        order = step.get("unit_order") or sorted(step["saved_by_unit"])   # (files written before unit_order)
        saved = {u: step["saved_by_unit"][u] for u in order if step["saved_by_unit"][u] or u != OUTSIDE_UNITS}
        units = list(saved)
        storage = step.get("activation_storage")
        if storage:
            series = {"plain autograd (BitTrain's count)": [storage["units"][u]["dense_bytes"] for u in units],
                      "stored by BitTrain (measured step)": [saved[u] for u in units]}
        else:
            series = {"saved for backward (measured)": [saved[u] for u in units]}
        batch = f", batch {fit['batch_size']}" if fit.get("batch_size") else ""
        budget = ("budget", fit["budget_bytes"]) if fit.get("budget_bytes") else None
        kinds = {"parameters": "param_bytes", "gradients": "grad_bytes", "optimizer state": "optimizer_bytes",
                 "activations": "activation_bytes", "peak (all)": "peak_bytes"}
        panels.append(BarPanel(f"train_bp: measured step peak by kind{batch}", list(kinds),
                               {"measured": [step[k] for k in kinds.values()]}, line=budget))
        panels.append(BarPanel(f"train_bp: saved activations per unit{batch}", units, series))
    if train_blocks is not None and train_blocks.get("block_results"):
        blocks = train_blocks["block_results"]
        names = [f"block {b['index']}\nunits {b['units'][0]}-{b['units'][-1]}\nbatch {b['batch_size']}"
                 for b in blocks]
        panels.append(BarPanel("train_blocks (NeuroFlux): measured peak per block", names,
                               {"measured peak": [b["peak_bytes"] for b in blocks]},
                               line=("budget", blocks[0]["budget_bytes"])))
    return panels
