"""One prepared run on an NVIDIA GPU: everything edgeflux has to show there, in one command.

Parts, in this order (each writes <out>/<part>_<device>.{json,md,png}):

* tests       the CUDA tests (``pytest -m cuda tests/test_cuda.py``: the device variants of the library's
              tests; they import the library only, no DVC, Prefect or MLflow);
* memory      one training step's peak measured two ways, the CUDA caching allocator
              (``torch.cuda.max_memory_allocated``) beside the CPU allocator's figure for the same step, and
              the difference split into allocator rounding, cuDNN, cuBLAS workspaces and CUDA vs CPU kernels,
              parts that add up to it exactly; then budgeted backprop runs whose whole
              training loop is held against the budget by the allocator's own peak;
* neuroflux   NeuroFlux vs backprop at the paper's budgets (VGG-16, 250 and 500 MiB on a GPU), one run per
              seed (bench/neuroflux.py), aggregated to mean and 95% interval of time to the target accuracy,
              speed-up and samples/s; a seed starts only while the parts after it keep their time;
* throughput  samples/s vs batch size on the GPU (bench/batch_throughput.py): what a larger batch buys there;
* bittrain    BitTrain on CUDA: saved bytes dense vs stored, the step's peak and its time against dense;
* finetune    MobileTL and ElasticTrainer on CUDA: one short transfer run each under one budget (peak,
              batch, step time, test accuracy, the elastic speed-up over full fine-tuning).

A part whose result says complete is skipped when the script runs again (each NeuroFlux seed too), so a
second short run finishes a first that was cut off; --deadline stops starting new work in time to write
what is done. <out>/gpu_<device>.{json,md} says what ran, what was skipped and what failed, and why.

    python -m bench.gpu --out /tmp/gpu                          # on a CUDA machine (about 8 minutes on an H100)
    python -m bench.gpu --quick --device cpu --out /tmp/gpu     # the same code here, on the CPU, in minutes
    bash bench/gpu_run.sh                                       # the device tool's runner (see that file)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from bench import batch_throughput, neuroflux
from bench.common import METHOD_COLOURS, RESULTS_DIR, BenchResult, HelpFormatter, fmt_ci, mean_ci, program_name
from bench.gpu_parts import (aggregate_neuroflux, bittrain_rows, budgeted_runs, finetune_rows, memory_rows,
                              plot_memory, plot_neuroflux)
from edgeflux.memory import format_bytes

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "memory", "neuroflux", "throughput", "bittrain", "finetune")
# t quantiles (0.975) for the 95% interval of a mean over n runs, by n - 1
NEEDS_S = {"tests": 30, "memory": 40, "bittrain": 40, "finetune": 60, "neuroflux": 95, "throughput": 60}
FULL = {"nf": ["--models", "vgg16", "--width", "1.0", "--budgets-mib", "250", "500", "--train-samples", "15000",
               "--eval-samples", "2000", "--test-samples", "0", "--epochs", "2", "--bp-epochs", "3",
               "--target-acc", "0.85"],
        "tp": ["--models", "vgg16", "resnet18", "--width", "1.0", "--batches", "1", "2", "4", "8", "16", "32", "64",
               "128", "256", "--samples", "512", "--rounds", "3"]}
QUICK = {"nf": ["--quick", "--budgets", "3.0"], "tp": ["--quick"], "tests": ["-k", "categories or resolve_device"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=program_name(), description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="where to run: cuda on the GPU machine, cpu to try the same code here")
    parser.add_argument("--quick", action="store_true", help="CI-sized settings (small models, little data)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for every part's results")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in this order")
    parser.add_argument("--seeds", type=int, default=3, help="NeuroFlux runs (seeds 0..N-1) per budget")
    parser.add_argument("--deadline", type=float, default=480.0,
                        help="seconds after which no part or seed starts (what is done is written)")
    parser.add_argument("--redo", action="store_true", help="run parts again even when their results are complete")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: redraw the plots and the NeuroFlux aggregate from the JSON files in "
                             "--out (their machine and command kept), e.g. after a change to a table or a plot")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available() and not args.render:
        parser.error("--device cuda: torch finds no CUDA device here; use --device cpu to try the script on a CPU")
    args.started = time.perf_counter()
    return args


def left_s(args) -> float:
    return args.deadline - (time.perf_counter() - args.started)


def done(path: Path) -> bool:
    """A result file that a finished part wrote (a cut-off part writes none)."""
    try:
        return json.loads(path.read_text()).get("complete", False)
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------- parts

def part_tests(args, name: str) -> None:
    """The device variants of tests/test_cuda.py through pytest; counts and every test's outcome."""
    xml = args.out / f"{name}.xml"
    marker = "cuda" if args.device == "cuda" else "not cuda"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "tests/test_cuda.py",
           f"--junitxml={xml}", *(QUICK["tests"] if args.quick else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tests = [{"test": f"{c.get('classname', '').split('.')[-1]}::{c.get('name')}",
              "outcome": next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed"),
              "seconds": float(c.get("time", 0))} for c in ET.parse(xml).getroot().iter("testcase")]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
    result = BenchResult()
    result.rows = tests
    result.write(name, args.out, title=f"The CUDA tests on {args.device}", notes=f"`{' '.join(cmd[2:])}`: "
                 f"{counts}; pytest exit code {proc.returncode}.\n\n```\n{proc.stdout[-3000:]}\n```",
                 extra={"counts": counts, "returncode": proc.returncode, "complete": True})
    xml.unlink()
    if proc.returncode != 0 or not tests:
        raise RuntimeError(f"pytest exit code {proc.returncode}: {counts}")


def part_memory(args, name: str) -> str | None:
    rows = memory_rows(args.device, args.quick)
    runs = budgeted_runs(args.device, args.quick)
    result = BenchResult()
    result.rows = rows
    mib = lambda n: "-" if n is None else f"{n / 2**20:.2f}"  # noqa: E731
    md = [{"model": f"{r['model']} w{r['width']:g}", "batch": r["batch"], "cpu": mib(r["cpu_peak"]),
           "dev": mib(r["peak"]), "diff": mib(r["peak"] - r["cpu_peak"]), "round": mib(r["rounding"]),
           "cudnn": mib(r["cudnn"]), "ws": mib(r["workspaces"]), "kernels": mib(r["kernels"]),
           "saved_cpu": mib(r["cpu_saved"]),
           "saved_dev": mib(r["saved"]), "reserved": mib(r["reserved_peak"])} for r in rows]
    result.add_section("Budgeted backprop on the device: the chosen batch's measured step, and the allocator's peak "
                       "over the whole training run (every step, the evaluations), against the budget", [
                           {**r, "budget": mib(r["budget_bytes"]), "step_peak": mib(r["step_peak_bytes"]),
                            "run_peak": mib(r["run_peak_bytes"])} for r in runs],
                       {"model": "model", "budget": "budget MiB", "batch": "batch", "step_peak": "step peak MiB",
                        "run_peak": "whole-run allocator peak MiB", "steps": "steps", "within": "run peak <= budget"})
    notes = MEMORY_NOTES.format(device=args.device)
    result.write(name, args.out, title=f"One training step's memory, {args.device} allocator vs CPU allocator",
                 md_rows=md, notes=notes, extra={"budgeted_runs": runs, "complete": True},
                 columns={"model": "model", "batch": "batch", "cpu": "CPU peak", "dev": f"{args.device} peak",
                          "diff": "difference", "round": "rounding", "cudnn": "cuDNN", "ws": "cuBLAS workspaces",
                          "kernels": "CUDA vs CPU kernels",
                          "saved_cpu": "saved (CPU)", "saved_dev": f"saved ({args.device})",
                          "reserved": "reserved peak"})
    plot_memory(rows, args.out / f"{name}.png", args.device)
    over = [r["model"] for r in runs if not r["within"]]
    return f"over its budget by the allocator's figure: {', '.join(over)}" if over else None


MEMORY_NOTES = """All sizes MiB. One SGD-momentum step in steady state on real Fashion-MNIST images (1x32x32), measured
by edgeflux.memory.measure_training_peak twice on the same weights and batch: on {device} (CUDA: the caching
allocator's max_memory_allocated after reset_peak_memory_stats) and on the CPU (the CPU allocator's events over the
step). difference = {device} peak - CPU peak = rounding + cuDNN + cuBLAS workspaces + CUDA vs CPU kernels, exactly:
rounding is the allocator's allocated peak minus its requested peak (blocks rounded up to 512 bytes); cuDNN is the
requested peak with cuDNN minus the requested peak of the same step with cuDNN off (cuDNN's workspaces and what its
kernels keep, against CUDA's native kernels: negative where the native ones need more); cuBLAS workspaces are the
bytes the device holds for no tensor of the step (made on first use and kept, so they sit in the allocator's figure
from the step's start: a fixed cost of training on CUDA, which the budget counts); CUDA vs CPU kernels is what
remains (the native CUDA kernels against oneDNN's and ATen's CPU kernels: scratch and saved tensors differ; the saved
columns show the saved-for-backward part). reserved peak: what the caching allocator held from the driver (the
process's real GPU use, CUDA context aside), not the budget's figure. On a CPU-only run the device columns repeat the
CPU's and the split is empty."""


def part_bittrain(args, name: str) -> None:
    rows = bittrain_rows(args.device, args.quick)
    result = BenchResult()
    result.rows = rows
    mib = lambda n: "-" if n is None else f"{n / 2**20:.2f}"  # noqa: E731
    md = [{**r, "peak": mib(r["peak_bytes"]), "dense": mib(r["dense_bytes"]), "stored": mib(r["stored_bytes"]),
           "step_ms": f"{1e3 * r['step_s']:.2f}", "ratio": f"{r['step_ratio']:.2f}",
           "peak_cut": f"{100 * r['peak_reduction']:.1f}%"} if "error" not in r else {**r, "peak": r["error"]}
          for r in rows]
    result.write(name, args.out, title=f"BitTrain on {args.device}: saved bytes, peak and step time", md_rows=md,
                 columns={"model": "model", "batch": "batch", "variant": "variant", "dense": "saved dense MiB",
                          "stored": "saved as stored MiB", "peak": "step peak MiB", "peak_cut": "peak vs dense",
                          "step_ms": "ms/step (median)", "ratio": "time vs dense"},
                 notes="Real Fashion-MNIST batch, SGD momentum, width as named. Saved bytes: BitTrain's own accounting "
                       "of what autograd saved (dense) and what it keeps (stored). Peak: the device allocator's over "
                       "one steady-state step. Time: median of interleaved repetitions, each ending in loss.item().",
                 extra={"complete": True})


def part_finetune(args, name: str) -> None:
    rows, info = finetune_rows(args.device, args.quick)
    result = BenchResult()
    result.rows = rows
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    md = [{**r, "peak": mib(r["peak_mem_bytes"]), "step_ms": f"{1e3 * r['step_time_s']:.2f}",
           "train_s": f"{r['train_time_s']:.2f}",
           "speedup": f"x{r['speedup_vs_ft_all']:.2f}" if r["speedup_vs_ft_all"] else "-"}
          if "error" not in r else {**r, "peak": r["error"]} for r in rows]
    result.write(name, args.out, title=f"MobileTL and ElasticTrainer on {args.device}, one budget", md_rows=md,
                 columns={"method": "method", "batch_size": "batch", "peak": "step peak MiB",
                          "trainable_params": "trainable params", "step_ms": "ms/step", "train_s": "train s",
                          "speedup": "train time vs ft_all", "test_acc": "test acc"},
                 notes=FINETUNE_NOTES.format(**info), extra={**info, "complete": True})


FINETUNE_NOTES = """{model} pre-trained on Fashion-MNIST classes 0-4 ({pretrain_samples} images, {pretrain_epochs}
epochs, Adam), then fine-tuned on classes 5-9 ({train_samples} images, {epochs} epochs, Adam lr 1e-3) by each method
under one budget, {budget_mib:.1f} MiB (plain backprop's measured step at batch {budget_batch}); each method trains at
the largest batch whose measured step fits. Test accuracy on the whole target test split. elastic: ElasticTrainer
(rho {rho}) over every tensor (on ft_all) or over MobileTL's (elastic-mobiletl); its train time includes profiling and
selection. train time vs ft_all: ft_all's training seconds over the method's."""


def part_neuroflux(args, name: str) -> None:
    """One bench/neuroflux.py run per seed (kept per seed, so a rerun goes on), then the aggregate."""
    seeds_dir = args.out / f"{name}_seeds"
    need = NEEDS_S["neuroflux"]
    later = PARTS[PARTS.index("neuroflux") + 1:]
    reserve = sum(NEEDS_S[p] for p in later if p in args.parts and not done(args.out / f"{p}_{args.device}.json"))
    for seed in range(args.seeds):
        part = seeds_dir / f"seed{seed}.json"
        if part.exists() and not args.redo:
            continue
        if left_s(args) - reserve < need:   # the parts after this one get their time first
            print(f"neuroflux: seed {seed} not started ({left_s(args):.0f}s left, {reserve}s kept for "
                  f"{', '.join(later)}, a seed takes {need:.0f}s)")
            break
        started = time.perf_counter()
        neuroflux.main([*(QUICK if args.quick else FULL)["nf"], "--methods", "backprop", "--device", args.device,
                        "--seeds", str(seed), "--out", str(seeds_dir), "--name", f"seed{seed}"])
        need = time.perf_counter() - started + 10
    runs = [json.loads(p.read_text()) for p in sorted(seeds_dir.glob("seed*.json"))]
    if not runs:
        raise RuntimeError("no NeuroFlux seed finished")
    write_neuroflux(args, name, runs, complete=len(runs) >= args.seeds)


def write_neuroflux(args, name: str, runs: list[dict], complete: bool, measured_by: dict | None = None) -> None:
    rows, speedups, goals = aggregate_neuroflux(runs, mean_ci)
    result = BenchResult()
    result.rows = rows
    md = [{"model": r["model"], "method": r["method"], "budget": format_bytes(r["budget_bytes"]),
           "batch": r["batches"], "peak": format_bytes(r["peak_max"]) if r["peak_max"] else "infeasible",
           "within": r["within_budget"], "t": fmt_ci(r["time_to_target_s"], " s"), "acc": fmt_ci(r["test_acc"]),
           "sps": fmt_ci(r["samples_per_s"], "", 4)} for r in rows]
    result.add_section("NeuroFlux's speed-up to the target over backprop (backprop's time / NeuroFlux's, per seed)",
                       [{**s, "speedup": fmt_ci(s["speedup"])} for s in speedups],
                       {"model": "model", "budget": "budget", "speedup": "speed-up, mean [95% interval]",
                        "reached": "seeds where both reached the target"})
    result.add_section("Targets", goals)
    target = runs[0]["settings"]["target_acc"]
    result.write(name, args.out, title=f"NeuroFlux vs backprop at equal budgets on {args.device}", md_rows=md,
                 columns={"model": "model", "method": "method", "budget": "budget", "batch": "batch per block",
                          "peak": "max measured peak", "within": "peak <= budget", "t": f"s to {target:.0%}",
                          "acc": "final test acc", "sps": "training samples/s"},
                 notes=f"Mean and 95% interval (Student's t) over seeds; per-seed results in {name}_seeds/. "
                       f"Settings: {runs[0]['notes']}",
                 extra={"speedups": speedups, "targets": goals, "n_seeds": len(runs), "seed_runs": [r["command"] for r in runs],
                        "complete": complete}, measured_by=measured_by)
    plot_neuroflux(runs, args.out / f"{name}.png", target, METHOD_COLOURS)


def part_throughput(args, name: str) -> None:
    seeds = args.out / f"neuroflux_{args.device}_seeds" / "seed0.json"
    batch_throughput.main([*(QUICK if args.quick else FULL)["tp"], "--device", args.device, "--name", name,
                           "--out", str(args.out), "--neuroflux-json", str(seeds)])
    path = args.out / f"{name}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "complete": True}, indent=2) + "\n")


def render(args) -> None:
    """The plots and the NeuroFlux aggregate again, from what the parts wrote (any device's)."""
    for device in ("cuda", "cpu"):
        if (mem := args.out / f"memory_{device}.json").exists():
            plot_memory(json.loads(mem.read_text())["rows"], args.out / f"memory_{device}.png", device)
        name = f"neuroflux_{device}"
        runs = [json.loads(p.read_text()) for p in sorted((args.out / f"{name}_seeds").glob("seed*.json"))]
        if runs:
            old = json.loads((args.out / f"{name}.json").read_text())
            args.device = device
            write_neuroflux(args, name, runs, complete=len(runs) >= args.seeds, measured_by=old)
        print(f"rendered the {device} results in {args.out}" if runs else f"no {device} NeuroFlux runs in {args.out}")


RUNNERS = {"tests": part_tests, "memory": part_memory, "bittrain": part_bittrain, "finetune": part_finetune,
           "neuroflux": part_neuroflux, "throughput": part_throughput}


def run_part(args, part: str) -> dict:
    name = f"{part}_{args.device}"
    if done(args.out / f"{name}.json") and not args.redo:
        return {"part": part, "status": "kept (complete from an earlier run)", "seconds": 0.0}
    if left_s(args) < NEEDS_S[part] and part != "neuroflux":
        return {"part": part, "status": f"not started: {left_s(args):.0f}s left before the deadline", "seconds": 0.0}
    print(f"== {part} ({left_s(args):.0f}s left)", flush=True)
    started = time.perf_counter()
    try:
        found = RUNNERS[part](args, name)   # what a part found that its reader must see (a missed target)
        status = "done" if done(args.out / f"{name}.json") else "partly done (run again to finish)"
        status += f"; {found}" if found else ""
    except Exception as exc:   # noqa: BLE001 - one failing part must not cost the others their device time
        traceback.print_exc()
        status = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    seconds = time.perf_counter() - started
    print(f"== {part}: {status} in {seconds:.0f}s", flush=True)
    return {"part": part, "status": status, "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(args)
        return 0
    torch.manual_seed(0)
    parts = [run_part(args, p) for p in PARTS if p in args.parts]
    result = BenchResult()
    result.rows = parts
    result.write(f"gpu_{args.device}", args.out, title=f"bench.gpu on {args.device}: what ran",
                 notes=f"Total {time.perf_counter() - args.started:.0f}s; deadline {args.deadline:g}s.")
    failed = [p for p in parts if p["status"].startswith("failed")]
    print(f"bench.gpu: {len(parts) - len(failed)} of {len(parts)} parts without failure; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
