"""Stage report: the summary table (reports/summary.md) and accuracy-vs-time plot of every stage.

`python -m stages.report --show` prints the last summary without recomputing it (the Makefile's
`run` target does this after `dvc repro`, which skips the stage when nothing changed).
"""
from __future__ import annotations

import sys
from pathlib import Path

from edgeflux.report import markdown_table, plot_accuracy_vs_time, summary_rows
from stages.common import run_stage, stage_parser

SUMMARY, PLOT = Path("reports/summary.md"), Path("reports/accuracy_vs_time.png")
CURVES = {"backprop (train_bp)": Path("plots/train_bp.csv"), "NeuroFlux (train_blocks)": Path("plots/train_blocks.csv")}


def show() -> None:
    from edgeflux.tracking import ui_command

    if not SUMMARY.exists():
        sys.exit(f"error: {SUMMARY} does not exist yet; run `dvc repro` first")
    print(SUMMARY.read_text())  # plain markdown: readable in any terminal width, pastes into notes
    print(f"Plot: {PLOT}\nBrowse every run in MLflow:  {ui_command()}  (then open http://127.0.0.1:5000)")


def main(args, params) -> None:
    if args.show:
        return show()
    from edgeflux.tracking import stage_run

    with stage_run("report", params.report.model_dump()) as run:
        rows = summary_rows(target_acc=params.report.target_acc)
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY.write_text("# edgeflux pipeline summary\n\n" + markdown_table(rows)
                           + f"\n'to target s': training time until validation accuracy first reached "
                             f"{params.report.target_acc:.0%}. "
                             "Peaks are measured (live tensor bytes of a steady-state training step on CPU; "
                             "the CUDA allocator's peak on GPU).\n")
        plot_accuracy_vs_time(CURVES, PLOT, target_acc=params.report.target_acc)
        run.log_artifact(SUMMARY)
        run.log_artifact(PLOT)


if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--show", action="store_true", help="print the existing summary and the MLflow UI command, then exit")
    run_stage(main, parser)
