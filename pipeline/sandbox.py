"""A throwaway cloud+device system on loopback, for tests and benchmarks.

One bare git origin holding this project with CI-sized params (QUICK), a local directory as its DVC
remote, and two git clones of it, `cloud` and `pi`, as on separate machines; a Prefect server, an
MLflow server, the deployments (pipeline.deploy) and one process worker per clone (logs: worker-*.log,
prefect/server.log, mlflow/server.log under the root):

    with sandbox(tmp_dir) as system:      # {"root", "origin", "clones", "prefect", "mlflow", "env", "workers"}
        sh("prefect deployment run cloud_flow/cloud --watch", system["root"], env=system["env"])

Workers are always stopped before the servers, even on an error or Ctrl-C. Used by
tests/test_orchestration.py, tests/test_pipeline.py (QUICK) and bench/pipeline.py.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

import yaml

from edgeflux.auth import client_env
from edgeflux.environ import venv_env
from pipeline.servers import MLflowServer, PrefectServer, PrefectWorker
from stages import registry

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
PI = "pi-01"
# What the sandbox's device run executes: every device stage but fine-tuning's runs (five methods), the
# edge-cloud evaluation (it starts a model server), the export (it needs fine-tuning's models) and the report,
# to keep the run short.
DEVICE_STAGES = [s for s in registry.names("device")
                 if s not in ("finetune", "evaluate_edge_cloud", "export", "report")]

RETRAIN_HOUR = (datetime.now(UTC).hour + 12) % 24

# CI-sized params: tiny models and datasets, one epoch, CPU; every stage still runs its real code.
QUICK = {
    "data": {"dataset": "mnist-subset", "seed": 0},
    # every budgeted stage runs on the CPU, batches up to 64; the budgets differ per stage, as their tiny models do
    "device": {"device": "cpu", "max_batch": 64},
    "pretrain": {"models": [{"name": "vgg11", "width": 0.125}, {"name": "mobilenet_v2", "width": 0.25}], "epochs": 1,
                 "max_train_samples": 400, "batch_size": 64, "evals_per_epoch": 1, "device": "cpu"},
    "finetune": {"model": "mobilenet_v2-w0.25", "methods": ["mobiletl", "ft_all", "elastic", "mobiletl-bittrain", "elastic-mobiletl"],
                 "budget": "8MB", "epochs": 1, "max_train_samples": 400, "evals_per_epoch": 1, "calibration_batches": 2,
                 "elastic": {"rho": 0.7, "repeats": 1}},
    "train_bp": {"model": {"name": "vgg11", "width": 0.125}, "budget": "3MB", "epochs": 1,
                 "max_train_samples": 400, "evals_per_epoch": 2},
    "neuroflux": {"model": {"name": "vgg11", "width": 0.125}, "budget": "2MB", "epochs": 1,
                  "max_train_samples": 400, "evals_per_epoch": 1, "profile_batches": [8, 16, 32], "min_r2": 0.9,
                  "cache": {"storage": "float16", "threshold": 0.0, "shard_size": "256KiB"}},
    "meanet": {"main": "mobilenet_v2-w0.25", "cloud": "vgg11-w0.125", "extension_blocks": 1, "budget": "8MB",
               "max_batch": 32, "epochs": 1, "max_train_samples": 400, "evals_per_epoch": 1, "max_test_samples": 200,
               "sweep": 3},
    # retrain_flow's cron half a day from now: its runs are scheduled (tests see them) but none comes due while
    # the sandbox runs, so no run the test did not start changes the device's clone
    "orchestration": {"retrain_cron": f"0 {RETRAIN_HOUR} * * *", "timezone": "UTC"},
}


# The pi pool's preset here: the shipped ones size a real device (256 MB budgets, 4 threads); this one keeps
# QUICK's sizes and one torch thread per stage, and changes one visible value, so tests see it applied.
CI_PRESET = "ci-pi"
CI_PRESET_FILE = {"description": "the sandbox's Raspberry Pi: QUICK's sizes, one torch thread",
                  "params": {"device.threads": 1, "train_bp.evals_per_epoch": 1}}


class SandboxError(RuntimeError):
    """A git, dvc or prefect command of the sandbox failed; the message ends with its output."""


GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git_env(**extra: str) -> dict[str, str]:
    """The venv's offline environment with a commit identity: sandbox machines have no git config."""
    return venv_env({**GIT_IDENTITY, **extra})


def sh(cmd: str, cwd, env=None, check=True, timeout=900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, shell=True, env=env or venv_env(), capture_output=True, text=True,
                         timeout=timeout)
    if check and out.returncode != 0:
        raise SandboxError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-6000:]}")
    return out


