"""How finely `edgeflux plan` tells its candidates apart: the same plan repeated, in one process.

The plan ranks candidates by samples/s timed over a few seconds, on a machine whose speed drifts. Repeated on the
same model, budget and data (bench.budget's cells: a model at a fraction of plain backprop's batch-32 peak), each
candidate's samples/s over plain backprop's in the same plan would not move on a steady machine: its spread over
the repeats is how small a difference the plan can see (method: auto counts candidates within 5% as tied), and
how often the plan's choice changes says what that spread does to auto. --against REV alternates every repeat with
the plan of an earlier revision (its edgeflux/plan/core.py, read from git), so that both time under the same drift.

Two settings of the plan are measured here too. How far a candidate's first round strays from its median (its
samples/s as a share of the fastest's, in the plans that timed it every round): what edgeflux.plan.core.CONTENDS
must allow for before it stops timing the slow. And each candidate's first steps on a fresh copy (after the
sizing, as in a plan) over its later steps' median, in the first round and in later ones: what WARMUP must skip.

    python -m bench.plan_precision --threads 2 --against 1156d52   # VGG-16, ResNet-18 w0.25 at 50%, ResNet-18 at 25%
    python -m bench.plan_precision --quick --out /tmp/p
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench import budget
from bench.common import BenchResult, bench_argparser
from edgeflux.data import batches
from edgeflux.models import build_model
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.plan import core as plan_core
from edgeflux.train import TrainRun, fit_step
from edgeflux.tricks.options import backprop_options

NAME = "plan_precision"
HERE = "this revision"
COLOURS = {HERE: "#1f77b4", "earlier": "#7f7f7f"}
CELLS = ("vgg16:0.5", "resnet18:0.5", "resnet18:0.25")
ROUND_LOG = re.compile(r"plan (\S+): batch \d+, [\d.]+ samples/s \(rounds: (.*)\)")
FIRST_STEPS, LATER_STEPS = 3, 8   # the warm-up table: these first steps over the median of the next ones


class RoundLog(logging.Handler):
    """Each candidate's samples/s per round, from the plan's log line (every revision writes it)."""
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rounds: dict[str, list[float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = ROUND_LOG.match(record.getMessage())
        if m:
            self.rounds[m.group(1)] = [float(v) for v in m.group(2).split(", ")]


def revision_core(rev: str):
    """edgeflux/plan/core.py as revision ``rev`` of this repository has it, imported as a module of its own."""
    repo = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:edgeflux/plan/core.py"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"plan_core_{rev}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)   # dataclasses look it up there
        spec.loader.exec_module(module)
    return module


def cell_options(name: str, fraction: float, splits: dict, bargs) -> tuple:
    """bench.budget's model spec, plain backprop's options at ``fraction`` of its batch-32 peak, and the fraction."""
    spec = budget.model_spec(name, bargs)
    limit = int(fraction * budget.reference_peak(spec, splits, bargs))
    return spec, budget.bp_options("backprop", spec, limit, 0, bargs), fraction


def parse_cell(text: str) -> tuple[str, float]:
    name, _, frac = text.partition(":")
    try:
        return name, float(frac)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a model and a budget fraction, e.g. resnet18:0.25") from None


def repeat_plans(cell: tuple, splits: dict, versions: dict, repeats: int) -> list[dict]:
    """Every version's plan of one cell (cell_options'), ``repeats`` times, the versions alternated: a record per
    plan."""
    spec, opts, fraction = cell
    records = []
    for i in range(repeats):
        for version, core in versions.items():
            started, log = time.perf_counter(), RoundLog()
            core.log.addHandler(log)
            core.log.setLevel(logging.INFO)
            try:
                rows = core.plan_training(build_model(**spec, seed=0), splits["train"], opts,
                                          candidates=budget.BACKPROP_METHODS)
            finally:
                core.log.removeHandler(log)
            seconds, rates = time.perf_counter() - started, {r.method: r.samples_per_s for r in rows}
            if rates["backprop"] is None:
                raise SystemExit(f"{opts.model.key}: plain backprop does not fit {fraction:g} of its batch-32 peak, "
                                 "which every ratio here is over: choose a larger --fraction")
            records.append({"model": opts.model.key, "budget_frac": fraction, "version": version, "repeat": i,
                            "plan_s": seconds, "rates": rates, "rounds": log.rounds,
                            "chose": core.fastest(rows).method})
            print(f"{opts.model.key} at {fraction:g} {version} #{i + 1}: {seconds:.1f} s, chose "
                  f"{records[-1]['chose']}", flush=True)
    return records


def first_round_gap(plan: dict, method: str) -> float | None:
    """How far ``method``'s first round strays from its median in one plan: its samples/s as a share of the
    fastest's (among the candidates timed every round), first round minus median; None unless it was timed in
    every round of the plan."""
    rounds = plan["rounds"]
    full = [m for m, r in rounds.items() if len(r) == max(map(len, rounds.values()))]
    if method not in full or len(rounds[method]) < 2:
        return None
    first, median = (max(f(rounds[m]) for m in full) for f in (lambda r: r[0], statistics.median))
    return rounds[method][0] / first - statistics.median(rounds[method]) / median


def summarise(records: list[dict]) -> list[dict]:
    """Per cell, version and candidate: its samples/s over plain backprop's, mean and standard deviation over the
    repeats, beside the plan's seconds and its choices."""
    rows = []
    for key in dict.fromkeys((r["model"], r["budget_frac"], r["version"]) for r in records):
        plans = [r for r in records if (r["model"], r["budget_frac"], r["version"]) == key]
        choices = Counter(budget.METHODS[p["chose"]] for p in plans)
        for method in budget.BACKPROP_METHODS[1:]:
            ratios = [p["rates"][method] / p["rates"]["backprop"] for p in plans if p["rates"][method]]
            if not ratios:   # does not fit the budget
                continue
            gaps = [g for g in (first_round_gap(p, method) for p in plans) if g is not None]
            rows.append({"model": key[0], "budget": key[1], "plan": key[2], "candidate": budget.METHODS[method],
                         "ratio_mean": round(statistics.fmean(ratios), 3),
                         "ratio_sd": round(statistics.stdev(ratios), 3) if len(ratios) > 1 else None,
                         "rounds": round(statistics.fmean(len(p["rounds"].get(method, [])) for p in plans), 2),
                         "first_round_gap": round(max(gaps, key=abs), 3) if gaps else None,
                         "plan_s": round(statistics.fmean(p["plan_s"] for p in plans), 2),
                         "choices": ", ".join(f"{m} {n}x" for m, n in choices.most_common()), "n": len(plans)})
    return rows


