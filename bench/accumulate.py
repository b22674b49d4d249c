"""What gradient accumulation costs in accuracy: BatchNorm normalises each micro-batch by its own statistics.

The same training twice per seed: plain backprop at batch --effective (32), and gradient accumulation
(edgeflux.tricks, as train_bp's `backprop-accumulate` trains) over micro-batches of each --micro size adding up
to the same --effective samples per update. Same weights, same data order (each update sees the same samples),
same learning rate, same number of updates; only BatchNorm differs: in training it normalises each micro-batch by
that micro-batch's mean and variance, and its running statistics (what evaluation uses) are updated once per
micro-batch instead of once per update. Test accuracy on the whole test split after --epochs; per model and
micro-batch, the accuracy's mean and 95% interval over the seeds and the paired difference (micro-batch minus
plain, seed by seed) with its interval: the accumulation trick changes accuracy only where that interval
excludes zero.

    python -m bench.accumulate --device cuda                   # 3 models x 3 seeds (a few minutes on a GPU)
    python -m bench.accumulate --quick --out /tmp/acc         # CI-sized, on the CPU
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.budget import bp_options, default_splits, model_spec, workload_parser
from bench.common import METHOD_COLOURS, BenchResult, fmt_ci, mean_ci, read_parts, runs_notes
from edgeflux.models import build_model
from edgeflux.train import TrainRun, evaluate, fit

NAME = "accumulate"
EXPERIMENT = ("width", "effective", "epochs", "train_samples", "val_samples", "test_samples")   # runs that merge agree
EVAL_BATCH = 500


def parse_args(argv=None) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "vgg11 w0.125, 512 images, 1 epoch, 2 seeds")
    p.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16], help="micro-batch sizes accumulated")
    p.add_argument("--effective", type=int, default=32, help="samples per update (plain backprop's batch)")
    p.add_argument("--epochs", type=int, default=4, help="epochs of every run")
    p.add_argument("--device", default="cpu", help="where to train (cpu, cuda)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.width, args.train_samples, args.test_samples = ["vgg11"], 0.125, 512, 512
        args.epochs, args.seeds, args.micro = 1, [0, 1], [8]
    bad = [m for m in args.micro if m >= args.effective or args.effective % m]
    if bad:
        p.error(f"--micro {bad}: each micro-batch must divide --effective {args.effective} and be smaller, so that "
                f"every update sees {args.effective} samples")
    args.max_batch = args.effective   # what bench.budget's options read
    return args


def train_once(name: str, micro: int | None, seed: int, splits: dict, args) -> float:
    """Test accuracy after training from seed's weights: plain at args.effective (micro None) or accumulated."""
    spec = model_spec(name, args)
    opts = bp_options("backprop" if micro is None else "backprop-accumulate", spec, None, seed, args)
    opts = opts.model_copy(update={"tricks": opts.tricks.model_copy(update={"effective_batch": args.effective})})
    model = build_model(**spec, seed=seed)
    run = TrainRun(args.device, desc=f"{name} seed {seed} " + (f"micro {micro}" if micro else "plain"),
                   tricks=opts.tricks, eval_batch=EVAL_BATCH)
    fit(model, splits["train"], splits["val"], opts, micro or args.effective, run)
    return evaluate(model, *splits["test"], batch_size=EVAL_BATCH, device=args.device)


def model_rows(name: str, splits: dict, args) -> list[dict]:
    accs = {(m or args.effective): {seed: train_once(name, m, seed, splits, args) for seed in args.seeds}
            for m in [None, *args.micro]}
    return summarise(f"{name}-w{args.width:g}", accs, args.effective)


def summarise(model: str, accs: dict[int, dict[int, float]], effective: int) -> list[dict]:
    """Rows of one model from its test accuracies by (micro-)batch and seed (``effective``: plain backprop's):
    mean and 95% interval over seeds, and the difference from plain backprop paired by seed."""
    rows, plain = [], accs[effective]
    for m, by_seed in sorted(accs.items(), key=lambda kv: -kv[0]):
        seeds = sorted(by_seed)
        ci = mean_ci([by_seed[s] for s in seeds])
        diff = mean_ci([by_seed[s] - plain[s] for s in seeds]) if m != effective else None
        rows.append({"model": model, "micro_batch": m, "method": "accumulation" if m != effective else "backprop",
                     "updates_of": effective, "n_seeds": len(seeds), "seeds": seeds,
                     "test_accs": [by_seed[s] for s in seeds], "test_acc": ci["mean"], "test_acc_ci": ci,
                     "test_acc_ci95": _half(ci), "diff": diff["mean"] if diff else None, "diff_ci": diff,
                     "diff_ci95": _half(diff) if diff else None,
                     "changes_accuracy": bool(diff and diff["lo"] is not None and (diff["lo"] > 0 or diff["hi"] < 0))})
        print(f"  {model} {rows[-1]['method']} (micro-)batch {m}: {fmt_ci(ci)}"
              + (f", minus plain {fmt_ci(diff)}" if diff else ""), flush=True)
    return rows


