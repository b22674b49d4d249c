"""BitTrain, measured: the paper's Table 1 and whole training steps on Fashion-MNIST.

(a) Table 1: ResNet convolution activation sizes at batch 16 (3x224x224, 7x112x112 as printed
    in the paper, 64x56x56, 128x28x28, 256x14x14, 512x7x7) at 0/25/50/75/100% non-zeros: dense
    bytes, the paper's theoretical bitmap bytes, achieved bytes (BitmapTensor.nbytes, and the live
    tensor bytes the compressed tensor holds, measured with edgeflux.memory's tracker), improvement,
    compress/decompress throughput (median of several runs) and the machine's memory-copy
    bandwidth (torch clone of a 64 MiB tensor) measured in the same run.
(b) Whole SGD-momentum training steps of VGG-16 (without and with BN), ResNet-18 and MobileNetV2
    on real Fashion-MNIST images: measured peak step memory (edgeflux.memory.measure_training_peak,
    steady state) and saved-activation bytes (dense / stored / theoretical, BitTrain's accounting)
    for dense, bitmap, bitmap + pruning (0.01, 0.05, 0.1), bitmap + fp16 storage and bitmap +
    double_mask (BN models); step-time ratio vs dense from interleaved repetitions in one run;
    test accuracy after a short training per setting on the whole test split. Every training figure is
    the mean over seeds (--seeds, default three: the model's init, the measured batch, the batch order)
    with its 95% interval (Student's t); a target is met only when its interval is (bench.common.target).

    python -m bench.bittrain                      # full run, results in bench/results/
    python -m bench.bittrain --quick --out /tmp/bench
"""
from __future__ import annotations

import copy
import gc
import hashlib
import math
import resource
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import TARGET_COLUMNS, BenchResult, add_seeds, bench_argparser, over_seeds, pm, seeds_of, target
from edgeflux.bittrain import BitTrainOptions, compress, kernel
from edgeflux.data import batches, load_raw, prepare, tensors
from edgeflux.memory import MiB, measure_training_peak, retain_freed_heap, track_live_tensors
from edgeflux.models import build_model
from edgeflux.report import BarPanel, plot_bar_panels

NAME = "bittrain"
TABLE1_SHAPES = ((3, 224, 224), (7, 112, 112), (64, 56, 56), (128, 28, 28), (256, 14, 14), (512, 7, 7))
DENSITIES = (0.0, 0.25, 0.5, 0.75, 1.0)
MODELS = {"vgg16_nobn": ("vgg16", {"batch_norm": False}), "vgg16_bn": ("vgg16", {}),
          "resnet18": ("resnet18", {}), "mobilenet_v2": ("mobilenet_v2", {})}


class TorchOpsPath:
    """A compressed_activations context run on bitmap.py's torch-op path instead of the C++ kernel."""

    def __init__(self, inner) -> None:
        self.inner, self._off = inner, kernel.disabled()

    def __enter__(self):
        self._off.__enter__()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._off.__exit__(*exc)

    def summary(self):
        return self.inner.summary()


def _same(t):
    return t


@dataclass
class Variant:
    opts: BitTrainOptions
    torch_ops: bool = False      # the torch-op path (what BitTrain ran before the C++ kernel)
    hooks_only: bool = False     # saved-tensor hooks that change nothing: the price of the hook mechanism itself

    def context(self, model):
        if self.hooks_only:
            return torch.autograd.graph.saved_tensors_hooks(_same, _same)
        ctx = self.opts.context(model)
        return TorchOpsPath(ctx) if self.torch_ops else ctx


