"""The DVC pipeline end to end, CI-sized: repro, no-op repro, exp run -S, and user errors."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from edgeflux.colours import method_colour
from edgeflux.process import run_group
from pipeline.sandbox import quick_params

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

MEANET = ["meanet_cloud", "meanet_edge", "evaluate_edge_cloud"]
NEUROFLUX = ["profile", "partition", "train_blocks", "select_exit"]
FINETUNE = [f"finetune@{m}" for m in ("mobiletl", "ft_all", "elastic", "mobiletl-bittrain", "elastic-mobiletl")]


def project_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # stages use the project's mlflow.db
    return {**env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def sh(cmd, cwd, check=True):
    out = run_group(cmd, 900, cwd=cwd, shell=True, env=project_env())   # a timeout stops dvc and its stage too
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory):
    """A fresh git + DVC repository holding this project's pipeline, with CI-sized params."""
    root = tmp_path_factory.mktemp("project")
    for item in ("edgeflux", "stages", "pipeline", "dvc.yaml"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / item)
    (root / "params.yaml").write_text(yaml.safe_dump(quick_params(REPO / "params.yaml"), sort_keys=False))
    (root / ".gitignore").write_text("mlflow.db\nmlruns/\n.edgeflux/\n__pycache__/\n")
    (root / "data/incoming").mkdir(parents=True)   # finetune and meanet_edge read it (empty inbox)
    (root / "data/incoming/README.md").write_text("class folders of new labelled images\n")
    sh("git init -q && dvc init -q && dvc config core.analytics false && git add -A && git commit -qm init", root)
    return root


@pytest.fixture(scope="module")
def first_repro(project_dir):
    """The pipeline's one `dvc repro` from nothing, which every test of the module builds on: each stage runs
    once here, and a test that reruns some of them does so on these outputs."""
    return sh("dvc repro", project_dir)


@pytest.fixture(scope="module")
def project(project_dir, first_repro):
    """The repository with every stage's outputs."""
    return project_dir


