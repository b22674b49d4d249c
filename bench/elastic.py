"""ElasticTrainer vs full training and offline selections, measured (Huang et al., MobiSys 2023: Figures 15-17,
Table 2, Table 1's overhead, Figure 7's interval, Figure 21's selections), over seeds.

Fashion-MNIST split by classes (source: classes 0-4, target: 5-9; labels keep their ids, the models have 10
outputs, as the pipeline's pretrain/finetune stages do). Each model (CIFAR-style ResNet-18, VGG-16 with BN,
MobileNetV2; CPU-sized widths, 1 channel, 32x32) is pre-trained on the source with plain backprop, then
fine-tuned on the target for the same fixed epochs, optimizer, lr and batch with every method, all through
edgeflux.finetune (one harness, one training loop). As the paper trains CNNs: SGD with momentum 0.9 and weight
decay 5e-4, a cosine schedule, importance re-evaluated every --interval epochs (the paper's 3).

* ``full`` (ft_all), ``last_layer`` (ft_last: traditional transfer learning), ``bn_bias`` (ft_bn_bias: BN
  scales/shifts, every bias and the classifier, selected offline), and ``elastic`` at each --rhos: 0.5 is what
  the headlines judge, the others the paper's Figure 17 sweep (accuracy and the training steps' speed-up against
  rho, judged per rho: within 1 point of full training, at least the 1/rho it asks for; ``elastic_rho.png``).
* the Adam study (--adam-models): full training and elastic at rho 0.5 under Adam, with the importance summed
  over a tensor's weights ("update") and per weight ("per_weight"): test accuracy, and how far the importance
  ranks tensors by size alone (Spearman's rank correlation of importance with element count).

Per run: wall-clock seconds of the whole run as the paper counts it (training and the per-epoch evaluation,
``wall_s``), training time alone (selection overhead included, ``train_s``), validation accuracy after every
epoch, test accuracy on the whole target test split at the end, and for elastic the overhead of profiling + importance + DP as a fraction of the
training time, and the time model's predicted step against the measured one. Per model and seed the time model
is validated: predicted vs measured backward time of --selections random selections. Time-to-accuracy
(Table 2): training seconds to reach 95/98/100% of full training's final validation accuracy, elastic (rho 0.5)
against the fastest baseline. Every figure is the mean over --seeds with its 95% interval; targets are judged by the
interval of their per-seed values.

    python -m bench.elastic --threads 2                  # full run, 3 seeds, results in bench/results/
    python -m bench.elastic --quick --out /tmp/bench     # CI-sized: ResNet-18 only, 1 epoch, 1 seed
    python -m bench.elastic --threads 2 --workload realistic   # photos at 128 px, torchvision's ResNet-18 (43 min)
"""
from __future__ import annotations

import copy
import logging
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.logging import RichHandler
from scipy.stats import spearmanr

from bench import realistic
from bench.common import (TARGET_COLUMNS, BenchResult, HelpFormatter, add_seeds, add_workload, bench_argparser,
                          mean_ci, over_seeds, parse_workload, pm, quick_args, result_name, seeds_of, target,
                          workload_model)
from bench.mobiletl import load_data, pretrain
from edgeflux.colours import method_colour
from edgeflux.elastic import (ElasticBudgetError, ElasticOptions, classifier_names, profile_tensors, random_selections,
                              validate_time_model)
from edgeflux.elastic.plot import plot_selections
from edgeflux.finetune import FinetuneOptions, finetune
from edgeflux.train import make_optimizer

NAME = "elastic"
log = logging.getLogger("bench.elastic")

