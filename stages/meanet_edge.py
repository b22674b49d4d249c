"""Stage meanet_edge (MEANet, Algorithm 1 steps 5-8: the device's part): train the adaptive and extension blocks.

Starts from models/meanet/main.pt and models/meanet/hard_classes.json (meanet_cloud). Only the instances of
hard classes of the device's data (target split, plus the new samples in data/incoming/) train, with their
labels mapped to 0..n_hard-1; the main block is fixed (no gradients, eval mode: its BatchNorm statistics do
not move) and the adaptive and extension blocks learn from the cross-entropy at the extension exit, at the
largest batch whose measured step fits the budget (device.budget), with BitTrain as device.bittrain says. The same batch is then measured
under joint optimisation (every block trainable, losses at both exits; the paper's Fig. 6 comparison).

Writes models/meanet/edge.pt, metrics/meanet_edge.json (hard-class accuracy, measured peaks of the edge's
step and of joint optimisation, Table VI's fixed and trained parameters and multiply-adds),
plots/meanet_edge.csv (accuracy vs training time) and memory/meanet_edge.json (the measurements).
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.artifacts import file_digest, read_json, write_json
from edgeflux.checkpoint import run_signature
from edgeflux.data import load_prepared, tensors
from edgeflux.data.incoming import add_incoming, load_incoming
from edgeflux.meanet.hard import HardClasses
from edgeflux.meanet.model import block_costs, load_meanet, save_meanet
from edgeflux.meanet.train import joint_step_memory, train_edge
from edgeflux.rows import MEANET_EDGE, with_bittrain
from edgeflux.tracking import stage_run
from edgeflux.train import resolve_device
from stages.common import peak_rss_bytes, run_stage, stage_parser, write_history_csv, write_metrics, TRAINING_HEADLINE
from stages.registry import Stage

STAGE = Stage(name="meanet_edge", section="meanet", side="device", budgeted=True, incoming=True,
              curve="plots/meanet_edge.csv",
              outs=("details/meanet_edge.json", "models/meanet/edge.pt", "memory/meanet_edge.json",
                    "plots/meanet_edge.csv", "metrics/meanet_edge.json"))

MAIN, HARD, EDGE = Path("models/meanet/main.pt"), Path("models/meanet/hard_classes.json"), Path("models/meanet/edge.pt")
PLOT, MEMORY = Path("plots/meanet_edge.csv"), Path("memory/meanet_edge.json")
CHECKPOINT = Path(".edgeflux/checkpoints/meanet_edge.pt")
INCOMING = Path("data/incoming")   # new labelled samples (class folders tracked by DVC): trained on with the target split


def load_hard() -> HardClasses:
    return HardClasses.from_dict(read_json(HARD, "run `dvc repro meanet_cloud`", checksum=True))


def main(args, params) -> None:
    p = params.meanet
    net, _ = load_meanet(MAIN, "meanet_cloud")
    hard = load_hard()
    data, device = load_prepared(Path("data/prepared")), resolve_device(p.device)
    incoming = load_incoming(INCOMING, data)
    train = add_incoming(tensors(data, "target_train", limit=p.max_train_samples), incoming)
    val, test = tensors(data, "target_val"), tensors(data, "target_test")
    with stage_run("meanet_edge", p.edge_options().model_dump()) as run:
        result = train_edge(net, hard, train, val, test, p.edge_options(), device, CHECKPOINT,
                            signature=run_signature(main=file_digest(MAIN), hard=file_digest(HARD)))
        net.cpu()
        joint = joint_step_memory(net, hard, result.batch_size, train, p, device)
        edge_peak, joint_peak = result.step_memory.peak_bytes, joint.peak_bytes
        metrics = {**result.metrics(), "hard_val_acc": result.train.history[-1]["val_acc"],
                   "hard_test_acc": result.test_acc, "joint_peak_mem_bytes": joint_peak,
                   "peak_vs_joint": edge_peak / joint_peak, "train_instances": int((hard.lookup()[train[1]] >= 0).sum()),
                   "n_incoming": len(incoming),
                   **block_costs(net, test[0][:1]), "peak_rss_bytes": peak_rss_bytes()}
        written = write_metrics("meanet_edge", metrics, run, names={
            **{k: v for k, v in TRAINING_HEADLINE.items() if k not in ("test_acc", "trainable_params")},
            "hard_test_acc": "hard_test_acc", "trained_params": "trainable_params"})
        write_json(MEMORY, {**result.memory_report(), "joint_step_memory": joint.to_dict()})
        write_history_csv(PLOT, result.train.history, with_bittrain(MEANET_EDGE, p.bittrain.enabled))
        save_meanet(EDGE, net, meta={"stage": "meanet_edge", **metrics})
        run.log_history(result.train.history)
        for path in (*written, MEMORY, PLOT):
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__), resumes=True)
