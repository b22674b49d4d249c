"""`edgeflux compare`: recent pipeline runs side by side, their headline metrics from MLflow, and a plot."""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
from pathlib import Path

from .common import RAW, UsageError, local_time, mlflow_client, run_info, store_missing, tracking_uri_flag, wrap

DEFAULT_METRICS = ("*.test_acc", "*.peak_mib", "*.train_cpu_s")
BUDGET_PARAM = "device.budget"   # the budget every budgeted stage inherits (a parent run's params: params.yaml)


def pipeline_runs(uri: str, last: int, include_failed: bool = False) -> list:
    """The newest ``last`` parent runs (tag edgeflux.kind = pipeline) of edgeflux's experiment: finished ones,
    or with ``include_failed`` also those that failed, were killed or still run."""
    from edgeflux.tracking import EXPERIMENT

    if store_missing(uri):
        return []
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    query = "tags.`edgeflux.kind` = 'pipeline'" + ("" if include_failed else " and attributes.status = 'FINISHED'")
    return client.search_runs([experiment.experiment_id], query, max_results=last,
                              order_by=["attributes.start_time DESC"])


def split_metric(key: str) -> tuple[str, str]:
    """'finetune.mobiletl.test_acc' -> ('finetune.mobiletl', 'test_acc'): the headline is <stage>.<name>."""
    stage, _, name = key.rpartition(".")
    return stage or "(pipeline)", name


def params_table(runs: list, patterns: list[str] | None) -> dict[str, list[str | None]]:
    """{param: [its value per run]} of the runs' params (a parent run's: params.yaml flattened, the preset, the
    overrides) that match a pattern; with no pattern, those whose values differ between the runs (why they
    differ). None where a run has no such param."""
    keys = sorted({k for run in runs for k in run.data.params})
    if patterns:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    else:
        keys = [k for k in keys if len({run.data.params.get(k) for run in runs}) > 1]
    return {k: [run.data.params.get(k) for run in runs] for k in keys}


def compare_data(runs: list, patterns: list[str], param_patterns: list[str] | None = None) -> dict:
    """The runs, each with its budget and the metrics that match a pattern; by metric name {name: {stage: [value
    per run]}}; and the params table (params_table)."""
    keys = sorted({k for run in runs for k in run.data.metrics if any(fnmatch.fnmatchcase(k, p) for p in patterns)})
    out = {"runs": [], "metrics": keys, "table": {}, "params": params_table(runs, param_patterns)}
    for run in runs:
        out["runs"].append(run_info(run) | {"budget": run.data.params.get(BUDGET_PARAM),
                                            "metrics": {k: run.data.metrics[k] for k in keys
                                                        if k in run.data.metrics}})
    for key in keys:
        stage, name = split_metric(key)
        out["table"].setdefault(name, {})[stage] = [r["metrics"].get(key) for r in out["runs"]]
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"


def print_compare(data: dict) -> None:
    """One table of the runs (#1 newest), then one table per metric: a row per stage, a column per run, so
    that runs read side by side in 100 columns."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    runs = Table(title="Pipeline runs (MLflow), newest first", title_justify="left")
    for column in ("#", "run", "started", "status", "preset", "budget", "DVC exp"):
        runs.add_column(column, overflow="fold")
    for i, run in enumerate(data["runs"], 1):
        runs.add_row(str(i), run["name"], local_time(run["start_time"]), run["status"],
                     run["preset"] or "-", run["budget"] or "-", run["dvc_exp"] or "-")
    console.print(runs)
    if data["params"]:
        params = Table(title="params" if data["param_patterns"] else "params that differ", title_justify="left")
        params.add_column("param", overflow="fold")
        for i in range(len(data["runs"])):
            params.add_column(f"#{i + 1}", overflow="fold")
        for key, values in data["params"].items():
            params.add_row(key, *(v if v is not None else "-" for v in values))
        console.print(params)
    for name, stages in data["table"].items():
        table = Table(title=name, title_justify="left")
        table.add_column("stage")
        for i in range(len(data["runs"])):
            table.add_column(f"#{i + 1}", justify="right")
        for stage, values in stages.items():
            table.add_row(stage, *map(_fmt, values))
        console.print(table)
    if not data["table"]:
        console.print(f"no metric matches {', '.join(data['patterns'])}: these runs carry no headline metrics "
                      "(<stage>.<name>, which each stage logs to its pipeline run when it succeeds)", highlight=False)


def plot_compare(data: dict, path: Path) -> None:
    """Grouped bars: one panel per metric name, the stages along x (the same slot width in every panel), a bar
    per run (none where a run has no figure), the runs' legend above the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, runs = list(data["table"]), data["runs"]
    slots = max(3, *(len(stages) for stages in data["table"].values()))
    fig, axes = plt.subplots(len(names), 1, figsize=(max(6.0, 1.3 * slots + 1.5), 0.35 * len(runs) + 3 * len(names)),
                             squeeze=False)
    width = 0.8 / len(runs)
    for ax, name in zip(axes[:, 0], names):
        stages = list(data["table"][name])
        for i, run in enumerate(runs):
            bars = [(x + (i - (len(runs) - 1) / 2) * width, data["table"][name][s][i]) for x, s in enumerate(stages)]
            bars = [(x, v) for x, v in bars if v is not None]
            label = f"#{i + 1} {run['name']}" + (f" ({run['preset']})" if run["preset"] and
                                                  run["preset"] not in run["name"] else "")
            ax.bar([x for x, _ in bars], [v for _, v in bars], width=width, color=f"C{i}", label=label)
        ax.set_xticks(range(len(stages)), stages, rotation=15, ha="right", fontsize=8)
        ax.set_xlim(-0.6, slots - 0.4)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.25 * len(runs) + 0.2) / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_patterns(patterns: list[str], flag: str = "--metric") -> None:
    """fnmatch reads an unclosed [ as a literal character, which no metric or param name holds: say so instead."""
    for pattern in patterns:
        if re.search(r"\[(?![^\]]*\])", pattern):
            raise UsageError(f"{flag} {pattern!r}: an unclosed [; patterns are shell-style: * any text, "
                             "? one character, [abc] one of, e.g. '*.test_acc'")


