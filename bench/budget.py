"""Time to a target test accuracy under a memory budget: the tricks a PyTorch user tries first, NeuroFlux and plain
backprop, and the method ``method: auto`` picks.

For each model, the reference is plain backprop's measured step peak at batch 32 (the batch a user would train at
without a budget); the budgets are fractions of it (default 50%, 25%, 12.5%). At each budget, from each seed's
weights and data order:

* backprop and its tricks (edgeflux.tricks, as train_bp runs them): plain, gradient accumulation to an effective
  batch of 32 (lr set for 32), checkpointing over units, the optimizer step in backward, and checkpointing with
  the step in backward. Each trains at the largest (micro-)batch whose measured step fits the budget, lr 0.05 at
  batch 32 scaled by sqrt to its batch; infeasible below its own smallest budget, which is reported;
* NeuroFlux (the paper's Algorithm 1 and 2 as bench.neuroflux runs it: measured profile, blocks, cached
  activations), its time including profiling;
* method: auto as train_bp runs it: edgeflux.plan measures and times every backprop method above on the seed's
  model (train_bp's plan also has BitTrain's variants, left out here as they are above), and the fastest trains
  from the batch the plan measured; its time includes the plan's seconds;
* method: auto with its plan stored, as a second run on the device finds it (edgeflux.plan.cache: the rows of the
  same model, data shape, options and machine are reused): the plan is measured once per model and budget before
  its first seed (those seconds are reported, not counted), each seed reads it (counted) and trains what it chose.

Time to target is wall seconds of training from the start, the batch search (backprop's measured steps), the plan
(auto) or profiling (NeuroFlux) included, evaluation excluded, to the first evaluation (4 per epoch; NeuroFlux: 2
per block epoch) whose accuracy on the whole 10,000-image test split reaches --target-acc; CPU seconds of training
beside it (--test-samples: fewer, for --quick only). A run stops there, or at --time-limit seconds of training
(then it did not reach the target). Per method and budget: mean and 95% interval (Student's t) over the seeds that
reached the target; the time is reported only when every seed reached it. The row of the method auto chose (most
seeds' choice) says so; auto's time over the fastest method's is paired by seed.

    python -m bench.budget --threads 2                       # default workload, 3 models, 3 seeds
    python -m bench.budget --threads 2 --workload realistic  # photos at 128 px, torchvision's MobileNetV2
    python -m bench.budget --models vgg16 --out /tmp/b       # one model; --combine merges parts
    python -m bench.budget --quick --out /tmp/bench

Every run (a method, a budget, a seed) is logged to --out's budget_runs.jsonl as it ends: the same command started
again after a stop takes the runs it finished from there and runs the rest (--fresh: every run again).
"""
from __future__ import annotations

import argparse
import logging
import math
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from bench.common import (METHOD_COLOURS, BenchResult, HelpFormatter, add_workload, fmt_ci, mean_ci, parse_workload,
                          model_args, program_name, read_parts, RESULTS_DIR, RunLog, runs_notes,
                          workload_model)
from bench.neuroflux import run_local
from bench import realistic
from edgeflux.backprop import train_under_budget
from edgeflux.config import NeuroFluxParams, TrainBPParams
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.memory import BudgetTooSmallError, format_bytes, measure_training_peak
from edgeflux.models import build_model
from edgeflux.plan import NoFeasibleMethodError, PlanCache, fastest, plan_key, plan_training
from edgeflux.train import TrainRun, optimizer_factory
from edgeflux.tricks import TrickOptions
from edgeflux.tricks.options import backprop_options

NAME = "budget"
# default: Fashion-MNIST at 32 px on the zoo's models; realistic: bench.realistic's photo folder at 3x128x128 on
# torchvision's full-width architectures (its settings below: a model's runs take minutes, not seconds)
PHOTO_PX = realistic.PHOTO_PX
DATA = {"default": "Fashion-MNIST at 32 px (its target split)",
        "realistic": f"bench.realistic's photo folder (Fashion-MNIST upscaled to RGB) at {PHOTO_PX} px, torchvision's "
                     "architectures from random weights"}
SHORT = {"default": "Fashion-MNIST, 1x32x32", "realistic": f"photos, 3x{PHOTO_PX}x{PHOTO_PX}"}
REALISTIC = dict(models=["mobilenet_v2"], fractions=[0.25], target_acc=0.75, epochs=3, time_limit=300.0,
                 nf_epochs=1, nf_profile_batches=[4, 8, 16])
