import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from edgeflux.tracking import (close_orphaned_runs, flatten, fleet_metrics, metric_name, pipeline_id, stage_run,
                               tracking_uri, ui_command, ui_url)

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


def _artifact_dir(run, store_dir: Path) -> Path:
    """Where a run's artifacts lie: a ``mlflow-artifacts:/`` location under ``mlruns`` next to the store's file,
    an old absolute ``file://`` one where it says."""
    uri = run.info.artifact_uri
    if uri.startswith("mlflow-artifacts:/"):
        return store_dir / "mlruns" / uri.removeprefix("mlflow-artifacts:/")
    return Path(uri.removeprefix("file://"))


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
                "git add -A", "git commit -qm init", f"{dvc} exp run --temp -n tiny-exp"):
        out = subprocess.run(cmd, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    (stage,) = [r for r in runs(client) if r.data.tags["edgeflux.kind"] == "stage"]
    assert stage.info.status == "FINISHED" and stage.data.tags["edgeflux.stage"] == "tiny"
    assert Path(stage.data.params["cwd"]).is_relative_to(repo / ".dvc/tmp/exps")   # it ran in DVC's temp copy
    assert _artifact_dir(stage, repo).is_relative_to(repo / "mlruns")
    assert (_artifact_dir(stage, repo) / "out.txt").read_text() == "x"
    # the parent run says which DVC experiment it was (DVC_EXP_NAME, which DVC sets for the stages it runs)
    (parent,) = [r for r in runs(client) if r.data.tags["edgeflux.kind"] == "pipeline"]
    assert parent.data.tags["edgeflux.dvc_exp"] == "tiny-exp" and parent.info.run_name.endswith(" · exp tiny-exp")


def test_a_copied_store_keeps_new_artifacts_in_the_copy(tmp_path, monkeypatch):
    """A copy of a clone (mlflow.db and mlruns/) must not write its new runs' artifacts into the original: its
    experiment's artifacts are located relative to the store, so the copy's new runs go to the same experiment
    in the copy, with their artifacts in the copy's mlruns/."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    monkeypatch.chdir(original)
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "in-the-original")
    with stage_run("prepare") as run:
        Path("out.txt").write_text("original")
        run.log_artifact("out.txt")
    shutil.copytree(original, copy)
    monkeypatch.chdir(copy)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")   # mlflow.set_tracking_uri exported it, for subprocesses
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "in-the-copy")
    with stage_run("prepare") as run:
        Path("out.txt").write_text("copy")
        run.log_artifact("out.txt")
        new_run_id = run.run_id
    client = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    new = client.get_run(new_run_id)
    assert (_artifact_dir(new, copy) / "out.txt").read_text() == "copy"
    assert not list(original.rglob(new_run_id))
    # the copied runs stay in the same (only) experiment, with their artifacts in the copy
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "edgeflux"]
    assert len(runs(client)) == 4


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


# --- what a newcomer meets in the MLflow UI ---------------------------------------------------------------------

def _experiment(client):
    return client.get_experiment_by_name("edgeflux")


def test_the_experiment_is_a_model_training_one(monkeypatch):
    """MLflow 3's UI opened the experiment on its GenAI overview: the experiment is tagged as model training
    (mlflow.experimentKind = custom_model_development), when it is created and when an older one lacks it;
    a kind someone chose in the UI stays."""
    client = MlflowClient(tracking_uri())
    with stage_run("prepare"):
        pass
    assert _experiment(client).tags["mlflow.experimentKind"] == "custom_model_development"
    client.delete_experiment_tag(_experiment(client).experiment_id, "mlflow.experimentKind")   # a store from before
    with stage_run("prepare"):
        pass
    assert _experiment(client).tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(_experiment(client).experiment_id, "mlflow.experimentKind", "genai_development")
    with stage_run("prepare"):
        pass
    assert _experiment(client).tags["mlflow.experimentKind"] == "genai_development"
    # the installed UI follows its GenAI / Machine learning switch instead: the address sets it
    url = ui_url()
    assert url.endswith(f"/#/experiments/{_experiment(client).experiment_id}/runs?workflowType=machine_learning")


def test_headline_metrics_go_to_the_stage_run_and_to_the_parent_as_stage_dot_metric(monkeypatch):
    import numpy as np

    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "headline-pipeline")
    with stage_run("train_bp") as run:
        run.log_headline({"test_acc": 0.9, "peak_mib": np.float32(12.5), "batch": 32, "model": "vgg11",
                          "ok": True, "missing": None})
        bp_id = run.run_id
    with stage_run("finetune@mobiletl") as run:
        run.log_headline({"test_acc": 0.8, "train_time_s": 3.0})
    with stage_run("pre+train") as run:   # several models: one level of nesting
        run.log_headline({"mobilenet_v2-w0.5": {"test_acc": 0.7, "params": 1000}, "resnet18": {"test_acc": 0.75}})
        pre_id = run.run_id
    client = MlflowClient(tracking_uri())
    (parent,) = [r for r in runs(client) if r.data.tags["edgeflux.kind"] == "pipeline"]
    assert parent.data.metrics == {
        "train_bp.test_acc": 0.9, "train_bp.peak_mib": 12.5, "train_bp.batch": 32.0,
        "finetune.mobiletl.test_acc": 0.8, "finetune.mobiletl.train_time_s": 3.0,
        "pre_train.mobilenet_v2-w0.5.test_acc": 0.7, "pre_train.mobilenet_v2-w0.5.params": 1000.0,
        "pre_train.resnet18.test_acc": 0.75}
    bp = client.get_run(bp_id).data.metrics
    assert {k: bp[k] for k in ("test_acc", "peak_mib", "batch")} == {"test_acc": 0.9, "peak_mib": 12.5, "batch": 32}
    assert "model" not in bp and "ok" not in bp and "missing" not in bp
    assert client.get_run(pre_id).data.metrics["mobilenet_v2-w0.5.test_acc"] == 0.7


def test_the_report_gives_its_parent_every_stage_headline_whichever_stages_reran(monkeypatch):
    """A repro that reran only the report: its parent run still carries every stage's figures."""
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "report-only")
    with stage_run("report") as run:
        run.log_pipeline_headline({"train_bp": {"test_acc": 0.9, "model": "vgg11"},
                                   "finetune@mobiletl": {"peak_mib": 21.0},
                                   "pretrain": {"resnet18": {"test_acc": 0.75}}})
        report_id = run.run_id
    client = MlflowClient(tracking_uri())
    (parent,) = [r for r in runs(client) if r.data.tags["edgeflux.kind"] == "pipeline"]
    assert parent.data.metrics == {"train_bp.test_acc": 0.9, "finetune.mobiletl.peak_mib": 21.0,
                                   "pretrain.resnet18.test_acc": 0.75}
    assert not {k for k in client.get_run(report_id).data.metrics if "." in k}   # the stage run keeps its own


