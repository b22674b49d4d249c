"""The pipeline's summary: one table, an accuracy-vs-time plot and a memory plot from every stage's outputs.

Works on what the stages wrote, handed over by the report stage, which owns the file paths: metrics as
dicts keyed by stage, accuracy-vs-time curves as CSV paths or (times, accs). Adds rows for the stages
that have run, so later techniques appear as soon as their stage has. BarPanel / plot_bar_panels draw
grouped bars (memory per unit, peak per block) for the report stage and the benchmarks alike.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeflux.memory import OUTSIDE_UNITS, MiB, format_bytes

COLUMNS = ["stage", "data", "model", "batch", "budget", "measured peak", "train s", "to target s", "test acc"]

# An accuracy-vs-time curve: a CSV with time_s and val_acc columns (as the training stages write them;
# a path that does not exist is no curve), or its (times, accs) already read.
Curve = Path | tuple[list[float], list[float]]


def summary_rows(metrics: dict[str, dict], curves: dict[str, Curve] | None = None,
                 target_acc: float | None = None) -> list[dict]:
    """One row per trained model, from `metrics`: stage name ("pretrain", "train_bp", "train_blocks",
    "select_exit") -> that stage's metrics JSON as a dict, and "finetune" -> {method: its metrics}; a stage
    missing from it has not run and gets no row. 'to target s' is the training time until validation accuracy first reached target_acc,
    from curves[stage] where the stage has one."""
    curves = curves or {}
    rows = []
    if "pretrain" in metrics:
        for key, m in metrics["pretrain"].items():
            rows.append(_row("pretrain", "source (cloud)", key, m, None))
    if "train_bp" in metrics:
        m = metrics["train_bp"]
        rows.append(_row("train_bp", "target (device)", m["model"], m, _to_target(curves.get("train_bp"), target_acc)))
    if "train_blocks" in metrics:
        m = metrics["train_blocks"]
        to_target = _to_target(curves.get("train_blocks"), target_acc)
        row = {**m, "batch_size": "/".join(map(str, m["batch_sizes"]))}
        rows.append(_row("train_blocks (NeuroFlux)", "target (device)", m["model"], row, to_target))
    for method, m in metrics.get("finetune", {}).items():
        rows.append(_row(f"finetune {method}", "target (device)", m["model"], m,
                         _to_target(curves.get(f"finetune {method}"), target_acc)))
    if "select_exit" in metrics:
        m = metrics["select_exit"]
        rows.append({"stage": "select_exit (NeuroFlux)", "data": "target (device)",
                     "model": f"{m['model']} exit {m['exit_unit']} ({m['compression']:.1f}x fewer params)",
                     "batch": "-", "budget": "-", "measured peak": "-", "train s": "-", "to target s": "-",
                     "test acc": f"{m['test_acc']:.4f}"})
    return rows


def time_to_target(times: list[float], accs: list[float], target: float) -> float | None:
    return next((t for t, a in zip(times, accs) if a >= target), None)


def _to_target(curve: Curve | None, target_acc: float | None) -> float | None:
    points = _points(curve) if target_acc else None
    return time_to_target(*points, target_acc) if points is not None else None


def _row(stage: str, data: str, model: str, m: dict, to_target: float | None) -> dict:
    return {"stage": stage, "data": data, "model": model, "batch": m["batch_size"],
            "budget": format_bytes(m["budget_bytes"]) if m.get("budget_bytes") else "none",
            "measured peak": format_bytes(m["peak_mem_bytes"]), "train s": f"{m['train_time_s']:.1f}",
            "to target s": f"{to_target:.1f}" if to_target is not None else "-", "test acc": f"{m['test_acc']:.4f}"}


def markdown_table(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def read_curve(path: Path) -> tuple[list[float], list[float]]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [float(r["time_s"]) for r in rows], [float(r["val_acc"]) for r in rows]


def _points(curve: Curve | None) -> tuple[list[float], list[float]] | None:
    """(times, accs) of `curve`; None where there is none (not given, or its file not written)."""
    if curve is None or isinstance(curve, tuple):
        return curve
    return read_curve(Path(curve)) if Path(curve).exists() else None


def plot_accuracy_vs_time(curves: dict[str, Curve], out: Path, target_acc: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        if (points := _points(curve)) is not None:
            ax.plot(*points, marker="o", label=label)
    if target_acc is not None:
        ax.axhline(target_acc, color="grey", linestyle="--", linewidth=1, label=f"target {target_acc:.0%}")
    ax.set(xlabel="training time (s)", ylabel="validation accuracy", title="Accuracy vs training time")
    ax.grid(alpha=0.3)
    ax.legend()
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

    def __post_init__(self) -> None:
        for label, values in self.series.items():
            if len(values) != len(self.categories):
                raise ValueError(f"bar panel {self.title!r}: series {label!r} has {len(values)} values for "
                                 f"{len(self.categories)} categories")


def draw_bars(ax: Any, panel: BarPanel) -> list:
    """Draw `panel` on matplotlib axes `ax`; returns the bar containers, one per series."""
    n = max(len(panel.series), 1)
    width = 0.8 / n
    containers = []
    for k, (label, values) in enumerate(panel.series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(panel.categories))]
        containers.append(ax.bar(xs, [v / panel.scale for v in values], width=width, label=label))
    if panel.line is not None:
        label, value = panel.line
        ax.axhline(value / panel.scale, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_xticks(range(len(panel.categories)), panel.categories,
                  rotation=45 if len(panel.categories) > 6 else 0, ha="right" if len(panel.categories) > 6 else "center",
                  fontsize=8)
    ax.set(ylabel=panel.ylabel, title=panel.title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return containers


def plot_bar_panels(panels: Sequence[BarPanel], out: Path, title: str | None = None, ncols: int = 2) -> None:
    """The panels side by side (ncols per row) in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError(f"nothing to plot in {out}: no panels")
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.4 * nrows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        draw_bars(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
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
