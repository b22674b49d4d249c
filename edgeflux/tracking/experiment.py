"""The experiment every run goes to: created with its artifacts next to a sqlite store, tagged as a model
training experiment, and moved aside when its store was copied or moved.

A store whose experiment has an absolute ``file:`` artifact location keeps it while it stays where it is;
once copied or moved (its runs' artifacts are still the original's), its experiment is renamed aside,
keeping its runs and their links, and a new experiment of the same name takes the new runs.
"""
from __future__ import annotations

import logging

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient

from .store import EXPERIMENT, _outside, _store_dir, _store_location

log = logging.getLogger(__name__)

# The experiment tag by which MLflow 3's UI tells a model-training experiment ("custom_model_development",
# shown as "Machine learning": opens on its runs) from a GenAI one ("genai_development": opens on an overview
# of traces). UIs from 3.17 on ignore it and follow the sidebar's GenAI / Machine learning switch (a browser
# setting, or ``?workflowType=machine_learning`` in the address): ui_url() gives the address with it.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


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