def test_repro_then_noop_then_exp_run(project, first_repro):
    first = first_repro
    for stage in ("prepare", "pretrain", "train_bp", *NEUROFLUX, *FINETUNE, *MEANET, "export", "report"):
        assert f"Running stage '{stage}'" in first.stdout
    metrics = json.loads((project / "details/train_bp.json").read_text())
    assert metrics["peak_mem_bytes"] <= metrics["budget_bytes"] == 3_000_000
    assert 1 <= metrics["batch_size"] <= 64 and metrics["test_acc"] > 0.2
    assert 0 < metrics["train_time_s"] and 0 < metrics["train_cpu_s"]
    # the headline: a few figures under the names every training stage shares, MiB for a person to read
    head = json.loads((project / "metrics/train_bp.json").read_text())
    assert head == {"test_acc": metrics["test_acc"], "train_time_s": metrics["train_time_s"],
                    "train_cpu_s": metrics["train_cpu_s"], "peak_mib": round(metrics["peak_mem_bytes"] / 2**20, 1),
                    "budget_mib": round(3_000_000 / 2**20, 1), "batch": metrics["batch_size"],
                    "trainable_params": metrics["params"], "params": metrics["params"]}
    assert (project / "models/pretrained/vgg11-w0.125.pt").exists()
    curve = (project / "plots/train_bp.csv").read_text().splitlines()
    assert curve[0] == "step,epoch,time_s,cpu_s,train_loss,val_acc,method,colour" and len(curve) == 3
    # the method's name (the plots' legend) and its colour, the one every figure gives it
    assert all(line.endswith(f",backprop,{method_colour('backprop')}") for line in curve[1:])
    summary = (project / "reports/summary.md").read_text()
    assert "| backprop | scratch | vgg11-w0.125 |" in summary and "different budgets" in summary
    for image in ("accuracy_vs_time", "memory", "pareto"):
        assert (project / f"reports/{image}.png").stat().st_size > 10_000

    # NeuroFlux: every block's measured step within the budget, caches as a DVC output, a compact exit
    blocks = json.loads((project / "partition/blocks.json").read_text())["blocks"]
    trained = json.loads((project / "details/train_blocks.json").read_text())
    assert trained["within_budget"] and trained["peak_mem_bytes"] <= 2_000_000
    assert [u for b in trained["block_results"] for u in b["units"]] == list(range(9))   # vgg11: 8 convs + classifier
    assert len(trained["block_results"]) >= len(blocks)
    assert (project / "cache/neuroflux/block0/train/manifest.json").exists()
    exit_metrics = json.loads((project / "details/select_exit.json").read_text())
    assert exit_metrics["params"] <= exit_metrics["full_params"] and exit_metrics["test_acc"] > 0.2
    # under the metric names every stage shares: the full model's accuracy and parameters, the smallest block batch
    assert trained["test_acc"] == trained["unit_test_acc"][-1] and trained["params"] == exit_metrics["full_params"]
    assert trained["batch_size"] == min(b["batch_size"] for b in trained["block_results"])
    import torch
    compact = torch.load(project / "models/neuroflux_exit.pt", weights_only=False)
    assert compact(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    assert f"| NeuroFlux, exit {exit_metrics['exit_unit']} | scratch |" in summary

    # fine-tuning: every method within the budget, MobileTL at a batch at least FT-All's, one report row each
    tuned = {m.split("@")[1]: json.loads((project / f"details/finetune/{m.split('@')[1]}.json").read_text())
             for m in FINETUNE}
    assert all(t["peak_mem_bytes"] <= t["budget_bytes"] == 8_000_000 for t in tuned.values())
    assert tuned["mobiletl"]["batch_size"] >= tuned["ft_all"]["batch_size"]
    assert tuned["mobiletl"]["train_params"] < tuned["ft_all"]["train_params"] == tuned["ft_all"]["params"]
    for label in ("MobileTL", "FT-All", "ElasticTrainer", "MobileTL + BitTrain", "ElasticTrainer on MobileTL"):
        assert f"| {label} | pretrained mobilenet_v2-w0.25 | mobilenet_v2-w0.25 |" in summary
    # the compositions: BitTrain stores MobileTL's saved activations in fewer bytes; elastic selects among
    # MobileTL's top blocks only (its candidates are MobileTL's trainable tensors)
    assert tuned["mobiletl-bittrain"]["saved_stored_bytes"] < tuned["mobiletl-bittrain"]["saved_dense_bytes"]
    assert tuned["elastic-mobiletl"]["train_params"] == tuned["mobiletl"]["train_params"]
    # export: every trained device model as checked ONNX + TorchScript files, each registered in MLflow
    exported = json.loads((project / "details/export.json").read_text())["models"]
    names = ["train_bp", "neuroflux_exit", *(f"finetune-{m.split('@')[1]}" for m in FINETUNE), "meanet_edge"]
    assert sorted(exported) == sorted(names)
    for name, check in exported.items():
        assert check["onnx_max_abs_diff"] <= 1e-4 and check["trace_max_abs_diff"] <= 1e-4, name
        card = json.loads((project / f"models/export/{name}.json").read_text())
        assert card["input"]["shape"] == ["batch", 1, 32, 32] and len(card["classes"]) == 10
        assert (project / f"models/export/{name}.onnx").stat().st_size == card["files"]["onnx"]["bytes"]
    rows = {r["stage"]: r for r in json.loads((project / "reports/summary.json").read_text())["rows"]}
    assert rows["finetune@mobiletl"]["peak_mib"] == round(tuned["mobiletl"]["peak_mem_bytes"] / 2**20, 1)
    assert any(r["pareto"] for r in rows.values())
    # elastic: one selection (one epoch) of some of FT-All's tensors, its timings and masks in the memory file
    assert tuned["elastic"]["elastic_selections"] == 1 and 0 < tuned["elastic"]["elastic_selected_frac"] < 1
    elastic = json.loads((project / "memory/finetune/elastic.json").read_text())
    assert len(elastic["elastic"]["selections"][0]["mask"]) == len(elastic["elastic"]["names"])
    assert all((project / f"plots/finetune/{m}_tensors.png").stat().st_size > 5_000 for m in tuned)
    assert "MEANet, edge + cloud" in summary

    # MEANet: 5 hard classes of 10, the edge's step within budget and below joint optimisation's, every test
    # instance answered through the real cloud server (started and stopped by the stage), nothing left running
    hard = json.loads((project / "models/meanet/hard_classes.json").read_text())
    assert len(hard["class_map"]) == 5 and sorted(hard["class_map"].values()) == list(range(5))
    edge = json.loads((project / "details/meanet_edge.json").read_text())
    assert edge["peak_mem_bytes"] <= edge["budget_bytes"] == 8_000_000 and edge["peak_vs_joint"] < 1
    routed = json.loads((project / "details/evaluate_edge_cloud.json").read_text())
    assert routed["test_instances"] == 200 and routed["fallbacks"] == 0
    assert routed["detail"]["cloud_only"]["exit_cloud"] == 200 and routed["detail"]["at_threshold"]["answered"] == 200
    assert (project / "models/meanet/cloud/MLmodel").exists() and (project / "plots/meanet_sweep.png").exists()
    assert not [p.info for p in psutil.process_iter(["cmdline", "cwd"]) if p.info["cwd"] == str(project)
                and any(w in " ".join(p.info["cmdline"] or []) for w in ("mlflow", "uvicorn"))]

    second = sh("dvc repro", project)
    assert "Running stage" not in second.stdout
    assert "Data and pipelines are up to date" in second.stdout

    sh("git add -A && git commit -qm 'first run'", project)
    exp = sh("dvc exp run -S train_bp.lr=0.01 -S +train_bp.bittrain.enabled=true", project)  # + adds a key params.yaml lacks
    assert "Running stage 'train_bp'" in exp.stdout and "Running stage 'report'" in exp.stdout
    assert "Running stage 'pretrain'" not in exp.stdout and "Running stage 'prepare'" not in exp.stdout
    assert not any(f"Running stage '{stage}'" in exp.stdout for stage in NEUROFLUX)
    shown = sh("dvc exp show --json", project).stdout
    assert '"lr": 0.01' in shown
    with_bittrain = json.loads((project / "details/train_bp.json").read_text())
    assert "| backprop + BitTrain | scratch |" in (project / "reports/summary.md").read_text()
    assert with_bittrain["saved_stored_bytes"] < with_bittrain["saved_dense_bytes"]
    assert with_bittrain["peak_mem_bytes"] <= 3_000_000

    # every stage logged as a child of one pipeline run per `dvc repro`
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp_id = client.get_experiment_by_name("edgeflux").experiment_id
    runs = client.search_runs([exp_id])
    parents = {r.info.run_id for r in runs if r.data.tags["edgeflux.kind"] == "pipeline"}
    first_children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents]
    assert len(parents) == 2  # the first repro and the exp run
    # the exp run reran train_bp and what reads its model (export, report) only; its parent still has every stage's headline (from the report)
    exp_parent, = [r for r in runs if r.info.run_id in parents and r.data.metrics.get("train_bp.test_acc")
                   == with_bittrain["test_acc"]]
    assert exp_parent.data.metrics["finetune.mobiletl.test_acc"] == tuned["mobiletl"]["test_acc"]
    assert exp_parent.data.metrics["evaluate_edge_cloud.edge_acc"] == routed["edge_acc"]
    assert sorted(r.data.tags["edgeflux.stage"] for r in first_children) == sorted(
        ["prepare", "pretrain", "train_bp", *NEUROFLUX, *FINETUNE, *MEANET, "export", "report", "train_bp",
         "export", "report"])
    bp = [r for r in first_children if r.data.tags["edgeflux.stage"] == "train_bp"]
    assert {r.data.params["lr"] for r in bp} == {"0.05", "0.01"}
    assert all(r.data.metrics["peak_mem_bytes"] <= 3_000_000 for r in bp)
    blocks_run, = [r for r in first_children if r.data.tags["edgeflux.stage"] == "train_blocks"]
    logged = blocks_run.data.metrics
    assert {k: logged[k] for k in ("batch_size", "params", "test_acc")} == {
        k: trained[k] for k in ("batch_size", "params", "test_acc")}
    assert [logged[f"block{i}.batch_size"] for i in range(len(trained["block_results"]))] == trained["batch_sizes"]
    curve = client.get_metric_history(blocks_run.info.run_id, "best_exit_val_acc")
    assert len(curve) >= len(trained["block_results"]) and max(m.value for m in curve) == trained["best_val_acc"]
    assert all(r.info.status == "FINISHED" for r in runs)


