import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from edgeflux.tracking import close_orphaned_runs, flatten, pipeline_id, stage_run, tracking_uri

STAGE_SCRIPT = """\
from pathlib import Path
from edgeflux.tracking import stage_run
with stage_run('tiny', {'cwd': Path.cwd()}) as run:
    Path('out.txt').write_text('x')
    run.log_artifact('out.txt')
"""


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


def test_store_is_found_from_dvc_root_and_the_tracking_uri_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))   # what DVC sets: in an experiment, the original repository
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri() == "http://tracking.example:5000"


def _artifact_dir(run) -> Path:
    return Path(run.info.artifact_uri.removeprefix("file://"))


def test_dvc_exp_run_temp_logs_to_the_repository_store(tmp_path):
    """`dvc exp run --temp` runs the stage in a copy under .dvc/tmp/exps/ that DVC deletes afterwards: the run
    and its artifacts must be in the repository's mlflow.db and next to it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "stage.py").write_text(STAGE_SCRIPT)
    (repo / "dvc.yaml").write_text(f"stages:\n  tiny:\n    cmd: {sys.executable} stage.py\n    deps: [stage.py]\n"
                                   "    outs: [out.txt]\n")
    (repo / ".gitignore").write_text("mlflow.db\nmlruns/\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT")}
    env.update(DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(tmp_path / "site-cache"), MLFLOW_DISABLE_TELEMETRY="true",
               GIT_CONFIG_GLOBAL=os.devnull)
    dvc = f"{sys.executable} -m dvc"
    for cmd in ("git init -q", "git config user.email t@t", "git config user.name t", f"{dvc} init -q",
                f"{dvc} config core.analytics false",
                "git add -A", "git commit -qm init", f"{dvc} exp run --temp"):
        out = subprocess.run(cmd, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    (stage,) = [r for r in runs(client) if r.data.tags["edgeflux.kind"] == "stage"]
    assert stage.info.status == "FINISHED" and stage.data.tags["edgeflux.stage"] == "tiny"
    assert Path(stage.data.params["cwd"]).is_relative_to(repo / ".dvc/tmp/exps")   # it ran in DVC's temp copy
    assert _artifact_dir(stage).is_relative_to(repo.resolve() / "mlruns")
    assert (_artifact_dir(stage) / "out.txt").read_text() == "x"


def test_a_copied_store_keeps_new_artifacts_in_the_copy(tmp_path, monkeypatch):
    """MLflow fixes an experiment's artifact location as an absolute path: a copy of a clone (mlflow.db and
    mlruns/) must not write its new runs' artifacts into the original."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    monkeypatch.chdir(original)
    with stage_run("prepare") as run:
        Path("out.txt").write_text("original")
        run.log_artifact("out.txt")
    shutil.copytree(original, copy)
    monkeypatch.chdir(copy)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")   # mlflow.set_tracking_uri exported it, for subprocesses
    with stage_run("prepare") as run:
        Path("out.txt").write_text("copy")
        run.log_artifact("out.txt")
        new_run_id = run.run_id
    client = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    new = client.get_run(new_run_id)
    assert _artifact_dir(new).is_relative_to(copy.resolve()) and (_artifact_dir(new) / "out.txt").read_text() == "copy"
    assert not list(original.rglob(new_run_id))
    # the copied runs stay findable, with their artifacts where they were logged
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 4


def test_a_corrupt_store_is_one_error_that_says_to_move_it_aside(tmp_path, monkeypatch):
    """A damaged mlflow.db blocked every stage with a 77-line traceback: now one line with the fix, raised
    before the stage does any work, and the fix works."""
    from edgeflux.tracking import TrackingStoreError

    db = tmp_path / "mlflow.db"
    db.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with pytest.raises(TrackingStoreError, match=r"cannot be used .*" + re.escape(f"`mv {db} {db}.corrupt`")) as info:
        with stage_run("prepare"):
            pytest.fail("the stage ran on a store it cannot use")
    assert "\n" not in str(info.value)
    db.rename(db.with_name("mlflow.db.corrupt"))   # the fix, then a new process (this one caches the store)
    subprocess.run([sys.executable, "-c", "from edgeflux.tracking import stage_run\nwith stage_run('prepare'): pass"],
                   check=True, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}, timeout=120)
    assert db.exists()