VARIANTS = {
    "dense": Variant(BitTrainOptions(enabled=False)),
    "hooks only": Variant(BitTrainOptions(enabled=False), hooks_only=True),
    "bitmap": Variant(BitTrainOptions(enabled=True)),
    "bitmap, torch ops": Variant(BitTrainOptions(enabled=True), torch_ops=True),
    "bitmap, int64 indices": Variant(BitTrainOptions(enabled=True, narrow_indices=False)),
    "prune 0.01": Variant(BitTrainOptions(enabled=True, threshold=0.01)),
    "prune 0.05": Variant(BitTrainOptions(enabled=True, threshold=0.05)),
    "prune 0.1": Variant(BitTrainOptions(enabled=True, threshold=0.1)),
    "fp16": Variant(BitTrainOptions(enabled=True, store_dtype="float16")),
    "double_mask": Variant(BitTrainOptions(enabled=True, double_mask=True)),
}
SAMPLE_SHAPE, NUM_CLASSES = (1, 32, 32), 10
# "extra": (model, width, batch) rows with dense / bitmap / prune 0.1 / prune 0.05 only
FULL = {"table1_batch": 16, "runs": 5, "batch": 32, "reps": 11, "widths": (0.25,),
        "extra": (("vgg16_nobn", 0.25, 128), ("vgg16_nobn", 0.25, 256), ("vgg16_nobn", 1.0, 32),
                  ("resnet18", 1.0, 32), ("mobilenet_v2", 1.0, 32)),
        "acc_steps": 600, "acc_grid": (("vgg16_nobn", ("dense", "bitmap", "prune 0.01", "prune 0.05", "prune 0.1",
                                                       "fp16")),
                                       ("resnet18", ("dense", "prune 0.05", "double_mask"))), "test": None}
QUICK = {"table1_batch": 2, "runs": 3, "batch": 16, "reps": 2, "widths": (0.25,), "extra": (),
         "acc_steps": 15, "acc_grid": (("vgg16_nobn", ("dense", "bitmap", "prune 0.1")),), "test": 500}


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4)


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ----------------------------------------------------------------------------- (a) Table 1

def copy_bandwidth(runs: int) -> dict[str, float]:
    """GB/s (tensor bytes per second) of torch clone (allocates, like compress) and copy_ into a buffer."""
    src = torch.rand(16 * MiB)                       # 64 MiB of fp32
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    return {"clone_gbps": nbytes / median_time(lambda: src.clone(), runs) / 1e9,
            "copy_gbps": nbytes / median_time(lambda: dst.copy_(src), runs) / 1e9}


def activation(batch: int, shape: tuple[int, ...], density: float, gen: torch.Generator) -> torch.Tensor:
    """A ReLU-like activation with exactly round(density * n) non-zeros at random positions."""
    n = batch * math.prod(shape)
    t = torch.zeros(n)
    k = round(density * n)
    if k:
        t[torch.randperm(n, generator=gen)[:k]] = torch.rand(k, generator=gen) + 0.01
    return t.view(batch, *shape)


def table1(batch: int, runs: int, bandwidth: dict, progress: Progress) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    task = progress.add_task("Table 1", total=len(TABLE1_SHAPES) * len(DENSITIES))
    for shape in TABLE1_SHAPES:
        for density in DENSITIES:
            progress.update(task, description=f"Table 1 {batch}x{'x'.join(map(str, shape))} {density:.0%}")
            t = activation(batch, shape, density, gen)
            n, dense = t.numel(), t.numel() * 4
            gc.collect()
            with track_live_tensors(seed=[t]) as tracker:
                before = tracker.current_bytes
                packed = compress(t)
                measured = tracker.current_bytes - before      # live bytes the compressed tensor holds
            assert torch.equal(packed.decompress(), t)
            theoretical = packed.theoretical_bytes()
            t_c = median_time(partial(compress, t), runs)
            t_d = median_time(packed.decompress, runs)
            with kernel.disabled():                           # the same on the torch-op path
                t_c_ops = median_time(partial(compress, t), runs)
                t_d_ops = median_time(packed.decompress, runs)
            rows.append({
                "case": f"table1 {batch}x{'x'.join(map(str, shape))} {density:.0%} non-zero",
                "part": "table1", "batch": batch, "shape": list(shape), "numel": n, "nonzero": density,
                "dense_bytes": dense, "theoretical_bytes": theoretical, "achieved_bytes": packed.nbytes,
                "measured_live_bytes": measured, "peak_bytes": None, "step_time_ratio": None,
                "achieved_vs_theoretical": packed.nbytes / theoretical - 1,
                "improvement_theoretical": 1 - theoretical / dense, "improvement_achieved": 1 - measured / dense,
                "compress_gbps": dense / t_c / 1e9, "decompress_gbps": dense / t_d / 1e9,
                "compress_gbps_torch_ops": dense / t_c_ops / 1e9, "decompress_gbps_torch_ops": dense / t_d_ops / 1e9,
                "clone_gbps": bandwidth["clone_gbps"], "copy_gbps": bandwidth["copy_gbps"],
                "compress_frac_of_clone": dense / t_c / 1e9 / bandwidth["clone_gbps"],
                "decompress_frac_of_clone": dense / t_d / 1e9 / bandwidth["clone_gbps"],
            })
            progress.advance(task)
    return rows


