"""MobileTL vs the fine-tuning baselines, measured (Chiang et al., AAAI 2023: Figure 1, Table 1, Table 3, Figure 5).

(a) case "block": the bytes ONE block saves for backward (the paper's Figure 1 / Table 1), counted in
    saved-tensor hooks over a training step (forward + backward + SGD step) of the block alone in train
    mode, at input (--block-batch, 96, --block-size, --block-size): input without gradient, parameters
    trainable. Blocks: a vanilla conv block (Conv2d 5x5 + BatchNorm2d + ReLU6, 96 -> 96 channels), a
    MobileNetV2 inverted-residual block (torchvision InvertedResidual(96, 96, stride 1, expansion 6))
    and a MobileNetV3 one (expansion 6, kernel 5, squeeze-excitation, Hard-Swish). Method "vanilla" is the
    block as built, "mobiletl" the block after edgeflux.mobiletl.transform_block (the conv block has one
    BatchNorm, which MobileTL keeps trainable: only its activation becomes sign-backward). Each with and
    without BitTrain. Also the measured peak of that step and its median latency.
(b) case "transfer": Fashion-MNIST split by classes (source: classes 0-4, target: 5-9; labels keep their
    ids, the models have 10 outputs, as the pipeline's pretrain/finetune stages do). MobileNetV2 and
    MobileNetV3-small (width 0.5, 1 channel, 32x32) pre-trained on the source with plain backprop, then
    fine-tuned on the target with every method of edgeflux.finetune.METHODS (the same epochs, optimizer,
    lr and batch for all), plus MobileTL with BitTrain. Per row: target test accuracy of that run; and,
    on the method's prepared model at --measure-batch, the measured peak and saved bytes of one
    steady-state training step, the counted FLOPs of one training step (counted, not timed), the
    trainable parameters and the median latency of a training step.
(c) case "budget": one memory budget per model, --budget-factor x FT-All's measured peak at
    --measure-batch (so FT-All fits only a small batch); each method trains at the largest batch whose
    measured step fits it (edgeflux.finetune chooses it): batch, peak at that batch, test accuracy.

    python -m bench.mobiletl --threads 2                # full run, 3 seeds (about 55 min on 2 cores), results in bench/results/
    python -m bench.mobiletl --quick --out /tmp/bench   # CI-sized: MobileNetV3-small only, < 2 min on 1 thread
    python -m bench.mobiletl --threads 2 --workload realistic   # photos at 128 px, torchvision's models (37 min)
    python -m bench.mobiletl --models mobilenet_v2 --skip-budget --out /tmp/bench
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
import warnings
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3

from bench import realistic
from bench.common import (TARGET_COLUMNS, BenchResult, HelpFormatter, add_seeds, add_workload, bench_argparser,
                          model_args, over_seeds, parse_workload, pm, quick_args, result_name, seeds_of, target,
                          workload_model)
from edgeflux.backprop import train_under_budget
from edgeflux.bittrain import BitTrainOptions
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.colours import method_colour
from edgeflux.finetune import FinetuneOptions, calibration_batches, count_flops, finetune, finetune_label
from edgeflux.finetune import prepare as prepare_method
from edgeflux.memory import (MiB, BudgetTooSmallError, TrainStep, format_bytes, measure_training_step,
                             saved_bytes_by_node)
from edgeflux.mobiletl import sign_backward, transform_block
from edgeflux.models import build_model, count_params
from edgeflux.models.units import train_mode
from edgeflux.train import TrainOptions, TrainRun, optimizer_factory

NAME = "mobiletl"
log = logging.getLogger("bench.mobiletl")

ROW_KEYS = ("case", "model", "method", "blocks", "bittrain", "seed", "batch", "peak_bytes", "saved_bytes", "flops",
            "train_params", "test_acc", "step_time_s", "saved_reduction", "saved_reduction_paper")
METRICS = ("test_acc", "peak_bytes", "saved_bytes", "flops", "step_time_s")   # averaged over seeds
BLOCK_METHODS = ("ft_blocks", "mobiletl")
MODELS = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")
PAPER_METHODS = ("ft_all", "ft_last", "ft_bn", "ft_bias", "ft_blocks", "mobiletl")   # MobileTL's Table 3 and itself
BLOCKS = ("conv_block", "mbv2_irb", "mbv3_irb")
BLOCK_CHANNELS = 96
SOURCE_CLASSES = [0, 1, 2, 3, 4]          # Fashion-MNIST: source 0-4, target 5-9
IRB_TARGETS = {"mbv2_irb": 0.463, "mbv3_irb": 0.533}   # the paper's saved-activation reductions per IRB (1 decimal)
RELU6_NODE = "HardtanhBackward0"   # ReLU6's backward: PyTorch saves its 32-bit input; the paper's Table 2 counts 2 bits
ACC_TOLERANCE = 0.5            # points: MobileTL-kBLKs at most this far below FT-kBLKs (the paper: 0.47-1.13 above)
MEMORY_TARGET = 0.167          # MobileTL-3BLKs' peak this much below FT-3BLKs' (the paper's Table 3, Proxyless)
ALL_TOLERANCE = 0.6            # points: MobileTL-5BLKs at most this far below FT-All (the paper's abstract, V3)
FLOPS_TARGET = 0.36            # MobileTL-5BLKs' training FLOPs this much below FT-All's (the same sentence)
LATENCY_TARGET = 1.8           # FT-All step latency / MobileTL-3BLKs' (the paper's Table 6: 1.82x on a Pi 4)
# --workload realistic: the photo folder at the realistic preset's size on torchvision's full-width architectures,
# where a step's memory is activations; its defaults, where a flag is left at the default workload's
REALISTIC = dict(image_size=realistic.PHOTO_PX, pretrain_samples=100_000, pretrain_epochs=4,
                 train_samples=100_000, val_samples=100_000, epochs=3, skip_budget=True)
DATA = {"default": "Fashion-MNIST (1 channel, {args.image_size}x{args.image_size}, the zoo's models at width "
                   "{args.width:g})",
        "realistic": "bench.realistic's photo folder (Fashion-MNIST upscaled to 3-channel PNGs, read at "
                     "{args.image_size}x{args.image_size}; torchvision's architectures at full width, from random "
                     "weights)"}
QUICK_NOTE = ("--quick: 512 images and 1 epoch are too few for the target classes to be learnt (the accuracies are "
              "not meaningful); memory, FLOPs and latency are measured as in the full run.\n")
QUICK = dict(models=["mobilenet_v3_small"], pretrain_samples=512, pretrain_epochs=1, train_samples=512,
             val_samples=256, test_samples=256, epochs=1, timing_steps=5, warmup_steps=2, max_batch=64)


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter    # the docstring as written, and every flag's default
    parser.add_argument("--models", nargs="+", default=["mobilenet_v2", "mobilenet_v3_small"], choices=MODELS,
                        metavar="MODEL", help=f"models of the transfer and budget cases (of {', '.join(MODELS)}; "
                                              f"--quick: mobilenet_v3_small)")
    parser.add_argument("--width", type=float, default=0.5, help="width multiplier of the models")
    parser.add_argument("--methods", nargs="+", default=list(PAPER_METHODS), choices=PAPER_METHODS, metavar="METHOD",
                        help=f"fine-tuning methods (of {', '.join(PAPER_METHODS)})")
    parser.add_argument("--blocks", type=int, nargs="+", default=[3, 5],
                        help="top blocks that train in ft_blocks and mobiletl, one run per value (the paper's 3 and "
                             "5); MobileTL + BitTrain and the budget case use the first")
    parser.add_argument("--pretrain-samples", type=int, default=12000,
                        help="source training images for pre-training (--quick: 512)")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="pre-training epochs (--quick: 1)")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3, help="pre-training learning rate (Adam, batch 64)")
    parser.add_argument("--bn-momentum", type=float, default=0.1,
                        help="BatchNorm momentum of the models (torchvision's MobileNetV3 uses 0.01: after a short "
                             "pre-training its running statistics are still far from the data's and eval-mode "
                             "accuracy is at chance); 0 keeps each model's own")
    parser.add_argument("--train-samples", type=int, default=5000,
                        help="target training images for fine-tuning (--quick: 512)")
    parser.add_argument("--val-samples", type=int, default=2000,
                        help="validation images, source and target (--quick: 256)")
    parser.add_argument("--test-samples", type=int, default=None,
                        help="test images, source and target (default: the whole test split; --quick: 256)")
    parser.add_argument("--image-size", type=int, default=32, help="image height and width of the transfer cases")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs, every method (--quick: 1)")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                        help="fine-tuning optimizer (weight decay 5e-4; sgd: momentum 0.9)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="fine-tuning learning rate, every method (cosine schedule). Chosen on trials of the "
                             "default sizes: MobileTL on mobilenet_v2 diverges (NaN loss) at sgd 0.05 (which FT-3BLKs "
                             "takes) and trails FT-3BLKs by 1.6 points at sgd 0.01 and 8 at sgd 0.02; at adam 1e-3 "
                             "it trains best, 0.6 point below FT-3BLKs (mobilenet_v3_small: 0.9)")
    parser.add_argument("--batch", type=int, default=32, help="fine-tuning batch of the transfer case (no budget)")
    parser.add_argument("--measure-batch", type=int, default=8,
                        help="batch at which peak, saved bytes, FLOPs and step latency are measured (transfer case)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps before timing (--quick: 2)")
    parser.add_argument("--timing-steps", type=int, default=20,
                        help="timed training steps; the median is reported (--quick: 5)")
    parser.add_argument("--budget-factor", type=float, default=2.0,
                        help="budget case: the budget is this times FT-All's measured peak at --measure-batch")
    parser.add_argument("--max-batch", type=int, default=128, help="budget case: largest batch a method may get "
                                                                   "(--quick: 64)")
    parser.add_argument("--block-batch", type=int, default=8, help="block case: batch of the block input")
    parser.add_argument("--block-size", type=int, default=7, help="block case: height and width of the block input")
    parser.add_argument("--skip-budget", action="store_true", help="leave out the budget case")
    add_workload(parser, "Fashion-MNIST at --image-size, the zoo's models at --width",
                 "bench.realistic's photo folder (3 channels), torchvision's architectures at full width", REALISTIC)
    add_seeds(parser, "pre-trained weights, fine-tuning order; the block case is deterministic and runs once")
    args = quick_args(parse_workload(parser, argv), QUICK)
    args.seeds = seeds_of(args)
    if min(args.blocks) < 1:
        parser.error(f"--blocks must be >= 1, got {args.blocks}")
    for flag in ("pretrain_samples", "pretrain_epochs", "train_samples", "val_samples", "epochs", "batch",
                 "measure_batch", "timing_steps", "max_batch", "block_batch", "block_size", "image_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.budget_factor <= 0 or args.width <= 0:
        parser.error("--budget-factor and --width must be > 0")
    if not 0 <= args.bn_momentum < 1:
        parser.error(f"--bn-momentum must be in [0, 1), got {args.bn_momentum}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    return args


def row(**values) -> dict:
    """A result row: exactly ROW_KEYS, None where a value does not apply."""
    unknown = set(values) - set(ROW_KEYS)
    if unknown:
        raise KeyError(f"not a row key: {sorted(unknown)}")
    return {k: values.get(k) for k in ROW_KEYS}


def median_step_time(net: nn.Module, make_step, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int) -> float:
    """Median wall time (time.perf_counter) of `steps` training steps on a copy of `net`, after `warmup` steps."""
    step = make_step(train_mode(copy.deepcopy(net)))
    for _ in range(warmup):
        step(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# ----------------------------------------------------------------------------- (a) one block

def build_block(name: str) -> nn.Module:
    c = BLOCK_CHANNELS
    if name == "conv_block":    # what torchvision's Conv2dNormActivation builds: the ReLU6 is in place
        return nn.Sequential(nn.Conv2d(c, c, 5, padding=2, bias=False), nn.BatchNorm2d(c), nn.ReLU6(inplace=True))
    if name == "mbv2_irb":
        return mobilenetv2.InvertedResidual(c, c, stride=1, expand_ratio=6)
    cfg = mobilenetv3.InvertedResidualConfig(c, 5, 6 * c, c, True, "HS", 1, 1, 1.0)
    return mobilenetv3.InvertedResidual(cfg, partial(nn.BatchNorm2d, eps=0.001, momentum=0.01))


def mobiletl_block(block: nn.Module, name: str) -> tuple[nn.Module, dict]:
    net = copy.deepcopy(block)
    if name == "conv_block":    # one BatchNorm: MobileTL keeps the last BN of a block trainable; the activation changes
        net[2] = sign_backward(net[2])
        return net, {"sign_backward": ["2"], "note": "conv block: sign-backward activation only"}
    return net, transform_block(net)


def block_rows(args, progress: Progress) -> tuple[list[dict], list[dict]]:
    torch.manual_seed(0)
    b, s = args.block_batch, args.block_size
    x, warm = torch.randn(b, BLOCK_CHANNELS, s, s), torch.randn(b, BLOCK_CHANNELS, s, s)
    y = torch.zeros(b)   # unused: the loss is the sum of the block output (it saves nothing of its own)
    rows, details = [], []
    task = progress.add_task("blocks", total=len(BLOCKS) * 4)
    for name in BLOCKS:
        torch.manual_seed(0)
        vanilla = build_block(name).train()
        for method in ("vanilla", "mobiletl"):
            net, changed = (vanilla, None) if method == "vanilla" else mobiletl_block(vanilla, name)
            params = [*net.parameters(), *net.buffers()]
            out = net(x)
            by_node = saved_bytes_by_node(out, params)     # autograd's own saved tensors (custom Functions aside)
            del out
            for bittrain in (False, True):
                progress.update(task, description=f"block {name} {method}{' + BitTrain' if bittrain else ''}")
                make_step = TrainStep.factory(sgd, loss_fn=lambda out, _y: out.sum(),
                                              context=BitTrainOptions(enabled=bittrain).context)
                mem = measure_training_step(net, make_step, (warm, y), (x, y), "cpu", process_stats=False)
                latency = median_step_time(net, make_step, x, y, args.warmup_steps, args.timing_steps)
                rows.append(row(case="block", model=name, method=method, bittrain=bittrain, batch=b,
                                peak_bytes=mem.peak_bytes, saved_bytes=mem.saved_bytes,
                                train_params=count_params(net, trainable_only=True), step_time_s=latency))
                details.append({"model": name, "method": method, "bittrain": bittrain, "transform": changed,
                                "saved_by_node": by_node if not bittrain else None,
                                "saved_dense_bytes": (mem.activation_storage or {}).get("total", {}).get("dense_bytes"),
                                "input_shape": [b, BLOCK_CHANNELS, s, s]})
                progress.advance(task)
    return add_reductions(rows, details), details


def paper_saved_bytes(saved_bytes: int, by_node: dict[str, int]) -> int:
    """A block's saved bytes as MobileTL's Table 2 counts them: each ReLU6 keeps a 2-bit mask of its input where
    PyTorch keeps the input itself (4 bytes an element). Hard-Swish is counted at 32 bits by both."""
    relu6 = by_node.get(RELU6_NODE, 0)
    return saved_bytes - relu6 + relu6 // 4 * 2 // 8


def add_reductions(rows: list[dict], details: list[dict]) -> list[dict]:
    """MobileTL rows of the block case get saved_reduction (against the vanilla block as PyTorch saves it, with or
    without BitTrain alike) and saved_reduction_paper (without BitTrain: against the paper's count of vanilla)."""
    def find(items, name, method, bittrain):
        return next(r for r in items if (r["model"], r["method"], r["bittrain"]) == (name, method, bittrain))
    for tl in (r for r in rows if r["method"] == "mobiletl"):
        vanilla = find(rows, tl["model"], "vanilla", tl["bittrain"])
        tl["saved_reduction"] = 1 - tl["saved_bytes"] / vanilla["saved_bytes"]
        if not tl["bittrain"]:
            paper = paper_saved_bytes(vanilla["saved_bytes"], find(details, tl["model"], "vanilla", False)["saved_by_node"])
            tl["saved_reduction_paper"] = 1 - tl["saved_bytes"] / paper
    return rows


# ----------------------------------------------------------------------------- (b), (c) transfer

def load_data(args):
    """The source and target splits (by classes) of the workload's data: Fashion-MNIST, or the photo folder."""
    if args.workload == "realistic":
        data = realistic.photo_data("classes", SOURCE_CLASSES, args.image_size)
    else:
        data = prepare(load_raw("fashion-mnist"), image_size=args.image_size, val_fraction=0.1, seed=0,
                       split_by="classes", source_classes=SOURCE_CLASSES)
    source = {"train": tensors(data, "source_train", limit=args.pretrain_samples),
              "val": tensors(data, "source_val", limit=args.val_samples),
              "test": tensors(data, "source_test", limit=args.test_samples)}
    target = {"train": tensors(data, "target_train", limit=args.train_samples),
              "val": tensors(data, "target_val", limit=args.val_samples),
              "test": tensors(data, "target_test", limit=args.test_samples)}
    return data, source, target


def model_spec(name: str, args) -> dict:
    """build_model's arguments for a model of the workload (classes and seed aside)."""
    return {k: v for k, v in model_args(name, args, args.image_size, 0).items() if k != "num_classes"}


def pretrain(name: str, args, num_classes: int, source: dict, seed: int) -> tuple[nn.Module, dict]:
    model = build_model(**model_spec(name, args), num_classes=num_classes, seed=seed)
    if args.bn_momentum > 0:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = args.bn_momentum
    opts = TrainOptions(epochs=args.pretrain_epochs, batch_size=64, lr=args.pretrain_lr, optimizer="adam",
                        evals_per_epoch=1, seed=seed, device="cpu")
    run = train_under_budget(model, source["train"], source["val"], source["test"], opts,
                             TrainRun(torch.device("cpu"), desc=f"pretrain {name}, seed {seed}"))
    info = {"model": name, "seed": seed, "source_test_acc": run.test_acc, "train_time_s": run.train.train_time_s,
            "epochs": args.pretrain_epochs, "samples": len(source["train"][1]), "batch": run.batch_size,
            "optimizer": f"adam lr {args.pretrain_lr:g}"}
    log.info("pretrained %s, seed %d: source test accuracy %.4f in %.0fs", name, seed, run.test_acc,
             run.train.train_time_s)
    return model, info


def measure_method(pretrained: nn.Module, method: str, opts: FinetuneOptions, calibration, batch, warm,
                   args) -> dict:
    """The method's prepared model (on a fresh copy of the pretrained one) at the measuring batch: measured peak
    and saved bytes of a steady-state step, counted FLOPs, trainable parameters, median step latency."""
    float_model = copy.deepcopy(pretrained)
    net = prepare_method(method, float_model, opts, calibration, "cpu").model
    make_step = TrainStep.factory(optimizer_factory(opts), context=opts.bittrain.context)
    mem = measure_training_step(net, make_step, warm, batch, "cpu", process_stats=False)
    fwd, bwd = count_flops(float_model, net, *batch)
    latency = median_step_time(net, make_step, *batch, args.warmup_steps, args.timing_steps)
    return {"peak_bytes": mem.peak_bytes, "saved_bytes": mem.saved_bytes, "flops": fwd + bwd, "flops_forward": fwd,
            "flops_backward": bwd, "train_params": count_params(net, trainable_only=True), "step_time_s": latency}


def variants(args) -> list[tuple[str, int | None, bool]]:
    """(method, blocks, bittrain) of the transfer case: a block-wise method once per --blocks value, MobileTL with
    BitTrain at the first."""
    out = [(m, k, False) for m in args.methods for k in (args.blocks if m in BLOCK_METHODS else [None])]
    return out + ([("mobiletl", args.blocks[0], True)] if "mobiletl" in args.methods else [])


def options(args, seed: int, **update) -> FinetuneOptions:
    """The fine-tuning every method of the benchmark gets (the same epochs, batch, lr, optimizer), with `update`."""
    return FinetuneOptions(epochs=args.epochs, batch_size=args.batch, lr=args.lr, optimizer=args.optimizer,
                           evals_per_epoch=1, seed=seed, device="cpu", max_batch=args.max_batch, **update)


def transfer_rows(key: str, pretrained: nn.Module, args, target: dict, progress: Progress, task,
                  seed: int) -> tuple[list[dict], list[dict]]:
    base = options(args, seed)
    m = args.measure_batch
    x, y = target["train"]
    batch, warm = (x[:m], y[:m].clone()), (x[m:2 * m], y[m:2 * m].clone())
    rows, details = [], []
    for method, blocks, bittrain in variants(args):
        name = f"{key} {label(method, blocks, bittrain)}, seed {seed}"
        progress.update(task, description=f"transfer {name}")
        opts = base.model_copy(update={"bittrain": BitTrainOptions(enabled=bittrain), "blocks": blocks or 1})
        calibration = calibration_batches(x, opts.calibration_batches)
        measured = measure_method(pretrained, method, opts, calibration, batch, warm, args)
        run = finetune(copy.deepcopy(pretrained), method, opts, target["train"], target["val"], target["test"], "cpu")
        metrics = run.metrics()
        warn_diverged(name, run)
        if metrics["train_params"] != measured["train_params"]:
            log.warning("%s: %d trainable parameters in the run, %d in the measured copy", name,
                        metrics["train_params"], measured["train_params"])
        rows.append(row(case="transfer", model=key, method=method, blocks=blocks, bittrain=bittrain, seed=seed,
                        batch=m, test_acc=metrics["test_acc"],
                        **{k: measured[k] for k in ("peak_bytes", "saved_bytes", "flops", "train_params",
                                                    "step_time_s")}))
        details.append({"case": "transfer", "model": key, "method": method, "blocks": blocks, "bittrain": bittrain,
                        "seed": seed, "flops_forward": measured["flops_forward"],
                        "flops_backward": measured["flops_backward"], "train_batch": metrics["batch_size"],
                        "train_peak_bytes": metrics["peak_mem_bytes"], "train_time_s": metrics["train_time_s"],
                        "train_steps": metrics["steps"], "val_acc": metrics["val_acc"],
                        "total_params": metrics.get("params"),
                        "info": {k: v for k, v in run.info.items() if k != "transformed"}})
        log.info("%s: test acc %.4f, peak %s at batch %d, step %.1f ms", name, metrics["test_acc"],
                 format_bytes(measured["peak_bytes"]), m, 1e3 * measured["step_time_s"])
        progress.advance(task)
    return rows, details


def budget_rows(key: str, pretrained: nn.Module, args, target: dict, budget: int, progress: Progress, task,
                seed: int) -> tuple[list[dict], list[dict]]:
    """Each method (block-wise ones at the first --blocks) at the largest batch whose measured step fits `budget`."""
    opts = options(args, seed, blocks=args.blocks[0], budget=f"{budget}B")
    rows, details = [], []
    for method in args.methods:
        blocks = args.blocks[0] if method in BLOCK_METHODS else None
        progress.update(task, description=f"budget {key} {method} ({format_bytes(budget)}), seed {seed}")
        try:
            run = finetune(copy.deepcopy(pretrained), method, opts, target["train"], target["val"], target["test"],
                           "cpu")
        except BudgetTooSmallError as exc:
            log.warning("budget %s: %s does not fit batch 1 (%s)", format_bytes(budget), method, exc)
            rows.append(row(case="budget", model=key, method=method, blocks=blocks, bittrain=False, seed=seed))
            progress.advance(task)
            continue
        metrics = run.metrics()
        warn_diverged(f"budget {key} {method}", run)
        rows.append(row(case="budget", model=key, method=method, blocks=blocks, bittrain=False, seed=seed,
                        batch=metrics["batch_size"], peak_bytes=metrics["peak_mem_bytes"],
                        saved_bytes=metrics["saved_bytes"], flops=step_flops(metrics),
                        train_params=metrics["train_params"], test_acc=metrics["test_acc"],
                        step_time_s=metrics["step_time_s"]))
        details.append({"case": "budget", "model": key, "method": method, "seed": seed, "budget_bytes": budget,
                        "measurements": run.run.batch_fit.measurements if run.run.batch_fit else None,
                        "train_time_s": metrics["train_time_s"], "train_steps": metrics["steps"],
                        "val_acc": metrics["val_acc"]})
        log.info("budget %s, %s %s: batch %d, peak %s, test acc %.4f", format_bytes(budget), key, method,
                 metrics["batch_size"], format_bytes(metrics["peak_mem_bytes"]), metrics["test_acc"])
        progress.advance(task)
    return rows, details


def warn_diverged(what: str, run) -> bool:
    """Log a run whose training loss went non-finite (its test accuracy is then that of a broken model)."""
    losses = [h["train_loss"] for h in run.run.train.history]
    if all(math.isfinite(v) for v in losses):
        return False
    log.warning("%s diverged: training loss %s (try a lower --lr)", what, [round(v, 3) for v in losses])
    return True


def step_flops(metrics: dict) -> int:
    """Counted FLOPs of one training step at the run's batch, from a FinetuneRun's metrics (counted per sample)."""
    return metrics["flops_per_sample"] * metrics["batch_size"]


# ----------------------------------------------------------------------------- report

def label(method: str, blocks: int | None, bittrain: bool = False) -> str:
    names = {"ft_all": "FT-All", "ft_last": "FT-Last", "ft_bn": "FT-BN", "ft_bias": "FT-Bias",
             "ft_blocks": f"FT-{blocks}BLKs", "mobiletl": f"MobileTL-{blocks}BLKs"}
    return names.get(method, method) + (" + BitTrain" if bittrain else "")


def targets(block: list[dict], seed_rows: list[dict], blocks: list[int]) -> list[dict]:
    """The paper's claims against this run: the blocks' saved bytes (deterministic, to the paper's one decimal), and
    per model, each comparison judged by the 95% interval of its per-seed values (paired by seed)."""
    out = []
    by_block = {(r["model"], r["method"]): r for r in block if not r["bittrain"]}
    for name, bar in IRB_TARGETS.items():
        value = round(100 * by_block[(name, "mobiletl")]["saved_reduction_paper"], 1)
        out.append(target("saved activations below the vanilla block, the paper's count (%)", round(100 * bar, 1), [value],
                          exact=True, model=name))
    runs: dict[tuple, dict] = {}
    for r in seed_rows:
        if r["case"] == "transfer" and not r["bittrain"]:
            runs.setdefault((r["model"], r["seed"]), {})[label(r["method"], r["blocks"])] = r
    k, last = blocks[0], blocks[-1]
    checks = ((f"MobileTL-{k}BLKs minus FT-{k}BLKs, test accuracy (points)", -ACC_TOLERANCE,
               lambda m: 100 * (m[f"MobileTL-{k}BLKs"]["test_acc"] - m[f"FT-{k}BLKs"]["test_acc"])),
              (f"MobileTL-{k}BLKs' peak below FT-{k}BLKs' (%)", 100 * MEMORY_TARGET,
               lambda m: 100 * (1 - m[f"MobileTL-{k}BLKs"]["peak_bytes"] / m[f"FT-{k}BLKs"]["peak_bytes"])),
              (f"MobileTL-{last}BLKs minus FT-All, test accuracy (points)", -ALL_TOLERANCE,
               lambda m: 100 * (m[f"MobileTL-{last}BLKs"]["test_acc"] - m["FT-All"]["test_acc"])),
              (f"MobileTL-{last}BLKs' counted training FLOPs below FT-All's (%)", 100 * FLOPS_TARGET,
               lambda m: 100 * (1 - m[f"MobileTL-{last}BLKs"]["flops"] / m["FT-All"]["flops"])),
              (f"step latency, FT-All / MobileTL-{k}BLKs (x)", LATENCY_TARGET,
               lambda m: m["FT-All"]["step_time_s"] / m[f"MobileTL-{k}BLKs"]["step_time_s"]))
    for model in dict.fromkeys(model for model, _ in runs):
        per_seed = [methods for (m, _), methods in runs.items() if m == model]
        for what, bound, value in checks:
            try:
                values = [value(methods) for methods in per_seed]
            except KeyError:           # a method left out by --methods or --blocks
                continue
            out.append(target(what, bound, values, model=model))
    return out


def plot(rows: list[dict], path: Path, block_size: int) -> None:
    """Accuracy vs measured peak per method, FLOPs as marker size (the paper's Figure 5), one panel per model;
    and the saved bytes of one block, vanilla vs MobileTL, with and without BitTrain."""
    transfer = [r for r in rows if r["case"] == "transfer"]
    models = list(dict.fromkeys(r["model"] for r in transfer))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(6 * len(models) + 6, 5.2), squeeze=False,
                             layout="constrained")
    top = max((r["flops"] for r in transfer), default=1)
    min_blocks = min((r["blocks"] for r in transfer if r["blocks"]), default=None)
    handles = {}
    for ax, model in zip(axes[0], models):
        # each method in its colour (edgeflux.colours), named in one legend below the panels: names written
        # beside points at about the same place ran into each other
        for r in (r for r in transfer if r["model"] == model):
            name = label(r["method"], r["blocks"], r["bittrain"])
            marker = "D" if r["bittrain"] else "s" if r["blocks"] and r["blocks"] != min_blocks else "o"
            ax.errorbar(r["peak_bytes"] / MiB, 100 * r["test_acc"],
                        yerr=100 * (r.get("test_acc_ci95") or 0), fmt="none", ecolor="black", elinewidth=0.8,
                        capsize=3)
            handles[name] = ax.scatter(r["peak_bytes"] / MiB, 100 * r["test_acc"], s=40 + 900 * r["flops"] / top,
                                       alpha=0.7, marker=marker, edgecolor="black", linewidth=0.5,
                                       color=method_colour(finetune_label(r["method"], r["bittrain"])))
        batch = next(r["batch"] for r in transfer if r["model"] == model)
        ax.set(title=f"{model}: target test accuracy vs measured peak\n(batch {batch}; marker area: counted "
                     f"training-step FLOPs;\nbars: 95% interval over seeds)",
               xlabel="measured peak of a training step (MiB)", ylabel="test accuracy, target classes (%)")
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 7),
               fontsize=8, frameon=False, markerscale=0.5)
    ax = axes[0][-1]
    blocks_rows = [r for r in rows if r["case"] == "block"]
    names = list(dict.fromkeys(r["model"] for r in blocks_rows))
    series = [(m, bt) for m in ("vanilla", "mobiletl") for bt in (False, True)]
    width = 0.8 / len(series)
    for i, (method, bittrain) in enumerate(series):
        values = [next((r["saved_bytes"] / MiB for r in blocks_rows if (r["model"], r["method"], r["bittrain"])
                        == (n, method, bittrain)), 0.0) for n in names]
        # MobileTL in its colour (edgeflux.colours); the block as built, which no method names, in greys
        name = ("MobileTL" if method == "mobiletl" else "vanilla block") + (" + BitTrain" if bittrain else "")
        colour = method_colour(name) if method == "mobiletl" else ("#525252" if bittrain else "#a3a3a3")
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(names))], values, width, label=name,
               color=colour)
    b = blocks_rows[0] if blocks_rows else None
    ax.set_xticks(range(len(names)), names)
    ax.set(title="one block: bytes saved for backward" + (f" (input {b['batch']}x{BLOCK_CHANNELS}x{block_size}x"
                                                          f"{block_size})" if b else ""),
           ylabel="MiB")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mib(n) -> str:
    return "" if n is None else f"{n / MiB:.3f}"


