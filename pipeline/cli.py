"""The `edgeflux` command: what a user does with the project, each a thin wrapper over the tool that does it.

    edgeflux run --preset pi4 --budget 200MB      # params.yaml updated (comments kept), `dvc repro`, the summary
    edgeflux run --exp big --budget 300MB         # the same as a DVC experiment: `dvc exp run -n big -S ...`
    edgeflux status                               # stages up to date / stale / running (DVC + MLflow)
    edgeflux compare --last 3                     # recent pipeline runs side by side (MLflow), and a plot
    edgeflux report --open                        # reports/summary.md, then the report opened
    edgeflux servers | worker --pool pi | serve-cloud   # pipeline.servers and pipeline.cloud, unchanged

The tools stay the source of truth: DVC decides what is stale and runs the stages, MLflow holds the runs,
Prefect runs the workers; their output is streamed, not captured, and their exit code is this command's.
Heavy imports (mlflow, matplotlib; torch, which validating params needs) happen inside the subcommand that
needs them, so `--help` answers at once. docs/cli.md has more examples.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from contextlib import redirect_stdout
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

import yaml

from edgeflux.errors import UserError
from edgeflux.presets import Preset, available, load_preset, merge, set_params

PARAMS = Path("params.yaml")
# --budget: every method's budget at once, so the report compares them under the same one
BUDGET_KEYS = ("train_bp.budget", "neuroflux.budget", "finetune.budget", "meanet.budget")
DEFAULT_METRICS = ("*.test_acc", "*.peak_mib", "*.train_cpu_s")
CHECKED = "params.yaml + overrides"   # how a validation error names the file it checked (a temporary copy)
RAW = argparse.RawDescriptionHelpFormatter


def _wrap(text: str) -> str:
    return textwrap.fill(text, 96)   # descriptions: the raw formatter (which keeps the examples' layout) wraps nothing


class UsageError(UserError):
    """A bad argument or input, reported as one line (exit 2) before anything runs."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: scripts and people read one line; the usage is one --help away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- run ----------------------------------------------------------------------------------------------