def test_metric_names_are_sanitised_to_what_mlflow_takes():
    assert metric_name("finetune@mobiletl") == "finetune.mobiletl"
    assert metric_name("a+b:c d/e") == "a_b_c_d_e"
    assert metric_name("..x") == "x"
    assert metric_name("mobilenet_v2-w0.5") == "mobilenet_v2-w0.5"


def test_fleet_metrics_reads_the_parents_headline_metrics(monkeypatch):
    monkeypatch.setenv("EDGEFLUX_FLEET_ID", "fleet-1")
    for device, acc in (("pi-01", 0.9), ("pi-02", 0.8)):
        monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", f"p-{device}")
        monkeypatch.setenv("EDGEFLUX_DEVICE_ID", device)
        with stage_run("train_bp") as run:
            run.log_metrics({"test_acc": acc, "loss": 1.0})
            run.log_headline({"test_acc": acc, "peak_mib": 10})
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "p-old")   # a pipeline whose stages logged no headline
    monkeypatch.setenv("EDGEFLUX_DEVICE_ID", "pi-03")
    with stage_run("train_bp") as run:
        run.log_metrics({"test_acc": 0.7, "loss": 1.0})
    assert fleet_metrics("fleet-1") == {"pi-01": {"train_bp.test_acc": 0.9, "train_bp.peak_mib": 10.0},
                                        "pi-02": {"train_bp.test_acc": 0.8, "train_bp.peak_mib": 10.0},
                                        "pi-03": {"train_bp.test_acc": 0.7}}


