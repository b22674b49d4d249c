"""Stage train_bp: standard backpropagation on the device (target) data under a memory budget.

Uses the largest batch whose measured training-step peak fits the budget, device.budget (an error gives
the smallest feasible budget when even batch 1 does not fit). train_bp.bittrain stores saved
activations as bitmaps (BitTrain) in both the measured steps and training. Writes models/train_bp.pt,
metrics/train_bp.json (DVC metrics), plots/train_bp.csv (accuracy vs training time) and
memory/train_bp.json (the measurements behind the batch size).
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.artifacts import save_model, write_json
from edgeflux.backprop import train_under_budget
from edgeflux.data import load_prepared, tensors
from edgeflux.models import build_model
from edgeflux.tracking import stage_run
from edgeflux.rows import MethodRow, RowInputs, training_row, with_bittrain
from edgeflux.train import TrainRun, resolve_device
from edgeflux.tricks.options import AUTO, BACKPROP, backprop_label, backprop_options
from stages.common import peak_rss_bytes, run_stage, stage_parser, write_history_csv, write_metrics
from stages.registry import Stage

STAGE = Stage(name="train_bp", section="train_bp", side="device", budgeted=True, curve="plots/train_bp.csv",
              rows=True,
              outs=("details/train_bp.json", "models/train_bp.pt", "memory/train_bp.json", "plots/train_bp.csv",
                    "metrics/train_bp.json"))

PLOT, MEMORY = Path(STAGE.curve), Path("memory/train_bp.json")
MODEL, CHECKPOINT = Path("models/train_bp.pt"), Path(".edgeflux/checkpoints/train_bp.pt")


def main(args, params) -> None:
    p = params.train_bp
    data = load_prepared(Path("data/prepared"))
    device = resolve_device(p.device)
    train = tensors(data, "target_train", limit=p.max_train_samples)
    build_args = p.model.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
    with stage_run("train_bp", p.model_dump()) as run:
        model = build_model(**build_args, pretrained_path=p.model.weights_path())
        method, batch_hint = choose_method(model, train, p, device, run)
        p = backprop_options(method, p)
        run_settings = TrainRun(device, checkpoint=CHECKPOINT, desc="train_bp", context=p.bittrain.context,
                                tricks=p.tricks, batch_hint=batch_hint)
        result = train_under_budget(model, train, tensors(data, "target_val"), tensors(data, "target_test"), p,
                                    run_settings, memory=p)
        metrics = {"model": p.model.key, "device": str(device), **result.metrics(), "method": method,
                   "auto": params.train_bp.method == AUTO,
                   # the whole process on the host (torch, data): not what the budget bounds
                   "peak_rss_bytes": peak_rss_bytes()}
        written = write_metrics("train_bp", metrics, run)
        write_json(MEMORY, result.memory_report())
        write_history_csv(PLOT, result.train.history, method_label(metrics, p.bittrain.enabled))
        save_model(MODEL, model, build_args, meta={"stage": "train_bp", **metrics})
        run.log_history(result.train.history)
        for path in (*written, MEMORY, PLOT):
            run.log_artifact(path)


def choose_method(model, train, p, device, run) -> tuple[str, int | None]:
    """train_bp.method, or with auto the plan's fastest feasible backprop (edgeflux.plan; the rows a stored plan
    of this model, data shape, options and machine holds are reused), its table logged; and the batch the plan
    measured for it (None without a plan)."""
    if p.method != AUTO:
        return p.method, None
    from edgeflux.plan import PlanCache, auto_method, plan_key, plan_training   # (only when planning)

    cache = PlanCache(plan_key(model, train, p, device))
    chosen = auto_method(plan_training(model, train, p, device=device, cache=cache), p.budget, run, cache)
    return chosen.method, chosen.batch


def method_label(detail: dict, bittrain: bool) -> str:
    """The report's name of the run ``detail`` describes: its method, chosen by auto or not, with BitTrain."""
    label = backprop_label(detail.get("method", BACKPROP)) + (" (auto)" if detail.get("auto") else "")
    return with_bittrain(label, bittrain)


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    if "train_bp" not in inputs.head:
        return []
    label = method_label(inputs.detail["train_bp"], bool(inputs.plus("train_bp")))
    return [training_row(label, "train_bp", "scratch", inputs.detail["train_bp"]["model"],
                         inputs.head["train_bp"], curve=STAGE.curve, plotted=True)]


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__), resumes=True)
