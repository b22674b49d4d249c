"""What the memory tricks and lean frozen layers save, measured (edgeflux.tricks).

(a) lean frozen layers: for every fine-tuning method, the measured peak and saved bytes of one steady-state
    training step of the method's prepared model, and its median step time, with torch's layers
    (``finetune.lean_layers: false``) and with lean ones (the default), at the papers' batch 8 and at the
    workload's. The TinyTL relation the lean layers restore: FT-Bias at or below MobileTL. ElasticTrainer is
    left out: its batch is measured with every tensor training (ft_all's step).
(b) the tricks, training from scratch: plain backprop, accumulation (micro-batches of half the batch adding up
    to it), checkpointing, the step in backward, and checkpointing with the step in backward: the measured
    peak at the batch and at batch 1, the gradients and activations alive at that peak, and the median step
    time over the same samples (per sample, as a ratio to plain backprop's, timed in this run).

Two workloads: ``default`` (the pipeline's: 1x32x32, MobileNetV2 w0.5 fine-tuned at batch 128, VGG-16 w0.25
from scratch at 128) and ``realistic`` (presets/realistic-128.yaml's tensors: 3x128x128, torchvision's
MobileNetV2 fine-tuned at 32, ResNet-18 from scratch at 32). Inputs are random: no step here stores by
content (no BitTrain), so the bytes are the data's whatever its pixels. Adam for fine-tuning, SGD with
momentum from scratch, as the pipeline.

    python -m bench.tricks                 # both workloads, ~2 min on 2 cores
    python -m bench.tricks --quick --out /tmp/bench
"""
from __future__ import annotations

import copy

import torch

from bench.common import METHOD_COLOURS, BenchResult, bench_argparser
from bench.mobiletl import median_step_time
from edgeflux.finetune import FinetuneOptions, prepare
from edgeflux.memory import measure_training_step
from edgeflux.models import build_model
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.step import TrainStep, Tricks
from edgeflux.train import TrainOptions, optimizer_factory
from edgeflux.tricks import Accumulation, TrickOptions

NAME, MIB = "tricks", 2**20
METHODS = ("ft_all", "ft_last", "ft_bn", "ft_bn_bias", "ft_bias", "ft_blocks", "mobiletl")
LABELS = {"ft_all": "FT-All", "ft_last": "FT-Last", "ft_bn": "FT-BN", "ft_bn_bias": "FT-BN+Bias",
          "ft_bias": "FT-Bias", "ft_blocks": "FT-Blocks", "mobiletl": "MobileTL"}
WORKLOADS = {   # (fine-tuned model, from-scratch model, channels, size, batch)
    "default": (dict(name="mobilenet_v2", width=0.5), dict(name="vgg16", width=0.25), 1, 32, 128),
    "realistic": (dict(name="mobilenet_v2", arch="torchvision"), dict(name="resnet18", arch="torchvision"), 3, 128, 32),
}
PAPER_BATCH = 8   # MobileTL's and TinyTL's fine-tuning batch
TRICKS = {"plain backprop": {}, "accumulation": {"accumulate": True}, "checkpointing": {"checkpoint": True},
          "step in backward": {"fused_step": True},
          "checkpointing + step in backward": {"checkpoint": True, "fused_step": True}}


