"""The threshold sweep as the paper shows it: accuracy and the share sent to the cloud (Fig. 7), and the
edge's energy (Fig. 8), per entropy threshold, beside edge-only and cloud-only."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgeflux.neuroflux.plots import _pyplot, _save


def plot_sweep(rows: Sequence[dict], edge_only: dict, cloud_only: dict, mu: tuple[float, float], chosen: float,
               out: Path, title: str = "MEANet edge-cloud inference") -> None:
    """rows: threshold_sweep's; edge_only/cloud_only: route_once rows with edge_energy_j; mu: (μ_c, μ_w)."""
    plt = _pyplot()
    t = [r["threshold"] for r in rows]
    fig, (acc_ax, energy_ax) = plt.subplots(1, 2, figsize=(11, 4))
    acc_ax.plot(t, [100 * r["acc"] for r in rows], marker="o", label="edge-cloud accuracy")
    acc_ax.axhline(100 * edge_only["acc"], color="tab:green", ls="--", label="edge only")
    acc_ax.axhline(100 * cloud_only["acc"], color="tab:red", ls="--", label="cloud only")
    acc_ax.set(xlabel="entropy threshold (nats)", ylabel="test accuracy (%)", title="Accuracy and data sent (Fig. 7)")
    frac_ax = acc_ax.twinx()
    frac_ax.plot(t, [100 * r["cloud_frac"] for r in rows], marker="s", color="tab:orange", label="sent to the cloud")
    frac_ax.set_ylabel("instances answered by the cloud (%)")
    energy_ax.plot(t, [r["edge_energy_j"] for r in rows], marker="o", label="edge-cloud")
    energy_ax.axhline(edge_only["edge_energy_j"], color="tab:green", ls="--", label="edge only")
    energy_ax.axhline(cloud_only["edge_energy_j"], color="tab:red", ls="--", label="cloud only")
    energy_ax.set(xlabel="entropy threshold (nats)", ylabel="energy at the edge (J, modelled upload)",
                  title="Energy at the edge (Fig. 8)")
    for ax in (acc_ax, energy_ax):
        ax.axvspan(*mu, color="grey", alpha=0.12, label="(μ_correct, μ_wrong)")
        ax.axvline(chosen, color="black", lw=0.8, label=f"threshold {chosen:.2f}")
        ax.grid(alpha=0.3)
    lines, labels = [], []
    for ax in (acc_ax, frac_ax):
        h, lab = ax.get_legend_handles_labels()
        lines += h
        labels += lab
    acc_ax.legend(lines, labels, fontsize=7, loc="lower left")
    energy_ax.legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, out)
