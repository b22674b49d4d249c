"""What a stage logs: to its nested run, and its headline metrics to the pipeline's parent run as
``<stage>.<metric>``, so that the parent runs, one per pipeline run, compare in MLflow's views."""
from __future__ import annotations

import logging
import numbers
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from .models import log_model, log_onnx_model
from .parents import PIPELINE_KEY_TAG, flatten

log = logging.getLogger(__name__)


def metric_name(name: str) -> str:
    """``name`` in the characters MLflow takes in a metric name on every platform (letters, digits, ``_ - .``;
    MLflow also takes ``/``, space and, except on Windows, ``:``): ``@`` becomes ``.`` (``finetune@mobiletl`` ->
    ``finetune.mobiletl``), anything else ``_``; no leading dot (MLflow refuses names that start with ``..``)."""
    return re.sub(r"[^\w.\-]", "_", name.replace("@", ".")).lstrip(".") or "_"


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among flattened ``metrics`` (numpy's too), as floats; strings, lists, None and bools left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, str))}


def _headline(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {metric_name(k): v for k, v in _numeric(metrics).items()}


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
        values = _headline(metrics)
        if values:
            mlflow.log_metrics(values)
            self._log_to_parent(self.stage, values)

    def log_pipeline_headline(self, by_stage: Mapping[str, Mapping[str, Any]]) -> None:
        """Every stage's headline, {stage: its metrics}, to the pipeline's parent run as ``<stage>.<name>``
        (the stage run itself gets none). The report stage, which reads them all after any change, calls it:
        a ``dvc repro`` that reran some stages then still carries the whole pipeline's figures, which the
        stages it did not rerun (up to date, from an earlier run) never logged to this parent."""
        for stage, metrics in by_stage.items():
            self._log_to_parent(stage, _headline(metrics))

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
        return log_model(model, name, example, registered_name, self._model_tags())

    def log_onnx_model(self, path: str | Path, name: str, example, registered_name: str):
        """An ONNX file as an MLflow model (``mlflow.pyfunc.load_model`` runs it in onnxruntime), registered as a
        new version of ``registered_name`` with the tags log_model gives."""
        return log_onnx_model(path, name, example, registered_name, self._model_tags())

    def _model_tags(self) -> dict[str, str]:
        return {PIPELINE_KEY_TAG: self.pipeline or "", "edgeflux.stage": self.stage, "edgeflux.run_id": self.run_id}
