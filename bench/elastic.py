"""ElasticTrainer vs full training and offline selections, measured (Huang et al., MobiSys 2023: Figures 15-17,
Table 2, Table 1's overhead, Figure 21's selections).

Fashion-MNIST split by classes (source: classes 0-4, target: 5-9; labels keep their ids, the models have 10
outputs, as the pipeline's pretrain/finetune stages do). Each model (CIFAR-style ResNet-18, VGG-16 with BN,
MobileNetV2; CPU-sized widths, 1 channel, 32x32) is pre-trained on the source with plain backprop, then
fine-tuned on the target for the same fixed epochs, optimizer, lr and batch with every method, all through
edgeflux.finetune (one harness, one training loop):

* ``full`` (ft_all), ``last_layer`` (ft_last: traditional transfer learning), ``bn_bias`` (ft_bn_bias: BN
  scales/shifts, every bias and the classifier, selected offline), and ``elastic`` at each --rhos (tensors
  re-selected by importance every epoch under the time objective rho).

Per run: wall-clock seconds of the whole run as the paper counts it (training and the per-epoch evaluation,
``wall_s``), training time alone (selection overhead included), test accuracy after every epoch, and for
elastic the overhead of profiling + importance + DP as a fraction of the training time. Per model, the time
model is validated: the profiler's predicted backward time against the measured one for --selections random
selections (mean absolute relative error, ``timing_error``), which also checks, by timing, that tensors left
out cost nothing below the deepest selected one. Time-to-accuracy (Table 2): for targets at 95/98/100% of
full training's final accuracy, training seconds to reach each, elastic (rho 0.5) against the fastest
baseline.

    python -m bench.elastic --threads 2                  # full run, results in bench/results/ (about 12 min here)
    python -m bench.elastic --quick --out /tmp/bench     # CI-sized: ResNet-18 only, 1 epoch, < 1 min
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

from bench.common import BenchResult, HelpFormatter, bench_argparser
from bench.mobiletl import load_data, pretrain
from edgeflux.elastic import (ElasticBudgetError, ElasticOptions, classifier_names, profile_tensors, random_selections,
                              validate_time_model)
from edgeflux.elastic.plot import plot_selections
from edgeflux.finetune import FinetuneOptions, finetune
from edgeflux.train import make_optimizer

NAME = "elastic"
log = logging.getLogger("bench.elastic")

MODELS = {"resnet18": 0.25, "vgg16": 0.25, "mobilenet_v2": 0.5}     # model: width (CPU-sized)
BASELINES = {"full": "ft_all", "last_layer": "ft_last", "bn_bias": "ft_bn_bias"}
SPEEDUP_TARGET, ACC_TOLERANCE, OVERHEAD_TARGET, TIMING_TARGET = 2.0, 0.01, 0.01, 0.15
TARGET_LEVELS = (0.95, 0.98, 1.0)       # time-to-accuracy targets, x full training's final test accuracy
QUICK = dict(models=["resnet18"], rhos=[0.5], pretrain_samples=512, pretrain_epochs=1, train_samples=512,
             eval_samples=256, epochs=1, selections=6)


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"models (of {', '.join(MODELS)}; widths {MODELS}; --quick: resnet18)")
    parser.add_argument("--rhos", nargs="+", type=float, default=[0.35, 0.4, 0.5, 0.7],
                        help="elastic's speedup objectives (--quick: 0.5)")
    parser.add_argument("--pretrain-samples", type=int, default=8000, help="source images for pre-training")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="pre-training epochs")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3, help="pre-training learning rate (Adam, batch 64)")
    parser.add_argument("--train-samples", type=int, default=5000, help="target training images for fine-tuning")
    parser.add_argument("--eval-samples", type=int, default=1000, help="validation and test images")
    parser.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs, every method")
    parser.add_argument("--batch", type=int, default=32, help="fine-tuning batch, every method")
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate (Adam, cosine schedule)")
    parser.add_argument("--selections", type=int, default=20, help="random selections that validate the time model")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if any(not 0 < r <= 1 for r in args.rhos):
        parser.error(f"--rhos must be in (0, 1], got {args.rhos}")
    args.width, args.bn_momentum = None, 0.1     # what bench.mobiletl's pretrain reads
    return args


def options(args, method: str, rho: float | None) -> FinetuneOptions:
    return FinetuneOptions(epochs=args.epochs, batch_size=args.batch, lr=args.lr, optimizer="adam", evals_per_epoch=1,
                           seed=0, device="cpu", elastic=ElasticOptions(rho=rho or 0.5))


def run_method(pretrained, args, target: dict, method: str, rho: float | None) -> dict:
    model = copy.deepcopy(pretrained)
    started = time.perf_counter()
    try:
        run = finetune(model, BASELINES.get(method, "elastic"), options(args, method, rho), target["train"],
                       target["val"], target["test"], "cpu", track_test=True)
    except ElasticBudgetError as exc:      # the forward pass alone takes more than rho of a step here
        log.warning("%s elastic rho %s: infeasible: %s", pretrained.name, rho, exc)
        return {"method": method, "rho": rho, "epochs": args.epochs, "wall_s": None, "train_time_s": None,
                "test_acc": None, "train_params": None, "batch": None, "overhead_frac": None, "overhead_s": None,
                "selected_frac": None, "curve": [], "selections": None, "tensors": None, "infeasible": str(exc)}
    wall = time.perf_counter() - started
    metrics = run.metrics()
    curve = [{"epoch": r["epoch"], "time_s": r["time_s"], "test_acc": r["test_acc"]} for r in run.run.train.history]
    log.info("%s %s%s: test %.4f, %.1fs wall, %.1fs training", pretrained.name, method,
             f" rho {rho}" if rho else "", run.run.test_acc, wall, metrics["train_time_s"])
    return {"method": method, "rho": rho, "epochs": args.epochs, "wall_s": wall, "train_time_s": metrics["train_time_s"],
            "test_acc": run.run.test_acc, "train_params": metrics["train_params"], "batch": metrics["batch_size"],
            "overhead_frac": metrics.get("elastic_overhead_frac"), "overhead_s": metrics.get("elastic_overhead_s"),
            "selected_frac": metrics.get("elastic_selected_frac"), "curve": curve,
            "selections": run.selections if method == "elastic" else None, "tensors": run.tensors, "infeasible": None}


def validate(pretrained, args, target: dict) -> dict:
    """The time model on the pretrained model at the training batch: predicted vs measured backward time."""
    model = copy.deepcopy(pretrained).train()
    x, y = target["train"][0][:args.batch], target["train"][1][:args.batch]
    opt = make_optimizer([p for p in model.parameters()], options(args, "full", None))
    timing = profile_tensors(model, x, y, optimizer=opt)
    n = len(timing.names)
    head = classifier_names(model)
    always = [k for k, name in enumerate(timing.names) if name in head]
    rows = validate_time_model(model, timing, random_selections(n, args.selections, always=always), x, y)
    errors = [abs(r["error"]) for r in rows]
    return {"timing_error": statistics.mean(errors), "timing_error_max": max(errors), "tensors": n,
            "t_forward_s": timing.t_forward, "t_full_s": timing.t_full, "profile_s": timing.profile_s,
            "validation": rows}


def time_to(curve: list[dict], target: float) -> float | None:
    return next((r["time_s"] for r in curve if r["test_acc"] >= target), None)


def table2(model: str, runs: list[dict]) -> list[dict]:
    full = next(r for r in runs if r["method"] == "full")
    elastic = next((r for r in runs if r["method"] == "elastic" and r["rho"] == 0.5 and r["curve"]), None)
    rows = []
    for level in TARGET_LEVELS:
        target = level * full["test_acc"]
        baselines = [(time_to(r["curve"], target), r["method"]) for r in runs if r["method"] != "elastic"]
        reached = [(t, m) for t, m in baselines if t is not None]
        best = min(reached) if reached else (None, None)
        mine = time_to(elastic["curve"], target) if elastic else None
        rows.append({"model": model, "target_acc": round(target, 4), "elastic_s": mine, "best_baseline": best[1],
                     "best_baseline_s": best[0],
                     "speedup": best[0] / mine if mine and best[0] else None})
    return rows


def plot(per_model: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(per_model), figsize=(5 * len(per_model), 4), squeeze=False)
    for ax, (model, runs) in zip(axes[0], per_model.items()):
        for r in [r for r in runs if r["curve"]]:
            label = f"elastic rho {r['rho']:g}" if r["method"] == "elastic" else r["method"]
            style = "-" if r["method"] == "elastic" else "--"
            ax.plot([0] + [c["time_s"] for c in r["curve"]], [None] + [c["test_acc"] for c in r["curve"]], style,
                    marker="o", ms=3, label=label)
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("training time (s, selection overhead included)")
        ax.set_ylabel("target test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ElasticTrainer vs baselines: test accuracy per epoch against training time (2-core CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["infeasible"]:
            out.append({"model": r["model"], "method": r["method"], "rho": r["rho"],
                        "wall_s": "infeasible: " + r["infeasible"].split("; ")[-1]})
            continue
        out.append({"model": r["model"], "method": r["method"], "rho": r["rho"], "batch": r["batch"],
                    "wall_s": round(r["wall_s"], 1), "train_s": round(r["train_time_s"], 1),
                    "speedup_vs_full": round(r["speedup_vs_full"], 2), "test_acc": round(r["test_acc"], 4),
                    "overhead": f"{100 * r['overhead_frac']:.2f}%" if r["overhead_frac"] is not None else "",
                    "tensors_trained": f"{100 * r['selected_frac']:.0f}%" if r["selected_frac"] is not None else "",
                    "timing_error": f"{100 * r['timing_error']:.1f}%" if r["timing_error"] is not None else ""})
    return out


def targets(rows: list[dict], validation: dict) -> str:
    lines = ["Targets (this machine, this run):", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        full = next(r for r in rows if r["model"] == model and r["method"] == "full")
        half = next((r for r in rows if r["model"] == model and r["method"] == "elastic" and r["rho"] == 0.5), None)
        for r in rows:
            if r["model"] == model and r["infeasible"]:
                lines.append(f"- {model}, rho {r['rho']:g}: infeasible here: {r['infeasible']}")
        if half and half["infeasible"] is None:
            ok = half["speedup_vs_full"] >= SPEEDUP_TARGET and half["test_acc"] >= full["test_acc"] - ACC_TOLERANCE
            lines.append(f"- {model}, rho 0.5: {half['speedup_vs_full']:.2f}x wall-clock over full training, test "
                         f"accuracy {half['test_acc']:.4f} vs {full['test_acc']:.4f} "
                         f"({'met' if ok else 'missed'}: >= {SPEEDUP_TARGET:g}x within {100 * ACC_TOLERANCE:g} point); "
                         f"overhead {100 * half['overhead_frac']:.2f}% of training "
                         f"({'met' if half['overhead_frac'] < OVERHEAD_TARGET else 'missed'}: < 1%)")
        error = validation[model]["timing_error"]
        lines.append(f"- {model}: time model error {100 * error:.1f}% mean, "
                     f"{100 * validation[model]['timing_error_max']:.1f}% max over "
                     f"{len(validation[model]['validation'])} random selections "
                     f"({'met' if error <= TIMING_TARGET else 'missed'}: <= 15%)")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], per_model: dict, validation: dict, tta: list[dict], args, started: float) -> None:
    out = Path(args.out)
    result = BenchResult()
    for r in rows:
        result.add(**{k: v for k, v in r.items() if k not in ("selections", "tensors")})
    result.add_section("Time to accuracy (Table 2): training seconds to reach a target, elastic rho 0.5 vs the "
                       "fastest baseline", tta)
    result.add_section("Time model (per model, at the training batch)",
                       [{"model": m, **{k: v for k, v in v.items() if k != "validation"}} for m, v in validation.items()])
    notes = targets(rows, validation) + (
        "\nwall_s: the whole run (batch measurement, training, the per-epoch validation and test evaluation, the "
        "final test); train_s: training steps with elastic's profiling, importance and selection included. "
        "speedup_vs_full: full training's wall_s / this run's. overhead: profiling + importance + DP over train_s. "
        "timing_error: mean |predicted - measured| / measured backward time over random selections.\n")
    if args.quick:
        notes += "\n--quick: 512 images and 1 epoch: accuracies and speedups are not meaningful.\n"
    result.write(NAME, out, title="ElasticTrainer vs full training, last layer and BN+Bias (class-split transfer)",
                 md_rows=summary_rows(rows), notes=notes,
                 extra={"settings": {k: v for k, v in vars(args).items() if k != "out"},
                        "validation": validation, "bench_s": time.perf_counter() - started})
    plot(per_model, out / f"{NAME}.png")
    for model, runs in per_model.items():
        half = next((r for r in runs if r["method"] == "elastic" and r["rho"] == 0.5 and r["selections"]), None)
        if half:
            plot_selections(half["tensors"], half["selections"], out / f"{NAME}_selections_{model}.png",
                            f"elastic rho 0.5, {model}")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False)])
    log.setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    data, source, target = load_data(args)
    rows, per_model, validation, tta = [], {}, {}, []
    for name in args.models:
        args.width = MODELS[name]
        pretrained, _ = pretrain(name, args, len(data.classes), source)
        key = f"{name}-w{MODELS[name]:g}"
        validation[key] = validate(pretrained, args, target)
        log.info("%s: time model error %.1f%% mean over %d selections", key, 100 * validation[key]["timing_error"],
                 args.selections)
        runs = [run_method(pretrained, args, target, m, None) for m in BASELINES]
        runs += [run_method(pretrained, args, target, "elastic", rho) for rho in args.rhos]
        full = runs[0]["wall_s"]
        for r in runs:
            r.update(model=key, speedup_vs_full=full / r["wall_s"] if r["wall_s"] else None,
                     timing_error=validation[key]["timing_error"] if r["method"] == "elastic" else None)
        rows += runs
        per_model[key] = runs
        tta += table2(key, runs)
    write(rows, per_model, validation, tta, args, started)
    log.info("bench time %.0fs", time.perf_counter() - started)


if __name__ == "__main__":
    main()
