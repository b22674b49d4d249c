"""Plots people would rather look at than read: measured memory per unit, accuracy and size per exit."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_profile(profiles: Sequence, out: Path) -> None:
    """Measured training-step bytes per unit at each profiled batch size (the paper's Figure 8)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = profiles[0].batches
    x = range(len(profiles))
    for j, batch in enumerate(batches):
        ax.plot(x, [u.peak_bytes[j] / 2**20 for u in profiles], marker="o", label=f"batch {batch}")
    ax.set_xticks(list(x), [u.name for u in profiles], rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="measured peak (MiB)", title="Training memory per unit (unit + auxiliary head)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out)


def plot_exits(names: Sequence[str], val_acc: Sequence[float], test_acc: Sequence[float], params: Sequence[int],
               chosen: int, out: Path) -> None:
    """Accuracy and parameters of the early-exit model at every unit (the paper's Figure 10)."""
    _save(exits_figure(names, val_acc, test_acc, params, chosen), out)


def exits_figure(names: Sequence[str], val_acc: Sequence[float], test_acc: Sequence[float], params: Sequence[int],
                 chosen: int):
    """plot_exits' figure: accuracy lines over the parameter bars (right axis), one legend for both axes
    below the plot, where it covers neither."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6), layout="constrained")
    x = list(range(len(names)))
    right = ax.twinx()
    right.bar(x, [p / 1e6 for p in params], alpha=0.2, color="grey", label="parameters of the exit model (right axis)")
    right.set_ylabel("parameters of the exit model (M)")
    ax.set_zorder(right.get_zorder() + 1)     # the accuracy lines over the bars, the bars in the background
    ax.patch.set_visible(False)
    ax.plot(x, val_acc, marker="o", label="validation accuracy")
    ax.plot(x, test_acc, marker=".", linestyle=":", label="test accuracy")
    ax.axvline(chosen, color="green", linestyle="--", linewidth=1, label=f"chosen exit: {names[chosen]}")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="accuracy", title="Early exits: accuracy and parameters per exit")
    ax.grid(alpha=0.3)
    handles, labels = (sum(pair, []) for pair in zip(ax.get_legend_handles_labels(), right.get_legend_handles_labels()))
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return fig


def _save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:       # exits_figure lays itself out (constrained, legend outside)
        fig.tight_layout()
    fig.savefig(out, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
