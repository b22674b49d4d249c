"""Energy and latency of edge-only, cloud-only and edge-cloud inference (Table I, Section III.D).

    rows = inference_costs(CostModel(), edge_only_s=2e-4, edge_cloud_s=1.8e-4, round_trip_s=1.5e-3,
                           sent_fraction=0.2, upload_bytes=1024, n=10_000)

What is measured and what is modelled (each row says so):

* measured: the edge's compute time per instance, answering alone (``edge_only_s``) and beside the cloud
  (``edge_cloud_s``: instances sent skip the extension block), the round trip per instance sent to the
  cloud on this machine (``round_trip_s``: HTTP over loopback plus the cloud model), and the fraction sent;
* modelled: the upload over WiFi, from the paper's power model ``P = 283.17 mW/Mbps · s + 132.86 mW`` at
  throughput ``s`` (18.88 Mb/s by default) and the upload time ``bits / s``; the edge's compute power
  (``edge_power_w``: this machine has no power meter, so edge energy is that power times the measured
  time). The cloud's own energy is not counted, as in the paper (Fig. 8: energy at the edge).

Table I with raw data sent: edge N·x, communication β·N·x_cu; cloud-only sends everything (β = 1) and
computes nothing on the edge.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CostModel:
    upload_mw_per_mbps: float = 283.17    # the paper's WiFi upload power model (from [48], [40])
    upload_base_mw: float = 132.86
    upload_mbps: float = 18.88            # the paper's average upload throughput
    edge_power_w: float = 10.0            # modelled: a Jetson Nano's 10 W mode (no power meter here)

    @property
    def upload_power_w(self) -> float:
        return (self.upload_mw_per_mbps * self.upload_mbps + self.upload_base_mw) / 1000

    def upload_s(self, upload_bytes: int) -> float:
        """Seconds to upload one instance at the modelled throughput."""
        return upload_bytes * 8 / (self.upload_mbps * 1e6)

    def upload_j(self, upload_bytes: int) -> float:
        return self.upload_power_w * self.upload_s(upload_bytes)


def inference_costs(model: CostModel, edge_only_s: float, edge_cloud_s: float, round_trip_s: float,
                    sent_fraction: float, upload_bytes: int, n: int) -> list[dict]:
    """Table I's three systems for n instances: edge energy (J) and latency (s), each part labelled.
    Times are per instance: edge compute (measured), round trip per instance sent (measured)."""
    if not 0 <= sent_fraction <= 1:
        raise ValueError(f"sent_fraction must be in [0, 1], got {sent_fraction}")
    e_up, t_cloud = model.upload_j(upload_bytes), model.upload_s(upload_bytes) + round_trip_s

    def row(system: str, edge_s: float, beta: float) -> dict:
        return {"system": system, "n": n, "sent_fraction": beta,
                "edge_compute_j": n * model.edge_power_w * edge_s, "upload_j": beta * n * e_up,
                "edge_energy_j": n * (model.edge_power_w * edge_s + beta * e_up),
                "latency_s": n * (edge_s + beta * t_cloud),
                "measured": "edge compute time, round trip, fraction sent",
                "modelled": "upload power and time (the paper's WiFi model), edge power"}

    return [row("edge", edge_only_s, 0.0), row("cloud", 0.0, 1.0), row("edge-cloud", edge_cloud_s, sent_fraction)]


def cost_params(model: CostModel) -> dict:
    return {**asdict(model), "upload_power_w": model.upload_power_w}