METHODS = {"backprop": "backprop", "backprop-accumulate": "accumulation", "backprop-checkpoint": "checkpointing",
           "backprop-fused_step": "step in backward",
           "backprop-checkpoint-fused_step": "checkpointing + step in backward", "neuroflux": "NeuroFlux",
           "auto": "method: auto", "auto_stored": "method: auto, plan stored"}
BACKPROP_METHODS = tuple(m for m in METHODS if m.startswith("backprop"))
AUTOS = ("auto", "auto_stored")   # the rows method: auto ran: they choose among BACKPROP_METHODS
REFERENCE_BATCH = 32
# flags that choose which runs a benchmark makes, not how a run is made: a finished run is resumed across them
PER_RUN = ("out", "models", "fractions", "methods", "seeds", "combine", "fresh", "run")
PLANS = f"{NAME}_plans"   # under --out: the stored plans of method: auto, plan stored (removed by a fresh start)
EVAL_BATCH = 500   # evaluation is not timed: at the training batch it would take longer than the training
log = logging.getLogger("bench.budget")


def workload_parser(name: str, doc: str, quick: str) -> argparse.ArgumentParser:
    """The flags of a benchmark on the default workload (this one's and bench.accumulate's): its results' ``name``,
    its module ``doc`` and what its --quick runs."""
    p = argparse.ArgumentParser(prog=program_name(), description=doc, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"CI-sized: {quick}")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"directory for {name}.{{json,md,png}}")
    p.add_argument("--models", nargs="+", default=["vgg16", "resnet18", "mobilenet_v2"], help="zoo models")
    p.add_argument("--width", type=float, default=0.25, help="width multiplier of every model")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (weights, heads, data order)")
    p.add_argument("--train-samples", type=int, default=8000, help="Fashion-MNIST training images (target split)")
    p.add_argument("--val-samples", type=int, default=500, help="validation images (no choice here reads them)")
    p.add_argument("--test-samples", type=int, default=None, help="test images (default: the whole test split)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (none: torch's choice)")
    p.set_defaults(workload="default")   # bench.budget's own parser offers --workload
    p.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                   help=f"instead of running: merge {name}.json files of runs over different --models (or seeds) "
                        "into --out")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "vgg11 w0.125, 512 images, one budget, 1 seed")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125],
                   help="budgets as fractions of plain backprop's measured batch-32 peak")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="methods to run")
    p.add_argument("--target-acc", type=float, default=0.80, help="target test accuracy")
    p.add_argument("--epochs", type=int, default=4, help="at most this many epochs of backprop and its tricks")
    p.add_argument("--nf-epochs", type=int, default=2, help="NeuroFlux epochs per block")
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds of training after which a run stops")
    p.add_argument("--max-batch", type=int, default=256, help="batch size limit of every method")
    p.add_argument("--nf-profile-batches", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="the batches NeuroFlux's profile measures each unit at")
    p.add_argument("--fresh", action="store_true",
                   help=f"run every seed again: without it, a run that --out's {NAME}_runs.jsonl holds under the same "
                        "settings (a stopped benchmark's) is taken from there")
    add_workload(p, "Fashion-MNIST at 32 px, the zoo's models at --width",
                 f"the photo folder of bench.realistic at {PHOTO_PX} px, torchvision's architectures (full width)",
                 REALISTIC)
    args = parse_workload(p, argv)
    if args.quick:
        args.models, args.width, args.fractions, args.seeds = ["vgg11"], 0.125, [0.5], [0]
        args.train_samples, args.val_samples, args.epochs, args.nf_epochs = 512, 128, 1, 1
        args.target_acc, args.time_limit, args.test_samples = 0.5, 30.0, 1000
    return args


def default_splits(args) -> dict:
    """The default workload's data: Fashion-MNIST at 32 px, args.train_samples / val_samples / test_samples
    (None: the whole split) of the target splits; the realistic workload's: the whole photo folder at 128 px."""
    if args.workload == "realistic":
        data = realistic.photo_data("none")
    else:
        data = prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    return {"train": tensors(data, "target_train", limit=args.train_samples),
            "val": tensors(data, "target_val", limit=args.val_samples),
            "test": tensors(data, "target_test", limit=args.test_samples)}


