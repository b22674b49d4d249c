"""What MEANet is judged by: Tables II-III on the edge, and the threshold sweep of Figs. 7-8 with the cloud.

    tables = edge_tables(net, hard, x_test, y_test)           # hard/all-class accuracy, main vs MEANet
    rows = [with_costs(r, cost, latency, round_trip_s, upload_bytes, n)
            for r in threshold_sweep(net, hard, cloud, x_test, y_test, thresholds(mu_c, mu_w, 9))]

The sweep routes the test split once per threshold through the real cloud callable (Algorithm 2, the
same Router as in deployment); each row has the accuracy, the fraction the cloud answered, and, with
``with_costs``, the edge's energy and latency from Table I's model (edgeflux.meanet.cost): the edge's
seconds per instance measured once (``edge_latency``: the main block, and what the extension path adds,
times the share of instances it ran for), the round trip measured over HTTP, the upload modelled.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from edgeflux.errors import UserError
from edgeflux.models import eval_mode
from edgeflux.neuroflux.exit import throughput

from .cost import CostModel, inference_costs
from .hard import HardClasses, detection_accuracy, select_hard
from .model import MEANet
from .router import EXITS, Router
from .train import main_logits


@torch.no_grad()
def edge_tables(net: MEANet, hard: HardClasses, x, y: Tensor) -> dict:
    """Table II (hard-class instances: the main block over all classes vs the extension exit over the hard
    ones, always activated) and Table III (every instance: the main block vs MEANet routed on the edge alone,
    and how well the main block tells easy from hard)."""
    y1 = main_logits(net, x)
    x_h, y_h = select_hard(x, y, hard)
    mask = hard.lookup()[y] >= 0
    routed = Router(net, hard).route(x)
    with eval_mode(net), torch.no_grad():
        y2 = torch.cat([net(x_h[i:i + 512]) for i in range(0, len(x_h), 512)]) if len(x_h) else torch.empty(0, 1)
    return {"hard_acc_main": (y1[mask].argmax(1) == y[mask]).float().mean().item(),
            "hard_acc_meanet": (y2.argmax(1) == y_h).float().mean().item() if len(y_h) else 0.0,
            "hard_acc_routed": (routed.pred[mask] == y[mask]).float().mean().item(),
            "all_acc_main": (y1.argmax(1) == y).float().mean().item(),
            "all_acc_meanet": routed.accuracy(y),
            "detection_acc": detection_accuracy(y1, y, hard),
            **{f"edge_exit_{k}": v for k, v in routed.fractions().items() if k in ("main", "extension")}}


def thresholds(mu_correct: float, mu_wrong: float, count: int, chosen: float | None = None) -> list[float]:
    """`count` thresholds (fewer when they coincide): μ_c, μ_w, `chosen` (default: their middle) and evenly spaced
    ones from just above 0 to 1.5 x μ_wrong. (Cloud-only is routed apart, at a negative threshold: an entropy can
    be exactly 0.)"""
    chosen = (mu_correct + mu_wrong) / 2 if chosen is None else chosen
    grid = np.linspace(0.0, 1.5 * mu_wrong, max(2, count - 2))[1:].tolist()
    return sorted({round(t, 4) for t in [*grid, mu_correct, mu_wrong, chosen]})


class EdgeBlocks(nn.Module):
    """The main block, then the adaptive and extension blocks: what the edge runs for an instance predicted hard."""

    def __init__(self, net: MEANet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        _, features = self.net.main_exit(x)
        return self.net.extension_exit(x, features)


@dataclass(frozen=True)
class EdgeLatency:
    """Measured seconds per instance on the edge: the main block, and what the extension path adds."""

    main_s: float
    extension_s: float

    def per_instance(self, extension_share: float) -> float:
        return self.main_s + extension_share * self.extension_s


def edge_latency(net: MEANet, sample: Tensor, batch: int = 64, seconds: float = 2.0) -> EdgeLatency:
    """Inference throughput of the main block alone and with the extension path (NeuroFlux's ``throughput``);
    measured once, so every threshold's edge time uses the same figures (the VM's drift stays out of the sweep)."""
    shape = tuple(sample.shape[1:])
    main_s = 1 / throughput(net.main, shape, batch, seconds)
    both_s = 1 / throughput(EdgeBlocks(net), shape, batch, seconds)
    return EdgeLatency(main_s, max(0.0, both_s - main_s))


def route_once(net: MEANet, hard: HardClasses, cloud: Callable[[Tensor], Tensor] | None, threshold: float | None,
               x, y: Tensor, send: str = "images", cloud_batch: int = 64) -> dict:
    """Route the split once: accuracy (the system's: fallbacks answered on the edge), the cloud's accuracy over
    the instances it answered itself, the exits' counts, the share that ran the extension path, and the
    measured round trip per instance the cloud answered."""
    routed = Router(net, hard, threshold, cloud, send, cloud_batch).route(x)
    counts, n = routed.counts(), max(1, len(y))
    by_cloud = routed.exit == EXITS.index("cloud")   # the cloud's own answers, without the edge's fallbacks
    answered_acc = (routed.pred[by_cloud] == y[by_cloud]).float().mean().item() if by_cloud.any() else None
    return {"threshold": threshold, "send": send, "acc": routed.accuracy(y), "cloud_frac": counts["cloud"] / n,
            "answered_acc": answered_acc,
            "sent_frac": (counts["cloud"] + counts["fallback"]) / n, "fallbacks": counts["fallback"],
            "answered": len(routed.pred), **{f"exit_{k}": counts[k] for k in EXITS},
            "extension_share": routed.extension_runs / n,
            "round_trip_s": routed.answered_s / counts["cloud"] if counts["cloud"] else None}


def with_costs(row: dict, cost: CostModel, latency: EdgeLatency, round_trip_s: float, upload_bytes: int,
               n: int) -> dict:
    """The row with Table I's edge energy and latency for its share sent and its extension share. Cloud-only
    (a negative threshold) computes on the edge only what the cloud did not answer (fallbacks), and F for every
    instance in features mode (Table I's q·x)."""
    system = "edge" if row["threshold"] is None else "cloud" if row["threshold"] < 0 else "edge-cloud"
    edge_s = latency.per_instance(row["extension_share"])
    if system == "cloud":
        main_share = 1.0 if row["send"] == "features" else row["fallbacks"] / max(1, n)
        edge_s = main_share * latency.main_s + row["extension_share"] * latency.extension_s
    systems = {r["system"]: r for r in inference_costs(cost, edge_s, edge_s, round_trip_s, row["sent_frac"],
                                                       upload_bytes, n)}
    system = systems[system]
    if system["system"] == "cloud":   # inference_costs' cloud row assumes no edge compute: add what ran
        system = {**system, "edge_compute_j": n * cost.edge_power_w * edge_s}
        system["edge_energy_j"] = system["edge_compute_j"] + system["upload_j"]
        system["latency_s"] += n * edge_s
    return {**row, "edge_energy_j": system["edge_energy_j"], "latency_s": system["latency_s"], "system": system["system"]}


def threshold_sweep(net: MEANet, hard: HardClasses, cloud: Callable[[Tensor], Tensor], x, y: Tensor,
                    grid: Sequence[float], send: str = "images", cloud_batch: int = 64) -> list[dict]:
    """One routed pass per threshold through the real cloud (Algorithm 2 as deployed)."""
    return [route_once(net, hard, cloud, t, x, y, send, cloud_batch) for t in grid]


def edge_cloud_report(net: MEANet, hard: HardClasses, cloud: Callable[[Tensor], Tensor], x, y: Tensor,
                      mu: tuple[float, float], threshold: float, sweep: int, cost: CostModel, send: str = "images",
                      cloud_batch: int = 64) -> dict:
    """Edge alone, cloud alone and the edge-cloud system at `threshold` and along the sweep, each with Table I's
    energy and latency at the edge (edge time measured once, round trip measured over HTTP cloud-only)."""
    latency, upload = edge_latency(net, x[:1]), upload_size(net, x[:1], send)
    edge_only = route_once(net, hard, None, None, x, y)
    cloud_only = route_once(net, hard, cloud, -1.0, x, y, send, cloud_batch)
    trip = cloud_only["round_trip_s"] or 0.0      # (None: the cloud answered nothing; every row counts fallbacks)
    rows = threshold_sweep(net, hard, cloud, x, y, thresholds(*mu, sweep, threshold), send, cloud_batch)

    def costed(row: dict) -> dict:
        return with_costs(row, cost, latency, trip, upload, len(y))

    rows = [costed(r) for r in rows]
    chosen = next(r for r in rows if r["threshold"] == round(threshold, 4))
    return {"edge_only": costed(edge_only), "cloud_only": costed(cloud_only), "at_threshold": chosen, "sweep": rows,
            "edge_latency": {"main_s": latency.main_s, "extension_s": latency.extension_s},
            "round_trip_s": trip, "upload_bytes": upload, "mu": list(mu), "threshold": threshold}


def upload_size(net: MEANet, sample: Tensor, send: str) -> int:
    """Bytes one instance takes on the link: an 8-bit image (as a camera gives it), or F in float32."""
    if send == "images":
        return int(sample[0].numel())
    with eval_mode(net), torch.no_grad():
        return int(net.features(sample[:1]).numel() * 4)


class CloudAnswerError(RuntimeError, UserError):
    """The cloud answered too little of what was sent for the figures to measure it."""


def check_answered(report: dict, min_share: float) -> dict:
    """Requests sent and answered over every routed pass of ``report`` (edge_cloud_report's); CloudAnswerError
    when the cloud answered less than ``min_share`` of them: at inference time a fallback is the right answer,
    but a sweep measured against a cloud that died is not a measurement of the cloud."""
    passes = [report["cloud_only"], *report["sweep"]]
    answered = sum(r["exit_cloud"] for r in passes)
    sent = answered + sum(r["fallbacks"] for r in passes)
    if sent and answered < min_share * sent:
        raise CloudAnswerError(f"the cloud answered {answered} of the {sent} instances sent to it ({answered / sent:.1%}; "
                               f"meanet.client.min_answered is {min_share:.0%}): the server died or timed out, so these "
                               "figures would not measure it; nothing written, the last good outputs are kept: see "
                               "the server's log and rerun")
    return {"sent": sent, "answered": answered}
