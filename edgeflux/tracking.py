"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

The only module of the library that imports mlflow. Telemetry is off: devices may be offline.

Where runs go: ``MLFLOW_TRACKING_URI`` when it is set; otherwise sqlite ``mlflow.db`` at the root of
the repository, found from ``DVC_ROOT``, which DVC sets for every stage it runs, else from the
working directory. Not the working directory first: ``dvc exp run --temp`` and queued experiments run
their stages in a copy of the repository under ``.dvc/tmp/exps/`` that DVC deletes afterwards, and
for those DVC sets ``DVC_ROOT`` to the original repository.

Where artifacts go: MLflow stores an experiment's artifact location as an absolute path, fixed
when the experiment is created (it keeps no relative one), and each run's artifacts go under its
experiment's. So with a sqlite store, the experiment is created with its artifacts in
``mlruns/<experiment>`` next to ``mlflow.db``, and when the experiment found in the store keeps them
outside the store's directory (the store was copied or moved: they are still the original's), it
is renamed aside, keeping its runs and their links to their artifacts, and a new experiment of the
same name takes the new runs. A store thus works from wherever it is.

How stages that run as separate processes find their common parent run: the pipeline id comes
from ``EDGEFLUX_PIPELINE_ID`` when a launcher (Makefile, Prefect flow) sets it; otherwise from the
``dvc`` process that is running this stage (its pid and start time are the same for every stage of
one ``dvc repro``), so a plain ``dvc repro`` groups its stages too. A stage run by hand gets a
parent of its own.

Metric names are shared by every stage so that MLflow's compare view lines them up:
``time_s``, ``peak_mem_bytes``, ``budget_bytes``, ``batch_size``, ``train_loss``, ``val_acc``,
``test_acc``, ``params``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

import sqlite3  # noqa: E402

import mlflow  # noqa: E402  (the environment above must be set before mlflow reads it)
import psutil  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from sqlalchemy.exc import SQLAlchemyError  # noqa: E402

log = logging.getLogger(__name__)

EXPERIMENT = os.environ.get("EDGEFLUX_EXPERIMENT", "edgeflux")
PIPELINE_KEY_TAG = "edgeflux.pipeline_id"


def tracking_uri() -> str:
    """Where runs go (see the module docstring)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def repo_root() -> Path:
    """The repository a stage belongs to: in a DVC experiment, the original, not DVC's temporary copy."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()