def _bytes(project, paths):
    return {path: (project / path).read_bytes() for path in paths}


def test_new_labelled_data_retrains_the_fine_tuning_stages_and_all_they_feed(project, monkeypatch):
    """What retrain_flow runs: the stages that read data/incoming, and those downstream of them, which
    `dvc status` cannot report changed before their inputs are rebuilt."""
    import numpy as np
    from PIL import Image

    from pipeline.flows import retrain_targets, stage_graph
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")   # the flow calls `dvc`
    assert retrain_targets(stage_graph()) == []   # everything up to date: nothing to retrain
    folder = project / "data/incoming/3"
    folder.mkdir()
    try:
        for i in range(2):
            Image.fromarray(np.zeros((28, 28), np.uint8)).save(folder / f"{i}.png")
        todo = retrain_targets(stage_graph())
    finally:
        shutil.rmtree(folder)
    assert set(todo) == {"finetune", "meanet_edge", "evaluate_edge_cloud", "export", "report"}
    assert todo.index("meanet_edge") < todo.index("evaluate_edge_cloud") and todo[-1] == "report"


def test_a_stage_that_stops_under_dvc_keeps_the_last_good_outputs(project):
    """DVC deletes a stage's outputs before running it unless they persist: a bad param, a misspelt section
    or a budget too small must stop the stage with its one line and leave every last good output in place."""
    bp = ["metrics/train_bp.json", "details/train_bp.json", "memory/train_bp.json", "plots/train_bp.csv",
          "models/train_bp.pt"]
    profile = ["profile/memory.json", "profile/memory.png", "metrics/profile.json", "details/profile.json"]
    before = _bytes(project, bp + profile)
    good_params = (project / "params.yaml").read_text()
    try:
        out = sh("dvc exp run -S train_bp.budget=24 train_bp", project, check=False)
        assert out.returncode != 0 and "train_bp.budget = 24: a memory size needs a unit" in out.stderr
        params = yaml.safe_load(good_params)   # a misspelt key, with a change that makes profile run again
        params["neuroflux"]["epocs"] = params["neuroflux"].pop("epochs")
        params["neuroflux"]["seed"] += 1
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        out = sh("dvc repro partition", project, check=False)
        assert out.returncode != 0 and "Running stage 'profile'" in out.stdout and "epocs" in out.stderr
        params = yaml.safe_load(good_params)
        params["train_bp"]["budget"] = "10KB"
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        out = sh("dvc repro train_bp", project, check=False)
        assert out.returncode != 0 and "smallest feasible budget" in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        (project / "params.yaml").write_text(good_params)
    assert _bytes(project, bp + profile) == before
    assert "Running stage" not in sh("dvc repro", project).stdout   # what persisted is what dvc.lock records


