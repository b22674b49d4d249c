"""Stage report: every method side by side under one budget (reports/summary.md, reports/summary.json and
reports/pareto.png: accuracy vs measured peak memory and vs training CPU time), the accuracy-vs-time
curves of every training stage (reports/accuracy_vs_time.png) and the memory plot (reports/memory.png:
train_bp's measured peak by kind and saved activations per unit, NeuroFlux's measured peak per block
against the budget). Rows come from each stage's headline (metrics/) and details (details/) files.

`python -m stages.report --show` prints the last summary without recomputing it (the Makefile's
`run` target does this after `dvc repro`, which skips the stage when nothing changed).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from edgeflux.config import budgeted_sections
from edgeflux.report import memory_panels, plot_accuracy_vs_time, plot_bar_panels, time_to_target, read_curve
from edgeflux.rows import MethodRow, RowInputs
from edgeflux.summary import mark_pareto, plot_pareto, rows_json, summary_markdown
from stages.common import DETAILS_DIR, METRICS_DIR, run_stage, stage_parser
from stages.registry import Stage, stages

STAGE = Stage(name="report", section="report", side="device",
              outs=("reports/summary.md", "reports/summary.json", "reports/pareto.png",
                    "reports/accuracy_vs_time.png", "reports/memory.png"))

REPORTS = Path("reports")
SUMMARY, SUMMARY_JSON, PARETO = REPORTS / "summary.md", REPORTS / "summary.json", REPORTS / "pareto.png"
PLOT, MEMORY_PLOT = REPORTS / "accuracy_vs_time.png", REPORTS / "memory.png"
TRAIN_BP_MEMORY = Path("memory/train_bp.json")


def read_existing(paths: dict[str, Path]) -> dict[str, dict]:
    """The JSON files of `paths` that exist (a stage not run yet wrote none), parsed, under the same keys."""
    return {key: json.loads(path.read_text()) for key, path in paths.items() if path.exists()}


def show() -> None:
    from edgeflux.tracking import ui_command, ui_url

    if not SUMMARY.exists():
        sys.exit(f"error: {SUMMARY} does not exist yet; run `dvc repro` first")
    print(SUMMARY.read_text())  # plain markdown: readable in any terminal width, pastes into notes
    print(f"Plots: {PARETO}, {PLOT}, {MEMORY_PLOT}\nBrowse every run in MLflow:  {ui_command()}  "
          f"(then open {ui_url()}; flip its sidebar's switch to Machine learning once, so runs keep that view)")


def stage_files(methods: list[str]) -> list[str]:
    """The names of every stage's headline and details files (finetune runs as finetune/<method>)."""
    return [f for s in stages() if s.name != STAGE.name for f in s.files(methods)]


def row_inputs(params, head: dict, detail: dict) -> RowInputs:
    bittrain = {s: bool(getattr(params, s) and getattr(params, s).bittrain.enabled) for s in budgeted_sections()}
    return RowInputs(head, detail, bittrain, params.finetune.model if params.finetune else None)


def collect_rows(inputs: RowInputs, registered: list[Stage] | None = None) -> list[MethodRow]:
    """Every registered stage's rows, in dvc.yaml's order, with the Pareto front marked."""
    registered = stages() if registered is None else registered
    return mark_pareto([row for s in registered if s.rows for row in s.load_module().summary_rows(inputs)])


def curves() -> list[Path]:
    """The accuracy-vs-time files the report may read: each stage's curve (finetune's: its folder)."""
    return [Path(s.curve).parent if s.matrix else Path(s.curve) for s in stages() if s.curve]


def read_rows(params) -> tuple[list[MethodRow], dict[str, dict], dict[str, float | None]]:
    """Every method's row from what the stages wrote (the methods in params, not stale files), each with its CPU
    time to the report's target; the headlines read; the budget of each budgeted stage."""
    methods = params.finetune.methods if params.finetune else []
    names = stage_files(methods)
    head = read_existing({n: METRICS_DIR / f"{n}.json" for n in names})
    detail = read_existing({n: DETAILS_DIR / f"{n}.json" for n in names})
    rows = collect_rows(row_inputs(params, head, detail))
    for row in rows:
        if row.curve is not None and Path(row.curve).exists():
            row.to_target_cpu_s = time_to_target(*read_curve(Path(row.curve), x="cpu_s"), params.report.target_acc)
    budgeted = {s.name for s in stages() if s.budgeted}   # rows of other stages repeat a budgeted stage's budget
    budgets = {r.stage.split("@")[0]: r.budget_mib for r in rows if r.stage.split("@")[0] in budgeted}
    return rows, head, budgets


def draw(rows: list[MethodRow], budgets: dict[str, float | None], target: float, out: Path = REPORTS) -> list[Path]:
    """The report's figures of ``rows`` in ``out`` (the Pareto plot, accuracy vs time, memory); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    shared = next(iter(set(budgets.values()))) if len(set(budgets.values())) == 1 else None
    paths = [out / PARETO.name, out / PLOT.name]
    plot_pareto(rows, paths[0], shared)
    plot_accuracy_vs_time({r.method: Path(r.curve) for r in rows if r.plotted}, paths[1], target_acc=target)
    if panels := memory_panels(**read_existing({"train_bp_memory": TRAIN_BP_MEMORY,
                                                "train_blocks": DETAILS_DIR / "train_blocks.json"})):
        paths.append(out / MEMORY_PLOT.name)
        plot_bar_panels(panels, paths[-1], title="edgeflux pipeline: measured training memory")
    return paths


def main(args, params) -> None:
    if args.show:
        return show()
    from edgeflux.tracking import stage_run

    target = params.report.target_acc
    with stage_run("report", params.report.model_dump()) as run:
        rows, head, budgets = read_rows(params)
        # the parent run of this pipeline run gets every stage's headline, whichever stages reran
        run.log_pipeline_headline({name.replace("/", "@", 1): figures for name, figures in head.items()})
        REPORTS.mkdir(parents=True, exist_ok=True)
        SUMMARY.write_text(summary_markdown(rows, budgets, target) + _cloud_table(head.get("pretrain", {})))
        SUMMARY_JSON.write_text(json.dumps({"budgets_mib": budgets, "rows": rows_json(rows)}, indent=2) + "\n")
        for path in (SUMMARY, SUMMARY_JSON, *draw(rows, budgets, target)):
            run.log_artifact(path)


def _cloud_table(pretrain: dict[str, dict]) -> str:
    """The cloud's pre-training (no budget, the source split): where the fine-tuned models come from."""
    if not pretrain:
        return ""
    lines = ["", "## Cloud pre-training (no budget, source split)", "",
             "| model | batch | measured peak MiB | train s (wall) | train CPU s | test acc |", "|---|---|---|---|---|---|"]
    lines += [f"| {key} | {m.get('batch', '-')} | {m.get('peak_mib', '-')} | {m.get('train_time_s', 0):.1f} | "
              f"{m.get('train_cpu_s', 0):.1f} | {m.get('test_acc', 0):.4f} |" for key, m in pretrain.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--show", action="store_true", help="print the existing summary and the MLflow UI command, then exit")
    run_stage(main, parser)
