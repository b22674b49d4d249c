"""Cloud and device as one system, on loopback: a Prefect server, an MLflow server, a DVC remote directory,
and process workers in pools `cloud` and `pi`, each in its own git clone of one origin, as on separate
machines. Workers are always stopped before the servers, even when a test fails."""
import json
import re
import secrets
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgeflux.auth import client_env
from pipeline.sandbox import CI_PRESET, CI_PRESET_FILE, DEVICE_STAGES, PI, RETRAIN_HOUR, sandbox, sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    # One fine-tuning method and fewer instances routed through the cloud: the flows' tests need those stages
    # run, not every method or instance (test_pipeline checks those). The killed-worker test gives
    # train_blocks the epochs it needs to be interrupted itself.
    overrides = {"finetune": {"methods": ["mobiletl"]}, "meanet": {"max_test_samples": 50}}
    # The servers check a password, as on a fleet: every flow, stage and worker below must carry it. This
    # process's own MLflow client (mlflow_runs) gets it the way a user's does, from the environment.
    password = secrets.token_urlsafe(18)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in client_env(password).items():
            mp.setenv(key, value)
        with sandbox(tmp_path_factory.mktemp("system"), overrides=overrides, password=password) as system:
            yield system


def run_deployment(system, name: str, params: dict | None = None, watch: bool = True) -> subprocess.CompletedProcess:
    """`prefect deployment run`; a failed run's output ends with the workers' last log lines, where the
    failing task's exception is (the CLI prints only the states)."""
    args = f" --params '{json.dumps(params)}'" if params else ""
    out = sh(f"prefect deployment run {name}{args}" + (" --watch --watch-interval 2" if watch else ""),
             system["root"], env=system["env"], check=False, timeout=1200)
    if out.returncode != 0:
        logs = [f"--- {w.log_path.name} ---\n{w.log_path.read_text(errors='replace')[-2500:]}"
                for w in system["workers"].values() if w.log_path.is_file()]
        out.stdout = out.stdout[-1000:] + "\n" + "\n".join(logs)
    return out


def md5_of(lock_entry: dict, path: str) -> str:
    """The md5 dvc.lock records for one output of a stage."""
    return next(o["md5"] for o in lock_entry["outs"] if o["path"] == path)


def in_remote(system, md5: str) -> bool:
    return (system["root"] / "remote/files/md5" / md5[:2] / md5[2:]).is_file()


def mlflow_runs(system, filter_string: str):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(system["mlflow"].url)
    experiment = client.get_experiment_by_name("edgeflux")
    return client.search_runs([experiment.experiment_id], filter_string=filter_string) if experiment else []


def test_cloud_then_device_through_workers_and_remote(system):
    """cloud_flow trains and pushes; device_flow on the pi worker pulls the cloud's models, trains, pushes."""
    out = run_deployment(system, "cloud_flow/cloud")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    main_lock = sh("git show main:dvc.lock", system["origin"]).stdout
    assert {"prepare", "pretrain", "meanet_cloud"} <= set(yaml.safe_load(main_lock)["stages"])
    assert in_remote(system, md5_of(yaml.safe_load(main_lock)["stages"]["pretrain"], "models/pretrained"))

    out = run_deployment(system, "device_flow/pi", {"stages": DEVICE_STAGES})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    pi = system["clones"]["pi"]
    assert (pi / "models/pretrained").is_dir() and (pi / "models/meanet/main.pt").is_file()   # pulled
    device_lock = yaml.safe_load(sh(f"git show devices/{PI}:dvc.lock", system["origin"]).stdout)["stages"]
    assert set(DEVICE_STAGES) <= set(device_lock) and device_lock["pretrain"] == yaml.safe_load(main_lock)["stages"]["pretrain"]
    assert in_remote(system, md5_of(device_lock["train_bp"], "models/train_bp.pt"))   # pushed
    assert in_remote(system, md5_of(device_lock["train_blocks"], "models/neuroflux.pt"))
    assert not in_remote(system, md5_of(device_lock["train_blocks"], "cache/neuroflux")), \
        "the activation cache left the device without share_activation_cache"

    # the pool's preset (the deployment's default) reached params.yaml, the stages and the MLflow tags
    device_params = yaml.safe_load(sh(f"git show devices/{PI}:params.yaml", system["origin"]).stdout)
    assert device_params["train_bp"]["evals_per_epoch"] == CI_PRESET_FILE["params"]["train_bp.evals_per_epoch"] != \
        yaml.safe_load(sh("git show main:params.yaml", system["origin"]).stdout)["train_bp"]["evals_per_epoch"]
    assert len((pi / "plots/train_bp.csv").read_text().splitlines()) == 1 + 1   # header + one evaluation
    parents = mlflow_runs(system, f"tags.`edgeflux.device` = '{PI}' and tags.`edgeflux.flow` = 'device_flow'")
    assert len(parents) == 1 and parents[0].data.tags["edgeflux.preset"] == CI_PRESET
    stages = {r.data.tags["edgeflux.stage"] for r in
              mlflow_runs(system, f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")}
    assert stages == set(DEVICE_STAGES)


def test_cron_deployment_creates_scheduled_runs(system):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + 60
    with temporary_settings(updates={PREFECT_API_URL: system["prefect"].api_url}):
        while True:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["retrain_flow"])))
            runs = [r for r in runs if r.state_name == "Scheduled"]
            if runs or time.monotonic() > deadline:
                break
            time.sleep(2)
    assert runs, "the scheduler created no run for retrain_flow within 60 s"
    assert all(r.expected_start_time.hour == RETRAIN_HOUR and r.expected_start_time.minute == 0 for r in runs)