def _model_server_of(project):
    """The pid of the cloud model server evaluate_edge_cloud started in ``project`` (None: not started yet)."""
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmd = proc.info["cmdline"] or []
        if "models" in cmd and "serve" in cmd and proc.info["cwd"] == str(project):
            return proc.pid
    return None


def test_a_cloud_killed_mid_evaluation_fails_the_stage_and_keeps_the_last_good_outputs(project):
    """The real model server SIGKILLed once it has answered: the edge's fallbacks answer the rest (right at
    inference time), but the stage must not record them as a measurement of the cloud: one line, exit != 0,
    dvc.lock and the last good outputs as they were."""
    outs = ["metrics/evaluate_edge_cloud.json", "details/evaluate_edge_cloud.json", "plots/meanet_sweep.csv"]
    sh("dvc repro evaluate_edge_cloud", project)
    before, lock = _bytes(project, outs), (project / "dvc.lock").read_text()
    good_params = (project / "params.yaml").read_text()
    log = project / ".edgeflux/logs/cloud_server.log"
    params = yaml.safe_load(good_params)
    params["meanet"]["client"]["batch"] = 4   # many requests: the kill lands mid-evaluation
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        stage = subprocess.Popen("dvc repro evaluate_edge_cloud", shell=True, cwd=project, text=True, env=project_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline, pid = time.monotonic() + 600, None
        while stage.poll() is None and time.monotonic() < deadline:
            pid = pid or _model_server_of(project)
            if pid and log.is_file() and "/invocations" in log.read_text(errors="replace"):
                os.killpg(os.getpgid(pid), signal.SIGKILL)   # the server and its uvicorn: the cloud is gone
                break
            time.sleep(0.02)
        assert stage.poll() is None, "the stage ended before the cloud could be killed"
        out, err = stage.communicate(timeout=600)
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
        (project / "params.yaml").write_text(good_params)
    assert stage.returncode != 0 and "Traceback" not in err
    assert "the cloud answered" in err and "meanet.client.min_answered is 99%" in err, err[-2000:]
    assert _bytes(project, outs) == before and (project / "dvc.lock").read_text() == lock


def test_a_damaged_model_is_one_line_and_dvc_checkout_restores_it(project):
    """models/neuroflux.pt with a flipped bit: select_exit run directly stops with one line naming the fix
    (it exported a broken model with exit 0 before), and the fix it names works."""
    model = project / "models/neuroflux.pt"
    good = model.read_bytes()
    data = bytearray(good)
    for k in range(4):   # a few bytes in the middle: weights, as a disk or a copy damages them
        data[len(data) // 2 + 7 * k] ^= 0x10
    model.write_bytes(bytes(data))
    out = sh("python -m stages.select_exit", project, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "models/neuroflux.pt is corrupt" in out.stderr and "dvc checkout --force models/neuroflux.pt" in out.stderr
    sh("dvc checkout --force models/neuroflux.pt", project)
    assert model.read_bytes() == good


def test_bad_params_stop_with_a_clear_error(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train_bp"]["budget"] = 300
    bad = project / "bad_params.yaml"
    bad.write_text(yaml.safe_dump(params))
    out = sh(f"python -m stages.train_bp --params {bad.name}", project, check=False)
    assert out.returncode == 2
    assert "train_bp.budget = 300: a memory size needs a unit" in out.stderr
    assert "Traceback" not in out.stderr


def test_budget_below_batch_one_stops_with_smallest_feasible(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train_bp"]["budget"] = "10KB"
    (project / "tiny_budget.yaml").write_text(yaml.safe_dump(params))
    out = sh("python -m stages.train_bp --params tiny_budget.yaml", project, check=False)
    assert out.returncode == 2 and "smallest feasible budget" in out.stderr and "Traceback" not in out.stderr


def test_neuroflux_budget_below_a_units_batch_one_names_the_unit(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["neuroflux"]["budget"] = "10KB"
    (project / "tiny_nf.yaml").write_text(yaml.safe_dump(params))
    out = sh("python -m stages.partition --params tiny_nf.yaml", project, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unit 0" in out.stderr and "raise the budget to at least" in out.stderr


def test_missing_dataset_gives_install_command(project, tmp_path):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"].update(dataset="fashion-mnist", root=str(tmp_path / "nowhere"))
    (project / "missing.yaml").write_text(yaml.safe_dump(params))
    env_home = f"EDGEFLUX_DATA_DIR={tmp_path / 'empty'}"
    out = sh(f"{env_home} python -c \"import edgeflux.data.load as d, pathlib, runpy, sys; "
             f"d.DEBIAN_FASHION_MNIST = pathlib.Path('{tmp_path / 'none'}'); "
             f"sys.argv = ['prepare', '--params', 'missing.yaml']; runpy.run_module('stages.prepare', run_name='__main__')\"",
             project, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "apt-get install -y dataset-fashion-mnist" in out.stderr and "download" in out.stderr


@pytest.fixture
def prefect_server():
    """A temporary Prefect server for the test, stopped before pytest closes its output."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_prefect_flow_runs_the_dvc_stages(project, monkeypatch, prefect_server):
    """The flow runs `dvc repro` per stage in order; a changed param reruns only its stage."""
    from mlflow.tracking import MlflowClient

    from pipeline.flows import pipeline

    sh("dvc repro", project)  # up to date (or made so) before the change
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train_bp"]["epochs"] = 2
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert pipeline("train_bp") == ["prepare", "train_bp"]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("edgeflux").experiment_id],
                              filter_string="tags.`edgeflux.pipeline_id` LIKE 'prefect:%'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    children = client.search_runs([runs[0].info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{runs[0].info.run_id}'")
    assert [c.data.tags["edgeflux.stage"] for c in children] == ["train_bp"]
    assert children[0].data.params["epochs"] == "2"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_stage_stops_cleanly_and_the_rerun_resumes(project, signum):
    """Ctrl-C (SIGINT) or a kill (SIGTERM: Prefect cancelling, a shutdown) during training: one line, not a
    traceback; the shell's exit code 128+signal; the MLflow run and its parent closed as KILLED, not left
    RUNNING; and the rerun resumes from the checkpoint the interrupted run wrote."""
    from mlflow.tracking import MlflowClient

    sh("dvc repro prepare", project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    # a checkpoint after each epoch: when the first appears, two epochs are left (time to interrupt the stage),
    # and the resumed run trains those two only
    params["train_bp"]["epochs"] = 3
    params["train_bp"]["seed"] = int(signum)   # a run of its own (another checkpoint signature)
    (project / "long.yaml").write_text(yaml.safe_dump(params))
    checkpoint = project / ".edgeflux/checkpoints/train_bp.pt"
    checkpoint.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # SIGINT as a terminal delivers it: a shell script's background jobs (CI run with `&`) inherit it
    # ignored, and Python then never raises KeyboardInterrupt (as it should: such a job is not meant
    # to see the terminal's Ctrl-C)
    stage = subprocess.Popen([sys.executable, "-m", "stages.train_bp", "--params", "long.yaml"], cwd=project,
                             env={**env, "EDGEFLUX_PIPELINE_ID": f"interrupted-{signum}"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and stage.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stage.poll() is None, "the stage ended before it could be interrupted"
    stage.send_signal(signum)
    _, err = stage.communicate(timeout=120)
    assert stage.returncode == 128 + signum
    assert f"interrupted ({signal.Signals(signum).name})" in err and "Traceback" not in err
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("edgeflux").experiment_id
    parent, = client.search_runs([experiment], filter_string=f"tags.`edgeflux.pipeline_id` = 'interrupted-{signum}'")
    child, = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert parent.info.status == child.info.status == "KILLED"
    resumed = sh("python -m stages.train_bp --params long.yaml", project)
    assert "resuming" in resumed.stdout + resumed.stderr


def test_dvc_reruns_the_stages_whose_device_or_own_params_changed(project):
    """A device key reruns every stage that inherits it (dvc status lists the stages `dvc repro` would run);
    a stage section's own key reruns that stage only."""
    good = (project / "params.yaml").read_text()

    def changed(edit) -> set[str]:
        params = yaml.safe_load(good)
        edit(params)
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        return set(json.loads(sh("dvc status --json", project).stdout))

    try:
        stale = changed(lambda p: None)   # what earlier tests of the module left to rerun, if anything
        inherits = {"train_bp", "profile", "train_blocks", "meanet_cloud", "meanet_edge", *FINETUNE}
        assert changed(lambda p: p["device"].update(device="auto")) - stale == inherits - stale
        assert changed(lambda p: p["train_bp"].update(budget="4MB")) - stale == {"train_bp"} - stale
    finally:
        (project / "params.yaml").write_text(good)
