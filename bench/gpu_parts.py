"""The measurements of bench/gpu.py that no other benchmark makes: each takes a device ("cuda" or "cpu")
and `quick` (CI-sized settings) and returns rows; bench/gpu.py writes them."""
from __future__ import annotations

import copy
import functools
import gc
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from bench.bittrain import MODELS as BITTRAIN_MODELS, VARIANTS, Captured
from edgeflux.backprop import fit_model_batch
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.elastic import ElasticOptions
from edgeflux.finetune import FinetuneOptions, finetune
from edgeflux.memory import BudgetTooSmallError, MiB, format_bytes, measure_training_peak
from edgeflux.models import build_model
from edgeflux.train import MemoryOptions, TrainOptions, TrainRun, fit

SAMPLE, CLASSES = (1, 32, 32), 10
MEMORY = {"models": ("vgg16", "resnet18", "mobilenet_v2"), "widths": (0.25, 1.0), "batches": (8, 64)}
MEMORY_QUICK = {"models": ("vgg11", "mobilenet_v2"), "widths": (0.125,), "batches": (2, 4)}
BUDGETED = {"models": (("vgg16", 1.0), ("resnet18", 1.0), ("mobilenet_v2", 1.0)), "budget_mib": 400.0,
            "samples": 4096}
BUDGETED_QUICK = {"models": (("vgg11", 0.125),), "budget_mib": 3.0, "samples": 128}
BITTRAIN = {"models": ("vgg16_nobn", "vgg16_bn", "resnet18", "mobilenet_v2"), "width": 1.0, "batch": 64, "reps": 10}
BITTRAIN_QUICK = {"models": ("vgg16_nobn",), "width": 0.125, "batch": 8, "reps": 2}
FINETUNE = {"model": "mobilenet_v2", "width": 1.0, "pretrain_samples": 8000, "pretrain_epochs": 2,
            "train_samples": 4000, "test_samples": None, "epochs": 2, "budget_batch": 32, "max_batch": 256,
            "rho": 0.5, "methods": ("ft_all", "mobiletl", "mobiletl-bittrain", "elastic", "elastic-mobiletl")}
FINETUNE_QUICK = {"model": "mobilenet_v2", "width": 0.25, "pretrain_samples": 256, "pretrain_epochs": 1,
                  "train_samples": 128, "test_samples": 128, "epochs": 1, "budget_batch": 8, "max_batch": 32,
                  "rho": 0.5, "methods": ("ft_all", "mobiletl", "elastic-mobiletl")}


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@functools.cache
def fashion(split_by: str):
    """Fashion-MNIST at 32x32, split as the pipeline splits it (by data, or source/target by classes)."""
    return prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by=split_by)


def real_batch(n: int):
    x, y = tensors(fashion("data"), "train", limit=n)
    return x[:n].clone(), y.clone()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------- memory, two ways

def _held_before(device: str) -> int:
    """Requested bytes the device holds for no tensor of the step: the cuBLAS workspaces (made on first use
    and kept), read with nothing of the step alive. They are in the allocator's figure from the step's start."""
    a = torch.ones(8, 8, device=device)
    (a @ a + F.linear(a, a, a[0])).sum().item()
    del a
    gc.collect()
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _device_step(model, xy, device: str, cudnn: bool) -> dict:
    """The allocator's peak, requested peak and reserved peak over one measured step, its saved bytes, and
    what the device held before it."""
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = cudnn
    try:
        held = _held_before(device)
        mem = measure_training_peak(model, sgd, SAMPLE, CLASSES, len(xy[1]), device=device, data=xy,
                                    process_stats=False)
        stats = torch.cuda.memory_stats()   # read before anything else allocates: the peaks are the step's
    finally:
        torch.backends.cudnn.enabled = enabled
    return {"peak": mem.peak_bytes, "requested": stats["requested_bytes.all.peak"],
            "reserved": stats["reserved_bytes.all.peak"], "saved": mem.saved_bytes, "held": held}