def time_to(history: list[dict], target: float, offset: float) -> tuple[float, float] | None:
    """(wall s, training CPU s) at the first evaluation reaching the target, or None."""
    row = next((r for r in history if r.get("test_acc", 0.0) >= target), None)
    return (offset + row["time_s"], row.get("cpu_s")) if row else None


def model_spec(name: str, args) -> dict:
    """build_model's arguments for a model of the workload (seed aside)."""
    return model_args(name, args, PHOTO_PX if args.workload == "realistic" else 32, 10)


def bp_options(method: str, spec: dict, budget: int | None, seed: int, args) -> TrainBPParams:
    opts = TrainBPParams(model=workload_model(spec["name"], args),
                         budget=f"{budget}B" if budget else None,
                         max_batch=args.max_batch, epochs=args.epochs, lr=0.05, lr_scaling="sqrt",
                         lr_reference_batch=REFERENCE_BATCH, evals_per_epoch=4, seed=seed, device="cpu",
                         tricks=TrickOptions(effective_batch=REFERENCE_BATCH))
    return backprop_options(method, opts)


def run_backprop(method: str, spec: dict, splits: dict, budget: int, seed: int, args,
                 hint: int | None = None, offset: float = 0.0) -> dict:
    """One seed of backprop (with the method's tricks) to the target or the time limit. hint: a batch already
    measured to fit (method: auto's plan); offset: seconds spent before (the plan), counted in the time to target."""
    opts = bp_options(method, spec, budget, seed, args)

    def until(row: dict) -> bool:
        return row["test_acc"] >= args.target_acc or row["time_s"] >= args.time_limit
    run = TrainRun("cpu", desc=f"{METHODS[method]} seed {seed}", track_test=True, tricks=opts.tricks, until=until,
                   eval_batch=EVAL_BATCH, batch_hint=hint)
    try:
        out = train_under_budget(build_model(**spec, seed=seed), splits["train"], splits["val"], splits["test"],
                                 opts, run, opts)
    except BudgetTooSmallError as exc:
        return {"feasible": False, "min_feasible_bytes": exc.min_feasible_bytes}
    setup = offset + out.measure_s
    return {"feasible": True, "peak_bytes": out.step_memory.peak_bytes, "batch": out.batch_size,
            "to_target": time_to(out.train.history, args.target_acc, setup), "setup_s": setup,
            "test_acc": out.test_acc, "curve": [[setup + r["time_s"], r["test_acc"]] for r in out.train.history],
            "samples_per_s": out.train.steps * out.batch_size / max(out.train.train_time_s, 1e-9)}


def run_auto(spec: dict, splits: dict, budget: int, seed: int, args, stored: bool = False) -> dict:
    """One seed of method: auto as train_bp runs it: the plan over every backprop method (edgeflux.plan), then
    the fastest from the batch the plan measured; the plan's seconds count in its time to target. ``stored``: the
    plan is read from --out's budget_plans (PlanCache), measured there first (uncounted) where it is not."""
    opts = bp_options("backprop", spec, budget, seed, args)
    model = build_model(**spec, seed=seed)
    primed = {}
    if stored:
        key = plan_key(model, splits["train"], opts, "cpu")
        if not all(PlanCache(key, args.out / PLANS).get(m) for m in BACKPROP_METHODS):
            started = time.perf_counter()
            plan_training(model, splits["train"], opts, candidates=BACKPROP_METHODS,
                          cache=PlanCache(key, args.out / PLANS, fresh=True))
            primed = {"prime_s": time.perf_counter() - started}
    started = time.perf_counter()   # the stored plan's reading counts
    cache = PlanCache(key, args.out / PLANS) if stored else None
    plan = plan_training(model, splits["train"], opts, candidates=BACKPROP_METHODS, cache=cache)
    try:
        chosen = fastest(plan)
    except NoFeasibleMethodError:
        return {"feasible": False, "min_feasible_bytes": min(r.min_budget_bytes for r in plan if r.min_budget_bytes)}
    plan_s = time.perf_counter() - started
    r = run_backprop(chosen.method, spec, splits, budget, seed, args, hint=chosen.batch, offset=plan_s)
    return {**r, "chose": chosen.method, "plan_s": plan_s, **primed,
            "plan": [{"method": p.method, "batch": p.batch, "samples_per_s": p.samples_per_s} for p in plan]}