def batch(channels: int, size: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def lean_rows(workload: str, steps: int) -> list[dict]:
    spec, _, channels, size, n = WORKLOADS[workload]
    model = build_model(**spec, num_classes=10, in_channels=channels, image_size=size, seed=0)
    return [row for b in (PAPER_BATCH, n) for row in lean_rows_at(workload, model, b, steps)]


def lean_rows_at(workload: str, model, n: int, steps: int) -> list[dict]:
    _, _, channels, size, _ = WORKLOADS[workload]
    x, y = batch(channels, size, n)
    opts = TrainOptions(optimizer="adam", lr=1e-3)
    rows = []
    for method in METHODS:
        row = {"workload": workload, "method": LABELS[method], "batch": n}
        for lean in (False, True):
            net = prepare(method, copy.deepcopy(model), FinetuneOptions(lean_layers=lean),
                          [batch(channels, size, 32)[0]]).model
            make_step = TrainStep.factory(optimizer_factory(opts))
            step = measure_training_step(net, make_step, (x, y), (x, y), process_stats=False)
            key = "lean" if lean else "torch"
            row[f"peak_{key}_mib"], row[f"saved_{key}_mib"] = step.peak_bytes / MIB, step.saved_bytes / MIB
            row[f"step_{key}_ms"] = 1000 * median_step_time(net, make_step, x, y, 1, steps)
        row["peak_saving"] = 1 - row["peak_lean_mib"] / row["peak_torch_mib"]
        row["time_ratio"] = row["step_lean_ms"] / row["step_torch_ms"]
        rows.append(row)
        print(f"{workload} {row['method']} at {n}: {row['peak_torch_mib']:.1f} -> {row['peak_lean_mib']:.1f} MiB",
              flush=True)
    return rows


def trick_rows(workload: str, steps: int) -> list[dict]:
    _, spec, channels, size, n = WORKLOADS[workload]
    model = build_model(**spec, num_classes=10, in_channels=channels, image_size=size, seed=0)
    opts = TrainOptions(optimizer="sgd", lr=0.05)
    rows, base = [], None
    for label, on in TRICKS.items():
        options = TrickOptions(**on, effective_batch=n)
        row = {"workload": workload, "method": label, "batch": n}
        for b in (n, 1):
            micro = b // 2 if options.accumulate and b > 1 else b    # accumulation: two micro-batches
            x, y = batch(channels, size, micro)
            tricks = Tricks(options, Accumulation.measuring(micro, b) if options.accumulate else None)
            make = TrainStep.factory(optimizer_factory(opts), tricks=tricks)
            m = measure_training_step(model, make, (x, y), (x, y), process_stats=False)
            if b == n:
                row.update(peak_mib=m.peak_bytes / MIB, grad_mib=m.grad_bytes / MIB,
                           activation_mib=m.activation_bytes / MIB)
                timed = Tricks(options, Accumulation.for_epoch(n, micro, n) if options.accumulate else None)
                per_step = sum(median_step_time(model, TrainStep.factory(optimizer_factory(opts), tricks=timed), x, y,
                                                1, steps)
                               for _ in range(n // micro))
                row["step_s"] = per_step
            else:
                row["peak_batch1_mib"] = m.peak_bytes / MIB
        base = base or row["step_s"]
        row["time_ratio"] = row["step_s"] / base
        rows.append(row)
        print(f"{workload} {label}: {row['peak_mib']:.1f} MiB at {n}, {row['peak_batch1_mib']:.2f} at 1, "
              f"x{row['time_ratio']:.2f} time", flush=True)
    return rows


def plot(lean: list[dict], tricks: list[dict], out) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(3, 2, figsize=(13, 12.5))
    for col, workload in enumerate(WORKLOADS):
        for row, n in enumerate((PAPER_BATCH, WORKLOADS[workload][4])):
            rows = [r for r in lean if r["workload"] == workload and r["batch"] == n]
            ax = axes[row][col]
            if not rows:
                ax.set_visible(False)
                continue
            xs = range(len(rows))
            ax.bar([i - 0.2 for i in xs], [r["peak_torch_mib"] for r in rows], 0.4, color="#9e9e9e")
            ax.bar([i + 0.2 for i in xs], [r["peak_lean_mib"] for r in rows], 0.4, color="#1f77b4")
            ax.set_xticks(list(xs), [r["method"] for r in rows], rotation=25, ha="right")
            ax.set_ylabel("measured step peak (MiB)")
            ax.set_title(f"fine-tuning, {workload} workload, batch {n}")
        rows = [r for r in tricks if r["workload"] == workload]
        ax = axes[2][col]
        if not rows:
            ax.set_visible(False)
            continue
        for r in rows:
            ax.scatter(r["time_ratio"], r["peak_mib"], s=80, color=METHOD_COLOURS[r["method"]], label=r["method"],
                       edgecolor="black")
        ax.set_xlabel("step time per sample, relative to plain backprop")
        ax.set_ylabel(f"measured step peak at batch {rows[0]['batch']} (MiB)")
        ax.set_ylim(0, max(r["peak_mib"] for r in rows) * 1.1)
        ax.set_title(f"from scratch, {workload} workload")
        ax.legend(loc="lower right", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#9e9e9e", "#1f77b4")]
    fig.legend(handles, ["torch's layers", "lean layers (finetune.lean_layers, the default)"], loc="upper center",
               ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save(fig, out)


def relation_line(rows: list[dict], workload: str, n: int) -> str:
    """TinyTL's relation (FT-Bias at or below MobileTL) at one workload and batch, as measured."""
    m = {r["method"]: r for r in rows if r["workload"] == workload and r["batch"] == n}
    bias, mobiletl = m["FT-Bias"]["peak_lean_mib"], m["MobileTL"]["peak_lean_mib"]
    return (f"{workload} at batch {n}: FT-Bias {bias:.1f} MiB vs MobileTL {mobiletl:.1f} MiB "
            f"({'holds' if bias <= mobiletl else 'does not hold'}; torch's layers: FT-Bias "
            f"{m['FT-Bias']['peak_torch_mib']:.1f} MiB)")


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=9, help="timed steps per trick (the median is kept)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = ["default"] if args.quick else args.workloads
    lean = [r for w in workloads for r in lean_rows(w, 2 if args.quick else args.steps)]
    tricks = [r for w in workloads for r in trick_rows(w, 2 if args.quick else args.steps)]
    result = BenchResult()
    for r in lean:
        result.add(**r)
    result.add_section("The tricks, from scratch: measured peak at the batch and at batch 1, time per step", tricks,
                       ["workload", "method", "batch", "peak_mib", "grad_mib", "activation_mib", "peak_batch1_mib",
                        "step_s", "time_ratio"])
    relation = "; ".join(relation_line(lean, w, b) for w, b in dict.fromkeys((r["workload"], r["batch"]) for r in lean))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(lean, tricks, args.out / f"{NAME}.png")
    result.write(NAME, args.out, title="Lean frozen layers and the memory tricks: measured step peaks",
                 columns=["workload", "method", "batch", "peak_torch_mib", "peak_lean_mib", "peak_saving",
                          "saved_torch_mib", "saved_lean_mib", "step_torch_ms", "step_lean_ms", "time_ratio"],
                 notes=f"The TinyTL relation with lean layers, {relation}. Accumulation's row: two micro-batches "
                       "of half the batch, measured where the second closes the group (the first's gradients "
                       "held); its time is both micro-batches'. Times: medians of this run on this machine.")


if __name__ == "__main__":
    main()
