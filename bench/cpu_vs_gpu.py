"""docs/cpu_vs_gpu.md: what the committed CPU benchmarks and the committed GPU run (bench/gpu.py) each show,
side by side. Every figure is read from bench/results/*.json; a figure whose file is missing shows as "-".

    python -m bench.cpu_vs_gpu            # rewrites docs/cpu_vs_gpu.md
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import RESULTS_DIR, markdown_table, pm

DOC = Path(__file__).resolve().parents[1] / "docs" / "cpu_vs_gpu.md"


def load(name: str) -> dict | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def pick(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def machine(result: dict | None) -> str:
    if not result:
        return "-"
    m = result["machine"]
    return f"{m['cuda_device'] or m['cpu']}, torch {m['torch']}, {m['date'][:10]}"


def batch_lever(result: dict | None, model: str) -> str:
    """Best samples/s over samples/s at batch 1, and where the best is."""
    if not result:
        return "-"
    rows = [r for r in result["rows"] if r["model"] == model]
    best, one = max(rows, key=lambda r: r["samples_per_s"]), pick(rows, batch=1)
    return (f"{model}: x{best['samples_per_s'] / one['samples_per_s']:.1f} "
            f"({one['samples_per_s']:.0f} -> {best['samples_per_s']:.0f} samples/s, best at batch {best['batch']})")


def ceiling(result: dict | None, model: str) -> str:
    """The ceiling of backprop's smallest batch (its tightest budget) for `model`."""
    runs = [c for c in (result or {}).get("ceilings", []) if c["model"] == model]
    if not runs:
        return "-"
    c = min(runs, key=lambda c: c["backprop_batch"])
    return f"{c['model']}, backprop at batch {c['backprop_batch']}: x{c['ceiling_speedup']:.2f}"


def neuroflux_cpu(result: dict | None) -> str:
    if not result:
        return "-"
    s = pick(result["speedups"], model="vgg16-w0.25", budget_frac_of_bp_min=1.5)
    if s is None or s.get("judged_vs_backprop") is None:
        return "-"
    return (f"{s['model']} at {s['budget_bytes'] / 2**20:.1f} MiB (1.5x backprop's minimum): "
            f"x{pm(s, 'judged_vs_backprop', digits=3)} (mean ± 95% interval, {s['n_seeds']} seeds)")


def neuroflux_gpu(result: dict | None) -> str:
    if not result:
        return "-"
    goal = result["targets"][0]
    only = [r for r in result["rows"] if r["method"] == "NeuroFlux" and
            not pick(result["rows"], method="backprop", budget_bytes=r["budget_bytes"])["feasible"]]
    alone = "; ".join(f"at {r['budget_bytes'] / 2**20:.0f} MiB backprop cannot train and NeuroFlux reaches the "
                      f"target in {r['time_to_target_s']['mean']:.1f} s [{r['time_to_target_s']['lo']:.1f}, "
                      f"{r['time_to_target_s']['hi']:.1f}]" for r in only if r["time_to_target_s"]["lo"] is not None)
    return f"{goal['target'].split(', ', 1)[1]}: {goal['measured']} ({goal['met']}); {alone}"


def memory_split(result: dict | None) -> str:
    if not result:
        return "-"
    r = pick(result["rows"], model="vgg16", width=1.0, batch=64)
    mib = 2**20
    return (f"vgg16 w1 batch 64: CPU {r['cpu_peak'] / mib:.1f} MiB, CUDA {r['peak'] / mib:.1f} MiB = CPU + "
            f"{r['workspaces'] / mib:.1f} cuBLAS workspaces + {r['cudnn'] / mib:.1f} cuDNN + {r['rounding'] / mib:.1f} "
            f"rounding {r['kernels'] / mib:+.1f} kernels")


def bittrain(result: dict | None, case: str, cpu: bool) -> str:
    if not result:
        return "-"
    if cpu:
        r = pick(result["rows"], case=case)
        ratio, cut = r["step_time_ratio"], r["peak_reduction"]
    else:
        r = pick(result["rows"], model=case, variant="bitmap")
        ratio, cut = r["step_ratio"], r["peak_reduction"]
    return f"{case.rsplit(' bitmap', 1)[0]}: step x{ratio:.2f} of dense, peak -{100 * cut:.1f}%"


def elastic_cpu(result: dict | None) -> str:
    if not result:
        return "-"
    r, full = (pick(result["rows"], model="mobilenet_v2-w0.5", method=m, rho=rho) for m, rho in
               (("elastic", 0.5), ("full", None)))
    return (f"mobilenet_v2 w0.5: x{r['speedup_vs_full']:.2f} training time, test acc {r['test_acc']:.3f} vs "
            f"{full['test_acc']:.3f}")