def _budget(text: str) -> str:
    from edgeflux.options import parse_bytes   # light: no torch

    try:
        parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parse_set(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as YAML (as in params.yaml: 1 is a number, [1, 2] a list, 200MB text)."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key.strip()):
        raise UsageError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. train_bp.epochs=1")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise UsageError(f"--set {text!r}: the value is not valid YAML ({str(exc).splitlines()[0]})") from None


def collect_overrides(args: argparse.Namespace, preset: Preset | None, params: dict) -> dict[str, tuple[Any, str]]:
    """{key: (value, where it came from)}, in the order they apply: the preset's, --budget, then --set
    (the most specific wins; a later key moves to the end so that it also applies last)."""
    layers = [(preset.params if preset else {}, f"preset {preset and preset.name}"),
              ({k: args.budget for k in BUDGET_KEYS if k.split(".")[0] in params} if args.budget else {}, "--budget"),
              (dict(_parse_set(text) for text in args.overrides), "--set")]
    out: dict[str, tuple[Any, str]] = {}
    for values, source in layers:
        for key, value in values.items():
            out.pop(key, None)
            out[key] = (value, source)
    return out


def check_params(merged: dict) -> None:
    """Validate params as the stages will (edgeflux.config); UsageError with its message, one line per problem.

    In a child process (`python -m edgeflux.presets check`): validation imports torch (~350 MB, seconds on a
    Pi) and this process then waits on `dvc repro` for hours. When this process has it already (tests, a
    notebook), the same check runs here."""
    if "edgeflux.config" in sys.modules:
        from edgeflux.config import ParamsError, validate

        try:
            validate(merged, where=CHECKED)
        except ParamsError as exc:
            raise UsageError(str(exc)) from None
        return
    with tempfile.TemporaryDirectory(prefix="edgeflux-params-") as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(yaml.safe_dump(merged, sort_keys=False))
        check = subprocess.run([sys.executable, "-m", "edgeflux.presets", "check", str(path)],
                               check=False, capture_output=True, text=True)
    if check.returncode != 0:
        raise UsageError((check.stderr.strip() or check.stdout.strip() or "params check failed")
                         .replace(str(path), CHECKED))


_MISSING = object()


def _lookup(params: dict, key: str) -> Any:
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _hydra(value: Any) -> str:
    """A value in Hydra's override grammar, which `dvc exp run -S` parses (quoted where Hydra would read the
    text as another type, or as a sweep: a comma)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(map(_hydra, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = re.fullmatch(r"[\w.\-/]+", text) and yaml.safe_load(text) == text
    try:
        float(text.replace("_", ""))   # Hydra reads 1e3, 1_000, inf, nan as numbers
        plain = False
    except ValueError:
        pass
    return text if plain else '"' + text.replace('"', '\\"') + '"'


def set_args(params: dict, key: str, value: Any) -> list[str]:
    """The -S arguments for one override. A mapping onto a section merges into it (as set_params does), so it
    becomes one argument per leaf; a key params.yaml lacks is added with Hydra's `+`."""
    current = _lookup(params, key)
    if isinstance(value, dict) and isinstance(current, dict):
        return [arg for k, v in value.items() for arg in set_args(params, f"{key}.{k}", v)]
    return [f"{'+' if current is _MISSING else ''}{key}={_hydra(value)}"]


def run_command(args: argparse.Namespace, params: dict, overrides: dict[str, Any]) -> list[str]:
    """The DVC command line (argv[0] "dvc": the venv's, first on the PATH of venv_env)."""
    if not args.exp:
        return ["dvc", "repro", *args.targets]
    sets = [arg for key, value in overrides.items() for arg in set_args(params, key, value)]
    return ["dvc", "exp", "run", "-n", args.exp, *(["--temp"] if args.temp else []),
            *[part for s in sets for part in ("-S", s)], *args.targets]


def print_plan(args, preset: Preset | None, overrides: dict[str, tuple[Any, str]], env: dict, command: list[str]):
    if preset:
        print(f"preset {preset.name}: {preset.description}")
    if overrides:
        width = max(len(k) for k in overrides)
        print("overrides:")
        for key, (value, source) in overrides.items():
            print(f"  {key:<{width}} = {json.dumps(value)}   ({source})")
        print("params.yaml: " + ("left to DVC, which applies the overrides in the experiment" if args.exp
                                 else "these values " + ("would be " if args.dry_run else "") + "written in "
                                 "place, comments kept"))
    if env:
        print("env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print(f"$ {shlex.join(command)}", flush=True)


def call(command: list[str], env: dict[str, str]) -> int:
    """Run a tool with its output streamed; its exit code (128 + N when signal N ended it, as a shell says).
    Ctrl-C reaches the tool too (same process group): wait for it to stop cleanly; a second one stops it."""
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"{command[0]} not found: install the project (pip install -e .) in this environment") from None
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    return 128 - rc if rc < 0 else rc


def show_summary(args: argparse.Namespace) -> None:
    if args.exp and args.temp:   # the results are in the experiment, not in this workspace
        print(f"experiment {args.exp}: `dvc exp show`, `edgeflux compare`; `dvc exp apply {args.exp}` brings it here")
        return
    if Path("reports/summary.md").exists():   # a run of other stages only may have written none yet
        from stages.report import show

        show()
    print("compare with earlier runs: edgeflux compare" + ("; DVC's view: dvc exp show" if args.exp else ""))


def cmd_run(args: argparse.Namespace) -> int:
    if args.temp and not args.exp:
        raise UsageError("--temp needs --exp NAME (it runs the experiment in a temporary copy)")
    preset = load_preset(args.preset) if args.preset else None
    if not PARAMS.is_file():
        raise UsageError(f"{PARAMS} not found: run edgeflux from the project's root (where dvc.yaml is)")
    params = yaml.safe_load(PARAMS.read_text()) or {}
    sourced = collect_overrides(args, preset, params)
    overrides = {k: v for k, (v, _) in sourced.items()}
    check_params(merge(params, overrides))    # before anything runs or params.yaml changes
    if not args.targets and preset and preset.stages:
        args.targets = list(preset.stages)
    command = run_command(args, params, overrides)
    env = preset.env() if preset else {}      # threads; EDGEFLUX_PRESET tags the MLflow runs
    print_plan(args, preset, sourced, env, command)
    if args.dry_run:
        return 0
    if not args.exp:
        set_params(overrides, PARAMS)
    from edgeflux.environ import venv_env   # offline, the venv's dvc and python first on PATH

    rc = call(command, venv_env(env))
    if rc == 0:
        show_summary(args)
    return rc


# --- status -------------------------------------------------------------------------------------------

def _dvc(*argv: str) -> subprocess.CompletedProcess:
    from edgeflux.environ import venv_env

    return subprocess.run(["dvc", *argv], check=False, capture_output=True, text=True, env=venv_env())


def _dvc_error(proc: subprocess.CompletedProcess, what: str) -> UsageError:
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return UsageError(f"{what} failed: {lines[0].removeprefix('ERROR: ') if lines else f'exit {proc.returncode}'}")


def dvc_status(stages: list[str]) -> tuple[dict, list[str], str | None]:
    """({stage: dvc's changes}, the stages DVC holds locked, what holds them). While `dvc repro` runs, a plain
    `dvc status` fails on its locks ("is busy"): then each stage is asked alone, and those still locked (running,
    or reading what the running one writes) are listed."""
    proc = _dvc("status", "--json")
    if proc.returncode == 0:
        return json.loads(proc.stdout or "{}"), [], None
    if "is busy" not in proc.stderr:
        raise _dvc_error(proc, "dvc status")
    changes, busy = {}, []
    for stage in stages:
        one = _dvc("status", "--json", stage)
        if one.returncode == 0:
            changes.update(json.loads(one.stdout or "{}"))
        elif "is busy" in one.stderr:
            busy.append(stage)
        else:
            raise _dvc_error(one, f"dvc status {stage}")
    return changes, busy, _lock_holder(proc.stderr)


def _lock_holder(stderr: str) -> str | None:
    """'dvc repro (pid 123)' from DVC's "is busy" error, which names the process that holds the lock."""
    found = re.search(r"\(PID (\d+)\): (\S+)(.*)", stderr)
    return found and f"{Path(found[2]).name}{found[3]} (pid {found[1]})"


def describe_changes(entries: list) -> list[dict]:
    """dvc status's entries for one stage, flat: {"what": dep | out | param | ..., "name", "state"}."""
    out = []
    for entry in entries:
        if isinstance(entry, str):   # "changed command", "always changed"
            out.append({"what": entry, "name": None, "state": "changed"})
            continue
        for kind, paths in entry.items():
            noun = {"changed deps": "dep", "changed outs": "out"}.get(kind, kind)
            for path, state in paths.items():
                if isinstance(state, dict):   # a params file: {param or section: state}
                    out += [{"what": "param", "name": name, "state": s} for name, s in state.items()]
                else:
                    out.append({"what": noun, "name": path, "state": state})
    return out


def summarize_changes(changes: list[dict]) -> list[str]:
    """One line per kind of change, for the table: 'modified deps: a.py, b.py', 'changed command'."""
    groups: dict[str, list[str]] = {}
    for c in changes:
        head = f"{c['state']} {c['what']}s" if c["name"] else c["what"]
        groups.setdefault(head, []).extend([c["name"]] if c["name"] else [])
    return [f"{head}: {', '.join(names)}" if names else head for head, names in groups.items()]


def _iso(ms: int | None) -> str | None:
    return datetime.fromtimestamp(ms / 1000, UTC).astimezone().isoformat(timespec="seconds") if ms else None


def _when(iso: str | None) -> str:
    return (iso or "-")[:19].replace("T", " ")   # local time to the second, for tables


def _client(uri: str):
    # a CLI should not retry an unreachable server for minutes (MLflow's defaults): a few tries, then say so
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _store_missing(uri: str) -> bool:
    """A sqlite store not created yet: reading it would create an empty one (and its migrations)."""
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///").split("?")[0]).exists()


def _run_info(run) -> dict:
    tags = run.data.tags
    return {"run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
            "start_time": _iso(run.info.start_time), "end_time": _iso(run.info.end_time),
            "preset": tags.get("edgeflux.preset"), "dvc_exp": tags.get("edgeflux.dvc_exp"),
            "host": tags.get("edgeflux.host") or tags.get("host")}


def mlflow_status(uri: str) -> dict:
    """The stage runs MLflow has RUNNING (alive: their process still exists, when it is on this host) and the
    last pipeline (parent) run."""
    from edgeflux.tracking import EXPERIMENT, _alive

    out: dict = {"tracking_uri": uri, "running": [], "last_pipeline": None}
    if _store_missing(uri):
        return out | {"note": "no store yet: no stage has run"}
    client = _client(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return out | {"note": f"no experiment {EXPERIMENT!r} yet"}
    ids = [experiment.experiment_id]
    for run in client.search_runs(ids, "attributes.status = 'RUNNING' and tags.`edgeflux.kind` = 'stage'"):
        tags = run.data.tags
        alive = _alive(tags) if tags.get("edgeflux.host") == socket.gethostname() else None
        out["running"].append({"stage": tags.get("edgeflux.stage", run.info.run_name), "pid": tags.get("edgeflux.pid"),
                               "alive": alive, **_run_info(run)})
    last = client.search_runs(ids, "tags.`edgeflux.kind` = 'pipeline'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    out["last_pipeline"] = _run_info(last[0]) if last else None
    return out


def stage_states(stages: list[str], changes: dict, busy: list[str], running: list[dict]) -> list[dict]:
    lock = yaml.safe_load(Path("dvc.lock").read_text()) if Path("dvc.lock").exists() else {}
    locked = set((lock or {}).get("stages", {}))
    in_mlflow = {r["stage"] for r in running if r["alive"] is not False}
    rows = []
    for stage in stages:
        if stage in in_mlflow:
            state = "running"
        elif stage in busy:
            state = "locked"   # DVC holds it: it runs, or it reads what the running stage writes
        elif stage not in changes:
            state = "up to date"
        else:
            state = "stale" if stage in locked else "never run"
        rows.append({"stage": stage, "state": state, "changes": describe_changes(changes.get(stage, []))})
    rows += [{"stage": name, "state": "changed", "changes": describe_changes(entries)}   # .dvc files: data
             for name, entries in changes.items() if name not in stages]
    return rows


STATE_STYLE = {"up to date": "green", "stale": "yellow", "never run": "yellow", "running": "bold cyan",
               "locked": "cyan", "changed": "yellow"}


def print_status(rows: list[dict], tracked: dict, holder: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Stages (dvc status; running: MLflow)", title_justify="left")
    for column in ("stage", "state", "what changed"):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = STATE_STYLE.get(row["state"], "")
        table.add_row(row["stage"], f"[{style}]{row['state']}[/]", "\n".join(summarize_changes(row["changes"])) or "-")
    console = Console()
    console.print(table)
    if holder:
        console.print(f"locked: held by {holder}: the stage runs, or reads what the running stage writes",
                      highlight=False)
    console.print(f"MLflow: {tracked['tracking_uri']}" + (f" ({tracked['note']})" if tracked.get("note") else ""),
                  highlight=False)
    for run in tracked["running"]:
        where = {True: "alive", False: "process gone: killed? (closed at the next stage run)", None: "another host"}
        console.print(f"  running: {run['stage']} since {_when(run['start_time'])} on {run['host']} pid {run['pid']} "
                      f"({where[run['alive']]})", highlight=False)
    if last := tracked["last_pipeline"]:
        console.print(f"  last pipeline run: {last['name']} {last['status']} (started {_when(last['start_time'])}"
                      + (f", preset {last['preset']}" if last["preset"] else "")
                      + (f", DVC experiment {last['dvc_exp']}" if last["dvc_exp"] else "") + ")", highlight=False)


def cmd_status(args: argparse.Namespace) -> int:
    from edgeflux.tracking import tracking_uri

    listed = _dvc("stage", "list", "--name-only")
    if listed.returncode != 0:
        raise _dvc_error(listed, "dvc stage list")
    stages = listed.stdout.split()
    changes, busy, holder = dvc_status(stages)
    tracked = mlflow_status(args.tracking_uri or tracking_uri())
    rows = stage_states(stages, changes, busy, tracked["running"])
    if args.json:
        print(json.dumps({"stages": rows, "dvc_busy": busy, "dvc_lock_holder": holder, "mlflow": tracked}, indent=2))
    else:
        print_status(rows, tracked, holder)
    return 0


# --- compare ------------------------------------------------------------------------------------------

def pipeline_runs(uri: str, last: int) -> list:
    """The newest ``last`` parent runs (tag edgeflux.kind = pipeline) of edgeflux's experiment."""
    from edgeflux.tracking import EXPERIMENT

    if _store_missing(uri):
        return []
    client = _client(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], "tags.`edgeflux.kind` = 'pipeline'", max_results=last,
                              order_by=["attributes.start_time DESC"])


def split_metric(key: str) -> tuple[str, str]:
    """'finetune.mobiletl.test_acc' -> ('finetune.mobiletl', 'test_acc'): the headline is <stage>.<name>."""
    stage, _, name = key.rpartition(".")
    return stage or "(pipeline)", name


def compare_data(runs: list, patterns: list[str]) -> dict:
    """The runs, each with the metrics that match a pattern, and by metric name {name: {stage: [value per run]}}."""
    keys = sorted({k for run in runs for k in run.data.metrics if any(fnmatch.fnmatchcase(k, p) for p in patterns)})
    out = {"runs": [], "metrics": keys, "table": {}}
    for run in runs:
        out["runs"].append(_run_info(run) | {"metrics": {k: run.data.metrics[k] for k in keys
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
    for column in ("#", "run", "started", "status", "preset", "DVC exp"):
        runs.add_column(column, overflow="fold")
    for i, run in enumerate(data["runs"], 1):
        runs.add_row(str(i), run["name"], _when(run["start_time"]), run["status"],
                     run["preset"] or "-", run["dvc_exp"] or "-")
    console.print(runs)
    for name, stages in data["table"].items():
        table = Table(title=name, title_justify="left")
        table.add_column("stage")
        for i in range(len(data["runs"])):
            table.add_column(f"#{i + 1}", justify="right")
        for stage, values in stages.items():
            table.add_row(stage, *map(_fmt, values))
        console.print(table)
    if not data["table"]:
        console.print(f"no metric matches {', '.join(data['patterns'])}: a parent run carries its stages' headline "
                      "metrics as <stage>.<name> (StageRun.log_headline); runs older than that carry none",
                      highlight=False)


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


def cmd_compare(args: argparse.Namespace) -> int:
    from edgeflux.tracking import tracking_uri

    if args.last < 1:
        raise UsageError(f"--last {args.last}: give 1 or more runs")
    uri = args.tracking_uri or tracking_uri()
    data = compare_data(pipeline_runs(uri, args.last), args.metric or list(DEFAULT_METRICS))
    data |= {"tracking_uri": uri, "patterns": args.metric or list(DEFAULT_METRICS), "plot": None}
    if data["table"] and not args.no_plot:
        plot_compare(data, Path(args.plot))
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


# --- report -------------------------------------------------------------------------------------------

def opener() -> Callable[[Path], None]:
    """The platform's way to open a file: xdg-open (Linux), open (macOS), the default app (Windows), else a
    web browser Python knows of; UsageError when there is none (a headless device: read the files over ssh)."""
    if sys.platform == "win32":
        return os.startfile   # Windows only
    tool = shutil.which("open" if sys.platform == "darwin" else "xdg-open")
    if tool:
        def run_tool(path: Path) -> None:
            done = subprocess.run([tool, str(path)], check=False, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
                raise UsageError(f"{Path(tool).name} could not open {path}: {why}")
        return run_tool
    import webbrowser

    try:
        browser = webbrowser.get()
    except webbrowser.Error:
        raise UsageError("no program to open files with (no xdg-open or open on PATH, no web browser): "
                         "open reports/summary.md yourself, or install xdg-utils") from None
    return lambda path: browser.open(path.resolve().as_uri())


def cmd_report(args: argparse.Namespace) -> int:
    from stages.report import MEMORY_PLOT, PLOT, SUMMARY, show

    show()   # exits with its own error when there is no summary yet
    if args.open:
        open_file = opener()
        for path in (SUMMARY, PLOT, MEMORY_PLOT):
            if path.exists():
                open_file(path)
    return 0


# --- servers, worker, serve-cloud: the existing command lines, forwarded ---------------------------------

def _help_of(main: Callable[[], Any], rename: tuple[str, str], epilog: str) -> int:
    """Another module's --help, under this command's name, with this command's examples after it."""
    buffer = StringIO()
    with redirect_stdout(buffer):
        try:
            main()
        except SystemExit:
            pass
    text, (old, new) = buffer.getvalue(), rename
    if old:   # the usage's continuation lines are aligned under the old name: shift them by the difference
        usage, _, rest = text.partition("\n\n")
        shift = len(old) - len(new)
        usage = "\n".join(ln[shift:] if ln.startswith(" " * (shift + 1)) else ln for ln in usage.splitlines())
        text = f"{usage}\n\n{rest}".replace(old, new)
    print(text.rstrip() + "\n\n" + epilog.strip())
    return 0


def forward_servers(command: str, name: str, argv: list[str], epilog: str) -> int:
    """`edgeflux <name> ARGS` is `python -m pipeline.servers <command> ARGS` (its parser, its run_worker)."""
    from pipeline import servers

    if {"-h", "--help"} & set(argv):
        return _help_of(lambda: servers.main([command, "-h"]),
                        (f"python -m pipeline.servers {command}", f"edgeflux {name}"), epilog)
    return servers.main([command, *argv])


def forward_cloud(argv: list[str]) -> int:
    """`edgeflux serve-cloud ARGS` is `python -m pipeline.cloud ARGS`. Its main() parses sys.argv, so that is
    what it gets (argparse's prog is sys.argv[0]: the usage then reads `edgeflux serve-cloud`)."""
    from pipeline import cloud

    saved = sys.argv
    sys.argv = ["edgeflux serve-cloud", *argv]
    try:
        if {"-h", "--help"} & set(argv):
            return _help_of(cloud.main, ("", ""), SERVE_CLOUD_EXAMPLES)
        cloud.main()
        return 0
    finally:
        sys.argv = saved


# --- the parser ---------------------------------------------------------------------------------------

RUN_EXAMPLES = """\
examples:
  edgeflux run                                   # dvc repro: every stage that is not up to date
  edgeflux run --preset pi4                      # a Raspberry Pi 4's params and threads (presets/pi4.yaml)
  edgeflux run --preset pi4 --budget 200MB train_bp   # every method under 200 MB; train_bp and what it needs
  edgeflux run --set train_bp.epochs=1 --set neuroflux.cache.storage=dense
  edgeflux run --exp pi4-200MB --preset pi4 --budget 200MB   # a DVC experiment: dvc exp run -n ... -S ...
  edgeflux run --dry-run --preset jetson-nano    # print the overrides and the dvc command, run nothing
"""
STATUS_EXAMPLES = """\
examples:
  edgeflux status                                # the table
  edgeflux status --json | jq '.stages[] | select(.state != "up to date")'
  edgeflux status --tracking-uri http://cloud:5000   # running stages as a shared MLflow server sees them
"""
COMPARE_EXAMPLES = """\
examples:
  edgeflux compare                               # the last 5 pipeline runs; reports/compare.png
  edgeflux compare --last 2 --metric '*.test_acc' --metric 'finetune.*.peak_mib'
  edgeflux compare --tracking-uri http://cloud:5000 --json > runs.json
"""
REPORT_EXAMPLES = """\
examples:
  edgeflux report                                # print reports/summary.md
  edgeflux report --open                         # and open it and its plots (xdg-open / open / a browser)
"""
SERVERS_EXAMPLES = """\
The Prefect server and the MLflow tracking server for the cloud host and its devices, until Ctrl-C
(python -m pipeline.servers cloud).

examples:
  edgeflux servers                               # on loopback: Prefect :4200, MLflow :5000
  edgeflux servers --host 0.0.0.0 --public-host cloud.lan --deploy   # for devices; deployments created
"""
WORKER_EXAMPLES = """\
A Prefect process worker in this clone that runs the pool's flow runs (python -m pipeline.servers worker).

examples:
  edgeflux worker --pool pi --device-id pi-01 --api-url http://cloud.lan:4200/api \\
      --tracking-uri http://cloud.lan:5000
  PREFECT_API_URL=http://cloud.lan:4200/api edgeflux worker --pool jetson
"""
SERVE_CLOUD_EXAMPLES = """\
examples:
  edgeflux serve-cloud                           # models/meanet/cloud on 127.0.0.1:5001 until Ctrl-C
  edgeflux serve-cloud --host 0.0.0.0 --port 5001   # for devices on the network
"""
TOP_EXAMPLES = """\
examples:
  edgeflux run --preset pi4 --budget 200MB       # the pipeline as a Raspberry Pi 4 runs it, every method at 200 MB
  edgeflux run --exp big --budget 300MB          # the same as a DVC experiment
  edgeflux status                                # up to date / stale (what changed) / running, per stage
  edgeflux compare --last 2                      # two pipeline runs side by side; reports/compare.png
  edgeflux report --open                         # the summary, and its plots opened
  edgeflux servers --host 0.0.0.0 --deploy       # cloud host: Prefect + MLflow servers
  edgeflux worker --pool pi --device-id pi-01    # device: a Prefect worker in this clone
  edgeflux serve-cloud                           # MEANet's cloud model over HTTP

`edgeflux COMMAND --help` gives each command's flags and examples; docs/cli.md has more.
"""
FORWARDED = {   # name: (one-line help, how it runs)
    "servers": ("the cloud host's Prefect and MLflow servers (pipeline.servers cloud)",
                lambda argv: forward_servers("cloud", "servers", argv, SERVERS_EXAMPLES)),
    "worker": ("a Prefect worker for a device pool: --pool pi|jetson|cloud (pipeline.servers worker)",
               lambda argv: forward_servers("worker", "worker", argv, WORKER_EXAMPLES)),
    "serve-cloud": ("MEANet's cloud model server: MLflow's model server on models/meanet/cloud (pipeline.cloud)",
                    forward_cloud),
}


def add_run(sub) -> None:
    p = sub.add_parser("run", help="run the pipeline (dvc repro), or a DVC experiment with --exp",
                       description=_wrap("Apply a device preset and overrides to params.yaml, then run the stages "
                                   "that are not up to date (dvc repro); or, with --exp, run them as a DVC "
                                   "experiment with the overrides given to DVC (dvc exp run -S)."),
                       epilog=RUN_EXAMPLES, formatter_class=RAW)
    p.add_argument("targets", nargs="*", metavar="STAGE",
                   help="stages to run, with what they need (default: every stage, or the preset's)")
    p.add_argument("--preset", metavar="NAME", help=f"device preset: {', '.join(available()) or 'none in presets/'} "
                   "(presets/NAME.yaml), or the path of a preset file: its params and its thread count")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set one param, dotted key, YAML value (repeatable; wins over --preset and --budget), "
                        "e.g. train_bp.epochs=1")
    p.add_argument("--budget", type=_budget, metavar="SIZE",
                   help="every method's memory budget at once (" + ", ".join(BUDGET_KEYS) + "), e.g. 200MB or 1GiB")
    p.add_argument("--exp", metavar="NAME", help="run as the DVC experiment NAME (dvc exp run -n NAME -S ...): "
                   "edgeflux leaves params.yaml to DVC, which applies the overrides in the experiment")
    p.add_argument("--temp", action="store_true",
                   help="with --exp: run it in a temporary copy (dvc exp run --temp), leaving this workspace as it is")
    p.add_argument("--dry-run", action="store_true",
                   help="print the overrides and the dvc command; change and run nothing")
    p.set_defaults(func=cmd_run)


def _tracking_uri_flag(p) -> None:
    p.add_argument("--tracking-uri", metavar="URI", help="the MLflow store or server, e.g. http://cloud:5000 "
                   "(default: $MLFLOW_TRACKING_URI, else sqlite mlflow.db at the project root)")


def add_status(sub) -> None:
    p = sub.add_parser("status", help="which stages are up to date, stale (and why) or running",
                       description=_wrap("Each stage of dvc.yaml: up to date (cached), stale with what changed "
                                   "(dvc status), or running (a RUNNING stage run in MLflow); and the last "
                                   "pipeline run in MLflow."), epilog=STATUS_EXAMPLES, formatter_class=RAW)
    p.add_argument("--json", action="store_true", help="print the data as JSON, for scripts")
    _tracking_uri_flag(p)
    p.set_defaults(func=cmd_status)


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="recent pipeline runs side by side (MLflow), and a plot",
                       description=_wrap("The newest pipeline (parent) runs in MLflow with their preset, DVC "
                                         "experiment and each stage's headline metrics (<stage>.<name>): one table "
                                         "per metric, a row per stage, a column per run."),
                       epilog=COMPARE_EXAMPLES, formatter_class=RAW)
    p.add_argument("--last", type=int, default=5, metavar="N",
                   help="how many runs, newest first (default: %(default)s)")
    p.add_argument("--metric", action="append", metavar="PATTERN",
                   help="metrics to show, shell-style pattern on <stage>.<name> (repeatable; default: "
                        + " ".join(DEFAULT_METRICS) + ")")
    p.add_argument("--plot", default="reports/compare.png", metavar="PATH",
                   help="where the comparison plot goes (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--json", action="store_true", help="print the data as JSON, for scripts")
    _tracking_uri_flag(p)
    p.set_defaults(func=cmd_compare)


def add_report(sub) -> None:
    p = sub.add_parser("report", help="print the pipeline's summary (reports/summary.md)",
                       description=_wrap("Print reports/summary.md, written by the report stage."),
                       epilog=REPORT_EXAMPLES, formatter_class=RAW)
    p.add_argument("--open", action="store_true", help="also open it and its plots with the platform's opener")
    p.set_defaults(func=cmd_report)


def build_parser() -> Parser:
    parser = Parser(prog="edgeflux", formatter_class=RAW, epilog=TOP_EXAMPLES,
                    description=_wrap("Train CNNs on edge devices under a memory budget: the pipeline (DVC), "
                                      "its runs (MLflow), its servers and workers (Prefect)."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run(sub)
    add_status(sub)
    add_compare(sub)
    add_report(sub)
    for name, (text, _) in FORWARDED.items():   # listed here; their own parsers read their flags
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in FORWARDED:
        return FORWARDED[argv[0]][1](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:   # UsageError, PresetError, and the library's (a tracking store it cannot open)
        print(f"edgeflux {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