def test_fleet_run_fans_out_to_device_queues_and_collects_metrics(system):
    from edgeflux.tracking import fleet_metrics

    out = run_deployment(system, "fleet_flow/pi", {"stages": ["train_bp"], "params": {"train_bp.seed": 5}})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    fleet_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    table = fleet_metrics(fleet_id, system["mlflow"].url)
    assert list(table) == [PI] and 0 < table[PI]["train_bp.test_acc"] <= 1


def test_new_labelled_data_retrains_only_the_fine_tuning_stages(system):
    """Images dropped into data/incoming: retrain_flow versions them and retrains the stages that read them."""
    from PIL import Image

    pi = system["clones"]["pi"]
    for i in range(3):
        (pi / "data/incoming/3").mkdir(parents=True, exist_ok=True)
        Image.fromarray((np.arange(28 * 28) % 255).astype(np.uint8).reshape(28, 28)).save(pi / f"data/incoming/3/{i}.png")
    out = run_deployment(system, "retrain_flow/pi", {"pull": False})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    parents = mlflow_runs(system, f"tags.`edgeflux.device` = '{PI}' and tags.`edgeflux.flow` = 'retrain_flow'")
    children = mlflow_runs(system, f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    stages = {r.data.tags["edgeflux.stage"] for r in children}
    assert {"finetune", "meanet_edge"} <= {s.split("@")[0].split(":")[0] for s in stages}
    assert not stages & {"prepare", "pretrain", "train_bp", "train_blocks"}
    counts = [r.data.metrics.get("n_incoming") for r in children
              if r.data.tags["edgeflux.stage"].startswith(("finetune", "meanet_edge"))]
    assert counts and all(c == 3 for c in counts), counts
    assert "data/incoming/3.dvc" in sh(f"git show --stat devices/{PI}", system["origin"]).stdout


def crash(worker, clone: Path) -> None:
    """SIGKILL the worker and every process working in its clone (the flow run has a session of its own,
    and dvc and the stage are its children), as a power cut would."""
    import psutil
    victims = []
    for proc in psutil.process_iter():
        try:
            if Path(proc.cwd()).resolve() == clone.resolve():
                victims.append(proc)
        except (psutil.Error, OSError):
            continue
    worker.kill()
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def test_killed_worker_mid_stage_then_rerun_resumes_from_cached_blocks(system):
    """SIGKILL the pi worker (and with it the flow run, dvc and the stage) while train_blocks is in its
    second block; a new worker picks the next run up, which reuses block 0 and resumes block 1's epochs."""
    pi, worker = system["clones"]["pi"], system["workers"]["pi"]
    params = {"neuroflux.epochs": 4, "neuroflux.seed": 1}   # a new run of the stage
    run_deployment(system, "device_flow/pi", {"stages": ["train_blocks"], "pull": False, "push": False,
                                             "params": params}, watch=False)
    checkpoint = pi / ".edgeflux/checkpoints/neuroflux/block1.pt"
    deadline = time.monotonic() + 600
    while not checkpoint.exists():
        assert time.monotonic() < deadline, "block 1 never wrote a checkpoint"
        time.sleep(0.2)
    crash(worker, pi)
    worker.start()   # a restarted worker: the next run is its
    out = run_deployment(system, "device_flow/pi", {"stages": ["train_blocks"], "pull": False, "push": False,
                                                   "params": params})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    blocks = json.loads((pi / "details/train_blocks.json").read_text())["block_results"]
    assert blocks[0]["skipped"], "block 0 was trained again instead of reused from the activation cache"
    assert blocks[1]["resumed_from_epoch"] >= 1 or blocks[1]["skipped"]


def process_in(clone: Path, command: str):
    """A running process whose command line holds ``command`` and whose working directory is ``clone``, or None."""
    import psutil
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if command in " ".join(proc.info["cmdline"] or []) and Path(proc.cwd()) == clone:
                return proc
        except (psutil.Error, OSError):
            continue
    return None


def test_server_killed_mid_stage_loses_nothing(system):
    """SIGKILL the Prefect server while a device stage trains: the stage still finishes and its outputs stay;
    with the server back (same database), the workers pick runs up again and a re-run skips the stage."""
    import psutil
    pi, prefect = system["clones"]["pi"], system["prefect"]
    request = {"stages": ["train_bp"], "pull": False, "push": False, "params": {"train_bp.seed": 11}}
    run_deployment(system, "device_flow/pi", request, watch=False)
    deadline = time.monotonic() + 600
    while process_in(pi, "stages.train_bp") is None:   # training, not only starting
        assert time.monotonic() < deadline, "train_bp never started"
        time.sleep(0.2)
    repro = process_in(pi, "repro --single-item train_bp")   # the stage's dvc: it saves the outputs after it
    prefect.kill()
    gone, alive = psutil.wait_procs([repro], timeout=600)
    assert gone and not alive, "the stage did not finish without the server"
    model = pi / "models/train_bp.pt"
    trained = model.stat().st_mtime_ns
    assert sh("dvc status --json train_bp", pi).stdout.strip() in ("{}", ""), "train_bp's outputs are not recorded"

    prefect.start()   # the same port and database
    for name, worker in system["workers"].items():
        if worker.process is None or worker.process.poll() is not None:
            print(f"worker {name} exited while the server was down: restarted")   # in the test's output
            worker.stop()
            worker.start()
    out = run_deployment(system, "device_flow/pi", request)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert model.stat().st_mtime_ns == trained, "train_bp ran again: what it made while the server was down was lost"
