"""MEANet's cloud: a CNN far stronger than the edge's, trained on the cloud's data, one per seed.

The paper's cloud is a ResNet-101 on a GPU server, well above its edge models; a cloud barely stronger than the
edge makes "edge-cloud within 1 point of cloud-only" hold trivially and never tests what sending buys. Here the
cloud is a full-width ResNet-18 (CIFAR-style, 1 channel, 32 px: about 11 M parameters, 16x the edge's ResNet-18
w0.25) trained on every class of the source half of Fashion-MNIST (the split bench.meanet and the pipeline give
the cloud) with the one training loop: SGD with momentum and weight decay, a cosine learning rate, random crops
and flips. Each seed's weights are saved for bench.meanet's --cloud-dir, which serves them over HTTP as its cloud.

Train it where a cloud would, on a GPU: a seed is about a minute on an H100 and hours on 2 CPU cores.

    python -m bench.meanet_cloud --device cuda --out runs/cloud     # 3 seeds: cloud_seed{0,1,2}.pt + meanet_cloud.{json,md}
    python -m bench.meanet_cloud --quick --out /tmp/cloud           # CI-sized: a narrow model, 1 epoch, small data
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from bench.common import BenchResult, HelpFormatter, bench_argparser, fmt_ci, mean_ci, quick_args
from edgeflux.backprop import train_under_budget
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.models import build_model
from edgeflux.options import AugmentOptions, TrainOptions
from edgeflux.train import TrainRun

NAME = "meanet_cloud"
log = logging.getLogger("bench.meanet_cloud")
QUICK = dict(width=0.125, epochs=1, train_samples=1024, test_samples=256, seeds=[0])


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    parser.add_argument("--model", default="resnet18", help="the cloud's CNN (a zoo model)")
    parser.add_argument("--width", type=float, default=1.0, help="its width multiplier")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one cloud per seed (weights, order)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the source half")
    parser.add_argument("--batch", type=int, default=256, help="training batch")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine to 0)")
    parser.add_argument("--crop-scale", type=float, nargs=2, default=[0.6, 1.0], metavar=("LO", "HI"),
                        help="random-resized crops keep this share of each image's area")
    parser.add_argument("--train-samples", type=int, default=None, help="source images (default: all)")
    parser.add_argument("--test-samples", type=int, default=None, help="target test images (default: all 10,000)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the cloud trains")
    args = quick_args(parser.parse_args(argv), QUICK)
    return args


def spec_of(args, seed: int) -> dict:
    """build_model's arguments: what bench.meanet rebuilds the cloud from."""
    return dict(name=args.model, num_classes=10, in_channels=1, width=args.width, image_size=32, seed=seed)


def train_cloud(args, data, seed: int, out: Path) -> dict:
    """One seed's cloud, trained and saved (half-precision weights: the served model computes in fp32)."""
    spec = spec_of(args, seed)
    model = build_model(**spec)
    opts = TrainOptions(epochs=args.epochs, batch_size=args.batch, lr=args.lr, lr_reference_batch=args.batch,
                        momentum=0.9, weight_decay=5e-4, evals_per_epoch=1, seed=seed, device=args.device,
                        augment=AugmentOptions(enabled=True, scale=list(args.crop_scale), flip=True))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    run = train_under_budget(model, data["train"], data["val"], data["test"], opts,
                             TrainRun(torch.device(device), desc=f"cloud {args.model}-w{args.width:g} seed {seed}"))
    path = out / f"cloud_seed{seed}.pt"
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    torch.save({"spec": spec, "state_dict": state, "test_acc": run.test_acc}, path)
    log.info("seed %d: target test accuracy %.4f after %.0f s; %s", seed, run.test_acc, run.train.train_time_s, path)
    return {"seed": seed, "test_acc": run.test_acc, "val_acc": run.train.history[-1]["val_acc"],
            "train_s": run.train.train_time_s, "params": run.params, "file": path.name}


def load_cloud(path: str | Path) -> torch.nn.Module:
    """A saved cloud (cloud_seed{S}.pt), rebuilt in fp32 and in eval mode; its build_model arguments and recorded
    test accuracy as ``model.spec`` and ``model.test_acc``."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(**saved["spec"])
    model.load_state_dict(saved["state_dict"])   # copied into the fp32 parameters
    model.spec, model.test_acc = saved["spec"], saved["test_acc"]
    return model.eval()


def load_splits(args) -> dict:
    """The cloud's data: the source half (train, val) and the target test split every MEANet figure scores on."""
    split = prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    return {"train": tensors(split, "source_train", limit=args.train_samples),
            "val": tensors(split, "source_val", limit=args.test_samples),
            "test": tensors(split, "target_test", limit=args.test_samples)}


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    data = load_splits(args)
    started, result = time.perf_counter(), BenchResult()
    for seed in args.seeds:
        result.add(model=f"{args.model}-w{args.width:g}", **train_cloud(args, data, seed, args.out))
    acc = mean_ci([r["test_acc"] for r in result.rows])
    result.write(NAME, args.out, title="MEANet's cloud: the CNN the edge asks (target test split)",
                 notes=f"Target test accuracy over seeds: {fmt_ci(acc, digits=4)}. Trained on the source half's "
                       f"{len(data['train'][1])} images for {args.epochs} epochs at batch {args.batch}, lr {args.lr} "
                       f"(cosine), crops of {args.crop_scale[0]:g}-{args.crop_scale[1]:g} of the area and flips; "
                       f"{time.perf_counter() - started:.0f} s in all.",
                 extra={"n_seeds": len(args.seeds), "test_acc": acc["mean"],
                        "test_acc_ci95": None if acc["hi"] is None else acc["hi"] - acc["mean"],
                        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