def write(rows: list[dict], args, extra: dict, started: float) -> None:
    """rows: the block case's, then the transfer and budget cases' means over the seeds (over_seeds)."""
    stem = result_name(NAME, args)
    result = BenchResult()
    result.rows = rows
    md_rows = [{"case": r["case"], "model": r["model"],
                "method": label(r["method"], r["blocks"], r["bittrain"])
                if r["case"] != "block" else r["method"] + (" + BitTrain" if r["bittrain"] else ""),
                "batch": r["batch"], "peak": mib(r["peak_bytes"]), "saved": mib(r["saved_bytes"]),
                "mflops": "" if r["flops"] is None else f"{r['flops'] / 1e6:.1f}",
                "params": "" if r["train_params"] is None else f"{r['train_params']:,}",
                "acc": pm(r, "test_acc", scale=100), "seeds": r.get("n_seeds"),
                "ms": "" if r["step_time_s"] is None else f"{1e3 * r['step_time_s']:.2f}"} for r in rows]
    columns = {"case": "case", "model": "model", "method": "method", "batch": "batch", "peak": "peak MiB",
               "saved": "saved MiB", "mflops": "MFLOPs (counted)", "params": "trainable params",
               "acc": "test acc %", "ms": "step ms", "seeds": "seeds"}
    block = [r for r in rows if r["case"] == "block"]
    reductions = []
    for name in dict.fromkeys(r["model"] for r in block):
        for bittrain in (False, True):
            v, t = (next(r for r in block if (r["model"], r["method"], r["bittrain"]) == (name, m, bittrain))
                    for m in ("vanilla", "mobiletl"))
            reductions.append({"block": name, "bittrain": bittrain, "vanilla saved MiB": mib(v["saved_bytes"]),
                               "mobiletl saved MiB": mib(t["saved_bytes"]),
                               "saved reduction": f"{100 * t['saved_reduction']:.2f}%",
                               "on the paper's count": "" if bittrain else f"{100 * t['saved_reduction_paper']:.2f}%",
                               "peak reduction": f"{100 * (1 - t['peak_bytes'] / v['peak_bytes']):.2f}%",
                               "paper": f">= {100 * IRB_TARGETS[name]:.1f}%" if name in IRB_TARGETS and not bittrain
                               else ""})
    result.add_section("One block: MobileTL vs vanilla (the paper's Figure 1 / Table 1)", reductions)
    goals = extra["targets"]
    result.add_section("Targets: the paper's claims, each judged by the 95% interval of its per-seed values",
                       goals, ["model", *TARGET_COLUMNS])
    budgets = extra.get("budgets", {})
    pre = "; ".join(f"{p['model']} seed {p['seed']}: {100 * p['source_test_acc']:.2f}% source test accuracy "
                    f"({p['samples']} images, {p['epochs']} epochs, {p['train_time_s']:.0f}s)" for p in extra["pretrain"])
    notes = f"""
Sizes in MiB (2^20 bytes). Block case: a training step (forward, backward, SGD-momentum step) of the block alone in
train mode on a random input [{args.block_batch}, {BLOCK_CHANNELS}, {args.block_size}, {args.block_size}] without
gradient, loss = sum of the output (saves nothing); saved = bytes saved for backward in that step, counted in
saved-tensor hooks, deduplicated by storage, parameters and buffers excluded (edgeflux.memory; the block input,
which the first convolution saves, counts); with BitTrain: what BitTrain stores instead. peak = the measured
allocator peak of the step (parameters, gradients, momentum, the batch included). MobileTL = edgeflux.mobiletl.
transform_block: the intermediate BatchNorms shift-only (nothing saved), the activations sign-backward (a 1-bit mask
saved); the conv block has one BatchNorm, which stays trainable as a block's last BN does in MobileTL, so its
"mobiletl" row only has the sign-backward activation. The JSON's block_details has the saved bytes per autograd node.

Transfer case: {DATA[args.workload].format(args=args)} split by classes (source {SOURCE_CLASSES}, target the others; label
ids kept, 10-output models, as the pipeline does). Pre-training: plain backprop
(edgeflux.backprop.train_under_budget, no budget), Adam lr {args.pretrain_lr:g}, batch 64: {pre}. BatchNorm
momentum {args.bn_momentum:g} in every model (0: the model's own; torchvision's MobileNetV3 has 0.01, with which
a pre-training this short leaves eval-mode accuracy at chance). Fine-tuning
(edgeflux.finetune.finetune, no budget): {args.train_samples} target images, {args.epochs} epoch(s),
{args.optimizer} lr {args.lr:g} (cosine, weight decay 5e-4{', momentum 0.9' if args.optimizer == 'sgd' else ''}), batch {args.batch}, the same for every method; test accuracy on
{extra["test_samples"]} target test images ({"the whole target test split" if args.test_samples is None else "a prefix"}),
every figure the mean over seeds {args.seeds} with its 95% interval's half-width (Student's t); FT-kBLKs and
MobileTL-kBLKs train the top k blocks, for k in {args.blocks}. The row's peak, saved bytes, FLOPs and step latency are measured on the
method's prepared model (a fresh copy of the pretrained model through edgeflux.finetune.prepare) at batch
{args.measure_batch}: peak and saved bytes of one steady-state step (edgeflux.memory.measure_training_step); FLOPs
are COUNTED, not timed (torch.utils.flop_counter via edgeflux.finetune.count_flops: convolutions and matrix
products of one forward on the float model plus the backward that the method runs, 2 per multiply-add; MobileTL's
int8 bottom is counted as its float forward); step ms = median wall time of {args.timing_steps} training steps
after {args.warmup_steps} warm-up steps. MobileTL's bottom runs in int8 (FX post-training quantization,
calibrated on the target data). The lr was chosen on trials of these sizes: at sgd 0.05 (which FT-3BLKs takes)
MobileTL on mobilenet_v2 diverged to a NaN loss (its intermediate BatchNorms no longer normalise by the batch, and
the sign backward passes gradient where ReLU6 saturates); adam 1e-3 trained every method, MobileTL best.

Budget case: budget = {args.budget_factor:g} x FT-All's measured peak at batch {args.measure_batch}
({', '.join(f'{k}: {format_bytes(v)}' for k, v in budgets.items()) or 'not run'}); each method trains at the
largest batch (<= {args.max_batch}) whose measured step fits it, the same epochs and lr; peak and saved bytes
measured at that batch, FLOPs = edgeflux.finetune's count per sample x that batch, step ms = mean training step time of that run.

{QUICK_NOTE if args.quick else ""}torch intra-op threads: {torch.get_num_threads()}; bench time {time.perf_counter() - started:.0f}s.
Plot: {stem}.png (accuracy vs measured peak, FLOPs as marker size; block saved bytes).
"""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    json_path, md_path = result.write(stem, args.out, title="MobileTL vs fine-tuning baselines: one block, transfer "
                                                            "learning, one budget",
                                      columns=columns, md_rows=md_rows, notes=notes,
                                      extra={"settings": settings, "n_seeds": len(args.seeds), **extra})
    plot(rows, Path(args.out) / f"{stem}.png", args.block_size)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {Path(args.out) / f'{stem}.png'}")