def run_neuroflux(spec: dict, splits: dict, budget: int, seed: int, args) -> dict:
    opts = NeuroFluxParams(epochs=args.nf_epochs, lr=0.05, momentum=0.9, weight_decay=5e-4, evals_per_epoch=2,
                           seed=seed, lr_scaling="sqrt", lr_reference_batch=REFERENCE_BATCH)
    nf_args = argparse.Namespace(seed=seed, max_batch=args.max_batch, device="cpu", time_limit=args.time_limit,
                                 profile_batches=args.nf_profile_batches)

    def until(run) -> bool:   # between blocks: the target reached, or the time spent
        return run.train_time_s >= args.time_limit or any(h.get("test_acc", 0) >= args.target_acc for h in run.history)
    r = run_local({**spec, "seed": seed}, splits, opts, budget, nf_args, classic=False, until=until)
    if not r["feasible"]:
        return r
    return {"feasible": True, "peak_bytes": r["peak_bytes"], "batch": r["batch_sizes"],
            "to_target": time_to(r["history"], args.target_acc, r["offset"]), "setup_s": r["profile_s"],
            "test_acc": r["test_acc"], "curve": [[r["offset"] + h["time_s"], h["test_acc"]] for h in r["history"]],
            "samples_per_s": r["samples_per_s"]}


def summary(model: str, method: str, budget: int, frac: float, runs: list[dict]) -> dict:
    """One row of the results contract: the method at one budget over its seeds (``auto``: set by mark_auto)."""
    row = {"model": model, "budget_bytes": budget, "budget_frac": frac, "method": method,
           "label": METHODS[method], "n_seeds": len(runs), "seeds": [r["seed"] for r in runs],
           "feasible": runs[0]["feasible"], "auto": False}
    if method in AUTOS and row["feasible"]:
        row.update(chose=[r["chose"] for r in runs], plan_s=mean_ci([r["plan_s"] for r in runs])["mean"],
                   plans=[r["plan"] for r in runs])
    if not row["feasible"]:
        return {**row, "min_feasible_bytes": runs[0]["min_feasible_bytes"], "peak_bytes": None,
                "time_to_target_s": None, "ci95_s": None, "test_acc": None}
    reached = [r["to_target"] for r in runs if r["to_target"]]
    wall, cpu = mean_ci([t for t, _ in reached]), mean_ci([c for _, c in reached if c is not None])
    acc = mean_ci([r["test_acc"] for r in runs])
    every = len(reached) == len(runs)
    return {**row, "peak_bytes": max(r["peak_bytes"] for r in runs), "batch": [r["batch"] for r in runs],
            "reached": f"{len(reached)} of {len(runs)}", "time_to_target_s": wall["mean"] if every else None,
            "times": [r["to_target"][0] if r["to_target"] else None for r in runs],
            "ci95_s": [wall["lo"], wall["hi"]] if every and wall["lo"] is not None else None,
            "cpu_to_target_s": cpu["mean"] if every else None, "time_ci": wall, "cpu_ci": cpu,
            "test_acc": acc["mean"], "test_acc_ci": acc, "setup_s": mean_ci([r["setup_s"] for r in runs])["mean"],
            "samples_per_s": mean_ci([r["samples_per_s"] for r in runs])["mean"],
            "within_budget": all(r["peak_bytes"] <= budget for r in runs), "curves": [r["curve"] for r in runs]}


def reference_peak(spec: dict, splits: dict, args) -> int:
    """Plain backprop's measured step peak at batch REFERENCE_BATCH: the budgets are fractions of it."""
    shape = (spec["in_channels"], spec["image_size"], spec["image_size"])
    return measure_training_peak(build_model(**spec, seed=0), optimizer_factory(bp_options(
        "backprop", spec, None, 0, args)), shape, 10, REFERENCE_BATCH, data=splits["train"],
        process_stats=False).peak_bytes


