"""Stage meanet_cloud (MEANet, Algorithm 1 steps 1-4: the cloud's part): the main block, the hard classes, the cloud model.

The main block is models/pretrained/<meanet.main>.pt from the pretrain stage: model B uses the whole CNN;
model A cuts it after meanet.split_after, adds an exit and trains CNN and exit jointly on the cloud's data
for meanet.cloud_epochs (pretrain's recipe). The main block then predicts the cloud's validation split:
classes ranked by precision, ascending, the first meanet.n_hard are hard, and the entropy range
(mu_correct, mu_wrong) of its predictions is the router's useful threshold range.

Writes models/meanet/main.pt (the MEANet the device starts from: the main block, and the adaptive and
extension blocks before training), models/meanet/hard_classes.json (the class map to 0..n_hard-1 and the
statistics behind it, checksummed) and models/meanet/cloud (the cloud model in MLflow's format, which
evaluate_edge_cloud serves with `mlflow models serve`; images mode: models/pretrained/<meanet.cloud>.pt;
features mode, model A only: the CNN's tail after the fusion point). The cloud model is also logged to the
stage's MLflow run. Metrics: metrics/meanet_cloud.json (the test accuracies are evaluate_edge_cloud's).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from edgeflux.artifacts import file_digest, load_model, write_json
from edgeflux.checkpoint import run_signature
from edgeflux.config import ParamsError
from edgeflux.data import load_prepared, tensors
from edgeflux.meanet.hard import entropy_range, hard_classes
from edgeflux.meanet.model import MEANetConfigError, MEANetSpec, build_meanet, check_n_hard, main_block, save_meanet
from edgeflux.meanet.train import main_logits, train_main_block
from edgeflux.models import count_params, eval_mode
from edgeflux.tracking import save_model_dir, stage_run
from edgeflux.train import resolve_device
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="meanet_cloud", section="meanet", side="cloud",
              outs=("details/meanet_cloud.json", "models/meanet/main.pt", "models/meanet/hard_classes.json",
                    "models/meanet/cloud", "metrics/meanet_cloud.json"))

PRETRAINED = Path("models/pretrained")
MAIN, HARD, CLOUD = Path("models/meanet/main.pt"), Path("models/meanet/hard_classes.json"), Path("models/meanet/cloud")
CHECKPOINT = Path(".edgeflux/checkpoints/meanet_cloud.pt")


def spec_of(p, num_classes: int) -> MEANetSpec:
    n_hard = num_classes // 2 if p.n_hard is None else p.n_hard
    check_n_hard(n_hard, num_classes)   # before model A's training at the cloud, not after it
    return MEANetSpec(variant=p.variant, split_after=p.split_after, fusion=p.fusion, n_hard=n_hard,
                      extension_blocks=p.extension_blocks, num_classes=num_classes)


def pretrained(key: str) -> nn.Module:
    path = PRETRAINED / f"{key}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no pretrained model {key!r}; run `dvc repro pretrain` first")
    return load_model(path)[0]


def main(args, params) -> None:
    p = params.meanet
    if p is None:
        raise ParamsError(f"{args.params} has no meanet section; add one (see the repository's params.yaml)")
    if p.send == "features" and p.variant != "A":
        raise MEANetConfigError("meanet.send = 'features' needs meanet.variant = 'A' (the cloud continues the CNN "
                                "the main block is cut from); use send: images with model B")
    data, device = load_prepared(Path("data/prepared")), resolve_device(p.device)
    train, val, test = (tensors(data, f"source_{s}") for s in ("train", "val", "test"))
    model = pretrained(p.main)
    spec = spec_of(p, model.num_classes)
    with stage_run("meanet_cloud", p.model_dump()) as run:
        main_model, k = main_block(model, spec)
        metrics = {"variant": p.variant, "main": p.main, "cloud": p.cloud, "split_after": model.unit_names[k - 1]}
        if p.variant == "A":
            opts = params.pretrain.model_copy(update={"epochs": p.cloud_epochs})
            start = run_signature(pretrained=file_digest(PRETRAINED / f"{p.main}.pt"), split=k, spec=spec.to_dict())
            trained = train_main_block(model, main_model, k, train, val, test, opts, device, CHECKPOINT, start)
            metrics["main_train_time_s"] = trained.train.train_time_s
            model.cpu(), main_model.cpu()
        net = build_meanet(model, spec, model.build_args, main=main_model)
        logits = main_logits(net, val[0])
        hard = hard_classes(logits, val[1], spec.n_hard)
        mu_c, mu_w = entropy_range(logits, val[1])
        cloud = model.head(k) if p.send == "features" else pretrained(p.cloud)
        with eval_mode(net), torch.no_grad():   # (train mode would move the main block's BatchNorm statistics)
            example = net.features(test[0][:2]) if p.send == "features" else test[0][:2]
        metrics.update(main_val_acc=(logits.argmax(1) == val[1]).float().mean().item(),
                       main_params=count_params(net.main), cloud_params=count_params(cloud), mu_correct=mu_c, mu_wrong=mu_w,
                       hard_classes=[data.classes[c] for c in hard.hard])
        save_meanet(MAIN, net, meta={"stage": "meanet_cloud", **metrics})
        write_json(HARD, {**hard.to_dict(), "mu_correct": mu_c, "mu_wrong": mu_w, "send": p.send,
                          "class_names": list(data.classes)}, checksum=True)
        save_model_dir(cloud.eval(), CLOUD, example.detach())
        metrics["n_hard"] = len(hard.hard)
        written = write_metrics("meanet_cloud", metrics, run, names={
            k: k for k in ("main_val_acc", "main_params", "cloud_params", "n_hard")})
        run.log_model(cloud, "cloud_model", example=example.detach(), registered_name="edgeflux-meanet-cloud")
        for path in (*written, HARD):
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__), resumes=True)