def quick_params(path: Path = REPO / "params.yaml", overrides: dict | None = None) -> dict:
    """The params file at ``path`` with QUICK's sections (then ``overrides``' sections) merged in."""
    params = yaml.safe_load(Path(path).read_text())
    for changes in (QUICK, overrides or {}):
        for section, values in changes.items():
            params[section].update(values)
    return params


def make_origin(root: Path, overrides: dict | None = None) -> Path:
    """A bare git origin (root/origin.git) holding the project with CI-sized params, its DVC remote the local
    directory root/remote. ``overrides``: params sections merged in after QUICK's."""
    work = root / "seed"
    work.mkdir()
    for item in ("edgeflux", "stages", "pipeline", "presets", "dvc.yaml", ".dvcignore"):
        src = REPO / item
        if not src.exists():   # presets/: the device flows' presets, where the project has them
            continue
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item,
                                                            **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                               if src.is_dir() else {}))
    (work / "params.yaml").write_text(yaml.safe_dump(quick_params(overrides=overrides), sort_keys=False))
    (work / f"presets/{CI_PRESET}.yaml").write_text(yaml.safe_dump(CI_PRESET_FILE, sort_keys=False))
    (work / ".gitignore").write_text("mlflow.db\nmlruns/\n.edgeflux/\n.prefect/\n__pycache__/\n")
    (work / "data/incoming").mkdir(parents=True)
    shutil.copy(REPO / "data/incoming/README.md", work / "data/incoming")
    sh(f"git init -q -b main && dvc init -q && dvc config core.analytics false "
       f"&& dvc remote add -d store {root / 'remote'} && git add -A && git commit -qm init", work, env=git_env())
    sh(f"git clone -q --bare {work} {root / 'origin.git'}", root)
    return root / "origin.git"


@contextmanager
def sandbox(root: Path, poll_s: float = 2, scheduler_loop_s: float = 2,
            overrides: dict | None = None, password: str | None = None) -> Iterator[dict]:
    """The whole system under ``root`` (see the module's docstring), stopped on leaving.

    ``poll_s``: how often each worker asks for runs (Prefect's default is 10 s; 2 keeps tests short);
    ``scheduler_loop_s``: how often the server schedules cron deployments' runs; ``password``: the servers
    check it (edgeflux.auth), and the workers and ``env`` carry it."""
    root = Path(root)
    origin = make_origin(root, overrides)
    clones = {}
    for name in ("cloud", "pi"):
        sh(f"git clone -q {origin} {root / name}", root)
        clones[name] = root / name
    with ExitStack() as stack:   # unwinds in reverse: workers stop first, then the servers
        prefect = stack.enter_context(PrefectServer(root / "prefect", scheduler_loop_s=scheduler_loop_s,
                                                    password=password))
        mlflow = stack.enter_context(MLflowServer(root / "mlflow", password=password))
        # the CLI's own PREFECT_HOME (profiles, caches) under root too: nothing lands in ~/.prefect
        env = git_env(PREFECT_API_URL=prefect.api_url, MLFLOW_TRACKING_URI=mlflow.url,
                      PREFECT_HOME=str(root / "prefect-cli"), **client_env(password))
        # from the cloud's clone, as on the cloud host: the presets it names are that clone's
        sh(f"{sys.executable} -m pipeline.deploy --preset pi={CI_PRESET}", clones["cloud"], env=env)
        # only the identity on top of the worker's own variables: a PREFECT_API_URL or MLFLOW_TRACKING_URI in
        # this process's environment must not win over this sandbox's servers
        workers = {"cloud": PrefectWorker("cloud", prefect.api_url, clones["cloud"], device_id="cloud-1",
                                          tracking_uri=mlflow.url, poll_s=poll_s, env_extra=GIT_IDENTITY,
                                          password=password, log_path=root / "worker-cloud.log"),
                   "pi": PrefectWorker("pi", prefect.api_url, clones["pi"], device_id=PI, work_queue=PI,
                                       tracking_uri=mlflow.url, poll_s=poll_s, env_extra=GIT_IDENTITY,
                                       password=password, log_path=root / "worker-pi.log")}
        for w in workers.values():
            stack.callback(w.stop)
            w.start()
        log.info("sandbox up in %s: Prefect %s, MLflow %s, workers cloud-1 and %s", root, prefect.api_url,
                 mlflow.url, PI)
        yield {"root": root, "origin": origin, "clones": clones, "prefect": prefect, "mlflow": mlflow,
               "env": env, "workers": workers}
