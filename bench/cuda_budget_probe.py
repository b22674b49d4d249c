"""Why a budgeted CUDA run's whole-run allocator peak can exceed the budget its measured step fits.

Before edgeflux.memory.blocks, bench/gpu.py's memory part trained ResNet-18 w1 under 400 MiB at the batch
whose measured step fit, and the allocator's peak over the epoch went over the budget (docs/memory.md).
This probe runs that budgeted run again (the same model, budget, data and options as
bench.gpu_parts.budgeted_runs) once per variant, each in a fresh process, and records every training step
and evaluation on its own: the CUDA caching allocator's peak (``allocated_bytes.all.peak``: what ``max_memory_allocated`` and the
budget count) and the bytes the step asked for (``requested_bytes.all.peak``), the same two figures for every
step the batch search measured, and what ran between the windows. Variants:

* history / fresh: after the allocations bench/gpu.py's memory part makes first (memory_rows, the VGG-16
  budgeted run) or in a fresh process;
* cudnn_benchmark, cudnn_deterministic: cuDNN's autotuner on, or its deterministic algorithms only
  (edgeflux sets neither: both off by default);
* drop_last: without the epoch's last, smaller batch;
* split, split_history: with edgeflux's fix (edgeflux.memory.blocks: the allocator's blocks split to the
  request); every other variant runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``, the
  allocator as it was before the fix.

    python -m bench.cuda_budget_probe --out /tmp/probe                       # on a CUDA machine (~1 min)
    python -m bench.cuda_budget_probe --device cpu --quick --out /tmp/probe  # the same code here (no CUDA figures)

Writes <out>/cuda_budget_probe_<device>.{json,md}: one row per variant, each step's figures in the JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, BenchResult, HelpFormatter, program_name

ROOT = Path(__file__).resolve().parents[1]
MiB = 2 ** 20
FULL = {"model": ("resnet18", 1.0), "before": ("vgg16", 1.0), "budget_mib": 400.0, "samples": 4096}
QUICK = {"model": ("vgg11", 0.125), "before": ("vgg11", 0.125), "budget_mib": 3.0, "samples": 128}
VARIANTS = {
    "history": {"split": False, "history": True},
    "split_history": {"split": True, "history": True},
    "fresh": {"split": False},
    "cudnn_benchmark": {"split": False, "benchmark": True},
    "cudnn_deterministic": {"split": False, "deterministic": True},
    "drop_last": {"split": False, "drop_last": True},
    "split": {"split": True},
}
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=program_name(), description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="CI-sized settings (a small model, little data)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=None, help="variants run at once (default: all on cuda, 1 on cpu)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a variant may take")
    parser.add_argument("--synthetic", action="store_true",
                        help="random images of Fashion-MNIST's shape instead of the dataset (a machine without it; "
                             "plain backprop's allocations do not depend on the pixels); not with the history variants")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)   # one variant, in this process
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------- one variant

class Recorder:
    """The allocator's figures over each training step and evaluation (a window each), and over what ran
    between two windows (``gap_peak``): their maximum is the whole run's ``max_memory_allocated``."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.on = cuda, False
        self.windows: list[dict] = []
        self.measured: list[dict] = []

    def window(self, phase: str, batch: int, fn):
        if not (self.on and self.cuda):
            return fn()
        torch.cuda.synchronize()
        gap = torch.cuda.max_memory_allocated()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        self.windows.append({"phase": phase, "batch": batch, "gap_peak": gap, "start": start,
                             "peak": st["allocated_bytes.all.peak"], "requested_peak": st["requested_bytes.all.peak"],
                             "end": st["allocated_bytes.all.current"], "reserved": st["reserved_bytes.all.current"]})
        torch.cuda.reset_peak_memory_stats()
        return out


def instrument(rec: Recorder) -> None:
    """Every TrainStep call and evaluation of fit through rec.window; every step the batch search measures
    recorded with the bytes it asked for."""
    import edgeflux.backprop as backprop
    import edgeflux.train as train
    from edgeflux.step import TrainStep

    call = TrainStep.__call__
    TrainStep.__call__ = lambda self, x, y: rec.window("step", len(y), lambda: call(self, x, y))
    evaluate = train.evaluate
    train.evaluate = lambda model, x, y, batch_size=512, device="cpu": rec.window(
        "eval", batch_size, lambda: evaluate(model, x, y, batch_size=batch_size, device=device))
    measure = backprop.measure_training_step

    def measured(model, make_step, warmup, batch, device="cpu", *args, **kwargs):
        mem = measure(model, make_step, warmup, batch, device, *args, **kwargs)
        row = {"batch": len(batch[1]), "peak": mem.peak_bytes}
        if rec.cuda:   # nothing allocates after the measured step's window: these are its peaks
            st = torch.cuda.memory_stats()
            row.update(allocated_peak=st["allocated_bytes.all.peak"], requested_peak=st["requested_bytes.all.peak"])
        rec.measured.append(row)
        return mem

    backprop.measure_training_step = measured


