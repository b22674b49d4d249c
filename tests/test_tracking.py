import os
import signal
import subprocess
import sys

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from edgeflux.tracking import close_orphaned_runs, flatten, pipeline_id, stage_run, tracking_uri


def runs(client):
    exp = client.get_experiment_by_name("edgeflux")
    return client.search_runs([exp.experiment_id])


def test_stages_of_one_pipeline_nest_under_one_parent(monkeypatch):
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "test-pipeline-1")
    with stage_run("prepare", {"dataset": "x", "nested": {"a": 1}}) as run:
        run.log_metrics({"n_train": 10})
    with stage_run("train_bp", {"lr": 0.1}) as run:
        run.log_metrics({"test_acc": 0.9, "peak_mem_bytes": 1234, "model": "ignored-string"})
        run.log_history([{"step": 1, "time_s": 0.5, "val_acc": 0.4}, {"step": 2, "time_s": 1.0, "val_acc": 0.6}])
    client = MlflowClient(tracking_uri())
    all_runs = runs(client)
    parents = [r for r in all_runs if r.data.tags.get("edgeflux.kind") == "pipeline"]
    children = [r for r in all_runs if r.data.tags.get("edgeflux.kind") == "stage"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(c.data.tags["edgeflux.stage"] for c in children) == ["prepare", "train_bp"]
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    bp = next(c for c in children if c.data.tags["edgeflux.stage"] == "train_bp")
    assert bp.data.params == {"lr": "0.1"}
    assert bp.data.metrics["test_acc"] == 0.9 and bp.data.metrics["peak_mem_bytes"] == 1234
    assert bp.data.metrics["time_s"] >= 0
    curve = client.get_metric_history(bp.info.run_id, "val_acc")
    assert [(m.step, m.value) for m in curve] == [(1, 0.4), (2, 0.6)]
    prep = next(c for c in children if c.data.tags["edgeflux.stage"] == "prepare")
    assert prep.data.params == {"dataset": "x", "nested.a": "1"}


def test_failed_stage_marks_child_and_parent_failed(monkeypatch):
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "test-pipeline-2")
    with pytest.raises(RuntimeError):
        with stage_run("train_bp"):
            raise RuntimeError("boom")
    client = MlflowClient(tracking_uri())
    statuses = {r.data.tags["edgeflux.kind"]: r.info.status for r in runs(client)}
    assert statuses == {"pipeline": "FAILED", "stage": "FAILED"}
    assert mlflow.active_run() is None


def test_interrupted_stage_marks_child_and_parent_killed(monkeypatch):
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "test-pipeline-3")
    with pytest.raises(KeyboardInterrupt):
        with stage_run("train_bp"):
            raise KeyboardInterrupt
    statuses = {r.data.tags["edgeflux.kind"]: r.info.status for r in runs(MlflowClient(tracking_uri()))}
    assert statuses == {"pipeline": "KILLED", "stage": "KILLED"}
    assert mlflow.active_run() is None


def test_different_pipelines_get_different_parents(monkeypatch):
    for pid in ("p-a", "p-b"):
        monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", pid)
        with stage_run("prepare"):
            pass
    parents = [r for r in runs(MlflowClient(tracking_uri())) if r.data.tags["edgeflux.kind"] == "pipeline"]
    assert sorted(r.data.tags["edgeflux.pipeline_id"] for r in parents) == ["p-a", "p-b"]


def test_pipeline_id_outside_dvc_is_this_process():
    assert pipeline_id().startswith("standalone:")


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}


def test_runs_left_running_by_a_killed_process_are_closed_as_killed(monkeypatch):
    """A SIGKILL (or a power cut) leaves the stage's run and its parent RUNNING: the process could not close
    them. The next stage on this host marks them KILLED; a RUNNING run of a live process is left alone."""
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal\n"
        "from edgeflux.tracking import stage_run\n"
        "with stage_run('train_bp'):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")],
        env={**os.environ, "EDGEFLUX_PIPELINE_ID": "killed-pipeline"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    client = MlflowClient(tracking_uri())
    assert {r.data.tags["edgeflux.kind"]: r.info.status for r in runs(client)} == {"pipeline": "RUNNING",
                                                                                   "stage": "RUNNING"}
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "next-pipeline")
    with stage_run("train_bp") as live:
        # this process's own run is RUNNING now, and its process alive: a clean-up leaves it alone
        assert close_orphaned_runs(client, client.get_run(live.run_id).info.experiment_id) == []
        assert client.get_run(live.run_id).info.status == "RUNNING"
    pipelines = {r.data.tags["edgeflux.pipeline_id"]: r.info.status for r in runs(client)
                 if r.data.tags["edgeflux.kind"] == "pipeline"}
    assert pipelines == {"killed-pipeline": "KILLED", "next-pipeline": "FINISHED"}
    assert sorted(r.info.status for r in runs(client) if r.data.tags["edgeflux.kind"] == "stage") == ["FINISHED",
                                                                                                      "KILLED"]
