"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

The only package of the library that imports mlflow. Telemetry is off: devices may be offline. One module
per job:

- ``store``: where runs go (``tracking_uri``) and where their artifacts go, and the UI command that reads them;
- ``scheme``: ``mlflow-artifacts:/`` locations resolved next to a sqlite store, in every process that imports
  this package;
- ``experiment``: the experiment, created with its artifacts next to the store, or moved aside when its store
  was copied or moved;
- ``parents``: the pipeline id every stage of one pipeline run shares, its parent run (with the params the
  pipeline ran with), fleet metrics;
- ``stage``: what a stage logs (``StageRun``);
- ``lifecycle``: opening and closing a stage's run (``stage_run``), runs a killed process left open;
- ``models``: models in MLflow's format, and in its model registry.

Metric names are shared by every stage so that MLflow's compare view lines them up:
``time_s``, ``peak_mem_bytes``, ``budget_bytes``, ``batch_size``, ``train_loss``, ``val_acc``,
``test_acc``, ``params``.
"""
from __future__ import annotations

import os

# mlflow reads these when it is imported: set before any module of this package imports it
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

from . import scheme  # noqa: E402,F401  (importing it registers the artifact scheme)
from .experiment import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, resolve_experiment  # noqa: E402
from .lifecycle import TrackingStoreError, _alive, _process_tags, close_orphaned_runs, stage_run  # noqa: E402
from .models import ModelDirError, check_model_dir, save_model_dir  # noqa: E402
from .parents import (DVC_EXP_TAG, HEADLINE, LAUNCHER_TAGS, PIPELINE_KEY_TAG, dvc_experiment,  # noqa: E402
                      flatten, fleet_metrics, pipeline_id)
from .stage import StageRun, metric_name  # noqa: E402
from .store import (ARTIFACTS_DIR, EXPERIMENT, PROXIED_SCHEME, artifacts_root, repo_root,  # noqa: E402
                    tracking_uri, ui_command, ui_url)

__all__ = ["ARTIFACTS_DIR", "DVC_EXP_TAG", "EXPERIMENT", "EXPERIMENT_KIND", "EXPERIMENT_KIND_TAG", "HEADLINE",
           "LAUNCHER_TAGS", "PIPELINE_KEY_TAG", "PROXIED_SCHEME", "StageRun", "TrackingStoreError", "_alive",
           "_process_tags", "artifacts_root", "close_orphaned_runs", "dvc_experiment", "flatten", "fleet_metrics",
           "metric_name", "pipeline_id", "repo_root", "resolve_experiment", "save_model_dir", "stage_run",
           "check_model_dir", "ModelDirError",
           "tracking_uri", "ui_command", "ui_url"]