def finetune_gpu(result: dict | None, method: str) -> str:
    if not result:
        return "-"
    r, full = pick(result["rows"], method=method), pick(result["rows"], method="ft_all")
    if "error" in r:
        return f"{method} cannot run: {r['error'].split('(', 1)[1].strip(')').strip(chr(39))}"
    return (f"mobilenet_v2 w1 {method}: x{r['speedup_vs_ft_all']:.2f} training time, batch {r['batch_size']} vs "
            f"{full['batch_size']}, test acc {r['test_acc']:.3f} vs {full['test_acc']:.3f}")


def mobiletl_cpu(result: dict | None) -> str:
    if not result:
        return "-"
    r, full = (pick(result["rows"], case="budget", model="mobilenet_v2-w0.5", method=m) for m in ("mobiletl", "ft_all"))
    return f"mobilenet_v2 w0.5: batch {r['batch']} vs ft_all's {full['batch']} under one budget"


def main() -> None:
    c = {n: load(n) for n in ("batch_throughput", "neuroflux", "bittrain", "elastic", "mobiletl")}
    g = {n: load(f"{n}_cuda") for n in ("throughput", "neuroflux", "memory", "bittrain", "finetune", "tests")}
    rows = [
        {"what": "a larger batch's speed-up (samples/s, best batch over batch 1)",
         "cpu": batch_lever(c["batch_throughput"], "vgg16-w0.25"), "gpu": batch_lever(g["throughput"], "vgg16-w1")},
        {"what": "the most a larger batch could speed up backprop at its budget's batch",
         "cpu": ceiling(c["batch_throughput"], "vgg16-w0.25"), "gpu": ceiling(g["throughput"], "vgg16-w1")},
        {"what": "NeuroFlux's time to 85% test accuracy against backprop's, same budget",
         "cpu": neuroflux_cpu(c["neuroflux"]), "gpu": neuroflux_gpu(g["neuroflux"])},
        {"what": "one training step's peak, two allocators (both measured on the GPU machine)",
         "cpu": "-", "gpu": memory_split(g["memory"])},
        {"what": "BitTrain (bitmap, exact): step time and peak against dense",
         "cpu": bittrain(c["bittrain"], "resnet18 w0.25 b32 bitmap", cpu=True),
         "gpu": bittrain(g["bittrain"], "resnet18 w1", cpu=False)},
        {"what": "ElasticTrainer (rho 0.5) against full fine-tuning",
         "cpu": elastic_cpu(c["elastic"]), "gpu": finetune_gpu(g["finetune"], "elastic")},
        {"what": "ElasticTrainer on a MobileTL model (rho 0.5)", "cpu": "-",
         "gpu": finetune_gpu(g["finetune"], "elastic-mobiletl")},
        {"what": "MobileTL against full fine-tuning under one budget",
         "cpu": mobiletl_cpu(c["mobiletl"]), "gpu": finetune_gpu(g["finetune"], "mobiletl")},
    ]
    counts = g["tests"]["counts"] if g["tests"] else None
    tests = (f"{counts['passed']} passed, {counts['failure'] + counts['error']} failed, {counts['skipped']} skipped"
             if counts else None)
    cpu_runs = "; ".join(f"{what}: {machine(c[name])}" for name, what in (
        ("batch_throughput", "throughput"), ("neuroflux", "NeuroFlux"), ("bittrain", "BitTrain"),
        ("elastic", "ElasticTrainer"), ("mobiletl", "MobileTL")))
    text = f"""# CPU vs GPU: what each machine shows

Generated by `python -m bench.cpu_vs_gpu` from the committed results in `bench/results/` (do not edit by hand).
The GPU column is one run of `bench/gpu.py` (`bash bench/gpu_run.sh`, see [benchmarks](benchmarks.md#gpu));
the CPU column is the committed CPU benchmark of the same question, often at a narrower width (named in each
cell). Sizes and settings differ between the columns: compare the ratios, not the absolute figures.

- GPU: {machine(g['throughput'])}; CUDA tests there: {tests or '-'}.
- CPU, each result's own run: {cpu_runs}.

{markdown_table(rows, {"what": "question", "cpu": "CPU", "gpu": "GPU"})}

Files: `bench/results/{{throughput,neuroflux,memory,bittrain,finetune,tests,gpu}}_cuda.{{json,md,png}}`, per-seed
NeuroFlux runs in `bench/results/neuroflux_cuda_seeds/`, the runs' logs in `bench/results/gpu_cuda_log.txt`.
"""
    DOC.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