# ----------------------------------------------------------------------------- (b) training steps

class Captured:
    """A StepContext that remembers the last compressed_activations context it made (for its stats)."""

    def __init__(self, opts: BitTrainOptions) -> None:
        self.opts, self.last = opts, None

    def __call__(self, model):
        self.last = self.opts.context(model)
        return self.last


def variants_for(key: str) -> list[str]:
    names = [v for v in VARIANTS if v != "double_mask"]
    return names + (["double_mask"] if key != "vgg16_nobn" else [])   # double_mask needs BatchNorm


def model_rows(key: str, width: float, batch: int, reps: int, data, variants: list[str], seed: int,
               progress: Progress) -> list[dict]:
    """One row per variant of one seed: the seed draws the model's init and which real images the batch is."""
    name, kw = MODELS[key]
    torch.manual_seed(seed)
    model = build_model(name, width=width, in_channels=SAMPLE_SHAPE[0], num_classes=NUM_CLASSES, **kw)
    x, y = data[0][seed * batch:(seed + 1) * batch], data[1][seed * batch:(seed + 1) * batch]
    task = progress.add_task(f"seed {seed}: {key} w{width:g} b{batch}", total=len(variants) * (reps + 2))
    rows = {}
    for v in variants:
        cap = Captured(VARIANTS[v])
        mem = measure_training_peak(model, sgd, SAMPLE_SHAPE, NUM_CLASSES, batch, data=(x, y), context=cap)
        summary = cap.last.summary() if hasattr(cap.last, "summary") else None
        s = summary["total"] if summary else None
        fwd = forward_live_bytes(model, x, y, VARIANTS[v])
        rows[v] = {"case": f"{key} w{width:g} b{batch} {v}", "part": "train", "model": key, "width": width,
                   "batch": batch, "variant": v, "seed": seed, "peak_bytes": mem.peak_bytes,
                   # (the hooks-only row's own hooks are innermost: edgeflux.memory's saved-tensor count sees nothing)
                   "saved_bytes_measured": None if VARIANTS[v].hooks_only else mem.saved_bytes,
                   "forward_live_bytes": fwd,
                   "dense_bytes": s["dense_bytes"] if s else None, "achieved_bytes": s["stored_bytes"] if s else None,
                   "theoretical_bytes": s["theoretical_bytes"] if s else None,
                   "sparsity": s["sparsity"] if s else None, "compressed": s["compressed"] if s else None,
                   "double_masked": s["double_masked"] if s else None, "mask_only": s["mask_only"] if s else None,
                   "units": {u: {"dense_bytes": d["dense_bytes"], "stored_bytes": d["stored_bytes"]}
                             for u, d in summary["units"].items()} if s else None}
        progress.advance(task)
    dense_peak, dense_fwd = rows["dense"]["peak_bytes"], rows["dense"]["forward_live_bytes"]
    for r in rows.values():
        r["peak_reduction"] = 1 - r["peak_bytes"] / dense_peak
        r["forward_live_reduction"] = 1 - r["forward_live_bytes"] / dense_fwd
        r["saved_reduction"] = (1 - r["achieved_bytes"] / r["dense_bytes"]) if r["dense_bytes"] else None

    # step time: one model per variant, repetitions interleaved so that drifts hit all alike
    nets = {v: copy.deepcopy(model) for v in variants}
    opts = {v: sgd(nets[v].parameters()) for v in variants}

    def step(v):
        net, opt = nets[v], opts[v]
        opt.zero_grad(set_to_none=True)
        with VARIANTS[v].context(net):
            F.cross_entropy(net(x), y).backward()
        opt.step()

    times = {v: [] for v in variants}
    faults = {v: 0 for v in variants}                     # minor page faults: fresh pages from the kernel
    for v in variants:
        step(v)                                           # warm-up (allocator, oneDNN primitives)
        progress.advance(task)
    for _ in range(reps):
        for v in variants:
            f, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t)
            faults[v] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            progress.advance(task)
    # The ratio of the fastest repetitions: another process on the machine (the benchmarks run two
    # at a time) only ever adds time, so the minimum is the least disturbed measure; medians are kept.
    dense_t = min(times["dense"])
    for v, r in rows.items():
        r["page_faults_per_step"] = faults[v] / reps
        r["step_time_s"] = min(times[v])
        r["step_time_median_s"] = statistics.median(times[v])
        r["step_time_ratio"] = r["step_time_s"] / dense_t if v != "dense" else 1.0
        r["step_time_ratio_median"] = r["step_time_median_s"] / statistics.median(times["dense"])
    return list(rows.values())


