"""The threshold sweep as the paper shows it: accuracy and the share sent to the cloud (Fig. 7), and the
edge's energy (Fig. 8), per entropy threshold, beside edge-only and cloud-only."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgeflux.colours import method_colour
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.rows import MEANET_EDGE


MIN_SPAN = 5.0   # percentage points the accuracy axis spans at least: a 0.3-point spread drawn full height misleads


def _honest_limits(values: Sequence[float], span: float = MIN_SPAN) -> tuple[float, float]:
    """Axis limits around ``values`` (percent): half a point beyond them, at least ``span`` points wide, inside
    0-100."""
    lo, hi = min(values) - 0.5, max(values) + 0.5
    if hi - lo < span:
        middle = (lo + hi) / 2
        lo, hi = middle - span / 2, middle + span / 2
    shift = max(0.0, hi - 100.0) - max(0.0, -lo)
    return lo - shift, hi - shift


def plot_sweep(rows: Sequence[dict], edge_only: dict, cloud_only: dict, mu: tuple[float, float], chosen: float,
               out: Path, title: str = "MEANet edge-cloud inference") -> None:
    """rows: threshold_sweep's; edge_only/cloud_only: route_once rows with edge_energy_j; mu: (μ_c, μ_w). The
    methods in their colours (edgeflux.colours); one legend below both panels, covering no line."""
    plt = _pyplot()
    edge, both, cloud = MEANET_EDGE, "MEANet, edge + cloud", "cloud only"
    t = [r["threshold"] for r in rows]
    fig, (acc_ax, energy_ax) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    accs = [100 * r["acc"] for r in rows]
    acc_ax.plot(t, accs, marker="o", color=method_colour(both), label=both)
    acc_ax.axhline(100 * edge_only["acc"], color=method_colour(edge), ls="--", label=edge)
    acc_ax.axhline(100 * cloud_only["acc"], color=method_colour(cloud), ls="--", label=cloud)
    acc_ax.set_ylim(*_honest_limits([*accs, 100 * edge_only["acc"], 100 * cloud_only["acc"]]))
    acc_ax.set(xlabel="entropy threshold (nats)", ylabel="test accuracy (%)", title="Accuracy and data sent (Fig. 7)")
    frac_ax = acc_ax.twinx()
    frac_ax.plot(t, [100 * r["cloud_frac"] for r in rows], marker="s", color="#999999", ls=":",
                 label="sent to the cloud (right axis)")
    frac_ax.set_ylim(0, 100)
    frac_ax.set_ylabel("instances answered by the cloud (%)")
    energy_ax.plot(t, [r["edge_energy_j"] for r in rows], marker="o", color=method_colour(both))
    energy_ax.axhline(edge_only["edge_energy_j"], color=method_colour(edge), ls="--")
    energy_ax.axhline(cloud_only["edge_energy_j"], color=method_colour(cloud), ls="--")
    energy_ax.set(xlabel="entropy threshold (nats)", ylabel="energy at the edge (J, modelled upload)",
                  title="Energy at the edge (Fig. 8)")
    for ax in (acc_ax, energy_ax):
        ax.axvspan(*mu, color="grey", alpha=0.12, label="(μ_correct, μ_wrong)" if ax is acc_ax else None)
        ax.axvline(chosen, color="black", lw=0.8, label=f"threshold {chosen:.2f}" if ax is acc_ax else None)
        ax.grid(alpha=0.3)
    handles, labels = [], []
    for ax in (acc_ax, frac_ax):
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    fig.suptitle(title)
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    _save(fig, out)