def model_rows(name: str, seed: int, args, data, splits: tuple[dict, dict], extra: dict, shown) -> list[dict]:
    """One model and seed: pre-training on the source classes, the transfer case, and the budget case (2 x that
    seed's FT-All peak)."""
    (source, target), (progress, task) = splits, shown
    progress.update(task, description=f"pretrain {name}, seed {seed}")
    pretrained, info = pretrain(name, args, len(data.classes), source, seed)
    extra["pretrain"].append(info)
    key = workload_model(name, args).key
    rows, details = transfer_rows(key, pretrained, args, target, progress, task, seed)
    extra["details"] += details
    ft_all = next((r for r in rows if r["method"] == "ft_all"), None)
    if args.skip_budget or ft_all is None:
        return rows
    budget = int(args.budget_factor * ft_all["peak_bytes"])
    extra["budgets"].setdefault(key, budget)
    more, details = budget_rows(key, pretrained, args, target, budget, progress, task, seed)
    extra["details"] += details
    return rows + more


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False)])
    log.setLevel(logging.INFO)
    # copying MobileTL's int8 bottom (every measured step runs on a copy) re-creates quantized weights, and torch
    # warns each time that quantized tensor creation is deprecated
    warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*deprecated", category=UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    rows: list[dict] = []
    extra: dict = {"pretrain": [], "budgets": {}, "details": []}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        block, extra["block_details"] = block_rows(args, progress)
        rows += block
        data, source, target = load_data(args)
        extra["test_samples"] = len(target["test"][1])
        per_model = len(variants(args)) + (0 if args.skip_budget else len(args.methods))
        task = progress.add_task("transfer", total=len(args.seeds) * len(args.models) * per_model)
        seed_rows = []
        for seed in args.seeds:
            for name in args.models:
                seed_rows += model_rows(name, seed, args, data, (source, target), extra, (progress, task))
    extra["targets"] = targets(rows, seed_rows, args.blocks)
    rows += over_seeds(seed_rows, ("case", "model", "method", "blocks", "bittrain"), METRICS)
    write(rows, args, extra, started)
    log.info("bench time %.0fs", time.perf_counter() - started)


if __name__ == "__main__":
    main()