def merged(rows: list[dict]) -> list[dict]:
    """The rows of runs over different models or seeds (--combine), summarised again over every seed."""
    accs: dict[tuple[str, int], dict[int, dict[int, float]]] = {}
    for r in rows:
        accs.setdefault((r["model"], r["updates_of"]), {}).setdefault(r["micro_batch"], {}).update(
            zip(r["seeds"], r["test_accs"]))
    return [row for (model, effective), by_micro in accs.items() for row in summarise(model, by_micro, effective)]


def _half(ci: dict) -> float | None:
    return None if ci["lo"] is None else (ci["hi"] - ci["lo"]) / 2


def plot(rows: list[dict], path: Path) -> None:
    """Per model: accuracy difference (accumulated minus plain, paired by seed) against the micro-batch."""
    from edgeflux.neuroflux.plots import _pyplot, _save
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models) + 1, 4.2), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        acc = [r for r in rows if r["model"] == model and r["diff"] is not None]
        x = range(len(acc))
        err = [[100 * (r["diff"] - (r["diff_ci"]["lo"] if r["diff_ci"]["lo"] is not None else r["diff"])) for r in acc],
               [100 * ((r["diff_ci"]["hi"] if r["diff_ci"]["hi"] is not None else r["diff"]) - r["diff"]) for r in acc]]
        ax.bar(x, [100 * r["diff"] for r in acc], 0.6, yerr=err, capsize=4, color=METHOD_COLOURS["accumulation"])
        ax.axhline(0, color=METHOD_COLOURS["backprop"], linewidth=1.5, label="plain backprop at the same updates")
        ax.set_xticks(list(x), [f"micro-batch {r['micro_batch']}\n({r['updates_of'] // r['micro_batch']} per update)"
                                for r in acc])
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy minus plain backprop's\n(points; mean over seeds, 95% CI)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    _save(fig, path)


def write(rows: list[dict], args, notes: str, settings, measured_by: dict | None = None) -> None:
    """The results; settings: the run's flags (a merge: each part's)."""
    result = BenchResult()
    result.rows = rows
    md = [{**r, "acc": fmt_ci(r["test_acc_ci"]), "vs": fmt_ci(r["diff_ci"]) if r["diff_ci"] else "-"} for r in rows]
    result.write(NAME, args.out, title="Gradient accumulation and BatchNorm: test accuracy at the same updates",
                 md_rows=md, columns={"model": "model", "method": "method", "micro_batch": "(micro-)batch",
                                      "updates_of": "samples per update", "acc": "test acc (mean, 95% CI)",
                                      "vs": "minus plain backprop (paired by seed)",
                                      "changes_accuracy": "interval excludes 0"},
                 notes=notes, measured_by=measured_by,
                 extra={"n_seeds": max(r["n_seeds"] for r in rows), "settings": settings})
    plot(rows, args.out / f"{NAME}.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.combine:
        parts, _, measured_by = read_parts(args.combine)
        differ = [k for k in EXPERIMENT if len({str(part["settings"].get(k)) for part in parts}) > 1]
        if differ:
            raise SystemExit(f"cannot merge runs of different experiments: {', '.join(differ)} differ between "
                             f"{', '.join(map(str, args.combine))}")
        rows = [{"seeds": part["settings"]["seeds"], **r} for part in parts for r in part["rows"]]
        notes = runs_notes(measured_by["runs"])
        return write(merged(rows), args, notes, [part["settings"] for part in parts], measured_by)
    if args.threads:
        torch.set_num_threads(args.threads)
    splits = default_splits(args)
    started = time.perf_counter()
    rows = [r for name in args.models for r in model_rows(name, splits, args)]
    write(rows, args, f"Fashion-MNIST at 32 px, {args.train_samples} training images (target split), "
          f"{len(splits['test'][1])} test images (the whole split unless --test-samples); {args.epochs} epoch(s); SGD "
          f"momentum 0.9, lr 0.05 at {args.effective} samples per update, cosine schedule; seeds {args.seeds}; device "
          f"{args.device}; bench time {time.perf_counter() - started:.0f} s. Accuracy does not depend on where it "
          f"trains beyond floating-point order (the paired difference is the measure).",
          {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "combine"})


if __name__ == "__main__":
    main()