def warmup_steps(cell: tuple, splits: dict) -> list[dict]:
    """Each candidate's first steps on a fresh copy (as a plan's round makes it, at the batch its plan sized) over
    the median of its next LATER_STEPS, in the plan's ROUNDS rounds, the candidates in turn."""
    spec, opts, fraction = cell
    model, (x, y) = build_model(**spec, seed=0), splits["train"]
    sized = {m: plan_core.size_one(m, plan_core.Candidate(m, model, o, TrainRun(
        "cpu", context=o.bittrain.context, tricks=o.tricks)), splits["train"])
        for m, o in ((m, backprop_options(m, opts)) for m in budget.BACKPROP_METHODS)}
    out = []
    for turn in range(plan_core.ROUNDS):
        for method, row in ((m, r) for m, r in sized.items() if r.feasible):
            o = backprop_options(method, opts)
            run = TrainRun("cpu", context=o.bittrain.context, tricks=o.tricks)
            step, seconds = fit_step(copy.deepcopy(model).train(), o, row.batch, run, len(y)), []
            for xb, yb in batches(x, y, row.batch, shuffle=True, seed=turn):
                started = time.perf_counter()
                step(xb, yb)
                seconds.append(time.perf_counter() - started)
                if len(seconds) == FIRST_STEPS + LATER_STEPS:
                    break
            later = statistics.median(seconds[FIRST_STEPS:])
            out.append({"model": opts.model.key, "budget": fraction, "round": turn + 1, "candidate": method,
                        "steps": [round(t / later, 3) for t in seconds[:FIRST_STEPS]]})
    return out