MODELS = {"resnet18": 0.25, "vgg16": 0.25, "mobilenet_v2": 0.5}     # model: width (CPU-sized)
BASELINES = {"full": "ft_all", "last_layer": "ft_last", "bn_bias": "ft_bn_bias"}
LABELS = {"full": "FT-All", "last_layer": "FT-Last", "bn_bias": "FT-BN+Bias", "elastic": "ElasticTrainer"}
SPEEDUP_MODELS = ("resnet18", "vgg16")   # the issue's speed-up targets; Table 2's on every model
TRAIN_SPEEDUP, END_TO_END, ACC_TOLERANCE, OVERHEAD, TIMING, TTA = 2.0, 1.6, 1.0, 2.0, 15.0, 1.5
TARGET_LEVELS = (0.95, 0.98, 1.0)       # time-to-accuracy targets, x full training's final test accuracy
OVERHEAD_PARTS = ("profile_s", "importance_s", "select_s")    # where the selection overhead goes, seconds
METRICS = ("test_acc", "wall_s", "train_time_s", "speedup_vs_full", "train_speedup_vs_full", "overhead_frac",
           "selected_frac", "predicted_step_s", "measured_step_s", "size_rank_corr", *OVERHEAD_PARTS)
# --workload realistic: the photo folder at the realistic preset's size on torchvision's full-width ResNet-18 (a seed
# of it takes 15 min on 2 cores; --models resnet18 mobilenet_v2 doubles that, VGG-16 at full width is hours); its
# defaults, where a flag is left at the default workload's
REALISTIC = dict(models=["resnet18"], rhos=[0.5], pretrain_samples=100_000, pretrain_epochs=4,
                 train_samples=100_000, val_samples=100_000, adam_models=[], selections=10)
QUICK = dict(models=["resnet18"], rhos=[0.5], pretrain_samples=512, pretrain_epochs=1, train_samples=512,
             val_samples=256, test_samples=256, epochs=1, selections=6)


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"models (of {', '.join(MODELS)}; widths {MODELS}; --quick: resnet18)")
    parser.add_argument("--rhos", nargs="+", type=float, default=[0.5, 0.6, 0.7],
                        help="elastic's speedup objectives (--quick: 0.5); 0.5 is judged against the paper's "
                        "headlines, the others make the paper's Figure 17 sweep")
    parser.add_argument("--pretrain-samples", type=int, default=8000, help="source images for pre-training")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="pre-training epochs")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3, help="pre-training learning rate (Adam, batch 64)")
    parser.add_argument("--train-samples", type=int, default=5000, help="target training images for fine-tuning")
    parser.add_argument("--val-samples", type=int, default=1000, help="validation images (source and target)")
    parser.add_argument("--test-samples", type=int, default=None,
                        help="test images (default: the whole test split; --quick: 256)")
    parser.add_argument("--epochs", type=int, default=8, help="fine-tuning epochs, every method")
    parser.add_argument("--batch", type=int, default=32, help="fine-tuning batch, every method")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="fine-tuning learning rate (SGD, momentum 0.9, weight decay 5e-4, cosine schedule)")
    parser.add_argument("--interval", type=int, default=ElasticOptions().interval,
                        help="elastic re-selects every this many epochs")
    parser.add_argument("--adam-models", nargs="*", default=["resnet18"], choices=list(MODELS), metavar="MODEL",
                        help="models of the Adam study (none: skip it)")
    parser.add_argument("--adam-lr", type=float, default=1e-3, help="the Adam study's learning rate")
    parser.add_argument("--selections", type=int, default=20, help="random selections that validate the time model")
    add_workload(parser, "Fashion-MNIST at 32 px, the zoo's models at the widths above",
                 f"bench.realistic's photo folder at {realistic.PHOTO_PX} px (3 channels), torchvision's architectures "
                 "at full width", REALISTIC)
    add_seeds(parser, "pre-trained weights, fine-tuning order")
    args = quick_args(parse_workload(parser, argv), QUICK)
    args.seeds = seeds_of(args)
    if any(not 0 < r <= 1 for r in args.rhos):
        parser.error(f"--rhos must be in (0, 1], got {args.rhos}")
    # what bench.mobiletl's load_data and pretrain read
    args.width, args.bn_momentum = None, 0.1
    args.image_size = realistic.PHOTO_PX if args.workload == "realistic" else 32
    return args