def memory_rows(device: str, quick: bool) -> list[dict]:
    """Each model, width and batch: the CPU allocator's peak beside the device allocator's, the difference
    split so that its parts add up exactly: rounding + cuDNN + workspaces + kernels."""
    cfg = MEMORY_QUICK if quick else MEMORY
    rows = []
    for name in cfg["models"]:
        for width in cfg["widths"]:
            torch.manual_seed(0)
            model = build_model(name, num_classes=CLASSES, in_channels=1, width=width, image_size=32)
            for batch in cfg["batches"]:
                xy = real_batch(batch)
                cpu = measure_training_peak(model, sgd, SAMPLE, CLASSES, batch, data=xy, process_stats=False)
                row = {"model": name, "width": width, "batch": batch, "cpu_peak": cpu.peak_bytes,
                       "cpu_saved": cpu.saved_bytes, "peak": cpu.peak_bytes, "saved": cpu.saved_bytes,
                       "requested_peak": None, "reserved_peak": None, "peak_without_cudnn": None,
                       "rounding": None, "cudnn": None, "workspaces": None, "kernels": None}
                if device == "cuda":
                    on, off = (_device_step(model, xy, device, cudnn=c) for c in (True, False))
                    row.update(peak=on["peak"], saved=on["saved"], requested_peak=on["requested"],
                               reserved_peak=on["reserved"], peak_without_cudnn=off["peak"],
                               rounding=on["peak"] - on["requested"], cudnn=on["requested"] - off["requested"],
                               workspaces=off["held"], kernels=off["requested"] - off["held"] - cpu.peak_bytes)
                print(f"memory: {name} w{width:g} batch {batch}: cpu {format_bytes(row['cpu_peak'])}, "
                      f"{device} {format_bytes(row['peak'])}", flush=True)
                rows.append(row)
    return rows


def budgeted_runs(device: str, quick: bool) -> list[dict]:
    """Backprop at the largest batch whose measured step fits the budget, trained for an epoch; on CUDA the
    allocator's peak over the whole run (every step, every evaluation) is held against the budget too."""
    cfg = BUDGETED_QUICK if quick else BUDGETED
    train = tensors(fashion("data"), "train", limit=cfg["samples"])
    val = tensors(fashion("data"), "val", limit=cfg["samples"] // 4)
    budget = int(cfg["budget_mib"] * MiB)
    opts = TrainOptions(epochs=1, lr=0.05, evals_per_epoch=2, seed=0, device=device)
    rows = []
    for name, width in cfg["models"]:
        torch.manual_seed(0)
        model = build_model(name, num_classes=CLASSES, in_channels=1, width=width, image_size=32)
        try:
            batch, _, step = fit_model_batch(model, train, opts, MemoryOptions(budget=f"{budget}B"),
                                             TrainRun(torch.device(device)))
        except BudgetTooSmallError as exc:   # a row that says so: the budget holds, nothing trains
            rows.append({"model": f"{name}-w{width:g}", "budget_bytes": budget, "batch": None,
                         "step_peak_bytes": exc.min_feasible_bytes, "run_peak_bytes": None, "steps": 0,
                         "within": True, "infeasible": str(exc)})
            continue
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        result = fit(model, train, val, opts, batch, TrainRun(device, desc=f"{name} under {format_bytes(budget)}"))
        run_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        rows.append({"model": f"{name}-w{width:g}", "budget_bytes": budget, "batch": batch,
                     "step_peak_bytes": step.peak_bytes, "run_peak_bytes": run_peak, "steps": result.steps,
                     "within": step.peak_bytes <= budget and (run_peak is None or run_peak <= budget)})
        model.cpu()
    return rows


def plot_memory(rows: list[dict], path, device: str) -> None:
    """Top: the CPU allocator's peak beside the device's per configuration. Bottom (CUDA): the difference's
    parts, which add up to it exactly."""
    labels = [f"{r['model']}\nw{r['width']:g}, batch {r['batch']}" for r in rows]
    xs = list(range(len(rows)))
    fig, axes = plt.subplots(2, 1, figsize=(max(10.0, 1.15 * len(rows)), 9.0))
    ax = axes[0]
    ax.bar([x - 0.2 for x in xs], [r["cpu_peak"] / MiB for r in rows], 0.4, label="CPU allocator", color="tab:gray")
    ax.bar([x + 0.2 for x in xs], [r["peak"] / MiB for r in rows], 0.4, label=f"{device.upper()} allocator",
           color="tab:blue")
    ax.set(ylabel="peak of one training step (MiB)", title="the same training step, measured by two allocators")
    ax = axes[1]
    parts = (("rounding", "allocator rounding", "tab:olive"), ("cudnn", "cuDNN (vs CUDA's own kernels)", "tab:red"),
             ("workspaces", "cuBLAS workspaces (held before the step)", "tab:purple"),
             ("kernels", "CUDA vs CPU kernels", "tab:cyan"))
    for i, (key, label, color) in enumerate(parts):
        ax.bar([x - 0.3 + 0.2 * i for x in xs], [(r[key] or 0) / MiB for r in rows], 0.2, label=label, color=color)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(ylabel="MiB", title=f"{device.upper()} peak minus CPU peak, in parts that add up to it")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- BitTrain

def _timed_steps(nets: dict, opts: dict, variants: list[str], xy, reps: int, device: str) -> dict[str, float]:
    """Median step seconds per variant, repetitions interleaved so that drifts hit every variant alike."""
    x, y = xy

    def step(v):
        opts[v].zero_grad(set_to_none=True)
        with VARIANTS[v].context(nets[v]):
            loss = F.cross_entropy(nets[v](x), y)
            loss.backward()
        opts[v].step()
        return loss.item()

    times = {v: [] for v in variants}
    for v in variants:
        step(v)
    for _ in range(reps):
        for v in variants:
            sync(device)
            t = time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t)
    return {v: statistics.median(t) for v, t in times.items()}