def forward_live_bytes(model, x, y, opts: Variant) -> int:
    """Measured bytes a forward (and loss) leaves alive for backward: what activations occupy
    when the forward is done (the paper's activation footprint), on a copy of the model."""
    net = copy.deepcopy(model)
    gc.collect()
    with track_live_tensors(seed=[*net.parameters(), *net.buffers(), x, y]) as tracker:
        start = tracker.current_bytes
        with opts.context(net):
            loss = F.cross_entropy(net(x), y)
        live = tracker.current_bytes - start
    del loss
    return live


def train_accuracy(key: str, variant: str, seed: int, cfg: dict, train, test) -> dict:
    """Short training from the seed's init and batch order (the same for every variant); accuracy on the test
    images."""
    name, kw = MODELS[key]
    steps, batch = cfg["acc_steps"], cfg["batch"]
    torch.manual_seed(seed)
    model = build_model(name, width=0.25, in_channels=SAMPLE_SHAPE[0], num_classes=NUM_CLASSES, **kw)
    opt = sgd(model.parameters())
    opts = VARIANTS[variant]
    done, epoch, start = 0, 0, time.perf_counter()
    while done < steps:
        for xb, yb in batches(*train, batch_size=batch, shuffle=True, seed=1000 * seed + epoch, drop_last=True):
            opt.zero_grad(set_to_none=True)
            with opts.context(model):
                F.cross_entropy(model(xb), yb).backward()
            opt.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    # a digest of the trained weights: exact storage must train to the same bits as dense
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(xb).argmax(1) == yb).sum())
                      for xb, yb in batches(*test, batch_size=500, shuffle=False))
    return {"case": f"accuracy {key} {variant}", "part": "accuracy", "model": key, "variant": variant, "width": 0.25,
            "seed": seed, "steps": steps, "batch": batch, "test_accuracy": correct / len(test[1]),
            "train_seconds": seconds, "weights_digest": digest,
            "dense_bytes": None, "theoretical_bytes": None, "achieved_bytes": None, "peak_bytes": None,
            "step_time_ratio": None}


# ----------------------------------------------------------------------------- report

PLOT_VARIANTS = ("bitmap", "prune 0.05", "fp16", "double_mask")
TRAIN_METRICS = ("peak_bytes", "forward_live_bytes", "saved_bytes_measured", "dense_bytes", "achieved_bytes",
                 "theoretical_bytes", "sparsity", "peak_reduction", "forward_live_reduction", "saved_reduction",
                 "step_time_s", "step_time_median_s", "step_time_ratio", "step_time_ratio_median",
                 "page_faults_per_step")