def options(args, seed: int, rho: float = 0.5, optimizer: str = "sgd", importance: str = "update") -> FinetuneOptions:
    return FinetuneOptions(epochs=args.epochs, batch_size=args.batch, lr=args.lr if optimizer == "sgd" else args.adam_lr,
                           optimizer=optimizer, momentum=0.9, weight_decay=5e-4, evals_per_epoch=1, seed=seed,
                           device="cpu", elastic=ElasticOptions(rho=rho, interval=args.interval, importance=importance))


def run_method(pretrained, target: dict, method: str, opts: FinetuneOptions, rho: float | None) -> dict:
    """One fine-tuning run: its times, accuracy per epoch and, for elastic, its selections and their cost."""
    row = {"method": method, "rho": rho, "optimizer": opts.optimizer,
           "importance": opts.elastic.importance if method == "elastic" else None, "seed": opts.seed}
    started = time.perf_counter()
    try:
        run = finetune(copy.deepcopy(pretrained), BASELINES.get(method, "elastic"), opts, target["train"],
                       target["val"], target["test"], "cpu")
    except ElasticBudgetError as exc:      # the forward pass alone takes more than rho of a step here
        log.warning("%s elastic rho %s: infeasible: %s", pretrained.name, rho, exc)
        return {**row, **{m: None for m in METRICS}, "curve": [], "infeasible": str(exc)}
    wall, m = time.perf_counter() - started, run.metrics()
    state = run.run.train.extra.get("elastic")
    row.update(wall_s=wall, train_time_s=m["train_time_s"], test_acc=run.run.test_acc, batch=m["batch_size"],
               train_params=m["train_params"], overhead_frac=m.get("elastic_overhead_frac"),
               selected_frac=m.get("elastic_selected_frac"), infeasible=None,
               **{part: m.get(f"elastic_{part}") for part in OVERHEAD_PARTS},
               curve=[{"epoch": r["epoch"], "time_s": r["time_s"], "val_acc": r["val_acc"]}
                      for r in run.run.train.history], **step_times(state, m), **ranking(pretrained, state))
    row["selections"], row["tensors"] = (run.selections, run.tensors) if method == "elastic" else (None, None)
    log.info("%s %s%s (%s), seed %d: test %.4f, %.1fs wall, %.1fs training", pretrained.name, method,
             f" rho {rho}" if rho else "", opts.optimizer, opts.seed, row["test_acc"], wall, row["train_time_s"])
    return row


def step_times(state: dict | None, metrics: dict) -> dict:
    """Elastic's predicted training step (the time model, mean over selections) and the measured one (training
    time less the selection overhead, per step)."""
    if not state or not state["selections"]:
        return {"predicted_step_s": None, "measured_step_s": None}
    predicted = statistics.mean(s["predicted_step_s"] for s in state["selections"])
    measured = (metrics["train_time_s"] - metrics["elastic_overhead_s"]) / max(1, metrics["steps"])
    return {"predicted_step_s": predicted, "measured_step_s": measured}


def ranking(model, state: dict | None) -> dict:
    """Spearman's rank correlation of the first selection's importances with the tensors' element counts: 1 when
    size alone ranks them."""
    if not state or not state["selections"]:
        return {"size_rank_corr": None}
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    importance = state["selections"][0]["importance"]
    return {"size_rank_corr": float(spearmanr(importance, [sizes[n] for n in state["names"]]).statistic)}


