"""Stage finetune: fine-tune a pretrained backbone on the device (target) data under a memory budget, one method a run.

dvc.yaml runs it once per entry of finetune.methods (stages finetune@mobiletl, finetune@ft_all, ...;
`dvc repro finetune` runs them all). The backbone is models/pretrained/<finetune.model>.pt from the
pretrain stage; the batch is the largest whose measured training step fits the budget (device.budget), with
finetune.bittrain applied to what the method still saves. Methods: edgeflux/finetune.py. It trains on the
target_train split (its first finetune.max_train_samples) plus every new labelled sample in data/incoming/.

Writes models/finetune/<method>.pt (the float model with the fine-tuned weights; it loads into the plain
architecture), metrics/finetune/<method>.json (test accuracy, measured peak and saved bytes, trainable
parameters, counted FLOPs, step time; elastic: its overhead and selections), plots/finetune/<method>.csv
(accuracy vs training time), plots/finetune/<method>_tensors.png (which tensors train in which epoch: a
method's fixed set, or elastic's selections) and memory/finetune/<method>.json (the measurements behind the
batch size; elastic: its tensor timings and every selection).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from edgeflux.artifacts import file_digest, load_model, model_fix, save_model, write_json
from edgeflux.config import ParamsError
from edgeflux.data import PreparedDataError, load_prepared, tensors
from edgeflux.data.incoming import add_incoming, load_incoming
from edgeflux.elastic.plot import plot_selections
from edgeflux.finetune import METHOD_HELP, finetune, finetune_label, parse_method
from edgeflux.tracking import stage_run
from edgeflux.tricks.options import AUTO
from edgeflux.train import resolve_device
from edgeflux.rows import MethodRow, RowInputs, training_row
from stages.common import peak_rss_bytes, run_stage, stage_parser, write_history_csv, write_metrics
from stages.registry import MATRIX_ITEM, Stage

STAGE = Stage(name="finetune", section="finetune", side="device", budgeted=True, incoming=True,
              curve="plots/finetune/${item.method}.csv", rows=True,
              outs=("details/finetune/${item.method}.json", "models/finetune/${item.method}.pt",
                    "memory/finetune/${item.method}.json", "plots/finetune/${item.method}.csv",
                    "metrics/finetune/${item.method}.json", "plots/finetune/${item.method}_tensors.png"))

PRETRAINED = Path("models/pretrained")
INCOMING = Path("data/incoming")   # new labelled samples (class folders tracked by DVC): trained on with the target split
CHECKPOINTS = Path(".edgeflux/checkpoints/finetune")   # <method>.pt: an interrupted run resumes from its last epoch


def _method(spec: str) -> str:
    try:
        if spec != AUTO:
            parse_method(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def parser():
    p = stage_parser(__doc__)
    p.add_argument("--method", required=True, type=_method,
                   help=f"the fine-tuning method to run: {METHOD_HELP}; or {AUTO}: the fastest way to train every "
                        "parameter under the budget (edgeflux.plan: FT-All with or without the memory tricks)")
    return p


def main(args, params) -> None:
    p, method = params.finetune, args.method
    if p is None:
        raise ParamsError(f"{args.params} has no finetune section; add one (see the repository's params.yaml)")
    source = PRETRAINED / f"{p.model}.pt"
    if not source.exists():
        raise FileNotFoundError(f"{source}: no pretrained model {p.model!r}; run `dvc repro pretrain` first")
    model, _ = load_model(source)
    data = load_prepared(Path("data/prepared"))
    if model.num_classes != len(data.classes):
        raise PreparedDataError(f"{source} has {model.num_classes} classes and data/prepared {len(data.classes)}: "
                                f"{model_fix(source, 'pretrain')}")
    device = resolve_device(p.device)
    incoming = load_incoming(INCOMING, data)
    train = add_incoming(tensors(data, "target_train", limit=p.max_train_samples), incoming)
    outputs = {kind: Path(f"{kind}/finetune/{method}.{ext}")
               for kind, ext in (("plots", "csv"), ("memory", "json"), ("models", "pt"))}
    outputs["tensors"] = Path(f"plots/finetune/{method}_tensors.png")
    with stage_run(f"finetune@{method}", {**p.model_dump(), "method": method}) as run:
        spec, hint = (method, None) if method != AUTO else planned(model, train, p, device, run)
        result = finetune(model, spec, p, train, tensors(data, "target_val"), tensors(data, "target_test"), device,
                          checkpoint=CHECKPOINTS / f"{method}.pt", start=file_digest(source), batch_hint=hint)
        metrics = {"model": p.model, "device": str(device), **result.metrics(), "n_incoming": len(incoming),
                   "auto": method == AUTO, "peak_rss_bytes": peak_rss_bytes()}
        written = write_metrics(f"finetune/{method}", metrics, run)
        write_json(outputs["memory"], {**result.run.memory_report(), "method_info": result.info,
                                       **result.run.train.extra})
        write_history_csv(outputs["plots"], result.run.train.history, method_label(method, metrics, p.bittrain.enabled))
        plot_selections(result.tensors, result.selections, outputs["tensors"], f"finetune {method}, {p.model}")
        save_model(outputs["models"], model, model.build_args, meta={"stage": "finetune", **metrics,
                                                                  "method_info": result.info})
        run.log_history(result.run.train.history)
        for path in (*written, outputs["memory"], outputs["plots"], outputs["tensors"]):
            run.log_artifact(path)


def planned(model, train, p, device, run) -> tuple[str, int]:
    """The plan's fastest feasible way to train every parameter (edgeflux.plan; the rows a stored plan of this
    model, data shape, options and machine holds are reused), its table logged, and the batch the plan measured
    for it."""
    from edgeflux.plan import FINETUNE_FULL, PlanCache, auto_method, plan_finetune, plan_key   # (only when planning)

    cache = PlanCache(plan_key(model, train, p, device))
    rows = plan_finetune(model, train, p, candidates=FINETUNE_FULL, device=device, cache=cache)
    chosen = auto_method(rows, p.budget, run, cache)
    return chosen.method, chosen.batch


def method_label(spec: str, detail: dict, bittrain: bool) -> str:
    """The report's name of the run of ``spec`` that ``detail`` describes (auto: the method it chose)."""
    return finetune_label(detail.get("method", spec), bittrain) + (" (auto)" if spec == AUTO else "")


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    """One row per fine-tuning run, in finetune.methods' order."""
    rows = []
    for key in [k for k in inputs.head if k.startswith("finetune/")]:
        spec = key.split("/", 1)[1]
        label = method_label(spec, inputs.detail[key], bool(inputs.plus("finetune")))
        rows.append(training_row(label, f"finetune@{spec}",
                                 f"pretrained {inputs.finetune_model}", inputs.detail[key]["model"], inputs.head[key],
                                 curve=STAGE.curve.replace(MATRIX_ITEM, spec), plotted=True))
    return rows


if __name__ == "__main__":
    run_stage(main, parser(), resumes=True)
