"""Stage pretrain (the cloud stage): plain backprop, no budget, on the source split.

Writes one model file per entry of pretrain.models to models/pretrained/<key>.pt: the backbones
that devices download (MobileTL and ElasticTrainer fine-tune them, MEANet's main block and its
larger cloud model come from here). Metrics per model in metrics/pretrain.json.
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.artifacts import save_model
from edgeflux.backprop import train_under_budget
from edgeflux.data import load_prepared, tensors
from edgeflux.models import build_model
from edgeflux.tracking import stage_run
from edgeflux.train import TrainRun, resolve_device
from stages.common import headline, run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="pretrain", section="pretrain", side="cloud",
              outs=("details/pretrain.json", "models/pretrained", "metrics/pretrain.json"))

OUT = Path("models/pretrained")
CHECKPOINTS = Path(".edgeflux/checkpoints/pretrain")


def main(args, params) -> None:
    p = params.pretrain
    data = load_prepared(Path("data/prepared"))
    device = resolve_device(p.device)
    train = tensors(data, "source_train", limit=p.max_train_samples)
    val, test = tensors(data, "source_val"), tensors(data, "source_test")
    summary = {}
    with stage_run("pretrain", p.model_dump()) as run:
        for spec in p.models:
            build_args = spec.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
            model = build_model(**build_args, pretrained_path=spec.weights_path())
            result = train_under_budget(model, train, val, test, p, TrainRun(
                device, checkpoint=CHECKPOINTS / f"{spec.key}.pt", desc=f"pretrain {spec.key}"))
            summary[spec.key] = result.metrics()
            save_model(OUT / f"{spec.key}.pt", model, build_args, meta={"stage": "pretrain", **summary[spec.key]})
            run.log_metrics({f"{spec.key}.{k}": v for k, v in summary[spec.key].items()})
        written = write_metrics("pretrain", summary, run, head={key: headline(m) for key, m in summary.items()})
        for stale in set(OUT.glob("*.pt")) - {OUT / f"{key}.pt" for key in summary}:
            stale.unlink()   # dvc.yaml persists this directory: a model no longer in params must not linger
        run.log_metrics({"peak_mem_bytes": max(m["peak_mem_bytes"] for m in summary.values())})
        for path in written:
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__), resumes=True)