def plot_panels(rows: list[dict], per_acc: list[dict], batch: int, acc_steps: int) -> list[BarPanel]:
    """Saved activation bytes per unit, plain vs stored per variant, for each model at the main width and
    batch (the paper's Figure 9; the first seed's batch), and test accuracy per variant with its 95% interval
    over seeds (its Figure 10). rows: the results' rows (Table 1, training steps and accuracy, over seeds);
    per_acc: each seed's accuracy rows (the dots)."""
    train = [r for r in rows if r["part"] == "train"]
    acc = [r for r in rows if r["part"] == "accuracy"]
    panels = []
    for key in dict.fromkeys(r["model"] for r in train):
        by = {r["variant"]: r for r in train if (r["model"], r["width"], r["batch"]) == (key, 0.25, batch)}
        if "bitmap" not in by:
            continue
        per_unit = by["bitmap"]["units"]
        units = [u for u, d in per_unit.items() if d["dense_bytes"]]
        series = {"plain autograd": [per_unit[u]["dense_bytes"] for u in units]}
        series |= {v: [by[v]["units"][u]["stored_bytes"] for u in units] for v in PLOT_VARIANTS if v in by}
        panels.append(BarPanel(f"{key} w0.25 b{batch}: saved activations per unit", units, series))
    if acc:
        seeds = acc[0].get("n_seeds", 1)
        panels.append(BarPanel(f"test accuracy after {acc_steps} steps (batch {batch}): mean of {seeds} seed(s), "
                               "dots: each seed", [f"{r['model']}\n{r['variant']}" for r in acc],
                               {"test accuracy": [r["test_accuracy"] for r in acc]}, ylabel="test accuracy", scale=1,
                               points={"test accuracy": [_per_seed(per_acc, "test_accuracy", 1.0, model=r["model"],
                                                                    variant=r["variant"]) for r in acc]}))
    return panels


def mib(n) -> str:
    return "" if n is None else f"{n / MiB:.2f}"


def pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _per_seed(rows: list[dict], metric: str, scale: float = 100.0, **where) -> list[float]:
    return [scale * r[metric] for r in rows if all(r[k] == v for k, v in where.items())]


def targets(t1: list[dict], train: list[dict], acc: list[dict]) -> list[dict]:
    """The paper's claims, judged over the per-seed rows (train, acc) by bench.common.target."""
    worst = max(abs(r["achieved_bytes"] / r["theoretical_bytes"] - 1) for r in t1)
    worst_live = max(abs(r["measured_live_bytes"] / r["theoretical_bytes"] - 1) for r in t1)
    what = "achieved bitmap bytes' deviation from 4 x non-zeros + elements / 8, worst Table 1 row (%)"
    out = [target(what, 1.0, [100 * worst], exact=True, at_most=True, model="Table 1 (BitmapTensor.nbytes)"),
           target(what, 1.0, [100 * worst_live], exact=True, at_most=True, model="Table 1 (measured live bytes)")]
    configs = list(dict.fromkeys((r["model"], r["width"], r["batch"]) for r in train))
    for key, width, batch in configs:
        where = {"model": key, "width": width, "batch": batch}
        label = f"{key} w{width:g} b{batch}"
        if key == "vgg16_nobn":   # ReLU outputs straight into the saved tensors: the paper's setting
            for metric, text in (("peak_reduction", "measured step peak"), ("saved_reduction", "saved activations")):
                out.append(target(f"memory below plain autograd, threshold 0: {text} (%)", 30,
                                  _per_seed(train, metric, variant="bitmap", **where), model=label))
            for v in ("prune 0.05", "prune 0.1"):
                out.append(target("pruning: saved activations below plain autograd (%)", 56,
                                  _per_seed(train, "saved_reduction", variant=v, **where), model=label, variant=v))
        ratios = _per_seed(train, "step_time_ratio", scale=1.0, variant="bitmap", **where)
        out.append(target("step-time overhead of bitmap storage vs dense, CPU (%)", 15,
                          [100 * (r - 1) for r in ratios], at_most=True, model=label))
    for key, variant in dict.fromkeys((r["model"], r["variant"]) for r in acc if r["variant"] != "dense"):
        deltas = _per_seed(acc, "acc_delta_points", scale=1.0, model=key, variant=variant)
        if variant == "bitmap":   # exact storage: the same training, to the bit
            out.append(target("exact storage: test accuracy minus dense, same init and batches (points)", 0.0,
                              deltas, model=key, variant=variant))
        else:
            out.append(target("approximate storage: test accuracy minus dense, same init and batches (points)",
                              -1.0, deltas, model=key, variant=variant))
    return out