def warmup_rows(steps: list[dict]) -> list[dict]:
    """Per cell and round: each first step over the later steps' median, the lowest and highest over candidates."""
    rows = []
    for key in dict.fromkeys((r["model"], r["budget"], r["round"]) for r in steps):
        group = [r["steps"] for r in steps if (r["model"], r["budget"], r["round"]) == key]
        rows.append({"model": key[0], "budget": key[1], "round": key[2], **{
            f"step {k + 1}": f"{min(g[k] for g in group):.2f}-{max(g[k] for g in group):.2f}"
            for k in range(FIRST_STEPS)}, "candidates": len(group)})
    return rows


def plot(records: list[dict], path: Path) -> None:
    plt = _pyplot()
    models = list(dict.fromkeys((r["model"], r["budget_frac"]) for r in records))
    versions = list(dict.fromkeys(r["version"] for r in records))
    methods = budget.BACKPROP_METHODS[1:]
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for k, version in enumerate(versions):
            plans = [r for r in records if (r["model"], r["budget_frac"]) == model and r["version"] == version]
            for j, method in enumerate(methods):
                ys = [p["rates"][method] / p["rates"]["backprop"] for p in plans if p["rates"][method]]
                ax.scatter([j + (k - (len(versions) - 1) / 2) * 0.25] * len(ys), ys, s=22, alpha=0.8,
                           color=COLOURS[HERE if version == HERE else "earlier"],
                           label=version if j == 0 else None)
        ax.axhline(1.0, color="#888888", lw=0.8)
        ax.set_xticks(range(len(methods)), [budget.METHODS[m].replace(" + ", " +\n") for m in methods], fontsize=8)
        ax.set(title=f"{model[0]} at {model[1]:g} x its batch-32 peak",
               ylabel="samples/s over plain backprop's (same plan)")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("The plan repeated: each point one plan's ratio")
    fig.tight_layout()
    _save(fig, path)


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=[parse_cell(c) for c in CELLS],
                        metavar="MODEL:FRACTION",
                        help="bench.budget's zoo models, each at a budget: this fraction of plain backprop's batch-32 "
                             f"peak (plain backprop must fit it); default: {' '.join(CELLS)}")
    parser.add_argument("--repeats", type=int, default=6, help="plans per version and model")
    parser.add_argument("--against", metavar="REV", help="also an earlier revision's plan (a git commit)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bargs = budget.parse_args(["--quick"] if args.quick else [])
    if args.quick:
        args.cells, args.repeats = [(m, 0.5) for m in bargs.models], 2
    splits = budget.default_splits(bargs)
    versions = {HERE: plan_core, **({args.against: revision_core(args.against)} if args.against else {})}
    records, steps = [], []
    for name, frac in args.cells:   # the warm-up first: the plans before it would have primed its first steps
        cell = cell_options(name, frac, splits, bargs)
        steps += warmup_steps(cell, splits)
        records += repeat_plans(cell, splits, versions, args.repeats)
    result = BenchResult()
    for row in summarise(records):
        result.add(**row)
    result.add_section("A fresh copy's first steps over its later steps' median (the plan's warm-up)",
                       warmup_rows(steps))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(records, args.out / f"{NAME}.png")
    result.write(NAME, args.out, title="edgeflux plan: how finely it tells candidates apart",
                 notes=f"Each model at a budget (x plain backprop's batch-32 peak), bench.budget's default data; "
                       f"{args.repeats} plans per version, alternated in one process. A candidate's ratio: its "
                       "samples/s over plain backprop's in the same plan; sd over the plans. rounds: the rounds it "
                       "was timed in (mean); first_round_gap: its first round's share of the fastest's samples/s "
                       "minus its median's, the largest in size over the plans that timed it in every round. "
                       f"Warm-up: each candidate's first {FIRST_STEPS} steps on a fresh copy over the median of "
                       f"its next {LATER_STEPS}, in three rounds taken in turn (lowest-highest over candidates).",
                 extra={"plans": records, "warmup_steps": steps})


if __name__ == "__main__":
    main()
