"""`edgeflux status`: each stage up to date, stale (and what changed) or running, from DVC and MLflow."""
from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
from pathlib import Path

import yaml

from .common import RAW, UsageError, local_time, mlflow_client, run_info, store_missing, tracking_uri_flag, wrap


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


def mlflow_status(uri: str) -> dict:
    """The stage runs MLflow has RUNNING (alive: their process still exists, when it is on this host) and the
    last pipeline (parent) run."""
    from edgeflux.tracking import EXPERIMENT, _alive

    out: dict = {"tracking_uri": uri, "running": [], "last_pipeline": None}
    if store_missing(uri):
        return out | {"note": "no store yet: no stage has run"}
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return out | {"note": f"no experiment {EXPERIMENT!r} yet"}
    ids = [experiment.experiment_id]
    for run in client.search_runs(ids, "attributes.status = 'RUNNING' and tags.`edgeflux.kind` = 'stage'"):
        tags = run.data.tags
        alive = _alive(tags) if tags.get("edgeflux.host") == socket.gethostname() else None
        out["running"].append({"stage": tags.get("edgeflux.stage", run.info.run_name), "pid": tags.get("edgeflux.pid"),
                               "alive": alive, **run_info(run)})
    last = client.search_runs(ids, "tags.`edgeflux.kind` = 'pipeline'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    out["last_pipeline"] = run_info(last[0]) if last else None
    if last and last[0].info.status != "FINISHED":   # a failed run is shown as such, beside the last good one
        good = client.search_runs(ids, "tags.`edgeflux.kind` = 'pipeline' and attributes.status = 'FINISHED'",
                                  max_results=1, order_by=["attributes.start_time DESC"])
        out["last_finished_pipeline"] = run_info(good[0]) if good else None
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
        console.print(f"  running: {run['stage']} since {local_time(run['start_time'])} on {run['host']} "
                      f"pid {run['pid']} ({where[run['alive']]})", highlight=False)
    for key, label in (("last_pipeline", "last pipeline run"), ("last_finished_pipeline", "last finished run")):
        if run := tracked.get(key):
            console.print(f"  {label}: {run['name']} {run['status']} (started {local_time(run['start_time'])}"
                          + (f", preset {run['preset']}" if run["preset"] else "")
                          + (f", DVC experiment {run['dvc_exp']}" if run["dvc_exp"] else "") + ")", highlight=False)


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


STATUS_EXAMPLES = """\
examples:
  edgeflux status                                # the table
  edgeflux status --json | jq '.stages[] | select(.state != "up to date")'
  edgeflux status --tracking-uri http://cloud:5000   # running stages as a shared MLflow server sees them
"""


def add_status(sub) -> None:
    p = sub.add_parser("status", help="which stages are up to date, stale (and why) or running",
                       description=wrap("Each stage of dvc.yaml: up to date (cached), stale with what changed "
                                        "(dvc status), or running (a RUNNING stage run in MLflow); and the last "
                                        "pipeline run in MLflow."), epilog=STATUS_EXAMPLES, formatter_class=RAW)
    p.add_argument("--json", action="store_true", help="print the data as JSON, for scripts")
    tracking_uri_flag(p)
    p.set_defaults(func=cmd_status)