def _bittrain_memory(model, key: str, variant: str, cfg: dict, xy, device: str) -> dict:
    cap = Captured(VARIANTS[variant].opts)
    mem = measure_training_peak(model, sgd, SAMPLE, CLASSES, cfg["batch"], device=device, data=xy, context=cap,
                                process_stats=False)
    total = cap.last.summary()["total"] if hasattr(cap.last, "summary") else None
    return {"model": f"{key} w{cfg['width']:g}", "batch": cfg["batch"], "variant": variant,
            "peak_bytes": mem.peak_bytes, "dense_bytes": total["dense_bytes"] if total else mem.saved_bytes,
            "stored_bytes": total["stored_bytes"] if total else mem.saved_bytes}


def bittrain_rows(device: str, quick: bool) -> list[dict]:
    cfg = BITTRAIN_QUICK if quick else BITTRAIN
    rows = []
    for key in cfg["models"]:
        name, kw = BITTRAIN_MODELS[key]
        torch.manual_seed(0)
        model = build_model(name, width=cfg["width"], in_channels=1, num_classes=CLASSES, **kw)
        xy = real_batch(cfg["batch"])
        variants = ["dense", "bitmap", "fp16", "prune 0.05"] + (["double_mask"] if key != "vgg16_nobn" else [])
        found = {}
        for v in list(variants):
            try:
                found[v] = _bittrain_memory(model, key, v, cfg, xy, device)
            except Exception as exc:   # noqa: BLE001 - one variant failing on this device must not lose the rest
                print(f"bittrain: {key} {v} failed on {device}: {exc!r}", flush=True)
                rows.append({"model": f"{key} w{cfg['width']:g}", "batch": cfg["batch"], "variant": v,
                             "error": repr(exc)[:300]})
                variants.remove(v)
        nets = {v: copy.deepcopy(model).to(device).train() for v in variants}
        times = _timed_steps(nets, {v: sgd(n.parameters()) for v, n in nets.items()}, variants,
                             (xy[0].to(device), xy[1].to(device)), cfg["reps"], device)
        for v in variants:
            found[v].update(step_s=times[v], step_ratio=times[v] / times["dense"],
                            peak_reduction=1 - found[v]["peak_bytes"] / found["dense"]["peak_bytes"])
            rows.append(found[v])
        print(f"bittrain: {key}: " + ", ".join(f"{v} x{found[v]['step_ratio']:.2f}" for v in variants), flush=True)
        del nets
    return rows