def validate(pretrained, args, target: dict, seed: int) -> dict:
    """The time model on the pretrained model at the training batch: predicted vs measured backward time."""
    model = copy.deepcopy(pretrained).train()
    x, y = target["train"][0][:args.batch], target["train"][1][:args.batch]
    opts = options(args, seed)
    opt = make_optimizer(list(model.parameters()), opts)
    timing = profile_tensors(model, x, y, optimizer=opt, repeats=opts.elastic.repeats)
    head = classifier_names(model)
    always = [k for k, name in enumerate(timing.names) if name in head]
    rows = validate_time_model(model, timing, random_selections(len(timing.names), args.selections, seed, always), x, y)
    errors = [abs(r["error"]) for r in rows]
    return {"seed": seed, "timing_error": statistics.mean(errors), "timing_error_max": max(errors),
            "tensors": len(timing.names), "t_forward_s": timing.t_forward, "t_full_s": timing.t_full,
            "profile_s": timing.profile_s, "validation": rows}


def time_to(curve: list[dict], level: float) -> float | None:
    return next((r["time_s"] for r in curve if r["val_acc"] >= level), None)


def table2(runs: list[dict]) -> list[dict]:
    """One seed's Table 2: per level (a share of full training's last validation accuracy), elastic rho 0.5's
    training seconds to it against the fastest baseline's."""
    full = next(r for r in runs if r["method"] == "full")
    elastic = next((r for r in runs if r["method"] == "elastic" and r["rho"] == 0.5 and r["curve"]), None)
    rows = []
    for level in TARGET_LEVELS:
        goal = level * full["curve"][-1]["val_acc"]
        reached = [(t, r["method"]) for r in runs if r["method"] != "elastic"
                   if (t := time_to(r["curve"], goal)) is not None]
        best_s, best = min(reached) if reached else (None, None)
        mine = time_to(elastic["curve"], goal) if elastic else None
        rows.append({"model": full["model"], "seed": full["seed"], "level": level, "target_acc": goal,
                     "elastic_s": mine, "best_baseline": best, "best_baseline_s": best_s,
                     # elastic never reaching the level counts as no speed-up at all
                     "speedup": (best_s / mine if mine else 0.0) if best_s else None})
    return rows


def seed_runs(name: str, seed: int, args, data, splits) -> tuple[list[dict], dict]:
    """One model and seed: pre-training, the time model's validation, every method, the Adam study."""
    source, target = splits
    args.width = MODELS[name]
    pretrained, _ = pretrain(name, args, len(data.classes), source, seed)
    key = workload_model(name, args).key
    check = validate(pretrained, args, target, seed)
    log.info("%s, seed %d: time model error %.1f%% mean over %d selections", key, seed, 100 * check["timing_error"],
             args.selections)
    runs = [run_method(pretrained, target, m, options(args, seed), None) for m in BASELINES]
    runs += [run_method(pretrained, target, "elastic", options(args, seed, rho), rho) for rho in args.rhos]
    if name in args.adam_models:
        runs += [run_method(pretrained, target, "full", options(args, seed, optimizer="adam"), None)]
        runs += [run_method(pretrained, target, "elastic", options(args, seed, 0.5, "adam", how), 0.5)
                 for how in ("update", "per_weight")]
    for r in runs:
        full = next(f for f in runs if f["method"] == "full" and f["optimizer"] == r["optimizer"])
        r.update(model=key, timing_error=check["timing_error"] if r["method"] == "elastic" else None,
                 speedup_vs_full=full["wall_s"] / r["wall_s"] if r["wall_s"] else None,
                 train_speedup_vs_full=full["train_time_s"] / r["train_time_s"] if r["train_time_s"] else None)
    return runs, check


