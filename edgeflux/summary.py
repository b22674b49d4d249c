"""Every method side by side: one row per trained method from the stages' headline metrics, which of
them are Pareto-optimal in accuracy vs measured peak memory, and the plot (the papers' Figure 5 style).

The report stage hands over what the stages wrote (``metrics/<stage>.json``, the headline, and
``details/<stage>.json``), keyed by stage name, plus the BitTrain switches from params (a row says
"+ BitTrain" when its stage ran with it). A stage that has not run gives no row. Which figure is
which:

* test accuracy: on the target split's test set (MEANet's: the first ``meanet.max_test_samples`` of it,
  every class, routed by the edge and, for "edge + cloud", the cloud);
* measured peak: the allocator's peak over one steady-state training step, the figure the budget
  holds (for NeuroFlux the largest block's; the whole process's RSS is in the details files);
* training time: wall clock and the process's CPU time (every thread) over the same spans. Wall time
  stretches when the machine is loaded; comparisons use CPU time.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from edgeflux.colours import method_colour
from edgeflux.rows import MethodRow


def mark_pareto(rows: list[MethodRow]) -> list[MethodRow]:
    """Set `pareto` on the rows that no other row dominates (accuracy at least as high and peak at most as
    high, one of them strictly). Rows without a measured peak are never on the front."""
    measured = [r for r in rows if r.peak_mib is not None]
    for r in measured:
        r.pareto = not any(o.test_acc >= r.test_acc and o.peak_mib <= r.peak_mib
                           and (o.test_acc > r.test_acc or o.peak_mib < r.peak_mib) for o in measured)
    return rows


COLUMNS = ["method", "starts from", "model", "batch", "measured peak MiB", "trainable / total params",
           "train s (wall)", "train CPU s", "CPU s to target", "test acc", "Pareto"]


def _cells(r: MethodRow) -> list[str]:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    params = f"{num(r.trainable_params, ',')} / {num(r.params, ',')}"
    return [r.method, r.starts_from, r.model, r.batch, num(r.peak_mib, ".1f"), params, num(r.train_s, ".1f"),
            num(r.cpu_s, ".1f"), num(r.to_target_cpu_s, ".1f"), f"{r.test_acc:.4f}", "yes" if r.pareto else ""]


def summary_markdown(rows: list[MethodRow], budgets: Mapping[str, float | None], target_acc: float) -> str:
    """The summary page: the shared budget (or which sections differ), the table, how to read it."""
    values = {v for v in budgets.values()}
    if len(values) == 1:
        (budget,) = values
        head = f"Every method under the same budget: **{_mib(budget)}** for its measured training step."
    else:
        head = ("**The methods ran under different budgets** (" + ", ".join(f"{k}: {_mib(v)}" for k, v in budgets.items())
                + "): the rows do not compare under one budget. `edgeflux run --budget 64MB` sets one for all.")
    lines = ["# edgeflux: every method side by side", "", head, "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    lines += ["", "Test accuracy is on the target split's test set (MEANet: its first `meanet.max_test_samples`, "
              "every class). The measured peak is the allocator's over one steady-state training step, what the "
              "budget holds (NeuroFlux: its largest block's); NeuroFlux's exit row trained as the full model and "
              "keeps only the units up to the exit. Train CPU s is the process's CPU time over the training "
              "(every thread), beside the wall clock: on a loaded machine the wall clock stretches, so the plots "
              "and the Pareto front use CPU time and measured peak. Pareto: no other method is at least as "
              "accurate with a peak at most as large. MEANet's cloud model and its traffic are not counted in "
              f"the edge's memory. CPU s to target: until validation accuracy first reached {target_acc:.0%}."]
    return "\n".join(lines) + "\n"


def _mib(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f} MiB"


def plot_pareto(rows: list[MethodRow], out: Path, budget_mib: float | None = None) -> None:
    """Test accuracy vs measured peak memory (the Pareto front drawn) and vs training CPU time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.peak_mib is not None]
    fig, (mem_ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for i, r in enumerate(measured):
        # each method its colour (edgeflux.colours); each point smaller than the one drawn before it, so that
        # points at one place (MobileTL and MobileTL + BitTrain: the same peak) nest instead of hiding each other;
        # a thick edge marks the front
        size = 230 * (0.8 ** i) + 25
        style = dict(color=method_colour(r.method), marker="o", s=size, edgecolor="black",
                     linewidth=2 if r.pareto else 0.6, zorder=3 + i)
        mem_ax.scatter(r.peak_mib, r.test_acc, label=r.method, **style)
        if r.cpu_s is not None:
            cpu_ax.scatter(r.cpu_s, r.test_acc, **style)
    front = sorted((r for r in measured if r.pareto), key=lambda r: r.peak_mib)
    if front:
        mem_ax.step([r.peak_mib for r in front], [r.test_acc for r in front], where="post", color="grey",
                    linewidth=1, label="Pareto front")
    if budget_mib is not None:
        mem_ax.axvline(budget_mib, color="red", linestyle="--", linewidth=1, label=f"budget {budget_mib:.1f} MiB")
    mem_ax.set(xlabel="measured peak of the training step (MiB)", ylabel="test accuracy",
               title="Accuracy vs measured training memory")
    cpu_ax.set(xlabel="training CPU time (s, every thread)", title="Accuracy vs training CPU time")
    for ax in (mem_ax, cpu_ax):
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False, title="thick edge: on the Pareto front",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.035 * ((len(measured) + 7) // 3), 1, 1))   # room for the legend's rows below
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def rows_json(rows: list[MethodRow]) -> list[dict]:
    """The rows as reports/summary.json holds them (where a curve lives is the report's business)."""
    return [{k: v for k, v in asdict(r).items() if k not in ("curve", "plotted")} for r in rows]
