"""Stage select_exit (NeuroFlux §4): the compact early-exit model.

Chooses the exit with the fewest parameters whose validation accuracy is within
neuroflux.exit_tolerance of the best exit, exports units[0..exit] + that exit's auxiliary head as
one nn.Module (models/neuroflux_exit.pt, loadable with torch.load(..., weights_only=False); the export
stage writes it as ONNX and registers it in MLflow), and reports test accuracy, parameters and inference throughput of the compact
model vs the full model. Writes metrics/select_exit.json and plots/exits.png (accuracy and
parameters per exit).
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.artifacts import save_torch
from edgeflux.data import load_prepared, tensors
from edgeflux.models.units import count_params
from edgeflux.neuroflux.aux import exit_params
from edgeflux.neuroflux.exit import ExitModel, select_exit, throughput
from edgeflux.neuroflux.model import load_learners
from edgeflux.neuroflux.plots import plot_exits
from edgeflux.tracking import stage_run
from edgeflux.train import evaluate
from edgeflux.rows import MethodRow, RowInputs, training_row
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage, by_name

STAGE = Stage(name="select_exit", section="neuroflux", side="device", rows=True,
              outs=("details/select_exit.json", "models/neuroflux_exit.pt", "metrics/select_exit.json",
                    "plots/exits.png"))

MODEL, TRAINED = Path("models/neuroflux_exit.pt"), Path("models/neuroflux.pt")
PLOT = Path("plots/exits.png")


def main(args, params) -> None:
    p = params.neuroflux
    data = load_prepared(Path("data/prepared"))
    test = tensors(data, "target_test")
    model, learners, meta = load_learners(TRAINED)
    val_acc, test_acc = meta["unit_val_acc"], meta["unit_test_acc"]   # from the checked model file
    params_per_exit = [exit_params(learners, k) for k in range(len(learners))]
    with stage_run("select_exit", {"exit_tolerance": p.exit_tolerance}) as run:
        k = select_exit(val_acc, params_per_exit, p.exit_tolerance)
        compact, full = ExitModel(learners, k).eval(), ExitModel(learners, len(learners) - 1).eval()
        sample_shape = tuple(test[0].shape[1:])
        metrics = {"model": p.model.key, "exit_index": k, "exit_unit": meta["unit_names"][k],
                   "exit_val_acc": val_acc[k], "best_val_acc": max(val_acc),
                   "test_acc": evaluate(compact, *test), "full_test_acc": evaluate(full, *test),
                   "params": count_params(compact), "full_params": count_params(full),
                   "throughput_img_s": throughput(compact, sample_shape, p.throughput_batch),
                   "full_throughput_img_s": throughput(full, sample_shape, p.throughput_batch)}
        metrics["compression"] = metrics["full_params"] / metrics["params"]
        metrics["speedup"] = metrics["throughput_img_s"] / metrics["full_throughput_img_s"]
        written = write_metrics("select_exit", metrics, run, names={
            k: k for k in ("test_acc", "params", "full_test_acc", "full_params", "compression", "speedup")})
        save_torch(MODEL, compact)
        plot_exits(meta["unit_names"], val_acc, test_acc, params_per_exit, k, PLOT)
        for path in (*written, PLOT):
            run.log_artifact(path)


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    """The exit model trained as the full model (its curve, batches and peak) and keeps the units up to the exit."""
    if "train_blocks" not in inputs.head or "select_exit" not in inputs.head:
        return []
    full, exit_ = inputs.detail["train_blocks"], inputs.detail["select_exit"]
    return [training_row(f"NeuroFlux, exit {exit_['exit_unit']}" + inputs.plus("neuroflux"), "select_exit", "scratch",
                         full["model"], inputs.head["train_blocks"], batch="/".join(map(str, full["batch_sizes"])),
                         params=exit_["params"], test_acc=exit_["test_acc"], curve=by_name()["train_blocks"].curve)]


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