def with_accuracy_deltas(acc: list[dict]) -> list[dict]:
    """Each accuracy row with acc_delta_points: its test accuracy minus dense's of the same model and seed
    (the paired difference: same init, same batches)."""
    dense = {(r["model"], r["seed"]): r["test_accuracy"] for r in acc if r["variant"] == "dense"}
    return [{**r, "acc_delta_points": 100 * (r["test_accuracy"] - dense[r["model"], r["seed"]])}
            for r in acc if (r["model"], r["seed"]) in dense]


def seed_rows(seed: int, cfg: dict, models: list[str], train_data, test, progress: Progress) -> tuple[list, list]:
    """Training-step rows and accuracy rows of one seed."""
    configs = [(k, w, cfg["batch"], variants_for(k)) for k in models for w in cfg["widths"]]
    configs += [(k, w, b, ["dense", "bitmap", "prune 0.05", "prune 0.1"]) for k, w, b in cfg["extra"] if k in models]
    train = [r for key, width, batch, variants in configs
             for r in model_rows(key, width, batch, cfg["reps"], train_data, variants, seed, progress)]
    grid = [(k, v) for k, vs in cfg["acc_grid"] if k in models for v in vs]
    task = progress.add_task(f"seed {seed}: accuracy", total=len(grid))
    acc = []
    for key, variant in grid:
        progress.update(task, description=f"seed {seed}: accuracy {key} {variant}")
        acc.append(train_accuracy(key, variant, seed, cfg, train_data, test))
        progress.advance(task)
    return train, with_accuracy_deltas(acc)


def train_md(train: list[dict]) -> list[dict]:
    return [{"model": r["model"], "width": f"{r['width']:g}", "batch": r["batch"], "variant": r["variant"],
             "peak MiB": mib(r["peak_bytes"]),
             "peak Δ": "" if r["variant"] == "dense" else pm(r, "peak_reduction", -100, 3) + "%",
             "fwd live MiB": mib(r["forward_live_bytes"]),
             "fwd live Δ": pct(-r["forward_live_reduction"]) if r["variant"] != "dense" else "",
             "saved (dense) MiB": mib(r["dense_bytes"] if r["dense_bytes"] is not None else r["saved_bytes_measured"]),
             "stored MiB": mib(r["achieved_bytes"]), "theoretical MiB": mib(r["theoretical_bytes"]),
             "saved Δ": pm(r, "saved_reduction", -100, 3) + "%" if r["saved_reduction"] is not None else "",
             "sparsity": pct(r["sparsity"]), "step time": f"{1e3 * r['step_time_s']:.0f} ms",
             "ratio": pm(r, "step_time_ratio", 1, 3), "page faults/step": f"{r['page_faults_per_step']:,.0f}"}
            for r in train]


def table1_md(t1: list[dict]) -> list[dict]:
    return [{"activation": f"{r['batch']}x{'x'.join(map(str, r['shape']))}", "elements": f"{r['numel']:,}",
             "non-zero": pct(r["nonzero"]), "dense MiB": mib(r["dense_bytes"]),
             "theoretical MiB": mib(r["theoretical_bytes"]),
             "achieved MiB": mib(r["achieved_bytes"]), "measured MiB": mib(r["measured_live_bytes"]),
             "improv. theor.": pct(r["improvement_theoretical"]), "improv. measured": pct(r["improvement_achieved"]),
             "compress GB/s": f"{r['compress_gbps']:.2f}", "decompress GB/s": f"{r['decompress_gbps']:.2f}",
             "compress / clone": pct(r["compress_frac_of_clone"]),
             "decompress / clone": pct(r["decompress_frac_of_clone"]),
             "torch ops: compress / decompress GB/s":
                 f"{r['compress_gbps_torch_ops']:.2f} / {r['decompress_gbps_torch_ops']:.2f}"}
            for r in t1]