def budget_rows(name: str, splits: dict, args, done: RunLog) -> Iterator[list[dict]]:
    """Each budget's rows of one model, one budget at a time; a run ``done`` holds is taken from it, every other
    is logged to it as it finishes."""
    spec = model_spec(name, args)
    model = bp_options("backprop", spec, None, 0, args).model.key
    reference = reference_peak(spec, splits, args)
    for frac in args.fractions:
        budget = int(frac * reference)
        print(f"{model}: budget {format_bytes(budget)} ({frac:g} x backprop's batch-{REFERENCE_BATCH} peak "
              f"{format_bytes(reference)})", flush=True)
        run, rows = {"neuroflux": run_neuroflux, "auto": run_auto,
                     "auto_stored": partial(run_auto, stored=True)}, []
        for method in args.methods:
            runs = []
            for seed in args.seeds:
                r = done.get(model, budget, method, seed)
                if r is None:
                    r = done.add({**(run[method](spec, splits, budget, seed, args) if method in run else
                                     run_backprop(method, spec, splits, budget, seed, args)), "run": args.run},
                                 model, budget, method, seed)
                runs.append({**r, "seed": seed})
                if not r["feasible"]:
                    break   # the budget, not the seed, decides
            rows.append(summary(model, method, budget, frac, runs))
            rows[-1].update(reference_bytes=reference, run="+".join(sorted({r["run"] for r in runs})),
                            workload=args.workload, target_acc=args.target_acc)
            print(f"  {METHODS[method]}: {_cell(rows[-1])}", flush=True)
        yield mark_auto(rows)


def mark_auto(rows: list[dict]) -> list[dict]:
    """``auto`` true on the row of the method a method: auto row at its model and budget chose (the seeds' most
    common choice), false elsewhere; rows merged from several runs keep one row per method (the later run's), in
    the order model, budget (largest first), method."""
    rows = list({(r["workload"], r["model"], r["budget_bytes"], r["method"]): r for r in rows}.values())
    models = list(dict.fromkeys(r["model"] for r in rows))
    rows.sort(key=lambda r: (models.index(r["model"]), -r["budget_bytes"], list(METHODS).index(r["method"])))
    for r in rows:
        auto = next((a for a in rows if a["method"] == "auto" and a["feasible"] and
                     (a["model"], a["budget_bytes"]) == (r["model"], r["budget_bytes"])), None)
        r["auto"] = auto is not None and r["method"] == _majority(auto["chose"])
    return rows


def _majority(choices: list[str]) -> str:
    return max(choices, key=choices.count)


def _interval(ci: list | None) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci and ci[0] is not None else ""


def _cell(row: dict) -> str:
    if not row["feasible"]:
        return f"infeasible (needs {format_bytes(row['min_feasible_bytes'])})"
    return f"{fmt_ci(row['time_ci'], ' s')} to target ({row['reached']}), test acc {fmt_ci(row['test_acc_ci'])}"


def _eval_step(row: dict) -> str:
    """The median training seconds between two evaluations of the row's runs: the resolution of its time to
    target (a run reaches the target at an evaluation, not between)."""
    steps = [b[0] - a[0] for curve in row.get("curves") or [] for a, b in zip(curve, curve[1:])]
    return f"{statistics.median(steps):.1f}" if steps else ""


def verdicts(rows: list[dict]) -> list[dict]:
    """Per model and budget: the fastest method to the target, NeuroFlux's time, what method: auto chose and its
    time to target (its plan included) as a ratio, paired by seed, of the fastest method's and of the fastest
    among those auto chooses from (the backprop methods), and whether the ratio's 95% interval lies within 10%.
    Times compare only within one run: two VMs of the same processor model differed by up to 1.5x in samples/s,
    so a model and budget whose timed rows come from several runs is not judged."""
    out = []
    for key in dict.fromkeys((r["model"], r["budget_bytes"]) for r in rows):
        group = [r for r in rows if (r["model"], r["budget_bytes"]) == key]
        runs = {r.get("run") for r in group if r.get("time_to_target_s") is not None}
        if len(runs) > 1:
            out.append({"model": key[0], "budget_bytes": key[1], "budget_frac": group[0]["budget_frac"],
                        "fastest": f"not judged: timed in {len(runs)} runs", "auto": _choice(next(
                            (r for r in group if r["method"] == "auto"), None)),
                        **_auto_ratio(None, None, ""), **_auto_ratio(None, None, "_backprop")})
            continue
        best = _fastest([r for r in group if r["method"] not in AUTOS])
        best_full = _fastest([r for r in group if r["method"] in BACKPROP_METHODS])
        nf = next((r for r in group if r["method"] == "neuroflux"), None)
        ran = next((r for r in group if r["method"] == "auto"), None)
        auto = ran if ran and ran["feasible"] else None
        chosen = next((r for r in group if r["auto"]), None)
        entry = {"model": key[0], "budget_bytes": key[1], "budget_frac": group[0]["budget_frac"],
                 "fastest": best["label"] if best else None, "fastest_s": best["time_to_target_s"] if best else None,
                 "neuroflux_s": nf.get("time_to_target_s") if nf else None,
                 "fastest_backprop": best_full["label"] if best_full else None,
                 "auto": _choice(ran), "auto_s": auto.get("time_to_target_s") if auto else None,
                 "plan_s": auto.get("plan_s") if auto else None,
                 "auto_is_fastest_backprop": (chosen is best_full) if chosen and best_full else None}
        for suffix, other in (("", best), ("_backprop", best_full)):
            entry.update(_auto_ratio(auto, other, suffix))
        entry.update(_stored(next((r for r in group if r["method"] == "auto_stored"), None), best, best_full, group))
        out.append(entry)
    return out