def targets(seed_rows: list[dict], tta: list[dict], checks: list[dict]) -> list[dict]:
    """The issue's targets, each judged by the 95% interval of its per-seed values."""
    out = []
    for model in dict.fromkeys(r["model"] for r in seed_rows):
        sgd = [r for r in seed_rows if r["model"] == model and r["optimizer"] == "sgd"]
        pairs = sweep_pairs(sgd, 0.5)
        if model.removeprefix("tv-").split("-")[0] in SPEEDUP_MODELS and pairs:
            out += [target("training steps' speed-up over full training, rho 0.5 (x)", TRAIN_SPEEDUP,
                           [e["train_speedup_vs_full"] for _, e in pairs], model=model),
                    target("end-to-end speed-up over full training, rho 0.5 (x)", END_TO_END,
                           [e["speedup_vs_full"] for _, e in pairs], model=model),
                    target("test accuracy minus full training's, rho 0.5 (points)", -ACC_TOLERANCE,
                           [100 * (e["test_acc"] - f["test_acc"]) for f, e in pairs], model=model)]
        out += rho_sweep(sgd, model)
        if pairs:
            out.append(target("selection overhead, % of training time, rho 0.5", OVERHEAD,
                              [100 * e["overhead_frac"] for _, e in pairs], at_most=True, model=model))
        out.append(target("time model: mean |error| of predicted backward times (%)", TIMING,
                          [100 * c["timing_error"] for c in checks if c["model"] == model], at_most=True, model=model))
        for level in TARGET_LEVELS:
            values = [t["speedup"] for t in tta if t["model"] == model and t["level"] == level]
            if values and None not in values:
                out.append(target(f"time to {level:.0%} of full training's accuracy, fastest baseline / elastic "
                                  "rho 0.5 (x; never reached: 0)", TTA, values, model=model))
    return out


def sweep_pairs(sgd: list[dict], rho: float) -> list[tuple[dict, dict]]:
    """(full training, elastic at rho) per seed, SGD, where elastic trained."""
    return [(next(r for r in sgd if r["method"] == "full" and r["seed"] == e["seed"]), e) for e in sgd
            if e["method"] == "elastic" and e["rho"] == rho and not e["infeasible"]]


def rho_sweep(sgd: list[dict], model: str) -> list[dict]:
    """The paper's Figure 17 on this workload: at every rho but 0.5 (judged above), the accuracy against full
    training's and whether the training steps reach the speed-up 1/rho asks for."""
    out = []
    for rho in sorted({r["rho"] for r in sgd if r["method"] == "elastic"} - {0.5}):
        if pairs := sweep_pairs(sgd, rho):
            out += [target(f"rho sweep: test accuracy minus full training's, rho {rho:g} (points)", -ACC_TOLERANCE,
                           [100 * (e["test_acc"] - f["test_acc"]) for f, e in pairs], model=model),
                    target(f"rho sweep: training steps' speed-up over full training, rho {rho:g} (x)", 1 / rho,
                           [e["train_speedup_vs_full"] for _, e in pairs], model=model)]
    return out