def test_the_parent_run_names_the_dvc_experiment_and_the_preset(monkeypatch):
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "exp-pipeline")
    monkeypatch.setenv("DVC_EXP_NAME", "bushy-lamb")   # what `dvc exp run` sets for every stage it runs
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "a" * 40)
    monkeypatch.setenv("EDGEFLUX_PRESET", "pi")
    with stage_run("prepare"):
        pass
    with stage_run("train_bp"):
        pass
    (parent,) = [r for r in runs(MlflowClient(tracking_uri())) if r.data.tags["edgeflux.kind"] == "pipeline"]
    assert parent.data.tags["edgeflux.dvc_exp"] == "bushy-lamb"
    assert parent.data.tags["edgeflux.dvc_exp_baseline"] == "a" * 40
    assert re.fullmatch(r"pipeline \d{4}-\d\d-\d\d \d\d:\d\d:\d\d · preset pi · exp bushy-lamb", parent.info.run_name)
    monkeypatch.delenv("DVC_EXP_NAME")   # `dvc repro`: no experiment
    monkeypatch.delenv("EDGEFLUX_PRESET")
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "repro-pipeline")
    with stage_run("prepare"):
        pass
    (parent,) = [r for r in runs(MlflowClient(tracking_uri()))
                 if r.data.tags.get("edgeflux.pipeline_id") == "repro-pipeline"]
    assert "edgeflux.dvc_exp" not in parent.data.tags
    assert re.fullmatch(r"pipeline \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", parent.info.run_name)


def _tiny_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.randn(2, 4)


def test_log_model_with_registered_name_adds_a_tagged_model_version(monkeypatch):
    import mlflow.pytorch
    import torch

    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "registry-pipeline")
    model, example = _tiny_model()
    run_ids = []
    for _ in range(2):
        with stage_run("select_exit") as run:
            info = run.log_model(model, "neuroflux_exit", example=example, registered_name="edgeflux-test-exit")
            run_ids.append(run.run_id)
    client = MlflowClient(tracking_uri())
    versions = sorted(client.search_model_versions("name = 'edgeflux-test-exit'"), key=lambda v: int(v.version))
    assert [str(v.version) for v in versions] == ["1", "2"] and str(info.registered_model_version) == "2"
    assert [v.run_id for v in versions] == run_ids
    tags = versions[1].tags
    assert tags["edgeflux.pipeline_id"] == "registry-pipeline" and tags["edgeflux.stage"] == "select_exit"
    assert tags["edgeflux.run_id"] == run_ids[1]
    assert re.fullmatch(r"[0-9a-f]{40}", tags["edgeflux.git_commit"])   # (the tests run in the repository)
    loaded = mlflow.pytorch.load_model("models:/edgeflux-test-exit/2")
    assert torch.allclose(loaded(example), model(example))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _mlflow_ui(cwd: Path):
    """ui_command(), run from ``cwd`` on a free loopback port, stopped (its whole process group) on the way out."""
    port = _free_port()
    command = shlex.split(ui_command()) + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    log_file = (cwd / "ui.log").open("w")
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, (cwd / "ui.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow ui did not start in 120 s"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log_file.close()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


@pytest.mark.slow   # the MLflow UI server
def test_a_moved_store_keeps_its_artifacts_and_its_experiment(tmp_path, monkeypatch):
    """Artifacts are located relative to the store: after the clone is moved, the old runs' artifacts and
    registered model are listed and downloadable, in this process and from the UI that ui_command() starts,
    and new runs go to the same experiment (nothing renamed aside)."""
    import json

    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "before-the-move")
    before, after = tmp_path / "clone", tmp_path / "moved" / "clone"
    before.mkdir()
    monkeypatch.chdir(before)
    model, example = _tiny_model()
    with stage_run("meanet_cloud") as run:
        Path("out.txt").write_text("logged before the move")
        run.log_artifact("out.txt")
        run.log_model(model, "cloud_model", example=example, registered_name="edgeflux-test-cloud")
        old_id = run.run_id
    after.parent.mkdir()
    before.rename(after)
    monkeypatch.chdir(after)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")   # mlflow.set_tracking_uri exported it
    uri = f"sqlite:///{after / 'mlflow.db'}"
    client = MlflowClient(uri)
    assert [a.path for a in client.list_artifacts(old_id)] == ["out.txt"]
    mlflow.set_tracking_uri(uri)
    downloaded = mlflow.artifacts.download_artifacts(run_id=old_id, artifact_path="out.txt",
                                                     dst_path=str(tmp_path / "dl"))
    assert Path(downloaded).read_text() == "logged before the move"
    assert mlflow.pytorch.load_model("models:/edgeflux-test-cloud/1")(example).shape == (2, 3)
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "after-the-move")
    with stage_run("meanet_cloud") as run:
        Path("out.txt").write_text("logged after the move")
        run.log_artifact("out.txt")
        new_id = run.run_id
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "edgeflux"]
    assert client.get_run(new_id).info.experiment_id == client.get_run(old_id).info.experiment_id
    assert (after / "mlruns/edgeflux" / new_id / "artifacts/out.txt").read_text() == "logged after the move"
    assert not list(tmp_path.glob("clone*"))   # nothing written where the clone was
    with _mlflow_ui(after) as url:
        listed = json.loads(_get(f"{url}/api/2.0/mlflow/artifacts/list?run_id={old_id}"))
        assert [f["path"] for f in listed["files"]] == ["out.txt"]
        assert _get(f"{url}/get-artifact?path=out.txt&run_uuid={old_id}") == b"logged before the move"
        assert _get(f"{url}/get-artifact?path=out.txt&run_uuid={new_id}") == b"logged after the move"
        mlmodel = _get(f"{url}/model-versions/get-artifact?path=MLmodel&name=edgeflux-test-cloud&version=1")
        assert b"pytorch" in mlmodel