def _store_dir(uri: str) -> Path | None:
    """The directory of a sqlite store's file; None for any other store (a server keeps its own artifacts)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?")[0]).resolve().parent


def _outside(location: str, directory: Path) -> bool:
    """Whether an artifact location is a local path outside ``directory`` (remote locations work from anywhere)."""
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return False
    return not Path(url2pathname(parsed.path)).resolve().is_relative_to(directory)


def resolve_experiment(client: MlflowClient, uri: str) -> str:
    """The id of EXPERIMENT in the store at ``uri``, with its artifacts next to a sqlite store."""
    store_dir = _store_dir(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment and store_dir and _outside(experiment.artifact_location, store_dir):
        aside = f"{EXPERIMENT} (artifacts in {experiment.artifact_location})"
        log.warning("MLflow: experiment %s keeps its artifacts outside %s (a copied or moved store): renamed it %r, "
                    "new runs go to a new %s", EXPERIMENT, store_dir, aside, EXPERIMENT)
        client.rename_experiment(experiment.experiment_id, aside)
        experiment = None
    if experiment:
        return experiment.experiment_id
    location = (store_dir / "mlruns" / EXPERIMENT).as_uri() if store_dir else None
    return client.create_experiment(EXPERIMENT, artifact_location=location)


def pipeline_id() -> str:
    """The id shared by every stage of one pipeline run (see the module docstring)."""
    if os.environ.get("EDGEFLUX_PIPELINE_ID"):
        return os.environ["EDGEFLUX_PIPELINE_ID"]
    me = psutil.Process()
    for proc in me.parents():
        try:
            argv = proc.cmdline()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if any(Path(a).name in ("dvc", "dvc.exe") for a in argv[:2]) or argv[1:3] == ["-m", "dvc"]:
            return f"dvc:{socket.gethostname()}:{proc.pid}:{int(proc.create_time())}"
    return f"standalone:{socket.gethostname()}:{me.pid}:{int(me.create_time())}"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'name': 'vgg11'}} -> {'model.name': 'vgg11'}; lists become JSON strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


class StageRun:
    """What a stage logs to its nested MLflow run."""

    def __init__(self, run_id: str, stage: str):
        self.run_id = run_id
        self.stage = stage
        self.started = time.perf_counter()

    def log_params(self, params: Mapping[str, Any]) -> None:
        mlflow.log_params(flatten(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        numeric = {k: float(v) for k, v in flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        mlflow.log_metrics(numeric, step=step)

    def log_history(self, history: list[Mapping[str, float]], step_key: str = "step") -> None:
        """A training curve: one MLflow step per row. The row's time_s (training time so far) is logged as
        train_time_s, keeping time_s for the stage's wall clock."""
        for row in history:
            renamed = {("train_time_s" if k == "time_s" else k): v for k, v in row.items() if k != step_key}
            self.log_metrics(renamed, step=int(row[step_key]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path or path.name)
        elif path.exists():
            mlflow.log_artifact(str(path), artifact_path=artifact_path)
        else:
            log.warning("not logging missing artifact %s", path)

    def log_dict(self, data: dict, name: str) -> None:
        mlflow.log_dict(data, name)

    def log_model(self, model, name: str, example=None) -> None:
        """A PyTorch model as an MLflow model (loadable with mlflow.pytorch.load_model); ``example``: an
        input batch (tensor) that gives the model its signature."""
        import mlflow.pytorch

        mlflow.pytorch.log_model(model, name=name, **_model_kwargs(example))


def _model_kwargs(example) -> dict:
    """What log_model and save_model_dir give MLflow: the input example (numpy) and the environment. pip_requirements
    given: MLflow would otherwise resolve the environment by importing and inspecting every package, slow and noisy
    on a device."""
    return {"input_example": example.detach().cpu().numpy() if example is not None else None,
            "pip_requirements": [f"torch=={_torch_version()}"]}


def save_model_dir(model, path: str | Path, example) -> None:
    """A PyTorch model in MLflow's format in directory ``path``: what ``mlflow models serve -m path`` serves, float32
    [N, ...] like ``example`` in (any N), the model's output out (logits [N, classes]).

    Exported in eval mode (the mode is restored after): MLflow exports the module (torch.export), so a model in
    training mode would be served with BatchNorm's batch statistics and dropout. Replaced atomically: written
    beside ``path``, then renamed over it, so a kill never leaves half a model; a kill between the two renames
    leaves the previous model in ``<path>.old``, which the next call puts back first."""
    import shutil

    import mlflow.pytorch

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if old.exists() and not path.exists():
        old.rename(path)   # the previous call was killed between its renames
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    modes = [(m, m.training) for m in model.modules()]   # each its own: a frozen BatchNorm may be in eval already
    try:
        mlflow.pytorch.save_model(model.eval(), str(tmp), **_model_kwargs(example))
    finally:
        for module, training in modes:
            module.training = training
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _parent_run(client: MlflowClient, experiment_id: str, pid: str) -> str:
    found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{pid}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    name = time.strftime("pipeline %Y-%m-%d %H:%M:%S")
    tags = {PIPELINE_KEY_TAG: pid, "edgeflux.kind": "pipeline", "host": socket.gethostname(), **_launcher_tags()}
    if commit := _git_commit():
        tags["mlflow.source.git.commit"] = commit
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


LAUNCHER_TAGS = {"EDGEFLUX_FLOW": "edgeflux.flow", "EDGEFLUX_DEVICE_ID": "edgeflux.device",
                 "EDGEFLUX_FLEET_ID": "edgeflux.fleet_id", "EDGEFLUX_PRESET": "edgeflux.preset"}


def _launcher_tags() -> dict[str, str]:
    """Which flow, device, fleet run and preset started the pipeline (set by pipeline.flows), to filter runs by."""
    return {tag: os.environ[var] for var, tag in LAUNCHER_TAGS.items() if os.environ.get(var)}


HEADLINE = re.compile(r"(^|[._])(test_acc|val_acc|acc|peak_\w*bytes|train_time_s)$")


def fleet_metrics(fleet_id: str, uri: str | None = None) -> dict[str, dict[str, float]]:
    """{device: {stage.metric: value}}: the headline metrics (accuracy, measured peak, training time) of
    every stage run under the pipeline runs that one fleet run started."""
    client = MlflowClient(uri or tracking_uri())
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return {}
    parents = client.search_runs([experiment.experiment_id], filter_string=f"tags.`edgeflux.fleet_id` = '{fleet_id}'")
    table: dict[str, dict[str, float]] = {}
    for parent in parents:
        device = parent.data.tags.get("edgeflux.device", parent.info.run_id)
        children = client.search_runs([experiment.experiment_id],
                                      filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        for child in children:
            stage = child.data.tags.get("edgeflux.stage", child.info.run_name)
            table.setdefault(device, {}).update({f"{stage}.{k}": v for k, v in child.data.metrics.items()
                                                  if HEADLINE.search(k)})
    return table


def _process_tags() -> dict[str, str]:
    """Which process holds a stage run: host, pid and the pid's start time (pids are reused)."""
    me = psutil.Process()
    return {"edgeflux.host": socket.gethostname(), "edgeflux.pid": str(me.pid),
            "edgeflux.pid_started": f"{me.create_time():.3f}"}


def _alive(tags: Mapping[str, str]) -> bool:
    try:
        return f"{psutil.Process(int(tags['edgeflux.pid'])).create_time():.3f}" == tags["edgeflux.pid_started"]
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
        return False


def close_orphaned_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """Mark KILLED the stage runs of this host still RUNNING whose process is gone (a SIGKILL, a power
    cut: the process could not close its run), and their parent runs. Returns the closed runs' ids.

    A stage run of another host is left alone: its process cannot be checked from here.
    """
    host = socket.gethostname()
    running = client.search_runs([experiment_id], filter_string=(
        f"attributes.status = 'RUNNING' and tags.`edgeflux.kind` = 'stage' and tags.`edgeflux.host` = '{host}'"))
    closed = []
    for orphan in running:
        if _alive(orphan.data.tags):
            continue
        client.set_terminated(orphan.info.run_id, status="KILLED")
        closed.append(orphan.info.run_id)
        parent = orphan.data.tags.get("mlflow.parentRunId")
        if parent and client.get_run(parent).info.status == "RUNNING":
            client.set_terminated(parent, status="KILLED")
        log.warning("MLflow: run %s of stage %s (pid %s) ended without closing it (killed?): marked KILLED",
                    orphan.info.run_id, orphan.data.tags.get("edgeflux.stage"), orphan.data.tags["edgeflux.pid"])
    return closed


class TrackingStoreError(RuntimeError):
    """The MLflow store cannot be opened (a damaged sqlite file, a server that is not there)."""


def _open_store(uri: str) -> tuple[MlflowClient, str, str]:
    """(client, experiment id, parent run id) in the store at ``uri``; TrackingStoreError with the fix when
    the store is unusable, before the stage has done any work."""
    try:
        mlflow.set_tracking_uri(uri)
        client = MlflowClient()
        experiment_id = resolve_experiment(client, uri)
        close_orphaned_runs(client, experiment_id)
        return client, experiment_id, _parent_run(client, experiment_id, pipeline_id())
    except (SQLAlchemyError, sqlite3.DatabaseError, MlflowException) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        db = uri.removeprefix("sqlite:///").split("?")[0]
        fix = (f"move it aside (`mv {db} {db}.corrupt`) and rerun: a new store is created (the old runs stay "
               "in the moved file)" if _store_dir(uri)
               else "check that the tracking server is up, or set MLFLOW_TRACKING_URI to a reachable one")
        raise TrackingStoreError(f"the MLflow tracking store {uri} cannot be used ({reason[:200]}): {fix}") from None


@contextmanager
def stage_run(stage: str, params: Mapping[str, Any] | None = None) -> Iterator[StageRun]:
    """Open the nested MLflow run of one stage inside its pipeline's parent run.

    On exit the stage's ``time_s`` (wall clock of the block) is logged, the child run is closed as
    FINISHED (KILLED on KeyboardInterrupt, e.g. Ctrl-C; FAILED on another exception) and the parent
    is left in the same state, so the parent always shows the state of the last stage that ran.
    Runs that a killed process left RUNNING on this host are closed as KILLED first.
    """
    uri = tracking_uri()
    client, experiment_id, parent_id = _open_store(uri)
    status = "FAILED"
    with mlflow.start_run(experiment_id=experiment_id, run_name=stage, parent_run_id=parent_id,
                          tags={"edgeflux.stage": stage, "edgeflux.kind": "stage", **_process_tags()}) as active:
        run = StageRun(active.info.run_id, stage)
        if params:
            run.log_params(params)
        try:
            yield run
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            if status == "FINISHED":
                mlflow.log_metric("time_s", time.perf_counter() - run.started)
            mlflow.end_run(status=status)
            client.set_terminated(parent_id, status=status)
    log.info("MLflow: stage %s logged as run %s (parent %s) in %s", stage, run.run_id, parent_id, uri)


def ui_command() -> str:
    """The command a user runs to browse what was tracked (with this interpreter's mlflow, so it
    works from a shell where the virtualenv is not activated)."""
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    if mlflow_bin.is_relative_to(Path.cwd()):
        mlflow_bin = mlflow_bin.relative_to(Path.cwd())
    return f"{mlflow_bin if mlflow_bin.exists() else 'mlflow'} ui --backend-store-uri {tracking_uri()}"
