"""Measured peak memory of one training step vs batch size: VGG-16, ResNet-18, MobileNetV2.

One SGD-momentum training step in steady state (the momentum buffers exist), on 1x32x32
inputs with 10 classes (the Fashion-MNIST shape), narrow (width 0.25) and full width (1.0).
The peak is measured (the allocator's: CPU, the CPU allocator's events over the step; CUDA,
max_memory_allocated) and split into parameters, gradients, optimizer state, buffers and activations
(everything else: saved activations, temporaries, the batch), beside the bytes saved for backward
and, on CPU, the peak of live tensor bytes of the same step (what a tensor-level count sees: the
difference is scratch that kernels allocate and free inside one op). A least-squares
line over the batch sizes (an estimate, labelled so) shows what NeuroFlux builds on: memory is
linear in the batch size and, beyond small batches, activations dominate.

    python -m bench.memory_baseline            # full run, results in bench/results/
    python -m bench.memory_baseline --quick --out /tmp/bench
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import BenchResult, bench_argparser
from edgeflux.memory import (MiB, TrainStep, fit_linear, live_tensor_peak, measure_training_peak,
                             saved_bytes_by_node)
from edgeflux.models import build_model

NAME = "memory_baseline"
MODELS = ("vgg16", "resnet18", "mobilenet_v2")
SAMPLE_SHAPE, NUM_CLASSES = (1, 32, 32), 10
FULL = {"widths": (0.25, 1.0), "batches": (1, 8, 16, 32, 64)}
QUICK = {"widths": (0.25,), "batches": (1, 4, 8, 16)}


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="MODEL",
                        help=f"models to measure (default: all of {', '.join(MODELS)})")
    parser.add_argument("--widths", nargs="+", type=float, default=None, metavar="W",
                        help="channel width multipliers (default: 0.25 1.0; --quick: 0.25)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, metavar="B",
                        help="batch sizes (default: 1 8 16 32 64; --quick: 1 4 8 16)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where to measure: cuda uses the CUDA allocator's peak, cpu the CPU allocator's "
                             "peak; auto picks cuda when it is available (default: auto)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.widths = tuple(args.widths or preset["widths"])
    args.batches = tuple(sorted(set(args.batches or preset["batches"])))
    if len(args.batches) < 2 or args.batches[0] < 1:   # the per-sample line needs two points
        parser.error(f"--batches needs at least two different batch sizes, each >= 1; got {list(args.batches)}")
    if any(w <= 0 for w in args.widths):
        parser.error(f"--widths must be > 0, got {list(args.widths)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch finds no CUDA device here (torch.cuda.is_available() is False); "
                     "use --device cpu or auto")
    return args


def measure_all(args) -> list[dict]:
    configs = [(m, w) for m in args.models for w in args.widths]
    rows = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("measuring", total=len(configs) * len(args.batches))
        for name, width in configs:
            model = build_model(name, num_classes=NUM_CLASSES, in_channels=SAMPLE_SHAPE[0], width=width,
                                image_size=SAMPLE_SHAPE[1])
            for batch in args.batches:
                progress.update(task, description=f"{name} width {width:g} batch {batch}")
                gen = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, *SAMPLE_SHAPE, generator=gen)
                y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
                mem = measure_training_peak(model, sgd_momentum, SAMPLE_SHAPE, NUM_CLASSES, batch, device=args.device,
                                            data=(x, y))
                live = (live_tensor_peak(model, TrainStep.factory(sgd_momentum), (x, y), (x, y))
                        if args.device == "cpu" else None)
                rows.append({"model": name, "width": width, "batch": batch, **mem.to_dict(),
                             "live_tensor_peak_bytes": live})
                progress.advance(task)
    return rows


def saved_by_node(args) -> list[dict]:
    """Saved-for-backward bytes per autograd node type at the largest batch (edgeflux.memory.saved_bytes_by_node)."""
    out = []
    batch = max(args.batches)
    for name, width in [(m, w) for m in args.models for w in args.widths]:
        torch.manual_seed(0)
        model = build_model(name, num_classes=NUM_CLASSES, in_channels=SAMPLE_SHAPE[0], width=width,
                            image_size=SAMPLE_SHAPE[1]).to(args.device).train()
        x = torch.randn(batch, *SAMPLE_SHAPE, device=args.device)
        y = torch.randint(0, NUM_CLASSES, (batch,), device=args.device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        by = saved_bytes_by_node(loss, [*model.parameters(), *model.buffers()])
        out.append({"model": name, "width": width, "batch": batch, "total_bytes": sum(by.values()), "by_node": by})
    return out


def fits(rows: list[dict]) -> list[dict]:
    out = []
    for name, width in dict.fromkeys((r["model"], r["width"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["width"]) == (name, width)]
        batches = [r["batch"] for r in rs]
        slope, intercept, r2 = fit_linear(batches, [r["peak_bytes"] for r in rs])
        saved_slope, _, _ = fit_linear(batches, [r["saved_bytes"] for r in rs])
        top = rs[-1]
        out.append({"model": name, "width": width, "slope_bytes_per_sample": slope, "intercept_bytes": intercept,
                    "r2": r2, "saved_bytes_per_sample": saved_slope, "largest_batch": top["batch"],
                    "activation_share_at_largest_batch": top["activation_bytes"] / top["peak_bytes"]})
    return out


def plot(rows: list[dict], fitted: list[dict], path: Path) -> None:
    widths = list(dict.fromkeys(r["width"] for r in rows))
    fig, axes = plt.subplots(1, len(widths) + 1, figsize=(5 * len(widths) + 7, 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": [5] * len(widths) + [7]})
    for ax, width in zip(axes[0], widths):
        for f in (f for f in fitted if f["width"] == width):
            rs = [r for r in rows if (r["model"], r["width"]) == (f["model"], width)]
            b = [r["batch"] for r in rs]
            line, = ax.plot(b, [r["peak_bytes"] / MiB for r in rs], "o-", label=f"{f['model']} (measured)")
            ax.plot(b, [(f["slope_bytes_per_sample"] * x + f["intercept_bytes"]) / MiB for x in b], ":",
                    color=line.get_color(), label=f"linear fit, R²={f['r2']:.4f}")
        ax.set(title=f"peak training-step memory, width {width:g}", xlabel="batch size", ylabel="MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    # Stacked split at the largest batch of each model/width.
    ax = axes[0][-1]
    tops = [max((r for r in rows if (r["model"], r["width"]) == (f["model"], f["width"])), key=lambda r: r["batch"])
            for f in fitted]
    labels = [f"{r['model']}\nwidth {r['width']:g}\nbatch {r['batch']}" for r in tops]
    bottom = [0.0] * len(tops)
    for key, label in (("param_bytes", "parameters"), ("grad_bytes", "gradients"),
                       ("optimizer_bytes", "optimizer state"), ("buffer_bytes", "buffers"),
                       ("activation_bytes", "activations + temporaries + batch")):
        vals = [r[key] / MiB for r in tops]
        ax.bar(labels, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title="split of the peak at the largest batch", ylabel="MiB")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = measure_all(args)
    fitted = fits(rows)
    by_node = saved_by_node(args)

    result = BenchResult()
    for r in rows:
        result.add(**r)
    mib = lambda n: f"{n / MiB:.2f}"  # noqa: E731
    md_rows = [{"model": r["model"], "width": f"{r['width']:g}", "batch": r["batch"], "peak": mib(r["peak_bytes"]),
                "params": mib(r["param_bytes"]), "grads": mib(r["grad_bytes"]), "opt": mib(r["optimizer_bytes"]),
                "buffers": mib(r["buffer_bytes"]), "acts": mib(r["activation_bytes"]), "saved": mib(r["saved_bytes"]),
                "act_share": f"{100 * r['activation_bytes'] / r['peak_bytes']:.1f}%",
                "live": mib(r["live_tensor_peak_bytes"]) if r["live_tensor_peak_bytes"] else "n/a",
                "scratch": f"{100 * (r['peak_bytes'] / r['live_tensor_peak_bytes'] - 1):+.2f}%"
                if r["live_tensor_peak_bytes"] else "n/a",
                "rss": mib(r["rss_peak_bytes"]) if r["rss_peak_bytes"] else "n/a"} for r in rows]
    result.add_section("Linear fit per model: peak = slope × batch + intercept (estimate over the measured points)", [
        {"model": f["model"], "width": f"{f['width']:g}", "slope": f"{f['slope_bytes_per_sample'] / 1024:.1f}",
         "saved": f"{f['saved_bytes_per_sample'] / 1024:.1f}", "intercept": mib(f["intercept_bytes"]),
         "r2": f"{f['r2']:.6f}", "share": f"{100 * f['activation_share_at_largest_batch']:.1f}%"} for f in fitted],
        {"model": "model", "width": "width", "slope": "slope KiB/sample", "saved": "saved-for-backward KiB/sample",
         "intercept": "intercept MiB", "r2": "R²", "share": "activation share of peak at largest batch"})

    result.add_section(f"Saved-for-backward bytes by autograd node at batch {max(args.batches)} (the four largest)", [
        {"model": r["model"], "width": f"{r['width']:g}", "node": node, "saved": mib(n),
         "share": f"{100 * n / r['total_bytes']:.1f}%"} for r in by_node for node, n in list(r["by_node"].items())[:4]],
        {"model": "model", "width": "width", "node": "autograd node", "saved": "saved MiB",
         "share": "share of saved bytes"})

    method = "CUDA allocator peak (torch.cuda.max_memory_allocated)" if args.device == "cuda" else \
        "the CPU allocator's peak over the plain step (edgeflux.memory: the allocator's events through torch.profiler)"
    notes = f"""All sizes in MiB (2^20 bytes). Peak: {method}, one SGD-momentum (0.9) training step in steady state