def churn(device: str) -> None:
    """Allocations of assorted sizes, freed and left cached, before edgeflux runs (the allocator's history)."""
    if device == "cuda":
        held = [torch.empty(int(mib * MiB), dtype=torch.uint8, device=device)
                for mib in (1.5, 3.0, 7.25, 11.5, 12.4, 19.9, 25.0, 47.0, 60.3)]
        del held


def budgeted(name: str, width: float, cfg: dict, device: str, rec: Recorder | None, drop_last: bool = False,
             synthetic: bool = False) -> dict:
    """bench.gpu_parts.budgeted_runs for one model: the batch search under the budget, then an epoch of fit."""
    from bench.gpu_parts import CLASSES, SAMPLE, fashion
    from edgeflux.backprop import fit_model_batch
    from edgeflux.data import tensors
    from edgeflux.models import build_model
    from edgeflux.train import MemoryOptions, TrainOptions, TrainRun, fit

    if synthetic:
        gen = torch.Generator().manual_seed(0)
        train, val = ((torch.randn(n, *SAMPLE, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen))
                      for n in (cfg["samples"], cfg["samples"] // 4))
    else:
        train = tensors(fashion("data"), "train", limit=cfg["samples"])
        val = tensors(fashion("data"), "val", limit=cfg["samples"] // 4)
    budget = int(cfg["budget_mib"] * MiB)
    opts = TrainOptions(epochs=1, lr=0.05, evals_per_epoch=2, seed=0, device=device)
    torch.manual_seed(0)
    model = build_model(name, num_classes=CLASSES, in_channels=1, width=width, image_size=32)
    batch, _, step = fit_model_batch(model, train, opts, MemoryOptions(budget=f"{budget}B"),
                                     TrainRun(torch.device(device)))
    if drop_last:
        keep = len(train[1]) // batch * batch
        train = (train[0][:keep], train[1][:keep])
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if rec is not None:
        rec.on = True
    result = fit(model, train, val, opts, batch, TrainRun(device, desc=f"{name} w{width:g} (batch {batch})"))
    after = torch.cuda.max_memory_allocated() if device == "cuda" else None
    if rec is not None:
        rec.on = False
    model.cpu()
    return {"batch": batch, "budget": budget, "step_peak": step.peak_bytes, "steps": result.steps, "after": after}


def worker(args) -> None:
    spec = VARIANTS[args.worker]
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(4 if args.device == "cuda" and spec.get("history") else 1)   # the CPU steps of memory_rows
    torch.backends.cudnn.benchmark = spec.get("benchmark", False)
    torch.backends.cudnn.deterministic = spec.get("deterministic", False)
    rec = Recorder(args.device == "cuda")
    instrument(rec)
    started = time.perf_counter()
    if spec.get("history"):
        from bench.gpu_parts import memory_rows
        churn(args.device)
        memory_rows(args.device, args.quick)
        budgeted(*cfg["before"], cfg, args.device, None)
        rec.measured.clear()
    run = budgeted(*cfg["model"], cfg, args.device, rec, drop_last=spec.get("drop_last", False),
                   synthetic=args.synthetic)
    from edgeflux.memory import blocks
    info = {"variant": args.worker, **spec, "synthetic": args.synthetic, "run": run, "measured": rec.measured, "windows": rec.windows,
            "split_blocks_exactly": blocks._state, "seconds": round(time.perf_counter() - started, 1),
            "env": {k: os.environ.get(k) for k in ENV_VARS}}
    if args.device == "cuda":
        st = torch.cuda.memory_stats()
        info["stats"] = {k: st.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                                 "segment.all.peak", "reserved_bytes.all.peak",
                                                 "inactive_split_bytes.all.peak", "oversize_allocations.peak")}
        info["expandable_segments"] = sum(bool(s.get("is_expandable")) for s in torch.cuda.memory_snapshot())
        info["segments"] = len(torch.cuda.memory_snapshot())
        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        info["allocator_settings"] = getter() if getter else None
    args.json.write_text(json.dumps(info, indent=1) + "\n")


# ------------------------------------------------------------------------------------- the variants

def run_variant(args, variant: str, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    if not VARIANTS[variant]["split"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"   # the allocator as before the fix
    path = tmp / f"{variant}.json"
    cmd = [sys.executable, "-m", "bench.cuda_budget_probe", "--worker", variant, "--json", str(path),
           "--device", args.device, *(["--quick"] if args.quick else []), *(["--synthetic"] if args.synthetic else [])]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        log = proc.stdout[-1500:] + proc.stderr[-3000:]
        ok = proc.returncode == 0 and path.exists()
    except subprocess.TimeoutExpired:
        log, ok = f"timed out after {args.timeout:g}s", False
    print(f"== {variant}: {'done' if ok else 'FAILED'} in {time.perf_counter() - started:.0f}s", flush=True)
    if not ok:
        print(log, flush=True)
        return {"variant": variant, "error": log[-600:]}
    return json.loads(path.read_text())


def mib(b) -> float | None:
    return None if b is None else round(b / MiB, 3)


def summarize(info: dict) -> dict:
    """One row: the measured step at the chosen batch beside the training run's windows."""
    if "error" in info:
        return {"variant": info["variant"], "error": info["error"][-200:]}
    run, windows = info["run"], info["windows"]
    batch, budget = run["batch"], run["budget"]
    row = {"variant": info["variant"], "split": info.get("split_blocks_exactly"), "batch": batch,
           "budget_mib": mib(budget), "measured_peak_mib": mib(run["step_peak"]), "steps": run["steps"]}
    chosen = [m for m in info["measured"] if m["batch"] == batch]
    if not windows or not chosen or "requested_peak" not in chosen[-1]:
        return row   # no CUDA figures (a CPU run)
    m = chosen[-1]
    steps = [w for w in windows if w["phase"] == "step"]
    full = [w for w in steps if w["batch"] == batch]
    evals = [w for w in windows if w["phase"] == "eval"]
    worst_i, worst = max(enumerate(steps), key=lambda iw: iw[1]["peak"])
    run_peak = max(max(w["peak"], w["gap_peak"]) for w in windows)
    run_peak = max(run_peak, run["after"] or 0)
    row.update(
        measured_requested_mib=mib(m["requested_peak"]), measured_slack_mib=mib(m["peak"] - m["requested_peak"]),
        run_peak_mib=mib(run_peak), over_budget_mib=mib(max(0, run_peak - budget)),
        over_measured_mib=mib(run_peak - m["peak"]),
        worst_step=worst_i + 1, worst_batch=worst["batch"], worst_peak_mib=mib(worst["peak"]),
        worst_requested_mib=mib(worst["requested_peak"]), worst_slack_mib=mib(worst["peak"] - worst["requested_peak"]),
        full_steps=len(full),
        full_requested_min_mib=mib(min(w["requested_peak"] for w in full)),
        full_requested_max_mib=mib(max(w["requested_peak"] for w in full)),
        full_peak_min_mib=mib(min(w["peak"] for w in full)), full_peak_max_mib=mib(max(w["peak"] for w in full)),
        full_slack_min_mib=mib(min(w["peak"] - w["requested_peak"] for w in full)),
        full_slack_max_mib=mib(max(w["peak"] - w["requested_peak"] for w in full)),
        full_steps_over_measured=sum(w["peak"] > m["peak"] for w in full),
        first_step_peak_mib=mib(steps[0]["peak"]), last_step_batch=steps[-1]["batch"],
        last_step_peak_mib=mib(steps[-1]["peak"]),
        eval_peak_max_mib=mib(max((w["peak"] for w in evals), default=None)),
        gap_peak_max_mib=mib(max(w["gap_peak"] for w in windows)),
        within=run_peak <= budget,
        expandable_segments=f"{info.get('expandable_segments')}/{info.get('segments')}",
        alloc_retries=info["stats"]["num_alloc_retries"])
    return row


COLUMNS = {"variant": "variant", "split": "blocks split (fix)", "batch": "batch", "measured_peak_mib": "measured step",
           "measured_requested_mib": "its requested", "measured_slack_mib": "its slack", "run_peak_mib": "run peak",
           "over_budget_mib": "over budget", "worst_step": "worst step", "worst_batch": "its batch",
           "worst_requested_mib": "its requested", "worst_slack_mib": "its slack",
           "full_requested_min_mib": "full steps' requested min", "full_requested_max_mib": "max",
           "full_slack_min_mib": "full steps' slack min", "full_slack_max_mib": "max",
           "full_steps_over_measured": "full steps over measured", "first_step_peak_mib": "first step",
           "last_step_peak_mib": "last step", "eval_peak_max_mib": "eval max", "within": "run peak <= budget",
           "expandable_segments": "expandable segments"}


def findings(rows: list[dict]) -> str:
    """What the rows say, in sentences whose every figure is read from them."""
    done = [r for r in rows if "run_peak_mib" in r]
    if not done:
        return "No CUDA figures (a CPU run checks only that the script works)."
    lines = []
    for r in done:
        same = r["full_requested_min_mib"] == r["full_requested_max_mib"] == r["measured_requested_mib"]
        lines.append(
            f"- **{r['variant']}** (batch {r['batch']}, blocks split to the request: {r['split']}): the measured step "
            f"{r['measured_peak_mib']:.3f} MiB = {r['measured_requested_mib']:.3f} requested + {r['measured_slack_mib']:.3f} "
            f"slack; the {r['full_steps']} full-batch training steps asked for "
            + (f"exactly the measured step's {r['measured_requested_mib']:.3f} MiB every time" if same else
               f"{r['full_requested_min_mib']:.3f} to {r['full_requested_max_mib']:.3f} MiB")
            + f", with {r['full_slack_min_mib']:.3f} to {r['full_slack_max_mib']:.3f} MiB slack; "
            f"{r['full_steps_over_measured']} of them above the measured peak; the run's peak {r['run_peak_mib']:.3f} MiB "
            f"(step {r['worst_step']}, batch {r['worst_batch']}: {r['worst_requested_mib']:.3f} requested + "
            f"{r['worst_slack_mib']:.3f} slack), {r['over_measured_mib']:+.3f} MiB against the measured step, "
            + ("within the budget" if r["within"] else f"{r['over_budget_mib']:.3f} MiB over the budget")
            + f"; first step {r['first_step_peak_mib']:.3f}, last step (batch {r['last_step_batch']}) "
            f"{r['last_step_peak_mib']:.3f}, evaluations at most {r['eval_peak_max_mib']:.3f} MiB.")
    return "\n".join(lines)


NOTES = """All sizes MiB. One budgeted run per variant, each in a fresh process: the batch search under the budget
(edgeflux.backprop.fit_model_batch), then one epoch of fit, as bench.gpu_parts.budgeted_runs. The CUDA caching
allocator's figures: *peak* is allocated_bytes.all.peak (torch.cuda.max_memory_allocated, the figure the budget is
held against), *requested* is requested_bytes.all.peak (the bytes the step's tensors and workspaces asked for),
*slack* = peak - requested (the blocks handed out beyond the request). *measured step*: the search's measurement
at the chosen batch; *full steps*: the training steps on a batch of that size; *run peak*: the whole run's
max_memory_allocated (every step, evaluation and what ran between them). Variants other than split* run with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (the allocator as before edgeflux.memory.blocks).
"""


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.synthetic and not args.worker and any(VARIANTS[v].get("history") for v in args.variants):
        sys.exit("--synthetic: the history variants measure the dataset's images (bench.gpu_parts.memory_rows)")
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch finds no CUDA device here; use --device cpu to try the script")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "cuda_budget_probe_runs"
    tmp.mkdir(exist_ok=True)
    jobs = args.jobs or (len(args.variants) if args.device == "cuda" else 1)
    with ThreadPoolExecutor(jobs) as pool:
        infos = list(pool.map(lambda v: run_variant(args, v, tmp), args.variants))
    for path in tmp.glob("*.json"):
        path.unlink()
    tmp.rmdir()
    rows = [summarize(i) for i in infos]
    result = BenchResult()
    result.rows = rows
    cfg = QUICK if args.quick else FULL
    name = f"cuda_budget_probe_{args.device}" + ("_synthetic" if args.synthetic else "")
    result.write(name, args.out, title="A budgeted CUDA run, step by step: the measured step against every "
                 "step and evaluation of its epoch", columns=COLUMNS,
                 md_rows=rows, notes=NOTES + "\n" + findings(rows),
                 extra={"settings": cfg, "variants": {v: VARIANTS[v] for v in args.variants},
                        "runs": infos, "complete": all("error" not in i for i in infos)})
    for r in rows:
        print({k: r.get(k) for k in ("variant", "batch", "measured_peak_mib", "run_peak_mib", "worst_slack_mib",
                                     "measured_slack_mib", "within", "error") if k in r}, flush=True)
    print(f"wrote {args.out / name}.json and .md")
    return 0 if all("error" not in i for i in infos) else 1


if __name__ == "__main__":
    sys.exit(main())