def _stored(row: dict | None, best: dict | None, best_full: dict | None, group: list[dict]) -> dict:
    """The verdict's fields of method: auto with its plan stored: its choice, time and ratios to the fastest
    method, to the fastest backprop method and to the method it chose (the same training, seed by seed: what
    the machine's speed alone varies between two runs of one step)."""
    if row is None:
        return {}
    ran = row if row["feasible"] else None
    chosen = next((r for r in group if ran and r["method"] == _majority(ran["chose"])), None)
    ratios = {**_auto_ratio(ran, best, ""), **_auto_ratio(ran, best_full, "_backprop"),
              **_auto_ratio(ran, chosen, "_chosen")}
    return {"auto_stored": _choice(row), "auto_stored_s": row.get("time_to_target_s"),
            **{k.replace("auto_", "auto_stored_"): v for k, v in ratios.items()}}


def _choice(auto: dict | None) -> str:
    if auto is None:
        return "auto not run"
    if not auto["feasible"]:
        return "no backprop method fits"
    top = _majority(auto["chose"])
    n = auto["chose"].count(top)
    return METHODS[top] + (f" ({n} of {len(auto['chose'])} seeds)" if n < len(auto["chose"]) else "")


def _fastest(group: list[dict]) -> dict | None:
    return min((r for r in group if r.get("time_to_target_s") is not None), key=lambda r: r["time_to_target_s"],
               default=None)


def _auto_ratio(auto: dict | None, other: dict | None, suffix: str) -> dict:
    """method: auto's time to target over ``other``'s, paired by seed, with its 95% interval and the 10% verdict."""
    keys = [f"auto_ratio{suffix}", f"auto_ratio{suffix}_ci", f"auto_within_10pct{suffix}"]
    if not (auto and other) or other.get("time_to_target_s") is None:   # no time to pair with in some seed
        return dict.fromkeys(keys)
    if auto.get("time_to_target_s") is None:   # not every seed of auto reached the target
        return dict(zip(keys, (None, None, False)))
    mine, theirs = _by_seed(auto), _by_seed(other)
    ci = mean_ci([mine[s] / theirs[s] for s in mine if s in theirs])
    return dict(zip(keys, (ci["mean"], [ci["lo"], ci["hi"]],
                           (ci["hi"] if ci["hi"] is not None else ci["mean"]) <= 1.10)))


def _by_seed(row: dict) -> dict:
    """A row's times to target by seed (rows written without their seeds ran seeds 0, 1, 2, ...)."""
    return dict(zip(row.get("seeds", range(len(row["times"]))), row["times"]))


