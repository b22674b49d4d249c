"""How well `edgeflux plan` predicts a run: the plan's samples/s against the samples/s of the run it plans.

For each project (a directory with params.yaml, data/prepared and models/pretrained, as `dvc repro` leaves them)
and each method below: the plan's row (edgeflux.plan: the batch measured under the budget, a few timed steps),
then one epoch of the run itself with the same options (train_bp's backprop, edgeflux.finetune), and the run's
training samples per second (its training set over its training wall time, evaluations excluded). The plan's
promise: within 15% of the run. Both in this process, one after the other, on the same data.

The machine's speed moves between the plan's few steps and the run's epoch, so one comparison is one draw: the
whole set is repeated (--repeats, default 3, the projects in turn) and each row is the mean over the repeats, with
the 95% interval of its mean |error| judged against 15% (bench.common.target: met only when the whole interval is).

    python -m bench.plan                                         # this repository's outputs (the default pipeline)
    python -m bench.plan --project realistic=/tmp/clone          # and a run of presets/realistic-128.yaml
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from bench.common import BenchResult, bench_argparser, over_seeds, target
from edgeflux.artifacts import load_model
from edgeflux.backprop import train_under_budget
from edgeflux.config import load_params
from edgeflux.data import load_prepared, tensors
from edgeflux.finetune import finetune
from edgeflux.models import build_model
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.plan import STEPS, plan_finetune, plan_training
from edgeflux.plan.core import ROUNDS, WARMUP, WINDOW_SAMPLES
from edgeflux.train import TrainRun
from edgeflux.tricks.options import backprop_options

NAME = "plan"
SCRATCH = ("backprop", "backprop-checkpoint", "backprop-fused_step")
FINETUNE = ("ft_all", "ft_bias", "mobiletl")
TOLERANCE = 0.15


def scratch_rows(workload: str, params, data, steps: int) -> list[dict]:
    p = params.train_bp.model_copy(update={"epochs": 1, "evals_per_epoch": 1})
    train = tensors(data, "target_train", limit=p.max_train_samples)
    spec = p.model.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
    rows = []
    for method in SCRATCH:
        model = build_model(**spec)
        planned = plan_training(model, train, p, candidates=(method,), steps=steps)[0]
        o = backprop_options(method, p)
        run = train_under_budget(model, train, train, train, o, TrainRun(context=o.bittrain.context, tricks=o.tricks),
                                 memory=o)
        rows.append(row(workload, "train_bp", method, planned, run.batch_size, len(train[1]) / run.train.train_time_s))
    return rows


def finetune_rows(workload: str, params, data, root: Path, steps: int) -> list[dict]:
    p = params.finetune.model_copy(update={"epochs": 1, "evals_per_epoch": 1})
    train = tensors(data, "target_train", limit=p.max_train_samples)
    source = root / "models/pretrained" / f"{p.model}.pt"
    rows = []
    for method in FINETUNE:
        planned = plan_finetune(load_model(source)[0], train, p, candidates=(method,), steps=steps)[0]
        run = finetune(load_model(source)[0], method, p, train, train, train)
        rows.append(row(workload, "finetune", method, planned, run.run.batch_size,
                        len(train[1]) / run.run.train.train_time_s))
    return rows


def row(workload: str, stage: str, method: str, planned, batch: int, measured: float) -> dict:
    error = planned.samples_per_s / measured - 1
    print(f"{workload} {stage} {method}: plan {planned.samples_per_s:.1f}/s at {planned.batch}, run {measured:.1f}/s "
          f"at {batch} ({error:+.1%})", flush=True)
    return {"workload": workload, "stage": stage, "method": planned.label, "plan_batch": planned.batch, "run_batch": batch,
            "plan_samples_per_s": round(planned.samples_per_s, 1), "run_samples_per_s": round(measured, 1),
            "error": round(error, 3), "abs_error": round(abs(error), 3), "within_15pct": abs(error) <= TOLERANCE}


def summarize(per_repeat: list[dict]) -> list[dict]:
    """One row per (workload, stage, method): means over the repeats, the mean |error|'s verdict against 15%, and
    how many single repeats were within it."""
    key = ("workload", "stage", "method")
    rows = over_seeds(per_repeat, key, ("plan_samples_per_s", "run_samples_per_s", "error", "abs_error"))
    for r in rows:
        same = [x for x in per_repeat if all(x[k] == r[k] for k in key)]
        r["within_15pct"] = sum(x["within_15pct"] for x in same)
        r["verdict"] = target("plan's |error|", TOLERANCE, [x["abs_error"] for x in same], at_most=True)["verdict"]
        del r["seeds"]
    return rows


def md_row(r: dict) -> dict:
    def ci(key: str, digits: int) -> str:
        half = r[f"{key}_ci95"]
        return f"{r[key]:.{digits}f}" + (f" ± {half:.{digits}f}" if half is not None else "")
    return {"workload": r["workload"], "stage": r["stage"], "method": r["method"], "plan_batch": r["plan_batch"],
            "run_batch": r["run_batch"], "plan samples/s": ci("plan_samples_per_s", 1),
            "run samples/s": ci("run_samples_per_s", 1), "error": ci("error", 3), "|error|": ci("abs_error", 3),
            "within 15%": f"{r['within_15pct']} of {r['n_seeds']}", "mean |error| <= 15%": r["verdict"]}


def plot(rows: list[dict], out: Path) -> None:
    """Each prediction against its run (every repeat's), the 15% band around equality."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 6))
    colours = {"train_bp": "#1f77b4", "finetune": "#ff7f0e"}
    speeds = [v for r in rows for v in (r["plan_samples_per_s"], r["run_samples_per_s"])]
    low, top = min(speeds) / 1.5, max(speeds) * 1.5
    ax.fill_between([low, top], [low * (1 - TOLERANCE), top * (1 - TOLERANCE)],
                    [low * (1 + TOLERANCE), top * (1 + TOLERANCE)], color="#dddddd", label="within 15%")
    ax.plot([low, top], [low, top], color="#888888", lw=1)
    for stage, colour in colours.items():
        pts = [r for r in rows if r["stage"] == stage]
        ax.scatter([r["run_samples_per_s"] for r in pts], [r["plan_samples_per_s"] for r in pts], color=colour,
                   edgecolor="black", s=60, label={"train_bp": "from scratch", "finetune": "fine-tuning"}[stage], zorder=3)
    ax.set(xlim=(low, top), ylim=(low, top), xscale="log", yscale="log", xlabel="the run's training samples/s",
           ylabel="the plan's predicted samples/s", title="edgeflux plan: predicted vs measured speed")
    ax.legend(loc="upper left")
    fig.tight_layout()
    _save(fig, out)


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--project", action="append", default=[], metavar="NAME=DIR",
                        help="a workload's project directory (repeatable); default: default=. (this repository)")
    parser.add_argument("--steps", type=int, default=None, help="the plan's timed steps per candidate and round (default: "
                                                                 "edgeflux.plan.STEPS)")
    parser.add_argument("--repeats", type=int, default=3, help="how many times the whole set of plans and runs is "
                        "measured (each row: the mean and 95%% interval over them)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.steps = args.steps or STEPS
    projects = [p.split("=", 1) for p in args.project] or [["default", "."]]
    per_repeat, here = [], Path.cwd()
    for repeat in range(args.repeats):
        for workload, root in projects:
            root = Path(root).resolve()
            os.chdir(root)   # the params' relative paths (data.root, weights) are the project's
            try:
                params, data = load_params(root / "params.yaml"), load_prepared(root / "data/prepared")
                rows = scratch_rows(workload, params, data, args.steps) + finetune_rows(workload, params, data, root,
                                                                                          args.steps)
            finally:
                os.chdir(here)
            per_repeat += [{**r, "seed": repeat} for r in rows]
    result = BenchResult()
    result.rows = summarize(per_repeat)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(per_repeat, args.out / f"{NAME}.png")
    met = sum(r["verdict"] == "met" for r in result.rows)
    within = sum(r["within_15pct"] for r in per_repeat)
    result.write(NAME, args.out, title="edgeflux plan: predicted samples/s against the run's",
                 md_rows=[md_row(r) for r in result.rows], extra={"n_seeds": args.repeats, "per_repeat": per_repeat},
                 notes=f"Mean over {args.repeats} repeat(s) ± the 95% interval's half-width. {met} of "
                       f"{len(result.rows)} rows: the mean |error|'s interval within 15% (met); {within} of "
                       f"{len(per_repeat)} single predictions within 15% of their run. The run: one epoch of the "
                       "stage's training set at the batch its own measurement chose (the plan's, unless noted), timed "
                       f"by the training loop without evaluations; the plan: the median of {ROUNDS} rounds, each at "
                       f"least {STEPS} steps and {WINDOW_SAMPLES} samples after {WARMUP} warm-up step(s), the "
                       "candidates in turn.")


if __name__ == "__main__":
    main()