# ------------------------------------------------------------------------------ MobileTL, ElasticTrainer

def _pretrained(cfg: dict, device: str):
    data = fashion("classes")
    torch.manual_seed(0)
    model = build_model(cfg["model"], num_classes=CLASSES, in_channels=1, width=cfg["width"], image_size=32)
    opts = TrainOptions(epochs=cfg["pretrain_epochs"], lr=2e-3, optimizer="adam", evals_per_epoch=1, seed=0,
                        device=device)
    fit(model, tensors(data, "source_train", limit=cfg["pretrain_samples"]),
        tensors(data, "source_val", limit=cfg["test_samples"] or 1000), opts, 128, TrainRun(device, desc="pretrain"))
    return model.cpu()


def finetune_rows(device: str, quick: bool) -> tuple[list[dict], dict]:
    """Every method of cfg's from one pretrained model under one budget (plain backprop's measured step at
    cfg's budget_batch)."""
    cfg = FINETUNE_QUICK if quick else FINETUNE
    data = fashion("classes")
    train = tensors(data, "target_train", limit=cfg["train_samples"])
    val = tensors(data, "target_val", limit=cfg["test_samples"] or 1000)
    test = tensors(data, "target_test", limit=cfg["test_samples"])
    pretrained = _pretrained(cfg, device)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    budget = measure_training_peak(pretrained, adam, SAMPLE, CLASSES, cfg["budget_batch"], device=device,
                                   data=train, process_stats=False).peak_bytes
    opts = FinetuneOptions(epochs=cfg["epochs"], lr=1e-3, optimizer="adam", evals_per_epoch=1, seed=0, device=device,
                           budget=f"{budget}B", max_batch=cfg["max_batch"], elastic=ElasticOptions(rho=cfg["rho"]))
    rows = []
    for method in cfg["methods"]:
        try:
            m = finetune(copy.deepcopy(pretrained), method, opts, train, val, test, device).metrics()
        except Exception as exc:   # noqa: BLE001 - one method failing on this device must not lose the rest
            print(f"finetune: {method} failed on {device}: {exc!r}", flush=True)
            rows.append({"method": method, "error": repr(exc)[:300]})
            continue
        rows.append({k: m.get(k) for k in ("method", "batch_size", "peak_mem_bytes", "trainable_params",
                                           "step_time_s", "train_time_s", "test_acc", "elastic_selected_frac",
                                           "elastic_overhead_s")} | {"within": m["peak_mem_bytes"] <= budget})
        print(f"finetune: {method}: batch {m['batch_size']}, {format_bytes(m['peak_mem_bytes'])}, "
              f"{m['train_time_s']:.1f}s, test {m['test_acc']:.4f}", flush=True)
    base = next((r["train_time_s"] for r in rows if r["method"] == "ft_all" and "error" not in r), None)
    for r in rows:
        r["speedup_vs_ft_all"] = base / r["train_time_s"] if base and "error" not in r else None
    info = {k: cfg[k] for k in ("pretrain_samples", "pretrain_epochs", "train_samples", "epochs", "budget_batch", "rho")}
    return rows, {**info, "model": f"{cfg['model']} w{cfg['width']:g}", "budget_mib": budget / MiB,
                  "budget_bytes": budget}


# ------------------------------------------------------------------------------ NeuroFlux, over seeds