(after one warm-up step), random inputs of shape [batch, {', '.join(map(str, SAMPLE_SHAPE))}], {NUM_CLASSES} classes.
params/grads/opt/buffers: bytes of those tensors alive at the moment of the peak (gradients can be partial when the
peak falls inside backward); acts = peak − params − grads − opt − buffers (saved activations, temporaries, the batch).
saved: bytes saved for backward (deduplicated by storage, parameters and buffers excluded). live: the exact peak of
live tensor bytes over the same step (edgeflux.memory.track_live_tensors, CPU only); peak vs live: how far the
allocator's peak is above it (scratch that kernels allocate and free inside one op, e.g. convolution_backward). By autograd node: the same
bytes read from the graph of one forward (edgeflux.memory.saved_bytes_by_node; a tensor several nodes save counts
once, for the node nearest the loss); HardtanhBackward0 holds the input copies MobileNetV2's in-place ReLU6 saves.
rss: process peak RSS during the step (1 ms sampling), a cross-check of the whole process (interpreter, libraries,
allocator caches), not the exact figure. Plot: {NAME}.png."""
    columns = {"model": "model", "width": "width", "batch": "batch", "peak": "peak", "params": "params",
               "grads": "grads", "opt": "opt", "buffers": "buffers", "acts": "acts", "saved": "saved",
               "act_share": "acts/peak", "live": "live tensors", "scratch": "peak vs live",
               "rss": "rss (cross-check)"}
    settings = {"device": args.device, "models": args.models, "widths": args.widths, "batches": args.batches,
                "optimizer": "SGD(lr=0.01, momentum=0.9)", "sample_shape": SAMPLE_SHAPE, "num_classes": NUM_CLASSES}
    json_path, md_path = result.write(NAME, args.out, title="Measured peak training memory vs batch size",
                                      columns=columns, notes=notes, md_rows=md_rows,
                                      extra={"settings": settings, "fits": fitted, "saved_by_node": by_node})
    plot(rows, fitted, Path(args.out) / f"{NAME}.png")
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {Path(args.out) / f'{NAME}.png'}")


if __name__ == "__main__":
    main()
