"""Stage evaluate_edge_cloud (MEANet, Algorithm 2 and Table I): inference on the edge with a real cloud over HTTP.

Starts MLflow's model server on models/meanet/cloud (127.0.0.1, a free port) and always stops it, even when
the stage fails. On the device's test split it measures: the edge alone (Tables II-III: hard-class and
all-class accuracy, main block vs MEANet), the cloud alone, and the edge-cloud system at meanet.threshold
(null: the middle of the validation entropy range (mu_correct, mu_wrong)) and at meanet.sweep thresholds.
A request the cloud does not answer in time (after meanet.client.retries) is answered on the edge and
counted as a fallback: no instance is dropped. Energy and latency come from Table I's model: the edge's
inference time (main block, extension path) and the HTTP round trip measured here, the upload and the edge's
power modelled (meanet.cost).

Writes metrics/evaluate_edge_cloud.json, plots/meanet_sweep.csv (a DVC plot: accuracy, share sent to the
cloud, edge energy and latency per threshold) and plots/meanet_sweep.png (Figs. 7-8).
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from edgeflux.artifacts import atomic_write, read_json
from edgeflux.data import load_prepared, tensors
from edgeflux.meanet.cloud import CloudClient
from edgeflux.meanet.cost import CostModel, cost_params
from edgeflux.meanet.evaluate import check_answered, edge_cloud_report, edge_tables
from edgeflux.meanet.hard import HardClasses
from edgeflux.meanet.model import load_meanet
from edgeflux.meanet.plot import plot_sweep
from edgeflux.meanet.server import ModelServer
from edgeflux.tracking import stage_run
from edgeflux.rows import MEANET_EDGE, MethodRow, RowInputs, training_row
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="evaluate_edge_cloud", section="meanet", side="device", rows=True,
              outs=("details/evaluate_edge_cloud.json", "metrics/evaluate_edge_cloud.json", "plots/meanet_sweep.csv",
                    "plots/meanet_sweep.png"))

EDGE, HARD, CLOUD = Path("models/meanet/edge.pt"), Path("models/meanet/hard_classes.json"), Path("models/meanet/cloud")
SWEEP_CSV, SWEEP_PNG = Path("plots/meanet_sweep.csv"), Path("plots/meanet_sweep.png")
SERVER_LOG = Path(".edgeflux/logs/cloud_server.log")
SWEEP_COLUMNS = ("threshold", "acc", "cloud_frac", "edge_energy_j", "latency_s", "fallbacks")


def write_sweep_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SWEEP_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, lambda p: p.write_text(buf.getvalue()))


def main(args, params) -> None:
    p = params.meanet
    net, _ = load_meanet(EDGE, "meanet_edge")
    stats = read_json(HARD, "run `dvc repro meanet_cloud`", checksum=True)
    hard, mu = HardClasses.from_dict(stats), (stats["mu_correct"], stats["mu_wrong"])
    x, y = tensors(load_prepared(Path("data/prepared")), "target_test", limit=p.max_test_samples)
    threshold = p.threshold if p.threshold is not None else sum(mu) / 2
    c = p.client
    with stage_run("evaluate_edge_cloud", p.model_dump()) as run:
        tables = edge_tables(net, hard, x, y)
        with ModelServer(CLOUD, ready_timeout_s=c.ready_timeout_s, log_path=SERVER_LOG) as server, \
                CloudClient(server.url, timeout_s=c.timeout_s, retries=c.retries, cooldown_s=c.cooldown_s) as client:
            report = edge_cloud_report(net, hard, client, x, y, mu, threshold, p.sweep, CostModel(**p.cost.model_dump()),
                                       stats["send"], c.batch)
            client_stats = vars(client.stats).copy()
        requests = check_answered(report, c.min_answered)
        edge, cloud, both = report["edge_only"], report["cloud_only"], report["at_threshold"]
        # cloud_acc: the cloud's own answers only; the fallbacks beside each figure that includes the edge's
        metrics = {**tables, "threshold": threshold, "mu_correct": mu[0], "mu_wrong": mu[1],
                   "edge_acc": edge["acc"], "cloud_acc": cloud["answered_acc"], "edge_cloud_acc": both["acc"],
                   "cloud_answered": cloud["exit_cloud"], "cloud_fallbacks": cloud["fallbacks"],
                   "edge_cloud_fallbacks": both["fallbacks"], "cloud_answered_share": requests["answered"] / max(1, requests["sent"]),
                   "cloud_frac": both["cloud_frac"], "fallbacks": requests["sent"] - requests["answered"],
                   "edge_energy_j": edge["edge_energy_j"], "cloud_energy_j": cloud["edge_energy_j"],
                   "edge_cloud_energy_j": both["edge_energy_j"], "edge_latency_s": edge["latency_s"],
                   "cloud_latency_s": cloud["latency_s"], "edge_cloud_latency_s": both["latency_s"],
                   "round_trip_s": report["round_trip_s"], "upload_bytes": report["upload_bytes"],
                   "test_instances": len(y), "send": stats["send"]}
        written = write_metrics("evaluate_edge_cloud", {
            **metrics, "detail": report, "cost_model": cost_params(CostModel(**p.cost.model_dump())),
            "client": client_stats}, run, names={k: k for k in (
                "edge_acc", "edge_cloud_acc", "cloud_acc", "cloud_frac", "edge_cloud_latency_s", "edge_cloud_energy_j")})
        write_sweep_csv(SWEEP_CSV, report["sweep"])
        plot_sweep(report["sweep"], edge, cloud, mu, threshold, SWEEP_PNG)
        for path in (*written, SWEEP_CSV, SWEEP_PNG):
            run.log_artifact(path)


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    """MEANet's edge training (the main block fixed) with this stage's accuracies on every class: the edge
    alone, and the edge with the cloud for what it routes there."""
    head = inputs.head
    if "meanet_edge" not in head or "evaluate_edge_cloud" not in head:
        return []
    main = inputs.detail.get("meanet_cloud", {}).get("main", "?")
    cloud, edge, plus = head["evaluate_edge_cloud"], head["meanet_edge"], inputs.plus("meanet")
    starts = f"pretrained {main} (main block, fixed)"
    return [training_row(MEANET_EDGE + plus, "meanet_edge", starts, main, edge, test_acc=cloud["edge_acc"]),
            training_row(f"MEANet, edge + cloud ({cloud['cloud_frac']:.0%} sent)" + plus, "evaluate_edge_cloud",
                         starts, main, edge, test_acc=cloud["edge_cloud_acc"])]


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