def aggregate_neuroflux(runs: list[dict], mean_ci) -> tuple[list[dict], list[dict], list[dict]]:
    """Per model, method and budget over the seeds' results: mean and interval of time to target, test
    accuracy and samples/s; per budget the speed-up per seed; the paper's targets against them."""
    keys = list(dict.fromkeys((r["model"], r["method"], r["budget_bytes"]) for run in runs for r in run["rows"]))
    rows = []
    for model, method, budget in keys:
        rs = [r for run in runs for r in run["rows"] if (r["model"], r["method"], r["budget_bytes"]) == (model, method, budget)]
        ok = [r for r in rs if r["feasible"]]
        rows.append({"model": model, "method": method, "budget_bytes": budget, "seeds": len(rs),
                     "feasible": len(ok), "batches": ok[0]["batch_sizes"] if ok else None,
                     "batches_per_seed": [r["batch_sizes"] for r in ok],
                     "peak_max": max((r["peak_bytes"] for r in ok), default=None),
                     "within_budget": all(r["within_budget"] for r in ok),
                     "time_to_target_s": mean_ci([r["time_to_target_s"] for r in ok if r["time_to_target_s"]]),
                     "test_acc": mean_ci([r["test_acc"] for r in ok]),
                     "samples_per_s": mean_ci([r["samples_per_s"] for r in ok if r.get("samples_per_s")])})
    speedups = []
    for model, budget in dict.fromkeys((m, b) for m, _, b in keys):
        per_seed = [s.get("speedup_vs_backprop") for run in runs for s in run["speedups"]
                    if (s["model"], s["budget_bytes"]) == (model, budget)]
        values = [v for v in per_seed if v]
        speedups.append({"model": model, "budget_bytes": budget, "budget": format_bytes(budget),
                         "speedup": mean_ci(values), "per_seed": per_seed, "reached": f"{len(values)} of {len(per_seed)}"})
    return rows, speedups, _targets(rows, speedups)


def _targets(rows: list[dict], speedups: list[dict]) -> list[dict]:
    """NeuroFlux >= 2.3x faster than backprop at the tightest budget both can train under (the interval's
    lower end must clear it); every block's measured peak within its budget."""
    goals = []
    shared = [s for s in speedups if any(r["method"] == "backprop" and r["feasible"] and r["budget_bytes"] ==
                                         s["budget_bytes"] and r["model"] == s["model"] for r in rows)]
    for s in sorted(shared, key=lambda s: s["budget_bytes"])[:1]:
        ci = s["speedup"]
        if ci["lo"] is not None:
            measured, met = f"x{ci['mean']:.2f} [{ci['lo']:.2f}, {ci['hi']:.2f}]", "met" if ci["lo"] >= 2.3 else "MISSED"
        elif ci["n"]:
            measured, met = f"x{ci['mean']:.2f} (one seed)", "not shown (one seed)"
        else:
            measured, met = f"no seed in which both reached the target ({s['reached']})", "MISSED"
        goals.append({"target": f"NeuroFlux >= 2.3x faster to target than backprop, {s['model']} at {s['budget']} "
                                "(the tightest budget both train under)", "measured": measured, "met": met})
    over = [r for r in rows if r["feasible"] and not r["within_budget"]]
    goals.append({"target": "measured peak <= budget in every run (the device allocator's figure)",
                  "measured": f"{sum(r['feasible'] for r in rows)} method/budget cells, {len(over)} over",
                  "met": "met" if not over else "MISSED"})
    return goals


def plot_neuroflux(runs: list[dict], path, target: float, colors: dict) -> None:
    """Test accuracy against training time, one panel per budget, every seed a line, one colour per method."""
    budgets = sorted({r["budget_bytes"] for run in runs for r in run["rows"]})
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        labelled = set()
        for run in runs:
            for r in run.get("per_seed", run["rows"]):     # a seed's curves (older seed files: in its rows)
                if r["budget_bytes"] != budget or not r.get("curve"):
                    continue
                t, acc = zip(*r["curve"])
                ax.plot(t, acc, marker=".", color=colors[r["method"]], alpha=0.8,
                        label=None if r["method"] in labelled else f"{r['method']} (one line per seed)")
                labelled.add(r["method"])
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
        model = runs[0]["rows"][0]["model"]
        ax.set(title=f"{model}, budget {format_bytes(budget)}", xlabel="training time (s), profiling included",
               ylabel="test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