def throughput(t1: list[dict]) -> dict:
    """Compress/decompress throughput against the machine's copy bandwidth (reported; the paper sets no bar)."""
    return {"compress_gbps": statistics.median(r["compress_gbps"] for r in t1),
            "decompress_gbps": statistics.median(r["decompress_gbps"] for r in t1),
            "compress_frac_of_clone": statistics.median(r["compress_frac_of_clone"] for r in t1),
            "decompress_frac_of_clone": statistics.median(r["decompress_frac_of_clone"] for r in t1),
            "copy_gbps": t1[0]["copy_gbps"]}


NOTES = """
Every training-step and accuracy figure is the mean over the seeds with its 95% interval (Student's t; "±" in the
tables, *_ci95 in the JSON). A seed draws the model's initial weights, which real images make the measured
batch, and the training batches' order; dense and every variant share them (accuracy differences are paired).
A target is met when its whole interval clears the bound (bench.common.target).
Peak: measured peak of one steady-state SGD-momentum training step (edgeflux.memory: the CPU allocator's events
over the step, scratch inside ops included), real Fashion-MNIST images (activation sparsity is that of real data);
it includes parameters, gradients and momentum. fwd live: live tensor bytes the forward leaves alive for backward
(saved activations, indices, logits; the exact TorchDispatchMode tracker), i.e. the activation footprint the paper
reports, measured.
saved (dense): bytes of the floating-point activations autograd saves (BitTrain's accounting, deduplicated;
for the dense row edgeflux.memory's saved-tensor count, which also includes int64 max-pool indices). stored: what
BitTrain holds instead; theoretical: the paper's 4·nnz + n/8 summed over the same tensors. Step-time ratio: from
interleaved repetitions in each seed's run (fastest of each: less disturbed by other processes; the JSON also
has the median ratio), each variant on its own copy of the model. double_mask on BN models in
training mode is approximate (BN inputs reconstructed by inverting BN's affine map; rounding-level gradient
error, see edgeflux/bittrain/doublemask.py); pruning and fp16 are approximate by design; bitmap is exact.
Table 1 (one run: its bytes are exact counts): exactly round(p·n) non-zeros at random positions; achieved =
BitmapTensor.nbytes; measured = live tensor bytes the compressed tensor holds (edgeflux.memory tracker);
throughput = dense bytes / median time.
"bitmap" rows run the compiled C++ kernel (edgeflux/bittrain/bitmap_kernel.cpp); "bitmap, torch ops" the same
format made with torch ops only (the path used where the kernel cannot be built); "bitmap, int64 indices" keeps
max-pool indices int64 (narrow_indices=False), to show what narrowing them to int16 saves.
"hooks only": torch.autograd.graph.saved_tensors_hooks that return every tensor as it is: what PyTorch's hook
mechanism itself costs (a Python call per saved tensor and per restore); the rest of a bitmap row's overhead is
BitTrain's own work.
Plot ({png}): saved activation bytes per unit for each model, plain autograd vs what each variant stores (the
paper's Figure 9), and test accuracy per variant (its Figure 10).
page faults/step: minor page faults of the process during a timed step (each a fresh 4 KiB page from the kernel:
glibc returns large freed blocks to the OS, so every step's re-allocations fault again unless --malloc retain).
"""


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"models for the training-step part (default: all of {', '.join(MODELS)})")
    parser.add_argument("--acc-steps", type=int, default=None,
                        help=f"training steps per accuracy run (default: {FULL['acc_steps']}; --quick: {QUICK['acc_steps']})")
    parser.add_argument("--malloc", choices=["default", "retain"], default="default",
                        help="glibc malloc as it comes (default), or told to keep freed heap memory for reuse "
                             "(edgeflux.memory.retain_freed_heap: no page faults on every step's re-allocations, "
                             "for dense and bitmap alike); results go to bittrain_retain.{json,md}")
    add_seeds(parser, "model init, the measured batch, the batch order")
    args = parser.parse_args(argv)
    if args.acc_steps is not None and args.acc_steps < 1:
        parser.error(f"--acc-steps must be >= 1, got {args.acc_steps}")
    if args.malloc == "retain" and not retain_freed_heap():
        raise SystemExit("--malloc retain needs glibc's malloc (Linux with glibc)")
    cfg = dict(QUICK if args.quick else FULL)
    cfg["acc_steps"] = args.acc_steps or cfg["acc_steps"]
    seeds = seeds_of(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()

    raw = prepare(load_raw("fashion-mnist"), image_size=SAMPLE_SHAPE[1])
    train_data = tensors(raw, "train", limit=12_800)
    test = tensors(raw, "test", limit=cfg["test"])

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        bandwidth = copy_bandwidth(cfg["runs"])
        t1 = table1(cfg["table1_batch"], cfg["runs"], bandwidth, progress)
        per_train, per_acc = [], []
        for seed in seeds:
            train_s, acc_s = seed_rows(seed, cfg, args.models, train_data, test, progress)
            per_train += train_s
            per_acc += acc_s
    train = over_seeds(per_train, ("model", "width", "batch", "variant"), TRAIN_METRICS)
    acc = over_seeds(per_acc, ("model", "variant"), ("test_accuracy", "acc_delta_points", "train_seconds"))
    for r in acc:
        r["peak_bytes"] = next((t["peak_bytes"] for t in train if (t["model"], t["variant"], t["width"], t["batch"])
                                == (r["model"], r["variant"], r["width"], r["batch"])), None)

    result = BenchResult()
    for r in t1 + train + acc:
        result.add(**r)
    result.add_section(
        f"Table 1 (paper): activation sizes at batch {cfg['table1_batch']}, sizes in MiB (2^20 bytes); copy bandwidth: "
        f"clone {bandwidth['clone_gbps']:.2f} GB/s, copy_ {bandwidth['copy_gbps']:.2f} GB/s", table1_md(t1))
    result.add_section(
        f"Test accuracy after {cfg['acc_steps']} steps (batch {cfg['batch']}, SGD-momentum, width 0.25, the same init "
        f"and batches per seed; {len(test[1])} test images)",
        [{"model": r["model"], "variant": r["variant"], "test accuracy (%)": pm(r, "test_accuracy", 100, 3),
          "minus dense (points)": pm(r, "acc_delta_points", 1, 3) if r["variant"] != "dense" else "",
          "seeds": r["n_seeds"], "train time": f"{r['train_seconds']:.1f} s",
          "peak (batch, above)": mib(r["peak_bytes"])} for r in acc])
    tg = targets(t1, per_train, per_acc)
    result.add_section("Targets", tg, ("model", "variant", *TARGET_COLUMNS))
    name, title = NAME, "BitTrain: sparse bitmap activations, Table 1 and whole training steps"
    if args.malloc == "retain":   # malloc changes neither bytes nor accuracy: its figure would be bittrain.png again
        name, title = f"{NAME}_retain", title + " (glibc malloc keeps freed heap memory)"
    else:
        plot_bar_panels(plot_panels(result.rows, per_acc, cfg["batch"], cfg["acc_steps"]), Path(args.out) / f"{name}.png",
                        title=title)
    notes = NOTES.replace("{png}", f"{NAME}.png") + (
        f"Seeds {seeds}; torch intra-op threads: {torch.get_num_threads()}; C++ kernel loaded: {kernel.available()}; "
        f"malloc: {args.malloc}; bench time {time.perf_counter() - started:.0f} s.\n")
    result.write(name, args.out, title=title, md_rows=train_md(train), notes=notes,
                 extra={"copy_bandwidth": bandwidth, "throughput": throughput(t1), "targets": tg, "n_seeds": len(seeds),
                        "per_seed": {"train": [{k: v for k, v in r.items() if k != "units"} for r in per_train],
                                     "accuracy": per_acc}, "config": cfg})


if __name__ == "__main__":
    main()
