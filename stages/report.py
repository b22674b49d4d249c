"""Stage report: the summary table (reports/summary.md), the accuracy-vs-time plot of every stage and
the memory plot (reports/memory.png: train_bp's measured peak by kind and saved activations per unit,
NeuroFlux's measured peak per block against the budget).

`python -m stages.report --show` prints the last summary without recomputing it (the Makefile's
`run` target does this after `dvc repro`, which skips the stage when nothing changed).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from edgeflux.report import markdown_table, memory_panels, plot_accuracy_vs_time, plot_bar_panels, summary_rows
from stages.common import run_stage, stage_parser

SUMMARY, PLOT, MEMORY_PLOT = Path("reports/summary.md"), Path("reports/accuracy_vs_time.png"), Path("reports/memory.png")
# What the report reads, each path once: the same files dvc.yaml lists as this stage's deps.
METRICS = {"pretrain": Path("metrics/pretrain.json"), "train_bp": Path("metrics/train_bp.json"),
           "train_blocks": Path("metrics/train_blocks.json"), "select_exit": Path("metrics/select_exit.json")}
STAGE_CURVES = {"train_bp": Path("plots/train_bp.csv"), "train_blocks": Path("plots/train_blocks.csv")}
TRAIN_BP_MEMORY = Path("memory/train_bp.json")
MEMORY_SOURCES = {"train_bp_memory": TRAIN_BP_MEMORY, "train_blocks": METRICS["train_blocks"]}
CURVES = {"backprop (train_bp)": STAGE_CURVES["train_bp"], "NeuroFlux (train_blocks)": STAGE_CURVES["train_blocks"]}
FINETUNE_METRICS, FINETUNE_CURVES = Path("metrics/finetune"), Path("plots/finetune")   # <method>.json / .csv


def read_existing(paths: dict[str, Path]) -> dict[str, dict]:
    """The JSON files of `paths` that exist (a stage not run yet wrote none), parsed, under the same keys."""
    return {key: json.loads(path.read_text()) for key, path in paths.items() if path.exists()}


def show() -> None:
    from edgeflux.tracking import ui_command

    if not SUMMARY.exists():
        sys.exit(f"error: {SUMMARY} does not exist yet; run `dvc repro` first")
    print(SUMMARY.read_text())  # plain markdown: readable in any terminal width, pastes into notes
    print(f"Plots: {PLOT}, {MEMORY_PLOT}\nBrowse every run in MLflow:  {ui_command()}  (then open http://127.0.0.1:5000)")


def main(args, params) -> None:
    if args.show:
        return show()
    from edgeflux.tracking import stage_run

    with stage_run("report", params.report.model_dump()) as run:
        metrics, curves, plotted = read_existing(METRICS), dict(STAGE_CURVES), dict(CURVES)
        for method in params.finetune.methods if params.finetune else []:   # the methods in params, not stale files
            metrics.setdefault("finetune", {}).update(read_existing({method: FINETUNE_METRICS / f"{method}.json"}))
            curves[f"finetune {method}"] = plotted[f"fine-tune {method}"] = FINETUNE_CURVES / f"{method}.csv"
        rows = summary_rows(metrics, curves, target_acc=params.report.target_acc)
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY.write_text("# edgeflux pipeline summary\n\n" + markdown_table(rows)
                           + f"\n'to target s': training time until validation accuracy first reached "
                             f"{params.report.target_acc:.0%}. "
                             "Peaks are measured: the allocator's peak over a steady-state training step "
                             "(the CPU allocator's events on CPU, the CUDA allocator's counter on GPU).\n")
        plot_accuracy_vs_time(plotted, PLOT, target_acc=params.report.target_acc)
        if panels := memory_panels(**read_existing(MEMORY_SOURCES)):
            plot_bar_panels(panels, MEMORY_PLOT, title="edgeflux pipeline: measured training memory")
        for path in (SUMMARY, PLOT, MEMORY_PLOT):
            if path.exists():
                run.log_artifact(path)


if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--show", action="store_true", help="print the existing summary and the MLflow UI command, then exit")
    run_stage(main, parser)