def plot(rows: list[dict], path: Path) -> None:
    """Time to target per method (mean and 95% interval), one panel per model, budgets along x."""
    from edgeflux.neuroflux.plots import _pyplot, _save
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    ncols = min(3, len(models))    # at most three panels a row: more stay readable on a page in rows
    nrows = math.ceil(len(models) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(9, 6 * ncols), 5.5 * nrows), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    hatched = False
    for ax, model in zip(axes.flat, models):
        fracs = sorted({r["budget_frac"] for r in rows if r["model"] == model}, reverse=True)
        width = 0.8 / len(methods)
        # a budget's bars compare when one run timed them: one timed in another run than most is hatched
        runs = {f: (Counter(r.get("run") for r in rows if (r["model"], r["budget_frac"]) == (model, f)
                            and r["time_to_target_s"] is not None).most_common(1) or [(None, 0)])[0][0] for f in fracs}
        for k, method in enumerate(methods):
            for i, frac in enumerate(fracs):
                r = next((r for r in rows if (r["model"], r["method"], r["budget_frac"]) == (model, method, frac)),
                         None)
                x = i + (k - (len(methods) - 1) / 2) * width
                if r is None:     # not run at this budget
                    continue
                if not r["feasible"] or r["time_to_target_s"] is None:
                    ax.text(x, 0, "x" if not r["feasible"] else "-", ha="center", va="bottom",
                            color=METHOD_COLOURS[METHODS[method]], fontsize=9)
                    continue
                lo, hi = r["ci95_s"] or (r["time_to_target_s"],) * 2
                other_run = r.get("run") != runs[frac]
                hatched |= other_run
                ax.bar(x, r["time_to_target_s"], width, color=METHOD_COLOURS[METHODS[method]],
                       edgecolor="black" if r["auto"] else "none", linewidth=1.5,
                       hatch="//" if other_run else None,
                       yerr=[[r["time_to_target_s"] - lo], [hi - r["time_to_target_s"]]], capsize=3)
        ax.set_xticks(range(len(fracs)), [f"{f:.1%} of backprop's\nbatch-{REFERENCE_BATCH} peak" for f in fracs])
        ax.set_xlim(-0.5, len(fracs) - 0.5)   # every method's slot, marks of the methods without a bar too
        first = next(r for r in rows if r["model"] == model)
        ax.set(title=f"{model}\n{SHORT[first.get('workload', 'default')]}",
               ylabel=f"seconds to {first['target_acc']:.0%} test accuracy (mean, 95% CI)")
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=METHOD_COLOURS[METHODS[m]]) for m in methods]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", linewidth=1.5))
    fig.legend(handles, [METHODS[m] for m in methods] + ["method: auto's choice"], loc="upper center",
               ncol=4, frameon=False, fontsize=9)
    other = "\nhatched: timed in another run than the budget's other bars (not compared with them: wall clocks of " \
            "two runs differ)" if hatched else ""
    fig.text(0.5, 0.01, "x: cannot train at this budget;  -: not every seed reached the target in the time limit"
             + other, ha="center", fontsize=9)
    fig.tight_layout(rect=(0, (0.07 if other else 0.04) / nrows, 1, 1 - 0.08 / nrows))
    _save(fig, path)


