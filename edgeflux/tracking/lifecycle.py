"""A stage's run from open to close: the store opened (or one error that says how to fix it), runs a killed
process left RUNNING closed, the stage's run nested in its pipeline's parent run, closed with the stage's state."""
from __future__ import annotations

import logging
import socket
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import mlflow
import psutil
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from sqlalchemy.exc import SQLAlchemyError

from .experiment import resolve_experiment
from .parents import parent_run, pipeline_id
from .stage import StageRun
from .store import sqlite_file, tracking_uri
from edgeflux.auth import HOW, AuthError, export_credentials
from edgeflux.errors import UserError

log = logging.getLogger(__name__)


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
        if not sqlite_file(uri):
            export_credentials()   # a server: the fleet's password (edgeflux.auth), where the environment has none
        mlflow.set_tracking_uri(uri)
        client = MlflowClient()
        experiment_id = resolve_experiment(client, uri)
        close_orphaned_runs(client, experiment_id)
        pid = pipeline_id()
        return client, experiment_id, parent_run(client, experiment_id, pid), pid
    except (SQLAlchemyError, sqlite3.DatabaseError, MlflowException, AuthError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        db = sqlite_file(uri)
        fix = (f"move it aside (`mv {db} {db}.corrupt`) and rerun: a new store is created (the old runs stay "
               "in the moved file)" if db
               else "check that the tracking server is up, or set MLFLOW_TRACKING_URI to a reachable one; a "
                    f"server that answers 401 needs the fleet's password: {HOW}")
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