def plot_rho(rows: list[dict], path: Path) -> None:
    """Per model and rho (SGD): test accuracy minus full training's and the training steps' speed-up, mean and 95%
    interval over seeds; the speed-up 1/rho asks for dashed."""
    fig, (acc, speed) = plt.subplots(1, 2, figsize=(10.4, 4.4), layout="constrained")
    for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
        sgd = [r for r in rows if r["model"] == model and r["optimizer"] == "sgd"]
        rhos = sorted({r["rho"] for r in sgd if r["method"] == "elastic"})
        for ax, value in ((acc, lambda f, e: 100 * (e["test_acc"] - f["test_acc"])),
                          (speed, lambda f, e: e["train_speedup_vs_full"])):
            cis = [(rho, mean_ci([value(f, e) for f, e in sweep_pairs(sgd, rho)])) for rho in rhos]
            cis = [(rho, ci) for rho, ci in cis if ci["n"]]
            ax.errorbar([rho + 0.004 * (i - 1) for rho, _ in cis], [ci["mean"] for _, ci in cis],
                        yerr=[[ci["mean"] - (ci["lo"] if ci["lo"] is not None else ci["mean"]) for _, ci in cis],
                              [(ci["hi"] if ci["hi"] is not None else ci["mean"]) - ci["mean"] for _, ci in cis]],
                        marker="o", ms=4, capsize=3, label=model, color=plt.cm.tab10(i))
    grid = sorted({r["rho"] for r in rows if r["method"] == "elastic"})
    acc.axhline(-ACC_TOLERANCE, color="grey", ls=":", label="1 point below full training")
    speed.plot(grid, [1 / r for r in grid], "k--", lw=1, label="asked for: 1 / rho")
    acc.set(xlabel="rho (a step's time over a full step's)", ylabel="test accuracy minus full training's (points)",
            title="accuracy")
    speed.set(xlabel="rho (a step's time over a full step's)", ylabel="training steps' speed-up over full (x)",
              title="speed-up of the training steps")
    for ax in (acc, speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ElasticTrainer against rho (SGD): mean and 95% interval over seeds", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows: list[dict], seed: int, path: Path) -> None:
    """Validation accuracy per epoch against training time, one seed's runs (SGD), a panel per model."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    others = sorted({r["rho"] for r in rows if r["rho"] not in (None, 0.5)})    # told apart by line and marker

    def style(r: dict) -> tuple[str, str]:
        if r["method"] != "elastic":
            return "--", "o"
        return ("-", "o") if r["rho"] == 0.5 else (("-.", "s"), (":", "^"))[others.index(r["rho"]) % 2]
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False, layout="constrained")
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model and r["seed"] == seed and r["optimizer"] == "sgd"
                  and r["curve"]):
            label = LABELS[r["method"]] + (f", rho {r['rho']:g}" if r["rho"] else "")
            line, marker = style(r)
            ax.plot([c["time_s"] for c in r["curve"]], [100 * c["val_acc"] for c in r["curve"]],
                    line, marker=marker, ms=3, label=label,
                    color=method_colour(LABELS[r["method"]]), alpha=1.0 if r["rho"] in (None, 0.5) else 0.55)
        ax.set(title=model, xlabel="training time (s, selection overhead included)",
               ylabel="validation accuracy, target classes (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"ElasticTrainer vs baselines: accuracy per epoch\nagainst training time (SGD, seed {seed})",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        base = {"model": r["model"], "method": r["method"], "optimizer": r["optimizer"],
                "importance": r["importance"] or "", "rho": r["rho"]}
        if r["test_acc"] is None:
            out.append({**base, "test_acc": "infeasible"})
            continue
        out.append({**base, "test_acc": pm(r, "test_acc", 100), "train_s": pm(r, "train_time_s", digits=3),
                    "train_speedup": pm(r, "train_speedup_vs_full", digits=3),
                    "speedup": pm(r, "speedup_vs_full", digits=3), "overhead_%": pm(r, "overhead_frac", 100, 2),
                    "step_ms_predicted": pm(r, "predicted_step_s", 1000, 3),
                    "step_ms_measured": pm(r, "measured_step_s", 1000, 3),
                    "size_rank_corr": pm(r, "size_rank_corr", digits=2), "seeds": r["n_seeds"]})
    return out


DATA = {"default": "Data: Fashion-MNIST (1 channel, 32x32), the zoo's CIFAR-style models at the widths above.\n",
        "realistic": "Data: bench.realistic's photo folder (Fashion-MNIST upscaled to 3-channel PNGs, read at "
                     f"{realistic.PHOTO_PX}x{realistic.PHOTO_PX}), "
                     "split by classes as above; torchvision's architectures at full width from random weights, "
                     "pre-trained here on the source classes.\n"}
NOTES = """Figures are means over the seeds ± the 95% interval's half-width (Student's t); targets are judged by the
interval of their per-seed values (met: all of it clears the bound; not met: none of it; not shown: it spans it).
wall_s: the whole run (batch measurement, training, the per-epoch validation and test evaluation, the final test);
train_s: training steps with elastic's profiling, importance and selection included. speedup: full training's
wall_s / this run's (under the same optimizer); train_speedup: the same for train_s. overhead: profiling +
importance + DP over train_s (each part in seconds in the JSON: profile_s, importance_s, select_s).
step_ms_predicted: the time model's step (forward, backward of the selection, optimizer) averaged over the
selections; step_ms_measured: (train_s - overhead) / steps, which also carries what
the time model leaves out (the batch's indexing, the loop, the learning-rate schedule). size_rank_corr: Spearman's
rank correlation of the first selection's importances with the tensors' element counts (1: size alone ranks).
Time to accuracy: seconds of training (overhead included) until the per-epoch validation accuracy reaches the level
(a share of full training's last validation accuracy); test accuracy is measured once, on the whole test split.
"""


def write(seed_rows: list[dict], checks: list[dict], tta: list[dict], args, started: float) -> None:
    out, name = Path(args.out), result_name(NAME, args)
    rows = over_seeds([{k: v for k, v in r.items() if k not in ("selections", "tensors", "curve")} for r in seed_rows],
                      ("model", "method", "optimizer", "importance", "rho"), METRICS)
    goals = targets(seed_rows, tta, checks)
    result = BenchResult()
    result.rows = rows
    result.add_section("Targets, each judged by the 95% interval of its per-seed values", goals,
                       ["model", *TARGET_COLUMNS])
    result.add_section("Time to accuracy (Table 2), per seed: training seconds to a level, elastic rho 0.5 vs the "
                       "fastest baseline", tta)
    result.add_section("Time model (per model and seed, at the training batch)",
                       [{k: v for k, v in c.items() if k != "validation"} for c in checks])
    notes = NOTES + DATA[args.workload] + ("\n--quick: 512 images and 1 epoch: accuracies and speed-ups are not "
                                          "meaningful.\n" if args.quick else "") + \
        f"\nbench time {time.perf_counter() - started:.0f}s.\n"
    result.write(name, out, title="ElasticTrainer vs full training, last layer and BN+Bias (class-split transfer)",
                 md_rows=summary(rows), notes=notes,
                 extra={"n_seeds": len({r["seed"] for r in seed_rows}),
                        "settings": {k: v for k, v in vars(args).items() if k != "out"},
                        "targets": goals, "time_to_accuracy": tta, "validation": checks,
                        "curves": [{k: r[k] for k in ("model", "method", "optimizer", "importance", "rho", "seed",
                                                      "curve")} for r in seed_rows],
                        # what the rho sweep's figure is drawn from (bench.replot)
                        "per_seed": [{k: r[k] for k in ("model", "method", "optimizer", "rho", "seed", "test_acc",
                                                        "train_speedup_vs_full", "infeasible")} for r in seed_rows],
                        "bench_s": time.perf_counter() - started})
    plot(seed_rows, args.seeds[0], out / f"{name}.png")
    if len({r["rho"] for r in seed_rows if r["method"] == "elastic"}) > 1:
        plot_rho(seed_rows, out / f"{name}_rho.png")
    for r in seed_rows:
        if r["method"] == "elastic" and r["rho"] == 0.5 and r["optimizer"] == "sgd" and r["seed"] == args.seeds[0] \
                and r["selections"]:
            plot_selections(r["tensors"], r["selections"], out / f"{name}_selections_{r['model']}.png",
                            f"elastic rho 0.5, {r['model']}, seed {r['seed']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False)])
    log.setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data, source, target = load_data(args)
    seed_rows, checks, tta = [], [], []
    for seed in args.seeds:
        for name in args.models:
            runs, check = seed_runs(name, seed, args, data, (source, target))
            seed_rows += runs
            checks.append({"model": runs[0]["model"], **check})
            tta += table2([r for r in runs if r["optimizer"] == "sgd"])
        write(seed_rows, checks, tta, args, started)   # after every seed: a stopped run keeps the seeds done
    log.info("bench time %.0fs", time.perf_counter() - started)


if __name__ == "__main__":
    main()