def write(rows: list[dict], args, notes: str, measured_by: dict | None = None) -> None:
    result = BenchResult()
    for r in rows:
        result.add(**r)
    judged = verdicts(rows)
    shown = [{**v, **{k: _interval(v.get(k)) for k in ("auto_ratio_ci", "auto_ratio_backprop_ci",
                                                      "auto_stored_ratio_ci", "auto_stored_ratio_backprop_ci",
                                                      "auto_stored_ratio_chosen_ci")}}
             for v in judged]
    result.add_section("Per budget: the fastest to the target, NeuroFlux, and what method: auto chose", shown,
        {"model": "model", "budget_frac": "budget (x batch-32 peak)", "fastest": "fastest", "fastest_s": "its s",
         "neuroflux_s": "NeuroFlux s", "auto": "auto chose", "auto_s": "auto s", "plan_s": "its plan s",
         "auto_ratio": "auto / fastest", "auto_ratio_ci": "95% CI",
         "auto_within_10pct": "within 10%", "fastest_backprop": "fastest backprop method",
         "auto_is_fastest_backprop": "auto chose it",
         "auto_ratio_backprop": "auto / it", "auto_ratio_backprop_ci": "95% CI ",
         "auto_within_10pct_backprop": "within 10% "})
    if any("auto_stored" in v for v in judged):
        result.add_section("Per budget: method: auto with its plan stored (a later run on the device)",
                           [v for v in shown if "auto_stored" in v],
                           {"model": "model", "budget_frac": "budget (x batch-32 peak)", "fastest": "fastest",
                            "fastest_s": "its s", "fastest_backprop": "fastest backprop method",
                            "auto_stored": "auto chose", "auto_stored_s": "auto s",
                            "auto_stored_ratio": "auto / fastest", "auto_stored_ratio_ci": "95% CI",
                            "auto_stored_within_10pct": "within 10%", "auto_stored_ratio_backprop": "auto / backprop's",
                            "auto_stored_ratio_backprop_ci": "95% CI ",
                            "auto_stored_within_10pct_backprop": "within 10% ",
                            "auto_stored_ratio_chosen": "auto / the method it chose (same runs)",
                            "auto_stored_ratio_chosen_ci": "95% CI  "})
    md = [{"model": r["model"], "budget": f"{format_bytes(r['budget_bytes'])} ({r['budget_frac']:g})",
           "method": r["label"] + (" (auto)" if r["auto"] else ""),
           **({"target": f"{r['target_acc']:.0%}"} if len({r["target_acc"] for r in rows}) > 1 else {}),
           "batch": "; ".join(str(b) for b in r.get("batch", [])) if r["feasible"] else "",
           "peak": format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "",
           "to target": _cell(r).split(" to target")[0] if r["feasible"] else _cell(r),
           "reached": r.get("reached", ""), "CPU s": f"{r['cpu_to_target_s']:.1f}" if r.get("cpu_to_target_s") else "",
           "s between evaluations": _eval_step(r),
           "test acc": fmt_ci(r["test_acc_ci"]) if r["feasible"] else "",
           **({"machine": r.get("machine", "")} if len({r.get("machine") for r in rows}) > 1 else {}),
           **({"run": (r.get("run") or "").replace("T", " ")} if len({r.get("run") for r in rows}) > 1 else {})}
          for r in rows]
    targets = sorted({r["target_acc"] for r in rows})
    goal = f"{targets[0]:.0%}" if len(targets) == 1 else "a target"
    result.write(NAME, args.out, title=f"Time to {goal} test accuracy under a memory budget",
                 md_rows=md, notes=notes, measured_by=measured_by,
                 extra={"n_seeds": max(r["n_seeds"] for r in rows), "verdicts": judged,
                        "settings": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items() if k != "combine"}})
    plot(rows, args.out / f"{NAME}.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.combine:
        parts, rows, measured_by = read_parts(args.combine)
        for part in parts:   # each row keeps the processor and the run it was measured in
            for r in part["rows"]:
                r.setdefault("machine", part["machine"]["cpu"])
                r.setdefault("run", part["machine"]["date"][:16])
                r.setdefault("target_acc", part["settings"]["target_acc"])
        notes = runs_notes(measured_by["runs"])
        rows = mark_auto(rows)   # a row measured again replaces the earlier one
        left = {r["machine"] for r in rows}   # the header names the latest machine whose rows are kept
        measured_by["machine"] = next(p["machine"] for p in reversed(parts) if p["machine"]["cpu"] in left)
        return write(rows, args, notes, measured_by=measured_by)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    splits = default_splits(args)
    args.run = datetime.now(timezone.utc).isoformat(timespec="minutes")   # which rows were measured together
    started, rows, total = time.perf_counter(), [], len(args.models) * len(args.fractions)
    finished = RunLog(args.out / f"{NAME}_runs.jsonl", {k: v for k, v in vars(args).items() if k not in PER_RUN},
                      fresh=args.fresh)
    if finished.done:
        print(f"resuming: {len(finished.done)} finished runs from {finished.path} (--fresh: run them again)",
              flush=True)
    else:   # the plans a stopped run stored are its own: a new run measures its own
        shutil.rmtree(args.out / PLANS, ignore_errors=True)
    for name in args.models:
        for budget in budget_rows(name, splits, args, finished):   # written after every budget: a stopped run keeps them
            rows += budget
            done = len({(r["model"], r["budget_bytes"]) for r in rows})
            write(rows, args, f"Workload {args.workload}: {DATA[args.workload]}, {len(splits['train'][1])} training "
                  f"images, the whole test split ({len(splits['test'][1])} images); seeds {args.seeds}; at "
                  f"most {args.epochs} epochs (NeuroFlux: {args.nf_epochs} per block) or {args.time_limit:g} s of "
                  f"training; SGD momentum 0.9, lr 0.05 at batch {REFERENCE_BATCH} (sqrt-scaled); torch threads "
                  f"{torch.get_num_threads()}; bench time {time.perf_counter() - started:.0f} s; "
                  f"{done} of {total} model budgets done.")


if __name__ == "__main__":
    main()
