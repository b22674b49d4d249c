"""Training throughput vs batch size: what a larger batch buys on this machine.

NeuroFlux's speed-up over backprop at equal memory (the paper: 2.3-6.1x on Jetson GPUs) comes
mostly from batch size: a block trains at a far larger batch than the whole network can, and a
GPU turns a larger batch into more samples per second. This benchmark measures that lever here:
samples per second of one full training step (forward, backward, SGD-momentum update) of the
NeuroFlux benchmark's models (1x32x32 inputs, 10 classes), at batch sizes from 1 to 256.

Each batch size is timed for about --samples images per measurement; measurements are
interleaved over --rounds rounds (drifts hit every batch size alike) and the fastest round is
kept. The backprop batch sizes of bench/results/neuroflux.json (when it exists) are timed too, and
a second table gives, for each, the most any batch size could speed backprop up on this machine
(best measured throughput / throughput at backprop's batch): a ceiling on the part of the
paper's speed-up that comes from batch size. It is read from the whole network's curve; a
NeuroFlux block (a slice of the network with its auxiliary heads) has a curve of its own.

    python -m bench.batch_throughput --threads 1         # as bench/neuroflux.py's runs (one per core)
    python -m bench.batch_throughput --quick --out /tmp/bench
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import RESULTS_DIR, BenchResult, bench_argparser
from edgeflux.memory import training_step_fn
from edgeflux.models import build_model

NAME = "batch_throughput"
SAMPLE_SHAPE, NUM_CLASSES = (1, 32, 32), 10
FULL = {"models": ("vgg16", "vgg19", "resnet18"), "width": 0.25, "batches": (1, 2, 4, 8, 16, 32, 64, 128, 256),
        "samples": 512, "rounds": 5}
QUICK = {"models": ("vgg11",), "width": 0.125, "batches": (1, 4, 16), "samples": 32, "rounds": 2}


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                        help="zoo models (default: vgg16 vgg19 resnet18; --quick: vgg11)")
    parser.add_argument("--width", type=float, default=None, help="width multiplier (default: 0.25; --quick: 0.125)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, metavar="B",
                        help="batch sizes (default: 1 2 4 ... 256; --quick: 1 4 16), plus the backprop batches of "
                             "--neuroflux-json")
    parser.add_argument("--samples", type=int, default=None,
                        help="images per measurement: steps = max(3, samples // batch) (default: 512; --quick: 32)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds over all batch sizes; the fastest is kept (default: 5; --quick: 2)")
    parser.add_argument("--neuroflux-json", type=Path, default=RESULTS_DIR / "neuroflux.json",
                        help="NeuroFlux benchmark result whose backprop batch sizes get a throughput ceiling "
                             "(skipped when the file does not exist)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where to time (each step ends in loss.item(), so a CUDA step is timed to its end)")
    parser.add_argument("--name", default=NAME, help="result file name: <out>/<name>.{json,md,png}")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.models = tuple(args.models or preset["models"])
    args.width = args.width or preset["width"]
    args.batches = tuple(sorted(set(args.batches or preset["batches"])))
    args.samples = args.samples or preset["samples"]
    args.rounds = args.rounds or preset["rounds"]
    if args.batches[0] < 1 or args.samples < 1 or args.rounds < 1:
        parser.error("--batches, --samples and --rounds must be >= 1")
    return args


def time_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               steps: int) -> float:
    """Seconds per training step (edgeflux.memory.training_step_fn), averaged over `steps` after a warm-up step."""
    step = training_step_fn(model, optimizer, x, y)
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def backprop_runs(neuroflux_json: Path) -> list[dict]:
    """The feasible backprop rows of a NeuroFlux benchmark result ([] when there is no such file)."""
    if not neuroflux_json.exists():
        return []
    result = json.loads(neuroflux_json.read_text())
    speedups = {(s["model"], s["budget_bytes"]): s.get("speedup_vs_backprop") for s in result["speedups"]}
    return [{**r, "neuroflux_speedup_vs_backprop": speedups.get((r["model"], r["budget_bytes"]))}
            for r in result["rows"] if r["method"] == "backprop" and r["feasible"]]


def measure(args, runs: list[dict]) -> list[dict]:
    """Rows per model and batch size: args.batches plus the batch of every backprop run of that model."""
    plan = {name: sorted({*args.batches,
                          *(r["batch_sizes"][0] for r in runs if r["model"] == f"{name}-w{args.width:g}")})
            for name in args.models}
    rows = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("timing", total=args.rounds * sum(map(len, plan.values())))
        for name, batches in plan.items():
            torch.manual_seed(0)
            model = build_model(name, num_classes=NUM_CLASSES, in_channels=SAMPLE_SHAPE[0], width=args.width,
                                image_size=SAMPLE_SHAPE[1]).to(args.device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
            seconds = {b: [] for b in batches}
            for r in range(args.rounds):
                for batch in batches:
                    progress.update(task, description=f"{name} round {r + 1}/{args.rounds} batch {batch}")
                    x = torch.randn(batch, *SAMPLE_SHAPE, device=args.device)
                    y = torch.randint(0, NUM_CLASSES, (batch,), device=args.device)
                    seconds[batch].append(time_steps(model, optimizer, x, y, max(3, args.samples // batch)))
                    progress.advance(task)
            best = max(batch / min(s) for batch, s in seconds.items())
            for batch, s in seconds.items():
                rows.append({"model": f"{name}-w{args.width:g}", "batch": batch, "step_ms": 1e3 * min(s),
                             "step_ms_median": 1e3 * sorted(s)[len(s) // 2], "samples_per_s": batch / min(s),
                             "share_of_best": batch / min(s) / best})
    return rows


def ceilings(rows: list[dict], runs: list[dict]) -> list[dict]:
    """For each backprop run of the NeuroFlux benchmark: the most a larger batch could speed it up here."""
    out = []
    for r in runs:
        at = next((m for m in rows if m["model"] == r["model"] and m["batch"] == r["batch_sizes"][0]), None)
        if at is None:   # a model this run did not time
            continue
        out.append({"model": r["model"], "budget_bytes": r["budget_bytes"], "backprop_batch": at["batch"],
                    "samples_per_s": at["samples_per_s"], "ceiling_speedup": 1 / at["share_of_best"],
                    "neuroflux_speedup_vs_backprop": r["neuroflux_speedup_vs_backprop"]})
    return out


def plot(rows: list[dict], path: Path, ticks: tuple[int, ...], device: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        ax.plot([r["batch"] for r in rs], [r["samples_per_s"] for r in rs], "o-", label=model)
    ax.set(xscale="log", xlabel="batch size", ylabel="training samples / s (fastest round)",
           title=f"training throughput vs batch size ({device})")
    ax.set_xticks(ticks)   # the requested batches: backprop's own fall between them and would crowd the axis
    ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = backprop_runs(args.neuroflux_json)
    rows = measure(args, runs)
    result = BenchResult()
    for r in rows:
        result.add(**r)
    limits = ceilings(rows, runs)
    if limits:
        result.add_section(f"The most batch size could speed up the backprop runs of {args.neuroflux_json.name} here", [
            {**c, "ceiling_speedup": f"x{c['ceiling_speedup']:.2f}",
             "neuroflux_speedup_vs_backprop": f"x{c['neuroflux_speedup_vs_backprop']:.2f}"
             if c["neuroflux_speedup_vs_backprop"] else "n/a"} for c in limits],
            {"model": "model", "budget_bytes": "budget bytes", "backprop_batch": "backprop batch",
             "samples_per_s": "its samples/s",
             "ceiling_speedup": "best samples/s / its samples/s",
             "neuroflux_speedup_vs_backprop": "NeuroFlux speed-up to target (that file)"})
    md_rows = [{**r, "step_ms": f"{r['step_ms']:.2f}", "step_ms_median": f"{r['step_ms_median']:.2f}",
                "samples_per_s": f"{r['samples_per_s']:.0f}", "share_of_best": f"{100 * r['share_of_best']:.0f}%"}
               for r in rows]
    notes = (f"One training step = forward, cross-entropy, backward, SGD(momentum 0.9, weight decay 5e-4) update, on "
             f"random inputs of shape [batch, {', '.join(map(str, SAMPLE_SHAPE))}] on {args.device}; torch threads "
             f"{torch.get_num_threads()}. Step time: the fastest of {args.rounds} interleaved rounds, each the mean "
             f"of max(3, {args.samples} // batch) steps after a warm-up step (the median round is in the JSON). "
             f"Share of best: samples/s over the model's best samples/s in this run. Plot: {args.name}.png.")
    settings = {"models": args.models, "width": args.width, "batches": args.batches, "samples": args.samples,
                "rounds": args.rounds, "threads": torch.get_num_threads(), "device": args.device}
    json_path, md_path = result.write(args.name, args.out, title="Training throughput vs batch size", notes=notes,
                                      md_rows=md_rows,
                                      columns={"model": "model", "batch": "batch", "step_ms": "ms/step",
                                               "step_ms_median": "ms/step (median round)",
                                               "samples_per_s": "samples/s", "share_of_best": "share of best"},
                                      extra={"settings": settings, "ceilings": limits})
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    plot(rows, Path(args.out) / f"{args.name}.png", args.batches, device)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {Path(args.out) / f'{args.name}.png'}")


if __name__ == "__main__":
    main()
