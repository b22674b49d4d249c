"""NeuroFlux vs backprop vs classic local learning at equal memory budgets (the paper's Figures 11-12).

For each model and budget, in one run on this machine:

* NeuroFlux: AAN-LL auxiliary heads, the measured per-unit profile, Algorithm 1's blocks and batch
  sizes, block-wise training over cached activations, the compact early-exit model;
* backprop: the largest batch whose measured training step fits the budget (infeasible below
  its batch-1 minimum);
* classic local learning: 256-filter auxiliary heads, one batch size for every unit (the largest
  all units fit), layer by layer, each unit's input recomputed through the trained units before it.

Budgets are fractions of backprop's measured batch-1 minimum for each model (so the first one,
below 1, is a budget where backprop cannot run at all). NeuroFlux and classic local learning train
the same number of epochs per unit; backprop trains --bp-epochs over the whole network (so it gets
the time to reach the target). Classic local learning is slow by design (tiny batches, every unit's
input recomputed): it stops starting new units after --time-limit seconds of training, and a
method that never reaches the target gives a speed-up lower bound (its whole training time).
Each method records test accuracy against training time. Reported per method and
budget: measured peak (max over blocks), batch sizes, time to the target test accuracy, final test
accuracy, test accuracy at a fixed time (the fastest method's total time for that model and
budget), and the parameters of the output model. NeuroFlux's time includes profiling, measuring
and writing caches. Every NeuroFlux exit's validation and test accuracy is kept too: a table gives
the exit chosen and the largest with >= 10x fewer parameters than the full model, and
neuroflux_exits.png plots accuracy and parameters per exit (the paper's Figure 10).

    python -m bench.neuroflux                  # full run, results in bench/results/
    python -m bench.neuroflux --quick --out /tmp/bench
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (METHOD_COLOURS, RESULTS_DIR, TARGET_COLUMNS, BenchResult, HelpFormatter, add_seeds, over_seeds,
                          pm, program_name, seeds_of, target)
from edgeflux.backprop import train_under_budget
from edgeflux.config import MemoryOptions, NeuroFluxParams
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.memory import BudgetTooSmallError, MiB, format_bytes, measure_training_peak
from edgeflux.models import build_model, count_params
from edgeflux.neuroflux.aux import exit_params
from edgeflux.neuroflux.exit import select_exit
from edgeflux.neuroflux.model import build_learners
from edgeflux.neuroflux.partition import Block, partition, unit_batch_sizes
from edgeflux.neuroflux.profile import profile_units, profiling_seconds
from edgeflux.neuroflux.worker import CacheOptions, train_blocks
from edgeflux.train import TrainRun, optimizer_factory

log = logging.getLogger("bench.neuroflux")
METHODS = {"neuroflux": "NeuroFlux", "backprop": "backprop", "classic": "classic LL"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=program_name(), description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized run: one narrow model, 512 training images, 1 epoch, two budgets")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for neuroflux.{json,md,png}")
    parser.add_argument("--models", nargs="+", default=["vgg16", "vgg19", "resnet18"], help="zoo models to compare")
    parser.add_argument("--width", type=float, default=0.25, help="width multiplier (narrow enough for a CPU)")
    parser.add_argument("--budgets", type=float, nargs="+", default=None,
                        help="budgets as fractions of backprop's measured batch-1 minimum per model "
                             "(default: 0.6 1.5 4.0; --quick: 0.6 3.0)")
    parser.add_argument("--train-samples", type=int, default=8000, help="Fashion-MNIST training images (target split)")
    parser.add_argument("--eval-samples", type=int, default=2000, help="validation and test images")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per block (NeuroFlux) and per unit (classic LL)")
    parser.add_argument("--lr-scaling", choices=["constant", "linear", "sqrt"], default="sqrt",
                        help="how each NeuroFlux block scales lr 0.05 (set for batch 32) to its own batch size")
    parser.add_argument("--bp-lr-scaling", choices=["constant", "linear", "sqrt"], default=None,
                        help="how backprop scales lr 0.05 to its batch (default: as --lr-scaling; constant keeps "
                             "0.05, for a large batch that diverges when scaled up)")
    parser.add_argument("--bp-epochs", type=int, default=6, help="epochs of backprop over the whole network")
    parser.add_argument("--time-limit", type=float, default=240.0,
                        help="seconds of training after which classic local learning starts no new unit")
    parser.add_argument("--target-acc", type=float, default=0.85, help="target test accuracy for time-to-target")
    parser.add_argument("--max-batch", type=int, default=256, help="batch size limit B for every method")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (none given: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every method trains and its memory is measured (cuda: the CUDA allocator's peak)")
    add_seeds(parser, "the weights, the auxiliary heads, the data order")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="methods to run (NeuroFlux always runs: every speed-up is measured against it)")
    parser.add_argument("--budgets-mib", type=float, nargs="+", default=None, metavar="MIB",
                        help="absolute budgets in MiB instead of --budgets (e.g. the paper's 250 and 500 MB on a GPU)")
    parser.add_argument("--test-samples", type=int, default=None,
                        help="test images (default: the whole 10,000-image test split; --quick: --eval-samples)")
    parser.add_argument("--name", default="neuroflux", help="result file name: <out>/<name>.{json,md,png}")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="instead of running: merge neuroflux.json files of runs over different --models or "
                             "--seeds (e.g. one process per core) into one result over every seed, in --out")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.width, args.budgets = ["vgg11"], 0.125, args.budgets or [0.6, 3.0]
        args.train_samples, args.eval_samples, args.epochs, args.target_acc = 512, 256, 1, 0.5
        args.bp_epochs, args.time_limit = 2, 60.0
        args.test_samples = args.eval_samples if args.test_samples is None else args.test_samples
    args.budgets = args.budgets or [0.6, 1.5, 4.0]
    if "neuroflux" not in args.methods:
        args.methods = ["neuroflux", *args.methods]
    return args


def time_to(history: list[dict], target: float, offset: float = 0.0) -> float | None:
    return next((offset + r["time_s"] for r in history if r.get("test_acc", 0.0) >= target), None)


def acc_at(history: list[dict], seconds: float, offset: float = 0.0) -> float:
    """Test accuracy of the last evaluation at or before `seconds` of training (0 if none yet)."""
    return max((r["test_acc"] for r in history if offset + r["time_s"] <= seconds + 1e-9 and "test_acc" in r),
               default=0.0)


def run_backprop(spec, splits, opts, budget, args) -> dict:
    model = build_model(**spec)
    memory = MemoryOptions(budget=f"{budget}B", max_batch=args.max_batch)
    opts = opts.model_copy(update={"epochs": args.bp_epochs, "lr_scaling": args.bp_lr_scaling or opts.lr_scaling})
    try:
        run = train_under_budget(model, splits["train"], splits["val"], splits["test"], opts,
                                 TrainRun(torch.device(args.device), desc="backprop", track_test=True), memory)
    except BudgetTooSmallError as exc:
        return {"method": "backprop", "feasible": False, "min_feasible_bytes": exc.min_feasible_bytes}
    return {"method": "backprop", "feasible": True, "peak_bytes": run.step_memory.peak_bytes,
            "batch_sizes": [run.batch_size], "train_time_s": run.train.train_time_s, "history": run.train.history,
            "test_acc": run.test_acc, "params": count_params(model), "offset": 0.0,
            "samples_per_s": run.train.steps * run.batch_size / max(run.train.train_time_s, 1e-9)}


def run_local(spec, splits, opts, budget, args, classic: bool, until=None) -> dict:
    """until(run): stop starting blocks (classic local learning: after args.time_limit s of training)."""
    method = "classic LL" if classic else "NeuroFlux"
    if classic:   # the baseline as published: one lr for every unit
        opts = opts.model_copy(update={"lr_scaling": "constant"})
    aux = dict(mode="classic" if classic else "adaptive", classic_filters=256, pool=2, seed=opts.seed)
    model, learners = build_learners(spec, aux)
    profiles = profile_units(learners, model.describe(), spec["num_classes"], optimizer_factory(opts),
                             batches=getattr(args, "profile_batches", (16, 32, 64, 128)), data=splits["train"], min_r2=0.0, device=args.device)
    profile_s = profiling_seconds(profiles)
    models = [p.model for p in profiles]
    try:
        if classic:   # one batch size for the whole network, each unit trained on its own
            batch = min(unit_batch_sizes(models, budget, args.max_batch))
            blocks = [Block(index=i, units=(i,), batch_size=batch) for i in range(len(learners))]
        else:
            blocks = partition(models, budget, args.max_batch)
        with tempfile.TemporaryDirectory() as tmp:
            run = train_blocks(learners, blocks, splits, opts, workdir=Path(tmp) / "cache", budget_bytes=budget,
                               cache=CacheOptions(storage="float16"), use_cache=not classic, desc=method,
                               split_rho=None if classic else 0.4,
                               until=(lambda r: r.train_time_s >= args.time_limit) if classic else until, device=args.device)
    except BudgetTooSmallError as exc:
        return {"method": method, "feasible": False, "min_feasible_bytes": exc.min_feasible_bytes}
    params = [exit_params(learners, k) for k in range(len(learners))]
    if classic:   # classic local learning outputs the whole network (or the units it trained in time)
        k = max(u for b in run.blocks for u in b.units)
    else:
        k = select_exit(run.unit_val_acc, params, tolerance=0.005)
    names = [u.name for u in model.describe()]
    exits = [{"unit": i, "name": names[i], "params": params[i], "val_acc": run.unit_val_acc[i],
              "test_acc": run.unit_test_acc[i]} for b in run.blocks for i in b.units]
    return {"method": method, "feasible": True, "exits": exits, "full_params": params[-1],
            "peak_bytes": run.peak_bytes,
            "batch_sizes": [b.batch_size for b in run.blocks], "train_time_s": profile_s + run.train_time_s,
            "profile_s": profile_s, "history": run.history, "test_acc": run.unit_test_acc[k],
            "full_test_acc": run.unit_test_acc[-1], "exit": k, "params": params[k], "offset": profile_s,
            "complete": run.complete,
            "samples_per_s": sum(len(splits["train"][1]) * opts.epochs for _ in run.blocks) /
            max(sum(b.train_time_s for b in run.blocks), 1e-9),
            "within_budget": all(b.peak_bytes <= budget for b in run.blocks)}


def plot(per_seed: list[dict], path: Path, target: float) -> None:
    """Test accuracy vs training time per model (columns) and budget (rows), every seed a line: the paper's
    Figure 12."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in per_seed))
    fracs = sorted({r["budget_frac_of_bp_min"] for r in per_seed})
    fig, axes = plt.subplots(len(fracs), len(models), figsize=(5 * len(models), 3.6 * len(fracs)), squeeze=False)
    for i, frac in enumerate(fracs):
        for j, model in enumerate(models):
            ax, labelled = axes[i][j], set()
            for r in per_seed:
                if r["model"] == model and r["budget_frac_of_bp_min"] == frac and r.get("curve"):
                    t, acc = zip(*r["curve"])
                    ax.plot(t, acc, marker=".", alpha=0.75, color=METHOD_COLOURS[r["method"]],
                            label=None if r["method"] in labelled else r["method"])
                    labelled.add(r["method"])
            budget = next(r["budget_bytes"] for r in per_seed if r["model"] == model and r["budget_frac_of_bp_min"] == frac)
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            ax.set(title=f"{model}, budget {format_bytes(budget)} ({frac:g}x BP min)", xlabel="training time (s)",
                   ylabel="test accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, title="one line per seed", title_fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_exits(per_seed: list[dict], path: Path) -> None:
    """Validation accuracy and parameters of every NeuroFlux exit (the paper's Figure 10), one panel per model,
    of the first seed's runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in per_seed if r["method"] == "NeuroFlux" and r.get("exits") and r["seed"] == per_seed[0]["seed"]]
    models = list(dict.fromkeys(r["model"] for r in runs))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        twin = ax.twinx()
        for r in (r for r in runs if r["model"] == model):
            ax.plot([e["unit"] for e in r["exits"]], [e["val_acc"] for e in r["exits"]], marker=".",
                    label=f"{format_bytes(r['budget_bytes'])} ({r['budget_frac_of_bp_min']:g}x BP min)")
            chosen = next(e for e in r["exits"] if e["unit"] == r["exit"])
            ax.plot([chosen["unit"]], [chosen["val_acc"]], "k*", markersize=10)
        last = next(r for r in runs if r["model"] == model)["exits"]
        twin.bar([e["unit"] for e in last], [e["params"] for e in last], color="grey", alpha=0.2)
        twin.set(ylabel="parameters up to the exit (bars)", yscale="log")
        ax.set(title=f"{model}, seed {runs[0]['seed']}: accuracy per exit (* chosen)", xlabel="exit after unit",
               ylabel="validation accuracy", xticks=[e["unit"] for e in last])
        ax.set_xticklabels([e["name"] for e in last], rotation=60, fontsize=7)
        ax.set_zorder(twin.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compact_exits(per_seed: list[dict]) -> list[dict]:
    """Per NeuroFlux run (model, budget, seed): the exit the rule chose, and the largest exit with >= 10x fewer
    parameters than the full model, both against backprop's test accuracy in the same seed (for reference: the
    rule selects on validation accuracy, within 0.5 pt of the best exit, never on test accuracy)."""
    by = {(r["model"], r["budget_bytes"], r["seed"], r["method"]): r for r in per_seed}
    out = []
    for r in per_seed:
        if r["method"] != "NeuroFlux" or not r.get("exits"):
            continue
        full, bp = r["full_params"], by.get((r["model"], r["budget_bytes"], r["seed"], "backprop"))
        ten = ([e for e in r["exits"] if full / e["params"] >= 10] or [None])[-1]
        chosen = next(e for e in r["exits"] if e["unit"] == r["exit"])
        out.append({"model": r["model"], "budget_bytes": r["budget_bytes"], "seed": r["seed"],
                    "backprop_test_acc": bp["test_acc"] if bp and bp["feasible"] else None,
                    "chosen_exit": chosen["name"], "chosen_reduction": full / chosen["params"],
                    "chosen_val_acc": chosen["val_acc"], "chosen_test_acc": chosen["test_acc"],
                    "best_val_acc": max(e["val_acc"] for e in r["exits"]),
                    "exit_10x": ten["name"] if ten else None,
                    "exit_10x_reduction": full / ten["params"] if ten else None,
                    "exit_10x_val_acc": ten["val_acc"] if ten else None,
                    "exit_10x_test_acc": ten["test_acc"] if ten else None})
    return out


PER_SEED = ("time_to_target_s", "test_acc", "test_acc_at_fixed_time", "fixed_time_s", "train_time_s", "samples_per_s")


def summarise(per_seed: list[dict]) -> list[dict]:
    """One row per model, budget and method over its seeds: PER_SEED's mean and 95% half-width (a mean time to
    target is over the seeds that reached it: n_reached), the largest measured peak (the figure a budget is held
    against), feasible only when every seed was, the first feasible seed's batches and every seed's."""
    rows = over_seeds([{k: v for k, v in r.items() if k not in ("curve", "exits")} for r in per_seed],
                      ("model", "budget_bytes", "method"), PER_SEED)
    for row in rows:
        group = [r for r in per_seed if (r["model"], r["budget_bytes"], r["method"]) ==
                 (row["model"], row["budget_bytes"], row["method"])]
        ok = [r for r in group if r["feasible"]]
        row.update(feasible=len(ok) == len(group), n_feasible=len(ok),
                   peak_bytes=max((r["peak_bytes"] for r in ok), default=None),
                   within_budget=all(r["within_budget"] for r in ok) if ok else None,
                   n_reached=sum(r["time_to_target_s"] is not None for r in ok),
                   batch_sizes=ok[0]["batch_sizes"] if ok else None,
                   batch_sizes_per_seed=[r.get("batch_sizes") for r in group],
                   params_per_seed=[r["params"] for r in group])
    return rows


def judged_speedup(entry: dict, method: str) -> float | None:
    """The speed-up over `method` in one seed that a ">= x" claim may count: the exact ratio; where `method`
    never reached the target, its whole time over NeuroFlux's (a lower bound); 0 where NeuroFlux never reached it;
    None where `method` could not run at the budget or was not run."""
    if not entry.get(f"{method}_feasible"):
        return None
    if entry["neuroflux_to_target_s"] is None:
        return 0.0
    exact = entry.get(f"speedup_vs_{method}")
    return exact if exact is not None else entry[f"speedup_vs_{method}_at_least"]


def targets(per_seed: list[dict], speedups: list[dict], target_acc: float) -> list[dict]:
    """The paper's headline results against the per-seed figures, each a bench.common.target judged by the 95%
    interval over seeds (accuracy gaps in points)."""
    out = []
    for model, budget in dict.fromkeys((r["model"], r["budget_bytes"]) for r in per_seed):
        at = dict(model=model, budget=format_bytes(budget))
        runs = {m: [r for r in per_seed if (r["model"], r["budget_bytes"], r["method"]) == (model, budget, m)]
                for m in METHODS.values()}
        nf, bp = runs["NeuroFlux"], runs["backprop"]
        if bp and not any(r["feasible"] for r in bp):
            out.append(target("trains where backprop cannot (below its batch-1 minimum): NeuroFlux's final test "
                              "accuracy", target_acc, [r["test_acc"] if r["feasible"] else 0.0 for r in nf], **at))
        for method, bar in (("backprop", 2.3), ("classic_LL", 3.3)):
            values = [v for e in speedups if (e["model"], e["budget_bytes"]) == (model, budget)
                      if (v := judged_speedup(e, method)) is not None]
            if values:
                out.append(target(f"time to target, speed-up over {method.replace('_', ' ')} (x)", bar, values, **at))
        if bp and all(r["feasible"] for r in bp + nf):
            exits = [c for c in compact_exits(nf) if c["budget_bytes"] == budget]
            gap = {c["seed"]: 100 * c["chosen_test_acc"] for c in exits}
            out += [target("compact model: the chosen exit's parameters, x fewer than the full model", 10,
                           [c["chosen_reduction"] for c in exits], **at),
                    target("compact model: the chosen exit's test accuracy minus backprop's (points)", -1,
                           [gap[r["seed"]] - 100 * r["test_acc"] for r in bp], **at)]
            if all(c["exit_10x"] for c in exits):
                ten = {c["seed"]: 100 * c["exit_10x_test_acc"] for c in exits}
                out.append(target("compact model: the largest exit with >= 10x fewer parameters, its test accuracy "
                                  "minus backprop's (points)", -1, [ten[r["seed"]] - 100 * r["test_acc"] for r in bp],
                                  **at))
    over = [r["peak_bytes"] - r["budget_bytes"] for r in per_seed if r["feasible"]]
    if over:
        out.append(target("largest measured peak minus its budget, every block of every run (bytes)", 0, [max(over)],
                          exact=True, at_most=True, model="every model", budget="every budget"))
    return out


def write(per_seed: list[dict], args, notes: str, settings: dict | list | None = None,
          combined_from: list[dict] | None = None) -> None:
    """Results over seeds, tables and plots. settings: the flags that made the rows (default: this run's);
    combined_from: the command and machine of each run whose rows these are (--combine)."""
    budgets: dict[tuple, set] = {}
    for r in per_seed:
        budgets.setdefault((r["model"], r["budget_frac_of_bp_min"]), set()).add(r["budget_bytes"])
    if split := {k: sorted(v) for k, v in budgets.items() if len(v) > 1}:
        raise SystemExit(f"the seeds measured different budgets for one model and fraction {split}: their rows "
                         "cannot be averaged; rerun them on one machine and torch")
    result = BenchResult()
    result.rows = rows = summarise(per_seed)
    seeds, per_seed_speedups = sorted({r["seed"] for r in per_seed}), speedup_entries(per_seed)
    md_rows = [{**r, "budget": format_bytes(r["budget_bytes"]),
                "peak": format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "infeasible",
                "to_target": pm(r, "time_to_target_s") + (f" ({r['n_reached']} of {r['n_seeds']} reached)"
                                                          if r["feasible"] else ""),
                "acc": pm(r, "test_acc"), "fixed": pm(r, "test_acc_at_fixed_time"), "sps": pm(r, "samples_per_s"),
                "params": ", ".join(f"{p:,}" for p in r["params_per_seed"] if p)} for r in rows]
    speedups = over_seeds([{**e, **{f"judged_vs_{m}": judged_speedup(e, m) for m in ("backprop", "classic_LL")}}
                           for e in per_seed_speedups], ("model", "budget_bytes"),
                          ("neuroflux_to_target_s", "speedup_vs_backprop", "speedup_vs_classic_LL",
                           "judged_vs_backprop", "judged_vs_classic_LL"))
    result.add_section(
        f"Speed-ups to {args.target_acc:.0%} test accuracy over seeds (time ratio, same budget, same process; a seed "
        "where the other method never reached the target counts its whole time, a lower bound; one where NeuroFlux "
        "never did counts 0)",
        [{"model": e["model"], "budget": format_bytes(e["budget_bytes"]), "nf": pm(e, "neuroflux_to_target_s"),
          "bp": pm(e, "judged_vs_backprop"), "classic": pm(e, "judged_vs_classic_LL"), "seeds": e["n_seeds"]}
         for e in speedups],
        {"model": "model", "budget": "budget", "nf": "NeuroFlux s to target", "bp": "x vs backprop",
         "classic": "x vs classic LL", "seeds": "seeds"})
    exits = compact_exits(per_seed)
    if exits:
        result.add_section("NeuroFlux exits per seed: the one chosen (fewest parameters within 0.5 pt of the best "
                           "validation accuracy) and the largest with >= 10x fewer parameters than the full model",
                           exits, {"model": "model", "budget_bytes": "budget bytes", "seed": "seed",
                                   "backprop_test_acc": "backprop test acc", "chosen_exit": "chosen exit",
                                   "chosen_reduction": "x fewer params", "chosen_val_acc": "val acc",
                                   "chosen_test_acc": "test acc", "best_val_acc": "best exit's val acc",
                                   "exit_10x": "largest >= 10x exit", "exit_10x_reduction": "x fewer params",
                                   "exit_10x_val_acc": "val acc", "exit_10x_test_acc": "test acc"})
    goals = targets(per_seed, per_seed_speedups, args.target_acc)
    result.add_section("Targets (the paper's headline results; verdicts by the 95% interval over seeds)", goals,
                       ("model", "budget", *TARGET_COLUMNS))
    columns = {"model": "model", "method": "method", "budget": "budget", "peak": "largest measured peak",
               "batch_sizes": "batch per block (first seed)", "to_target": f"s to {args.target_acc:.0%}",
               "acc": "final test acc", "fixed": "test acc at fixed time", "sps": "training samples/s",
               "params": "params (output model, per seed)", "within_budget": "peak <= budget"}
    result.write(args.name, args.out, title="NeuroFlux vs backprop vs classic local learning at equal budgets",
                 columns=columns, md_rows=md_rows, notes=notes,
                 extra={"n_seeds": min(r["n_seeds"] for r in rows),    # the fewest seeds any row has
                        "seeds": seeds, "per_seed": per_seed, "speedups": speedups,
                        "targets": goals, "compact_exits": exits,
                        "combined_from": combined_from,
                        "settings": settings or {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    plot(per_seed, args.out / f"{args.name}.png", args.target_acc)
    plot_exits(per_seed, args.out / f"{args.name}_exits.png")
    print(f"wrote {args.out / args.name}.json, .md, .png and {args.name}_exits.png")


PER_RUN = ("models", "seeds", "threads", "out", "name", "combine")   # the flags parts of one result may differ in


def combine(args) -> None:
    """Merge runs over different models or seeds into one result over every seed."""
    parts = [json.loads(Path(p).read_text()) for p in args.combine]
    per_seed = [r for part in parts for r in part["per_seed"]]
    runs = [(r["model"], r["seed"], r["budget_bytes"], r["method"]) for r in per_seed]
    twice = sorted({run[:2] for run in runs if runs.count(run) > 1})
    if twice:
        raise SystemExit(f"--combine: model and seed {twice} appear in more than one part; pass each run once")
    settings = [part["settings"] for part in parts]
    differ = sorted({k for one in settings for k, v in one.items() if k not in PER_RUN and v != settings[0].get(k)})
    if differ:
        raise SystemExit(f"--combine: the parts were run with different {', '.join(differ)}; combine runs of one "
                         "setting (they may differ only in --models, --seeds and --threads)")
    args.target_acc = settings[0]["target_acc"]
    write(per_seed, args, " | ".join(f"{part['command']}: {part['notes']}" for part in parts),
          settings=settings[0] if len(settings) == 1 else settings,
          combined_from=[{"command": part["command"], "machine": part["machine"]} for part in parts])


def run_seed(args, seed: int, data, splits) -> list[dict]:
    """Every model and budget under one seed (the weights, the auxiliary heads, the data order): its rows, each
    with the seed."""
    torch.manual_seed(seed)
    opts = NeuroFluxParams(epochs=args.epochs, lr=0.05, momentum=0.9, weight_decay=5e-4, evals_per_epoch=2,
                           seed=seed, lr_scaling=args.lr_scaling, lr_reference_batch=32)
    rows = []
    for name in args.models:
        spec = dict(name=name, num_classes=len(data.classes), in_channels=1, width=args.width, image_size=32,
                    batch_norm=True, seed=seed)
        bp_min = measure_training_peak(build_model(**spec), optimizer_factory(opts), (1, 32, 32), spec["num_classes"],
                                       1, data=splits["train"], device=args.device).peak_bytes
        budgets = [int(mib * MiB) for mib in args.budgets_mib] if args.budgets_mib else \
            [int(frac * bp_min) for frac in args.budgets]
        for budget in budgets:
            print(f"seed {seed}, {name} w{args.width:g}: budget {format_bytes(budget)} ({budget / bp_min:.2f} x "
                  f"backprop's batch-1 minimum {format_bytes(bp_min)}) on {args.device}", flush=True)
            runs = [run_local(spec, splits, opts, budget, args, classic=False)]
            if "backprop" in args.methods:
                runs.append(run_backprop(spec, splits, opts, budget, args))
            if "classic" in args.methods:
                runs.append(run_local(spec, splits, opts, budget, args, classic=True))
            model = f"{name}-w{args.width:g}"
            rows += [{**r, "seed": seed} for r in budget_rows(runs, model, budget, budget / bp_min, args.target_acc)]
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.combine:
        return combine(args)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    data = prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    splits = {"train": tensors(data, "target_train", limit=args.train_samples),
              "val": tensors(data, "target_val", limit=args.eval_samples),
              "test": tensors(data, "target_test", limit=args.test_samples or None)}
    started = time.perf_counter()
    per_seed = [r for seed in seeds_of(args) for r in run_seed(args, seed, data, splits)]
    test_n = len(splits["test"][1])
    write(per_seed, args, f"Fashion-MNIST target split, {args.train_samples} training images, "
          f"{args.eval_samples} validation and {test_n} test images, {args.epochs} epochs per block/unit (backprop: "
          f"{args.bp_epochs}), lr 0.05 at batch 32 scaled to each batch: NeuroFlux {args.lr_scaling}, backprop "
          f"{args.bp_lr_scaling or args.lr_scaling}, classic LL constant and capped at {args.time_limit:g}s of "
          f"training, seeds {seeds_of(args)}, device {args.device}, torch threads {torch.get_num_threads()}; bench "
          f"time {time.perf_counter() - started:.0f}s.")


def budget_rows(runs: list[dict], model: str, budget: int, frac: float, target: float) -> list[dict]:
    """One result row per method run at one budget (accuracy at a fixed time: the fastest run's total)."""
    fixed_time = min((r["train_time_s"] for r in runs if r["feasible"]), default=0.0)
    rows = []
    for r in runs:
        row = {"model": model, "method": r["method"], "budget_bytes": budget,
               "budget_frac_of_bp_min": round(frac, 4), "feasible": r["feasible"]}
        if r["feasible"]:
            row.update(peak_bytes=r["peak_bytes"], batch_sizes=r["batch_sizes"],
                       time_to_target_s=time_to(r["history"], target, r["offset"]),
                       test_acc=r["test_acc"], test_acc_at_fixed_time=acc_at(r["history"], fixed_time, r["offset"]),
                       fixed_time_s=fixed_time, train_time_s=r["train_time_s"], params=r["params"],
                       within_budget=r.get("within_budget", r["peak_bytes"] <= budget),
                       samples_per_s=r["samples_per_s"],
                       curve=[[r["offset"] + h["time_s"], h["test_acc"]] for h in r["history"]],
                       **{k: r[k] for k in ("exit", "exits", "full_params", "full_test_acc", "profile_s", "complete")
                          if k in r})
        else:
            row.update(peak_bytes=None, time_to_target_s=None, test_acc=None, params=None,
                       min_feasible_bytes=r["min_feasible_bytes"])
        rows.append(row)
    return rows


def speedup_entries(per_seed: list[dict]) -> list[dict]:
    """Per model, budget and seed, from the per-seed rows: NeuroFlux's time to the target against every other
    method's (their ratio; where the other never reached it, its whole time, profiling included, over NeuroFlux's:
    a lower bound) and the output model's parameters against the full model's."""
    out = []
    for nf in (r for r in per_seed if r["method"] == "NeuroFlux"):
        nf_t = nf["time_to_target_s"] if nf["feasible"] else None
        entry = {k: nf[k] for k in ("model", "budget_bytes", "budget_frac_of_bp_min", "seed")}
        entry["neuroflux_to_target_s"] = nf_t
        for r in per_seed:
            if r["method"] == "NeuroFlux" or (r["model"], r["budget_bytes"], r["seed"]) != \
                    (nf["model"], nf["budget_bytes"], nf["seed"]):
                continue
            method, t = r["method"].replace(" ", "_"), r["time_to_target_s"] if r["feasible"] else None
            entry[f"{method}_feasible"] = r["feasible"]
            entry[f"speedup_vs_{method}"] = t / nf_t if t is not None and nf_t else None
            if r["feasible"] and nf_t and t is None:
                entry[f"speedup_vs_{method}_at_least"] = r["train_time_s"] / nf_t
        entry["param_reduction_vs_full"] = nf["full_params"] / nf["params"] if nf["feasible"] else None
        out.append(entry)
    return out

if __name__ == "__main__":
    main()
