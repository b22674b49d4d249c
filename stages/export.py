"""Stage export: every trained device model as a file a device runs without edgeflux.

For backprop (train_bp), NeuroFlux's early-exit model (select_exit), each fine-tuning method (finetune) and
MEANet's edge model (meanet_edge): models/export/<name>.onnx (onnxruntime) and <name>.ts (TorchScript; with
export.exporter: dynamo, <name>.pt2 of torch.export), each
checked against the PyTorch model on the test split's first export.batch images (max |Δlogit| in
metrics/export.json), and <name>.json (input shape, normalisation, classes, accuracy). With export.registry, each
ONNX file is also a new version of edgeflux-<name> in MLflow's model registry, which plain MLflow loads
(`mlflow.pyfunc.load_model("models:/edgeflux-<name>/<version>")`).

MobileTL's int8 bottom (the frozen bottom's forward in int8 while training) is not exported: its model is saved and
exported in float32, as every other. torch.export's ONNX exporter refuses torch.ao's quantized modules; the
TorchScript one translates them, but onnxruntime's int8 arithmetic is not torch's (fbgemm/qnnpack), so the file's
logits miss the check by far more than float rounding; docs/data-models-tracking.md says how to quantize on a device.
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.artifacts import load_model, read_json
from edgeflux.data import load_prepared, tensors
from edgeflux.errors import UserError
from edgeflux.export import export_model, remove_export
from edgeflux.tracking import stage_run
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="export", section="export", side="device",
              outs=("models/export", "details/export.json", "metrics/export.json"))

OUT = Path("models/export")


def trained_models(params) -> dict[str, tuple]:
    """name -> (how to load it, where its test accuracy is): the device models the params train."""
    found = {"train_bp": (lambda: load_model("models/train_bp.pt")[0], "details/train_bp.json"),
             "neuroflux_exit": (_exit_model, "details/select_exit.json")}
    for method in (params.finetune.methods if params.finetune else []):
        found[f"finetune-{method}"] = (lambda m=method: load_model(f"models/finetune/{m}.pt")[0],
                                       f"details/finetune/{method}.json")
    if params.meanet:
        found["meanet_edge"] = (_meanet_edge, "details/meanet_edge.json")
    return found


def _exit_model():
    from edgeflux.neuroflux.exit import ExitModel
    from edgeflux.neuroflux.model import load_learners

    _, learners, _ = load_learners("models/neuroflux.pt")
    chosen = read_json("details/select_exit.json", "run `dvc repro select_exit`")["exit_index"]
    return ExitModel(learners, chosen)


def _meanet_edge():
    from edgeflux.meanet.model import load_meanet

    return load_meanet("models/meanet/edge.pt")[0]


class UnknownModelError(ValueError, UserError):
    """A model name the params train no model for."""


def export_one(name: str, params, out: Path = OUT, exporter: str | None = None, run=None) -> dict:
    """One trained model exported into ``out`` (its checks returned); with ``run``, also registered in MLflow."""
    models = trained_models(params)
    if name not in models:
        raise UnknownModelError(f"no trained model {name!r}: the params train {', '.join(models)}")
    load, details = models[name]
    data = load_prepared(Path("data/prepared"))
    images, _ = tensors(data, "target_test", limit=params.export.batch)
    example = images[:]
    card = {"classes": list(data.classes), "normalisation": {"mean": list(data.mean), "std": list(data.std)},
            "test_acc": read_json(details, f"run `dvc repro` for {name}").get("test_acc"), "test_acc_from": details}
    checks = export_model(load(), example, out, name, card, exporter or params.export.exporter)
    if run is not None and params.export.registry:
        run.log_onnx_model(out / f"{name}.onnx", name, example[:2], registered_name=f"edgeflux-{name}")
    return checks


def main(args, params) -> None:
    names = list(trained_models(params))
    for stale in {f.stem for f in OUT.glob("*")} - set(names):   # a method no longer trained
        remove_export(OUT, stale)
    with stage_run("export", params.export.model_dump()) as run:
        checks = {name: export_one(name, params, run=run) for name in names}
        worst = {k: max(c[k] for c in checks.values()) for k in ("onnx_max_abs_diff", "trace_max_abs_diff")}
        written = write_metrics("export", {"models": checks, **worst}, run, head=worst)
        for path in written:
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
