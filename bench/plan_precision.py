"""How finely `edgeflux plan` tells its candidates apart: the same plan repeated, in one process.

The plan ranks candidates by samples/s timed over a few seconds, on a machine whose speed drifts. Repeated on the
same model, budget and data (bench.budget's cells: a model at a fraction of plain backprop's batch-32 peak), each
candidate's samples/s over plain backprop's in the same plan would not move on a steady machine: its spread over
the repeats is how small a difference the plan can see (method: auto counts candidates within 5% as tied), and
how often the plan's choice changes says what that spread does to auto. --against REV alternates every repeat with
the plan of an earlier revision (its edgeflux/plan/core.py, read from git), so that both time under the same drift.

    python -m bench.plan_precision --threads 2 --against 7d98254   # VGG-16 and ResNet-18 w0.25 at 50%, 6 repeats
    python -m bench.plan_precision --quick --out /tmp/p
"""
from __future__ import annotations

import importlib.util
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
from edgeflux.plan import core as plan_core
from edgeflux.models import build_model
from edgeflux.neuroflux.plots import _pyplot, _save

NAME = "plan_precision"
HERE = "this revision"
COLOURS = {HERE: "#1f77b4", "earlier": "#7f7f7f"}


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


def repeat_plans(name: str, fraction: float, versions: dict, repeats: int, bargs) -> list[dict]:
    """Every version's plan of one cell, ``repeats`` times, the versions alternated: a record per plan."""
    spec, splits = budget.model_spec(name, bargs), budget.default_splits(bargs)
    limit = int(fraction * budget.reference_peak(spec, splits, bargs))
    opts = budget.bp_options("backprop", spec, limit, 0, bargs)
    records = []
    for i in range(repeats):
        for version, core in versions.items():
            started = time.perf_counter()
            rows = core.plan_training(build_model(**spec, seed=0), splits["train"], opts,
                                      candidates=budget.BACKPROP_METHODS)
            seconds, rates = time.perf_counter() - started, {r.method: r.samples_per_s for r in rows}
            if rates["backprop"] is None:
                raise SystemExit(f"{opts.model.key}: plain backprop does not fit {fraction:g} of its batch-32 peak, "
                                 "which every ratio here is over: choose a larger --fraction")
            records.append({"model": opts.model.key, "budget_frac": fraction, "version": version, "repeat": i,
                            "plan_s": seconds, "rates": rates, "chose": core.fastest(rows).method})
            print(f"{opts.model.key} {version} #{i + 1}: {seconds:.1f} s, chose {records[-1]['chose']}", flush=True)
    return records


def summarise(records: list[dict]) -> list[dict]:
    """Per cell, version and candidate: its samples/s over plain backprop's, mean and standard deviation over the
    repeats, beside the plan's seconds and its choices."""
    rows = []
    for key in dict.fromkeys((r["model"], r["version"]) for r in records):
        plans = [r for r in records if (r["model"], r["version"]) == key]
        choices = Counter(budget.METHODS[p["chose"]] for p in plans)
        for method in budget.BACKPROP_METHODS[1:]:
            ratios = [p["rates"][method] / p["rates"]["backprop"] for p in plans if p["rates"][method]]
            if not ratios:   # does not fit the budget
                continue
            rows.append({"model": key[0], "plan": key[1], "candidate": budget.METHODS[method],
                         "ratio_mean": round(statistics.fmean(ratios), 3),
                         "ratio_sd": round(statistics.stdev(ratios), 3) if len(ratios) > 1 else None,
                         "plan_s": round(statistics.fmean(p["plan_s"] for p in plans), 2),
                         "choices": ", ".join(f"{m} {n}x" for m, n in choices.most_common()), "n": len(plans)})
    return rows


def plot(records: list[dict], path: Path) -> None:
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in records))
    versions = list(dict.fromkeys(r["version"] for r in records))
    methods = budget.BACKPROP_METHODS[1:]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for k, version in enumerate(versions):
            plans = [r for r in records if r["model"] == model and r["version"] == version]
            for j, method in enumerate(methods):
                ys = [p["rates"][method] / p["rates"]["backprop"] for p in plans if p["rates"][method]]
                ax.scatter([j + (k - (len(versions) - 1) / 2) * 0.25] * len(ys), ys, s=22, alpha=0.8,
                           color=COLOURS[HERE if version == HERE else "earlier"],
                           label=version if j == 0 else None)
        ax.axhline(1.0, color="#888888", lw=0.8)
        ax.set_xticks(range(len(methods)), [budget.METHODS[m].replace(" + ", " +\n") for m in methods], fontsize=8)
        ax.set(title=model, ylabel="samples/s over plain backprop's (same plan)")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("The plan repeated: each point one plan's ratio")
    fig.tight_layout()
    _save(fig, path)


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vgg16", "resnet18"], help="bench.budget's zoo models")
    parser.add_argument("--fraction", type=float, default=0.5, help="the budget: this fraction of plain backprop's "
                                                                     "batch-32 peak")
    parser.add_argument("--repeats", type=int, default=6, help="plans per version and model")
    parser.add_argument("--against", metavar="REV", help="also an earlier revision's plan (a git commit)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bargs = budget.parse_args(["--quick"] if args.quick else [])
    if args.quick:
        args.models, args.repeats = bargs.models, 2
    versions = {HERE: plan_core, **({args.against: revision_core(args.against)} if args.against else {})}
    records = [r for name in args.models for r in repeat_plans(name, args.fraction, versions, args.repeats, bargs)]
    result = BenchResult()
    for row in summarise(records):
        result.add(**row)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(records, args.out / f"{NAME}.png")
    result.write(NAME, args.out, title="edgeflux plan: how finely it tells candidates apart",
                 notes=f"Each model at {args.fraction:g} x plain backprop's batch-32 peak, bench.budget's default "
                       f"data; {args.repeats} plans per version, alternated in one process. A candidate's ratio: "
                       "its samples/s over plain backprop's in the same plan; sd over the plans.",
                 extra={"plans": records})


if __name__ == "__main__":
    main()