def test_a_store_with_absolute_artifact_locations_keeps_working(tmp_path, monkeypatch):
    """A store made before relative locations: its experiment keeps its absolute location while the store stays
    where it is; once moved, it is renamed aside and a new experiment (relative, model training) takes new runs."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    old, moved = tmp_path / "old", tmp_path / "moved"
    old.mkdir()
    client = MlflowClient(f"sqlite:///{old / 'mlflow.db'}")
    client.create_experiment("edgeflux", artifact_location=(old / "mlruns" / "edgeflux").as_uri())
    monkeypatch.chdir(old)
    with stage_run("prepare") as run:
        Path("out.txt").write_text("old")
        run.log_artifact("out.txt")
        first = run.run_id
    assert (old / "mlruns/edgeflux" / first / "artifacts/out.txt").read_text() == "old"
    assert _experiment(client).tags["mlflow.experimentKind"] == "custom_model_development"
    old.rename(moved)
    monkeypatch.chdir(moved)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with stage_run("prepare") as run:
        second = run.run_id
    client = MlflowClient(f"sqlite:///{moved / 'mlflow.db'}")
    names = {e.name: e for e in client.search_experiments()}
    aside = names[f"edgeflux (artifacts in {(old / 'mlruns' / 'edgeflux').as_uri()})"]
    assert client.get_run(first).info.experiment_id == aside.experiment_id
    assert client.get_run(second).info.experiment_id == names["edgeflux"].experiment_id
    assert names["edgeflux"].artifact_location == "mlflow-artifacts:/edgeflux"
    assert names["edgeflux"].tags["mlflow.experimentKind"] == "custom_model_development"


def test_ui_command_serves_the_store_and_its_artifacts(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert ui_command().endswith(f"ui --backend-store-uri sqlite:///{tmp_path.resolve()}/mlflow.db "
                                 f"--artifacts-destination {tmp_path.resolve()}/mlruns")
