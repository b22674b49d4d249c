"""`python -m pipeline.servers`: the cloud's servers and a device's worker from a shell, up until Ctrl-C,
and nothing left behind after it."""
import shutil
import socket
import stat
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from edgeflux.environ import venv_env
from edgeflux.service import free_port, port_in_use

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def start(args: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.servers", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def read_until(proc: subprocess.Popen, marker: str, timeout_s: float = 180) -> str:
    out, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        out += line
        if marker in line:
            return out
    raise AssertionError(f"no {marker!r} in the output:\n{out[-4000:]}")


def interrupt(proc: subprocess.Popen, signum: int = signal.SIGINT) -> int:
    proc.send_signal(signum)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cloud_servers_and_a_device_worker_start_serve_and_stop_on_ctrl_c(tmp_path):
    ports = {"prefect": free_port(), "mlflow": free_port()}
    # MLflow's job runner as shipped (tests/conftest.py turns it off elsewhere): its processes must stop too
    env = venv_env({"PREFECT_HOME": str(tmp_path / "client"), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"})
    cloud = start(["cloud", "--dir", str(tmp_path / "servers"), "--prefect-port", str(ports["prefect"]),
                   "--mlflow-port", str(ports["mlflow"]), "--deploy"], REPO, env)
    worker = None
    try:
        out = read_until(cloud, "Ctrl-C stops both")
        api = f"http://127.0.0.1:{ports['prefect']}/api"
        assert f"export PREFECT_API_URL={api} MLFLOW_TRACKING_URI=http://127.0.0.1:{ports['mlflow']}" in out
        assert httpx.get(f"http://127.0.0.1:{ports['mlflow']}/health", trust_env=False).status_code == 200
        pools = httpx.post(f"{api}/work_pools/filter", json={}, trust_env=False).json()
        assert {"cloud", "jetson", "pi"} <= {p["name"] for p in pools}
        deployments = httpx.post(f"{api}/deployments/filter", json={}, trust_env=False).json()
        device = next(d for d in deployments if d["name"] == "pi" and d["parameters"].get("preset"))
        assert device["parameters"]["preset"] == "pi4"

        clone = tmp_path / "clone"
        clone.mkdir()
        shutil.copy(REPO / "dvc.yaml", clone)
        worker = start(["worker", "--pool", "pi", "--device-id", "pi-07", "--clone", str(clone), "--poll-s", "2"],
                       REPO, {**env, "PREFECT_API_URL": api})
        read_until(worker, "Ctrl-C stops it")
        queues = httpx.post(f"{api}/work_pools/pi/queues/filter", json={}, trust_env=False).json()
        assert "pi-07" in {q["name"] for q in queues}   # its own queue, created before it polls
        assert interrupt(worker, signal.SIGTERM) == 0   # `kill` stops it as cleanly as Ctrl-C
        assert "stopped" in worker.stdout.read()
        assert (clone / ".edgeflux/worker-pi-07.log").is_file()
    finally:
        if worker is not None and worker.poll() is None:
            interrupt(worker)
        code = interrupt(cloud)
    assert code == 0
    assert not port_in_use("127.0.0.1", ports["prefect"]) and not port_in_use("127.0.0.1", ports["mlflow"])


def test_worker_without_a_server_or_outside_a_clone_says_what_to_give(tmp_path):
    env = {k: v for k, v in venv_env().items() if k != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-m", "pipeline.servers", "worker", "--pool", "pi"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "give --api-url or set PREFECT_API_URL" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pipeline.servers", "worker", "--pool", "pi", "--clone", str(tmp_path),
                          "--api-url", "http://127.0.0.1:9/api"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "not an edgeflux clone (no dvc.yaml)" in out.stderr


def lan_address() -> str | None:
    """An address of this machine other than loopback (the route a packet to a documentation address would
    take; a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def one_line_error(args: list[str], env: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline.servers", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    return out.stderr.strip()


def test_servers_beyond_loopback_need_the_password_and_refuse_who_lacks_it(tmp_path):
    host = lan_address()
    if host is None:
        pytest.skip("this machine has no address but loopback")
    ports = {"prefect": free_port(host), "mlflow": free_port(host)}
    auth = tmp_path / "auth"
    env = {k: v for k, v in venv_env({"PREFECT_HOME": str(tmp_path / "client"), "EDGEFLUX_AUTH_FILE": str(auth)}).items()
           if k not in ("EDGEFLUX_PASSWORD", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD")}
    cloud_args = ["cloud", "--dir", str(tmp_path / "servers"), "--host", host, "--prefect-port", str(ports["prefect"]),
                  "--mlflow-port", str(ports["mlflow"]), "--allowed-hosts", f"{host}:{ports['mlflow']}"]
    # no password: refused before anything listens, one line naming how to set one
    assert "--init-auth" in one_line_error(cloud_args, env)
    auth.write_text("a-password-others-can-read\n")
    auth.chmod(0o644)
    assert f"chmod 600 {auth}" in one_line_error(cloud_args, env)
    auth.unlink()

    cloud = start([*cloud_args, "--init-auth"], REPO, env)
    worker = None
    try:
        read_until(cloud, "Ctrl-C stops both")
        assert stat.S_IMODE(auth.stat().st_mode) == 0o600
        password = auth.read_text().strip()
        api, mlflow = f"http://{host}:{ports['prefect']}/api", f"http://{host}:{ports['mlflow']}"
        pool = {"name": "pi", "type": "process"}
        experiment = f"{mlflow}/api/2.0/mlflow/experiments/create"
        with httpx.Client(trust_env=False, timeout=30) as anyone:
            assert anyone.post(f"{api}/work_pools/", json=pool).status_code == 401
            assert anyone.post(f"{api}/deployments/filter", json={}).status_code == 401
            assert anyone.post(experiment, json={"name": "x"}).status_code == 401
            assert anyone.put(f"{mlflow}/api/2.0/mlflow-artifacts/artifacts/x/y.txt", content=b"x").status_code == 401
            assert anyone.post(f"{api}/work_pools/", json=pool, auth=("edgeflux", "wrong-password")).status_code == 401
        with httpx.Client(trust_env=False, timeout=30, auth=("edgeflux", password)) as member:
            assert member.post(f"{api}/work_pools/", json=pool).status_code == 201
            assert member.post(experiment, json={"name": "x"}).status_code == 200
        # the edgeflux command reads the same file; without it, one line naming how to set it
        status = [sys.executable, "-m", "pipeline.cli", "status", "--tracking-uri", mlflow, "--json"]
        out = subprocess.run(status, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and '"last_pipeline"' in out.stdout, out.stderr
        out = subprocess.run(status, cwd=REPO, env={**env, "EDGEFLUX_AUTH_FILE": str(tmp_path / "none")},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"MLflow at {mlflow} needs the servers' password (401): `edgeflux servers --init-auth`" in out.stderr

        # a device's worker with the same file: it creates its queue and polls, all through the password
        clone = tmp_path / "clone"
        clone.mkdir()
        shutil.copy(REPO / "dvc.yaml", clone)
        worker = start(["worker", "--pool", "pi", "--device-id", "pi-08", "--clone", str(clone), "--poll-s", "2",
                        "--api-url", api, "--tracking-uri", mlflow], REPO, env)
        read_until(worker, "Ctrl-C stops it")
        queues = httpx.post(f"{api}/work_pools/pi/queues/filter", json={}, trust_env=False,
                            auth=("edgeflux", password)).json()
        assert "pi-08" in {q["name"] for q in queues}
    finally:
        if worker is not None and worker.poll() is None:
            interrupt(worker)
        code = interrupt(cloud)
    assert code == 0
    assert not port_in_use(host, ports["prefect"]) and not port_in_use(host, ports["mlflow"])


def test_model_server_refuses_to_listen_beyond_loopback(tmp_path):
    from edgeflux.meanet.server import CloudServerError, ModelServer

    host = lan_address()
    if host is None:
        pytest.skip("this machine has no address but loopback")
    with pytest.raises(CloudServerError, match="no authentication of its own.*reverse proxy"):
        ModelServer(tmp_path, host=host).start()
