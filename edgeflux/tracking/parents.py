"""The pipeline's parent run: the one run every stage of one pipeline run nests in.

How stages that run as separate processes find their common parent run: the pipeline id comes
from ``EDGEFLUX_PIPELINE_ID`` when a launcher (Makefile, Prefect flow) sets it; otherwise from the
``dvc`` process that is running this stage (its pid and start time are the same for every stage of
one ``dvc repro``), so a plain ``dvc repro`` groups its stages too. A stage run by hand gets a
parent of its own.

What the UI shows of it: each parent run carries its stages' headline metrics as ``<stage>.<metric>``
(``StageRun.log_headline``), the DVC experiment it belongs to (``edgeflux.dvc_exp``, from ``DVC_EXP_NAME``),
the launcher's flow, device, fleet run and preset as tags, and the preset in its name.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import yaml
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from edgeflux.presets import OVERRIDES_ENV

from .store import EXPERIMENT, tracking_uri

PIPELINE_KEY_TAG = "edgeflux.pipeline_id"
DVC_EXP_TAG = "edgeflux.dvc_exp"
LAUNCHER_TAGS = {"EDGEFLUX_FLOW": "edgeflux.flow", "EDGEFLUX_DEVICE_ID": "edgeflux.device",
                 "EDGEFLUX_FLEET_ID": "edgeflux.fleet_id", "EDGEFLUX_PRESET": "edgeflux.preset"}
HEADLINE = re.compile(r"(^|[._])(test_acc|val_acc|acc|peak_\w*bytes|train_time_s)$")
PARAMS_FILE = Path("params.yaml")   # in the directory DVC runs the stages in: the workspace's, or an experiment's
PRESET_PARAM, OVERRIDES_PARAM = "edgeflux.preset", "edgeflux.overrides"
PARAM_CHARS = 6000   # the longest param value MLflow stores (mlflow.utils.validation); a longer one is cut


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


def pipeline_params(path: Path = PARAMS_FILE) -> dict[str, str]:
    """What a pipeline run ran with, as its parent run's params, so that MLflow's compare view says why two
    pipeline runs differ: params.yaml flattened (every stage's section, ``train_bp.lr``, and the ``device``
    section the budgeted stages inherit, ``device.budget``), the preset (``edgeflux.preset``) and the overrides
    `edgeflux run` applied (``edgeflux.overrides``, JSON; they are in params.yaml's values too)."""
    try:
        params = yaml.safe_load(path.read_text()) if path.is_file() else {}
    except (OSError, yaml.YAMLError):   # the stage that reads it says what is wrong
        params = {}
    flat = {k: _param_text(v) for k, v in flatten(params if isinstance(params, dict) else {}).items()}
    if preset := os.environ.get("EDGEFLUX_PRESET"):
        flat[PRESET_PARAM] = preset
    if overrides := os.environ.get(OVERRIDES_ENV):
        flat[OVERRIDES_PARAM] = _param_text(overrides)
    return flat


def _param_text(value: Any) -> str:
    # YAML's own word for an unset value (a stage's budget: null inherits device.budget): an empty param shows
    # as "unknown" in MLflow's compare view
    text = "null" if value is None else str(value)
    return text if len(text) <= PARAM_CHARS else text[:PARAM_CHARS - 1] + "…"


def log_pipeline_params(client: MlflowClient, run_id: str, path: Path = PARAMS_FILE) -> None:
    """pipeline_params() on the parent run (MLflow takes at most 100 params a call), and params.yaml itself as
    its artifact."""
    items = [Param(k, v) for k, v in pipeline_params(path).items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start:start + 100])
    if path.is_file():
        client.log_artifact(run_id, str(path))


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


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


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


def _launcher_tags() -> dict[str, str]:
    """Which flow, device, fleet run and preset started the pipeline (set by pipeline.flows), to filter runs by."""
    return {tag: os.environ[var] for var, tag in LAUNCHER_TAGS.items() if os.environ.get(var)}


def parent_run(client: MlflowClient, experiment_id: str, pid: str) -> str:
    """The id of pipeline ``pid``'s parent run, RUNNING again: found by its tag, else created."""
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
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    run_id = client.create_run(experiment_id, run_name=_parent_run_name(), tags=tags).info.run_id
    log_pipeline_params(client, run_id)   # once: every stage of one pipeline run reads the same params.yaml
    return run_id


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
