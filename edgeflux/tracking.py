"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

The only module of the library that imports mlflow. Telemetry is off: devices may be offline.

Where runs go: ``MLFLOW_TRACKING_URI`` when it is set; otherwise sqlite ``mlflow.db`` at the root of
the repository, found from ``DVC_ROOT``, which DVC sets for every stage it runs, else from the
working directory. Not the working directory first: ``dvc exp run --temp`` and queued experiments run
their stages in a copy of the repository under ``.dvc/tmp/exps/`` that DVC deletes afterwards, and
for those DVC sets ``DVC_ROOT`` to the original repository.

Where artifacts go: ``mlruns/<experiment>`` next to ``mlflow.db``, recorded relative to the store so
that a moved or copied clone keeps working. MLflow keeps no relative local path (it makes an
experiment's artifact location absolute when the experiment is created, and each run's artifacts go
under its experiment's), so a sqlite store's experiment is created with the location
``mlflow-artifacts:/<experiment>``: MLflow's own scheme for artifacts served by a tracking server
from its ``--artifacts-destination``. ``ui_command()`` starts the UI with ``--artifacts-destination
<store dir>/mlruns``, and in every process that imports this module the scheme resolves, for a sqlite
tracking URI, to ``<store dir>/mlruns`` (for an http(s) one, MLflow's proxy as usual). A store made
before this (an absolute ``file:`` location) keeps it while it stays where it is; once copied or moved
(its runs' artifacts are still the original's), its experiment is renamed aside, keeping its runs and
their links, and a new experiment of the same name takes the new runs.

What the UI shows: the experiment is tagged ``mlflow.experimentKind = custom_model_development``
(a training experiment, not a GenAI one); each parent run carries its stages' headline metrics as
``<stage>.<metric>`` (``StageRun.log_headline``), the DVC experiment it belongs to (``edgeflux.dvc_exp``,
from ``DVC_EXP_NAME``) and the preset in its name; ``StageRun.log_model(..., registered_name=...)``
registers a model in MLflow's model registry, each version tagged with its pipeline, stage and commit.

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
import numbers
import os
import re
import shlex
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
from mlflow.entities import Metric  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode  # noqa: E402
from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry  # noqa: E402
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository  # noqa: E402
from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from sqlalchemy.exc import SQLAlchemyError  # noqa: E402

from edgeflux.errors import UserError

log = logging.getLogger(__name__)

EXPERIMENT = os.environ.get("EDGEFLUX_EXPERIMENT", "edgeflux")
PIPELINE_KEY_TAG = "edgeflux.pipeline_id"
DVC_EXP_TAG = "edgeflux.dvc_exp"
# The experiment tag by which MLflow 3's UI tells a model-training experiment ("custom_model_development",
# shown as "Machine learning": opens on its runs) from a GenAI one ("genai_development": opens on an overview
# of traces). UIs from 3.17 on ignore it and follow the sidebar's GenAI / Machine learning switch (a browser
# setting, or ``?workflowType=machine_learning`` in the address): ui_url() gives the address with it.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
ARTIFACTS_DIR = "mlruns"          # next to a sqlite store's file: where ``mlflow-artifacts:/`` resolves
PROXIED_SCHEME = "mlflow-artifacts"


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


def artifacts_root(uri: str) -> Path | None:
    """Where ``mlflow-artifacts:/`` URIs resolve for the sqlite store at ``uri`` (``mlruns`` next to its file,
    what ui_command() gives the UI as ``--artifacts-destination``); None for a server's store."""
    store_dir = _store_dir(uri)
    return store_dir / ARTIFACTS_DIR if store_dir else None


def _proxied_artifact_repository(artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None):
    """The artifact repository of an ``mlflow-artifacts:`` URI: with a sqlite tracking URI, the directory it names
    under artifacts_root(), as a tracking server started by ui_command() serves it; otherwise MLflow's (the
    tracking server proxies it). Registered for the scheme in every process that imports this module."""
    parsed = urlparse(artifact_uri)
    root = artifacts_root(tracking_uri or mlflow.get_tracking_uri())
    if root is None or parsed.netloc:
        return MlflowArtifactsRepository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)
    path = (root / url2pathname(parsed.path).lstrip("/")).resolve()
    if not path.is_relative_to(root.resolve()):
        raise MlflowException(f"artifact URI {artifact_uri} points outside {root}")
    return LocalArtifactRepository(str(path), tracking_uri=tracking_uri, registry_uri=registry_uri)


_artifact_repository_registry.register(PROXIED_SCHEME, _proxied_artifact_repository)


def _store_location(name: str) -> str:
    """A new experiment's artifact location in a sqlite store: relative to the store (see the module docstring)."""
    directory = re.sub(r"[^\w.-]", "_", name).lstrip(".") or "_"
    return f"{PROXIED_SCHEME}:/{directory}"


def resolve_experiment(client: MlflowClient, uri: str) -> str:
    """The id of EXPERIMENT in the store at ``uri``, with its artifacts next to a sqlite store, tagged as a model
    training experiment (when it has no kind yet: a kind chosen in the UI stays)."""
    store_dir = _store_dir(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment and store_dir and _outside(experiment.artifact_location, store_dir):
        aside = f"{EXPERIMENT} (artifacts in {experiment.artifact_location})"
        log.warning("MLflow: experiment %s keeps its artifacts outside %s (a copied or moved store): renamed it %r, "
                    "new runs go to a new %s", EXPERIMENT, store_dir, aside, EXPERIMENT)
        client.rename_experiment(experiment.experiment_id, aside)
        experiment = None
    if experiment is None:
        location = _store_location(EXPERIMENT) if store_dir else None
        try:
            return client.create_experiment(EXPERIMENT, artifact_location=location,
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as exc:   # another stage created it first
            if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            experiment = client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                raise
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


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


def metric_name(name: str) -> str:
    """``name`` in the characters MLflow takes in a metric name on every platform (letters, digits, ``_ - .``;
    MLflow also takes ``/``, space and, except on Windows, ``:``): ``@`` becomes ``.`` (``finetune@mobiletl`` ->
    ``finetune.mobiletl``), anything else ``_``; no leading dot (MLflow refuses names that start with ``..``)."""
    return re.sub(r"[^\w.\-]", "_", name.replace("@", ".")).lstrip(".") or "_"


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among flattened ``metrics`` (numpy's too), as floats; strings, lists, None and bools left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, str))}


class StageRun:
    """What a stage logs to its nested MLflow run (and, for its headline metrics, to the pipeline's parent run)."""

    def __init__(self, run_id: str, stage: str, parent_id: str | None = None, client: MlflowClient | None = None,
                 pipeline: str | None = None):
        self.run_id = run_id
        self.stage = stage
        self.parent_id = parent_id
        self.pipeline = pipeline
        self._client = client
        self.started = time.perf_counter()

    def log_params(self, params: Mapping[str, Any]) -> None:
        mlflow.log_params(flatten(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        mlflow.log_metrics(_numeric(metrics), step=step)

    def log_headline(self, metrics: Mapping[str, float | Mapping[str, float]]) -> None:
        """The stage's headline metrics (test_acc, train_time_s, peak_mib, ...; for a stage with several models,
        one level of nesting: {"mobilenet_v2-w0.5": {"test_acc": ..}} -> ``mobilenet_v2-w0.5.test_acc``): logged
        under these names to the stage's run, and to the pipeline's parent run as ``<stage>.<name>``
        (metric_name(stage): ``finetune@mobiletl.test_acc`` -> ``finetune.mobiletl.test_acc``), so that the parent
        runs, one per pipeline run, show and compare them in MLflow's table, charts and compare view.
        Non-numeric values are left out."""
        values = {metric_name(k): v for k, v in _numeric(metrics).items()}
        if values:
            mlflow.log_metrics(values)
            self._log_to_parent(self.stage, values)

    def log_pipeline_headline(self, by_stage: Mapping[str, Mapping[str, Any]]) -> None:
        """Every stage's headline, {stage: its metrics}, to the pipeline's parent run as ``<stage>.<name>``
        (the stage run itself gets none). The report stage, which reads them all after any change, calls it:
        a ``dvc repro`` that reran some stages then still carries the whole pipeline's figures, which the
        stages it did not rerun (up to date, from an earlier run) never logged to this parent."""
        for stage, metrics in by_stage.items():
            self._log_to_parent(stage, {metric_name(k): v for k, v in _numeric(metrics).items()})

    def _log_to_parent(self, stage: str, values: Mapping[str, float]) -> None:
        if self.parent_id and values:
            client = self._client or MlflowClient()
            now, prefix = int(time.time() * 1000), metric_name(stage)
            client.log_batch(self.parent_id, metrics=[Metric(f"{prefix}.{k}", v, now, 0) for k, v in values.items()])

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

    def log_model(self, model, name: str, example=None, registered_name: str | None = None):
        """A PyTorch model as an MLflow model (loadable with mlflow.pytorch.load_model); ``example``: an
        input batch (tensor) that gives the model its signature. ``registered_name``: also a new version of
        this model in MLflow's model registry (``models:/<registered_name>/<version>``), tagged with the pipeline
        id, the stage, the stage's run and the git commit. Returns MLflow's ModelInfo (with
        ``registered_model_version`` when registered)."""
        import mlflow.pytorch

        info = mlflow.pytorch.log_model(model, name=name, **_model_kwargs(example))
        if registered_name:
            tags = {PIPELINE_KEY_TAG: self.pipeline or "", "edgeflux.stage": self.stage, "edgeflux.run_id": self.run_id}
            if commit := _git_commit():
                tags["edgeflux.git_commit"] = commit
            version = mlflow.register_model(info.model_uri, registered_name, tags=tags)
            info.registered_model_version = version.version
            log.info("MLflow: model %s of stage %s registered as %s version %s", name, self.stage, registered_name,
                     version.version)
        return info


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


def dvc_experiment() -> str | None:
    """The name of the DVC experiment this stage runs in: ``dvc exp run`` (in the workspace, ``--temp`` or
    queued) sets ``DVC_EXP_NAME`` in every stage's environment (dvc/repo/experiments/queue/base.py), beside
    ``DVC_EXP_BASELINE_REV`` (the commit it starts from); None under ``dvc repro``."""
    return os.environ.get("DVC_EXP_NAME") or None


def _parent_run_name(started: float | None = None) -> str:
    """``pipeline 2026-11-25 03:00:00 · preset pi · exp bushy-lamb``: when it started, the preset and the DVC
    experiment, each when there is one."""
    parts = [time.strftime("pipeline %Y-%m-%d %H:%M:%S", time.localtime(started))]
    if preset := os.environ.get("EDGEFLUX_PRESET"):
        parts.append(f"preset {preset}")
    if exp := dvc_experiment():
        parts.append(f"exp {exp}")
    return " · ".join(parts)


def _dvc_tags() -> dict[str, str]:
    tags = {}
    if exp := dvc_experiment():
        tags[DVC_EXP_TAG] = exp
        if baseline := os.environ.get("DVC_EXP_BASELINE_REV"):
            tags["edgeflux.dvc_exp_baseline"] = baseline
    return tags


def _parent_run(client: MlflowClient, experiment_id: str, pid: str) -> str:
    found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{pid}'", max_results=1)
    if found:
        run = found[0]
        client.update_run(run.info.run_id, status="RUNNING")
        if (dvc_tags := _dvc_tags()) and DVC_EXP_TAG not in run.data.tags:   # started before DVC's experiment
            for key, value in dvc_tags.items():
                client.set_tag(run.info.run_id, key, value)
            client.update_run(run.info.run_id, name=_parent_run_name(run.info.start_time / 1000))
        return run.info.run_id
    tags = {PIPELINE_KEY_TAG: pid, "edgeflux.kind": "pipeline", "host": socket.gethostname(), **_launcher_tags(),
            **_dvc_tags()}
    if commit := _git_commit():
        tags["mlflow.source.git.commit"] = commit
    return client.create_run(experiment_id, run_name=_parent_run_name(), tags=tags).info.run_id


LAUNCHER_TAGS = {"EDGEFLUX_FLOW": "edgeflux.flow", "EDGEFLUX_DEVICE_ID": "edgeflux.device",
                 "EDGEFLUX_FLEET_ID": "edgeflux.fleet_id", "EDGEFLUX_PRESET": "edgeflux.preset"}


def _launcher_tags() -> dict[str, str]:
    """Which flow, device, fleet run and preset started the pipeline (set by pipeline.flows), to filter runs by."""
    return {tag: os.environ[var] for var, tag in LAUNCHER_TAGS.items() if os.environ.get(var)}


HEADLINE = re.compile(r"(^|[._])(test_acc|val_acc|acc|peak_\w*bytes|train_time_s)$")


def fleet_metrics(fleet_id: str, uri: str | None = None) -> dict[str, dict[str, float]]:
    """{device: {stage.metric: value}}: the headline metrics of the pipeline runs that one fleet run started,
    as their parent runs carry them (StageRun.log_headline: ``<stage>.<metric>``). A parent run that carries
    none (its stages predate log_headline) gets them from its stage runs: the metrics that look like headline
    ones (accuracy, measured peak, training time), as ``<stage>.<metric>``."""
    client = MlflowClient(uri or tracking_uri())
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return {}
    parents = client.search_runs([experiment.experiment_id], filter_string=f"tags.`edgeflux.fleet_id` = '{fleet_id}'")
    table: dict[str, dict[str, float]] = {}
    for parent in parents:
        device = parent.data.tags.get("edgeflux.device", parent.info.run_id)
        if parent.data.metrics:
            table.setdefault(device, {}).update(parent.data.metrics)
            continue
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


class TrackingStoreError(RuntimeError, UserError):
    """The MLflow store cannot be opened (a damaged sqlite file, a server that is not there)."""


def _open_store(uri: str) -> tuple[MlflowClient, str, str, str]:
    """(client, experiment id, parent run id, pipeline id) in the store at ``uri``; TrackingStoreError with the
    fix when the store is unusable, before the stage has done any work."""
    try:
        mlflow.set_tracking_uri(uri)
        client = MlflowClient()
        experiment_id = resolve_experiment(client, uri)
        close_orphaned_runs(client, experiment_id)
        pid = pipeline_id()
        return client, experiment_id, _parent_run(client, experiment_id, pid), pid
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
    client, experiment_id, parent_id, pid = _open_store(uri)
    status = "FAILED"
    with mlflow.start_run(experiment_id=experiment_id, run_name=stage, parent_run_id=parent_id,
                          tags={"edgeflux.stage": stage, "edgeflux.kind": "stage", **_process_tags()}) as active:
        run = StageRun(active.info.run_id, stage, parent_id=parent_id, client=client, pipeline=pid)
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
    works from a shell where the virtualenv is not activated); for a sqlite store, with the directory
    its ``mlflow-artifacts:/`` locations resolve to (see the module docstring)."""
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    if mlflow_bin.is_relative_to(Path.cwd()):
        mlflow_bin = mlflow_bin.relative_to(Path.cwd())
    uri = tracking_uri()
    command = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "ui", "--backend-store-uri", uri]
    if root := artifacts_root(uri):
        command += ["--artifacts-destination", str(root)]
    return shlex.join(command)


def ui_url(base: str = "http://127.0.0.1:5000") -> str:
    """The address of the experiment's runs in the UI at ``base``, in its Machine learning view (MLflow 3.17's UI
    picks GenAI or Machine learning by a switch in its sidebar, GenAI unless changed, not by the experiment's
    kind tag); the list of experiments when the store is not a sqlite file here that has the experiment."""
    uri, experiment = tracking_uri(), None
    if _store_dir(uri) and Path(uri.removeprefix("sqlite:///").split("?")[0]).is_file():
        try:
            experiment = MlflowClient(uri).get_experiment_by_name(EXPERIMENT)
        except (SQLAlchemyError, sqlite3.DatabaseError, MlflowException, OSError):
            pass
    where = f"experiments/{experiment.experiment_id}/runs" if experiment else "experiments"
    return f"{base.rstrip('/')}/#/{where}?workflowType=machine_learning"
