"""The pipeline's summary: one table and one accuracy-vs-time plot from every stage's outputs.

Reads what the stages wrote (metrics/*.json, plots/*.csv); adds rows for stages that exist, so
later techniques appear as soon as their stage has run.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from edgeflux.memory import format_bytes

COLUMNS = ["stage", "data", "model", "batch", "budget", "measured peak", "train s", "to target s", "test acc"]


def summary_rows(metrics_dir: Path = Path("metrics"), plots_dir: Path = Path("plots"),
                 target_acc: float | None = None) -> list[dict]:
    """One row per trained model; 'to target s' is the training time until validation accuracy
    first reached target_acc (from the stage's accuracy-vs-time curve, where it has one)."""
    rows = []
    pretrain = metrics_dir / "pretrain.json"
    if pretrain.exists():
        for key, m in json.loads(pretrain.read_text()).items():
            rows.append(_row("pretrain", "source (cloud)", key, m, None))
    train_bp = metrics_dir / "train_bp.json"
    if train_bp.exists():
        m = json.loads(train_bp.read_text())
        curve = plots_dir / "train_bp.csv"
        to_target = time_to_target(*read_curve(curve), target_acc) if curve.exists() and target_acc else None
        rows.append(_row("train_bp", "target (device)", m["model"], m, to_target))
    train_blocks = metrics_dir / "train_blocks.json"
    if train_blocks.exists():
        m = json.loads(train_blocks.read_text())
        curve = plots_dir / "train_blocks.csv"
        to_target = time_to_target(*read_curve(curve), target_acc) if curve.exists() and target_acc else None
        row = {**m, "batch_size": "/".join(map(str, m["batch_sizes"])), "test_acc": m["full_test_acc"]}
        rows.append(_row("train_blocks (NeuroFlux)", "target (device)", m["model"], row, to_target))
    select_exit = metrics_dir / "select_exit.json"
    if select_exit.exists():
        m = json.loads(select_exit.read_text())
        rows.append({"stage": "select_exit (NeuroFlux)", "data": "target (device)",
                     "model": f"{m['model']} exit {m['exit_unit']} ({m['compression']:.1f}x fewer params)",
                     "batch": "-", "budget": "-", "measured peak": "-", "train s": "-", "to target s": "-",
                     "test acc": f"{m['test_acc']:.4f}"})
    return rows


def time_to_target(times: list[float], accs: list[float], target: float) -> float | None:
    return next((t for t, a in zip(times, accs) if a >= target), None)


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


def plot_accuracy_vs_time(curves: dict[str, Path], out: Path, target_acc: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, path in curves.items():
        if path.exists():
            t, acc = read_curve(path)
            ax.plot(t, acc, marker="o", label=label)
    if target_acc is not None:
        ax.axhline(target_acc, color="grey", linestyle="--", linewidth=1, label=f"target {target_acc:.0%}")
    ax.set(xlabel="training time (s)", ylabel="validation accuracy", title="Accuracy vs training time")
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
