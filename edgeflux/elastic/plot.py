"""Which tensors train in which epoch, as a heat map (the paper's Figure 21): tensors by execution order (0
nearest the input) against epochs."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["per_epoch", "plot_selections"]


def per_epoch(selections: Sequence[dict], epochs: int) -> list[list[bool]]:
    """The mask in effect in each epoch, from selections (``epoch``, ``mask``) made at some epochs' starts."""
    ordered = sorted(selections, key=lambda s: s["epoch"])
    out = []
    for epoch in range(epochs):
        made = [s for s in ordered if s["epoch"] <= epoch]
        out.append(list(made[-1]["mask"]) if made else [False] * len(ordered[0]["mask"]))
    return out


def plot_selections(names: Sequence[str], masks: Sequence[Sequence[bool]], path: str | Path, title: str) -> Path:
    """Write the heat map of ``masks`` (one per epoch, over ``names``) to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array([[1.0 if m else 0.0 for m in mask] for mask in masks]).T   # tensors x epochs
    # wide enough for the title's two lines at any epoch count (a narrow map clipped it)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.0 + 0.5 * len(masks)), max(3.0, min(12.0, 0.08 * len(names) + 2))))
    ax.imshow(grid, aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest", origin="lower")
    ax.set_xlabel("epoch")
    ax.set_ylabel("tensor (execution order, 0 = nearest the input)")
    ax.set_xticks(range(len(masks)))
    ax.set_title(f"{title}\n{sum(map(sum, masks))} tensor-epochs trained of {grid.size}", fontsize=9, wrap=True)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