def _some(names: list[str]) -> str:
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def check_matched(runs: list, data: dict) -> None:
    """A pattern that matches none of the metrics (params) the runs carry is a mistake to name, not an empty
    table."""
    carried = sorted({k for run in runs for k in run.data.metrics})
    if carried and not data["table"]:
        raise UsageError(f"--metric {' '.join(data['patterns'])}: no metric of these runs matches; they carry "
                         f"{_some(carried)}")
    params = sorted({k for run in runs for k in run.data.params})
    if params and data["param_patterns"] and not data["params"]:
        raise UsageError(f"--params {' '.join(data['param_patterns'])}: no param of these runs matches; they carry "
                         f"{_some(params)}")


def write_plot(data: dict, path: Path) -> None:
    try:
        plot_compare(data, path)
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write it ({exc.strerror or exc}); give a writable path, "
                         "or --no-plot") from None


def cmd_compare(args: argparse.Namespace) -> int:
    from edgeflux.tracking import tracking_uri

    if args.last < 1:
        raise UsageError(f"--last {args.last}: give 1 or more runs")
    patterns = args.metric or list(DEFAULT_METRICS)
    check_patterns(patterns)
    check_patterns(args.params or [], "--params")
    uri = args.tracking_uri or tracking_uri()
    runs = pipeline_runs(uri, args.last, args.include_failed)
    data = compare_data(runs, patterns, args.params) | {"tracking_uri": uri, "patterns": patterns,
                                                        "param_patterns": args.params, "plot": None}
    check_matched(runs, data)
    if data["table"] and not args.no_plot:
        write_plot(data, Path(args.plot))
        data["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(data, indent=2))
    elif not data["runs"]:
        print(f"no pipeline runs in {uri} yet: `edgeflux run` makes one")
    else:
        print_compare(data)
        if data["plot"]:
            print(f"plot: {data['plot']}")
    return 0


COMPARE_EXAMPLES = """\
examples:
  edgeflux compare                               # the last 5 pipeline runs; reports/compare.png
  edgeflux compare --last 2 --metric '*.test_acc' --metric 'finetune.*.peak_mib'
  edgeflux compare --last 2 --params 'train_bp.*' --params device.budget   # these params (default: those that differ)
  edgeflux compare --tracking-uri http://cloud:5000 --json > runs.json
"""


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="recent pipeline runs side by side (MLflow), and a plot",
                       description=wrap("The newest pipeline (parent) runs in MLflow with their preset, budget, DVC "
                                        "experiment, the params that differ between them (params.yaml, flattened) "
                                        "and each stage's headline metrics (<stage>.<name>): one table per metric, "
                                        "a row per stage, a column per run."),
                       epilog=COMPARE_EXAMPLES, formatter_class=RAW)
    p.add_argument("--last", type=int, default=5, metavar="N",
                   help="how many runs, newest first (default: %(default)s)")
    p.add_argument("--metric", action="append", metavar="PATTERN",
                   help="metrics to show, shell-style pattern on <stage>.<name> (repeatable; default: "
                        + " ".join(DEFAULT_METRICS) + ")")
    p.add_argument("--params", action="append", metavar="PATTERN",
                   help="params to show, shell-style pattern on the flattened name, e.g. 'train_bp.*' (repeatable; "
                        "default: the params whose values differ between the runs)")
    p.add_argument("--plot", default="reports/compare.png", metavar="PATH",
                   help="where the comparison plot goes (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--include-failed", action="store_true",
                   help="also runs that failed, were interrupted or still run (default: finished runs only)")
    p.add_argument("--json", action="store_true", help="print the data as JSON, for scripts")
    tracking_uri_flag(p)
    p.set_defaults(func=cmd_compare)
