"""The cloud host's servers and a device's worker, each the tool's own command (see edgeflux.service).

    with PrefectServer(home) as prefect, MLflowServer(store) as mlflow:
        with PrefectWorker("pi", prefect.api_url, clone, tracking_uri=mlflow.url, device_id="pi-01"):
            ...

From a shell, in the foreground until Ctrl-C (README, "Cloud and devices"):

    python -m pipeline.servers cloud --host 0.0.0.0 --init-auth --deploy   # the servers (a password), the deployments
    python -m pipeline.servers worker --pool pi --device-id pi-01   # a device's worker, in this clone

which run the tools' own commands (`prefect server start`, `mlflow server`, `prefect worker start --pool pi
--type process`) with the environment each needs.

A worker runs each flow run in a child process that inherits its environment: `EDGEFLUX_HOME` (the clone
the deployments' pull step enters), `EDGEFLUX_DEVICE_ID`, `MLFLOW_TRACKING_URI` and the servers' password (as
the tools' own variables: edgeflux.auth) travel that way. Beyond loopback the servers need that password
(docs/cli.md, Security).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import secrets
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from edgeflux.auth import PASSWORD_ENV, USER, AuthError, auth_file, client_env, init_auth_file, load_password
from edgeflux.environ import venv_env
from edgeflux.service import Service, ServiceError
from pipeline import cli_logging

log = logging.getLogger(__name__)


class PrefectServer(Service):
    """`prefect server start` with its database under ``home`` (PREFECT_HOME). ``scheduler_loop_s``: how often
    the scheduler creates runs for cron deployments (Prefect's default: 60 s)."""

    name = "Prefect server"
    timeout_fix = "raise the ready timeout (a first start migrates a new database: ~8 s here)"

    def __init__(self, home: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 scheduler_loop_s: float | None = None, password: str | None = None, **kwargs) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        # every API request but the health probe needs Basic auth (the server's own services use it too)
        self.authenticated = bool(password)
        extra = {"PREFECT_HOME": str(self.home)}
        if password:   # the server checks it; its own services send it as clients do
            auth = client_env(password)["PREFECT_API_AUTH_STRING"]
            extra |= {"PREFECT_SERVER_API_AUTH_STRING": auth, "PREFECT_API_AUTH_STRING": auth}
        if scheduler_loop_s is not None:
            extra["PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS"] = str(scheduler_loop_s)
        kwargs.setdefault("log_path", self.home / "server.log")
        super().__init__(port, host, env=venv_env(extra), **kwargs)

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def probe_url(self) -> str:
        return f"{self.api_url}/health"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "prefect", "server", "start", "--host", self.host, "--port", str(self.port)]


# MLflow's job runner (a huey consumer per job type, for its GenAI jobs), which edgeflux never submits to:
# processes and memory taken from training on a small host (bench/servers.py measures the difference)
NO_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class MLflowServer(Service):
    """`mlflow server` with a sqlite store and the artifacts it serves (devices upload them over HTTP).

    With a ``password``, MLflow's basic-auth app: every request but /health needs the user edgeflux and that
    password. Its user store (basic_auth.db beside mlflow.db) is made anew at each start, its one admin from
    the password given now: MLflow reads the admin's password only when it creates the store, so a kept store
    would go on accepting an old password after the file changed."""

    name = "MLflow server"
    timeout_fix = "raise the ready timeout"

    def __init__(self, store: str | Path, port: int | None = None, host: str = "127.0.0.1", workers: int = 1,
                 allowed_hosts: str | None = None, password: str | None = None, **kwargs) -> None:
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self.workers, self.allowed_hosts = workers, allowed_hosts
        self.authenticated = bool(password)
        kwargs.setdefault("log_path", self.store / "server.log")
        super().__init__(port, host, env=venv_env({**NO_JOBS, **(self._auth_env(password) if password else {})}),
                         **kwargs)

    def _auth_env(self, password: str) -> dict[str, str]:
        return {"MLFLOW_AUTH_CONFIG_PATH": str(self.store / "basic_auth.ini"), "MLFLOW_AUTH_ADMIN_USERNAME": USER,
                "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                # signs the UI's CSRF tokens: new at each start, which only logs browsers in again
                "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}

    def start(self) -> MLflowServer:
        if self.authenticated:   # the auth app's configuration (no secret in it) and a new user store
            (self.store / "basic_auth.ini").write_text(
                f"[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                f"database_uri = sqlite:///{self.store / 'basic_auth.db'}\nadmin_username = {USER}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
            (self.store / "basic_auth.db").unlink(missing_ok=True)
        return super().start()

    @property
    def probe_url(self) -> str:
        return f"{self.url}/health"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlflow", "server", *(["--app-name", "basic-auth"] if self.authenticated else []),
                "--backend-store-uri", f"sqlite:///{self.store}/mlflow.db",
                "--artifacts-destination", str(self.store / "artifacts"), "--host", self.host,
                "--port", str(self.port), "--workers", str(self.workers),
                *(["--allowed-hosts", self.allowed_hosts] if self.allowed_hosts else [])]


class PrefectWorker(Service):
    """`prefect worker start --pool <pool> --type process` started in ``clone``, with a health check on its port.

    ``work_queue``: a device's own queue, polled beside the pool's default one (a fleet run addresses each
    device by its queue; a plain run goes to whichever device is free); ``poll_s``: how often it asks for
    runs (Prefect's default: 10 s, with 10 s of prefetch)."""

    name = "Prefect worker"
    timeout_fix = "check that the Prefect server is up at the worker's PREFECT_API_URL"

    def __init__(self, pool: str, api_url: str, clone: str | Path, device_id: str | None = None,
                 work_queue: str | None = None, tracking_uri: str | None = None, poll_s: float | None = None,
                 port: int | None = None, host: str = "127.0.0.1", env_extra: dict[str, str] | None = None,
                 password: str | None = None, **kwargs) -> None:
        self.pool, self.work_queue = pool, work_queue
        self.clone = Path(clone).resolve()
        self.device_id = device_id or f"{pool}-{self.clone.name}"
        super().__init__(port, host, cwd=self.clone, **kwargs)
        extra = {"PREFECT_API_URL": api_url, "EDGEFLUX_HOME": str(self.clone), "EDGEFLUX_DEVICE_ID": self.device_id,
                 "PREFECT_WORKER_WEBSERVER_HOST": self.host, "PREFECT_WORKER_WEBSERVER_PORT": str(self.port),
                 "PREFECT_HOME": str(self.clone / ".prefect")}
        if tracking_uri:
            extra["MLFLOW_TRACKING_URI"] = tracking_uri
        extra |= client_env(password)   # inherited by each flow run and the stages it starts
        if poll_s is not None:
            extra |= {"PREFECT_WORKER_QUERY_SECONDS": str(poll_s), "PREFECT_WORKER_PREFETCH_SECONDS": str(poll_s)}
        self.env = venv_env({**extra, **(env_extra or {})})
        self.name = f"Prefect worker {self.device_id} (pool {pool})"

    @property
    def probe_url(self) -> str:
        return f"{self.url}/health"

    def check_startable(self) -> None:
        """A worker polling a queue that does not exist polls nothing: create the device's queue first."""
        super().check_startable()
        if self.work_queue:
            proc = subprocess.run([sys.executable, "-m", "prefect", "work-queue", "create", self.work_queue,
                                   "--pool", self.pool], env=self.env, capture_output=True, text=True)
            if proc.returncode != 0 and "already exists" not in proc.stdout + proc.stderr:
                raise ServiceError(f"could not create work queue {self.work_queue} in pool {self.pool}: "
                                   f"{(proc.stdout + proc.stderr).strip()[-300:]}")

    def command(self) -> list[str]:
        queue = ["--work-queue", "default", "--work-queue", self.work_queue] if self.work_queue else []
        return [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process",
                "--name", self.device_id, "--with-healthcheck", *queue]


# --- the command line -----------------------------------------------------------------------------------

def follow(services: list[Service], echo: bool = True) -> int:
    """Until Ctrl-C (exit code 0) or one of the services exits (1): with ``echo``, print their logs as they grow."""
    offsets = {s.log_path: 0 for s in services}
    try:
        while True:
            for path in offsets if echo else ():
                with path.open("rb") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
                offsets[path] += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            dead = [s for s in services if s.process is not None and s.process.poll() is not None]
            if dead:
                log.error("the %s exited (%s): stopping; see %s", dead[0].name, dead[0].last_log_line(),
                          dead[0].log_path)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0


def serve_cloud(args: argparse.Namespace) -> int:
    home = Path(args.dir).resolve()
    if args.init_auth:
        print(f"credentials: {init_auth_file()} (user {USER}; copy the file to each device, mode 0600)")
    password = load_password()
    with ExitStack() as stack:
        prefect = stack.enter_context(PrefectServer(home / "prefect", args.prefect_port, args.host, password=password))
        mlflow = stack.enter_context(MLflowServer(home / "mlflow", args.mlflow_port, args.host,
                                                  allowed_hosts=args.allowed_hosts, password=password))
        where = args.public_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host)
        env = {"PREFECT_API_URL": f"http://{where}:{prefect.port}/api", "MLFLOW_TRACKING_URI": f"http://{where}:{mlflow.port}"}
        if args.deploy:
            subprocess.run([sys.executable, "-m", "pipeline.deploy"], env=venv_env(env | client_env(password)),
                           check=True)
        print("servers up; on this host and on each device:\n    export " +
              " ".join(f"{k}={v}" for k, v in env.items()) +
              f"\nPrefect UI: http://{where}:{prefect.port}   MLflow UI: http://{where}:{mlflow.port}" +
              (f"\nauthentication: user {USER}, the password of ${PASSWORD_ENV} or {auth_file()}"
               if password else "\nauthentication: none (loopback only)") +
              f"\nlogs: {prefect.log_path}, {mlflow.log_path}; Ctrl-C stops both", flush=True)
        return follow([prefect, mlflow], echo=args.follow)


def run_worker(args: argparse.Namespace) -> int:
    if not args.api_url:
        raise SystemExit("error: no Prefect server: give --api-url or set PREFECT_API_URL "
                         "(http://<cloud host>:4200/api)")
    clone = Path(args.clone).resolve()
    if not (clone / "dvc.yaml").is_file():
        raise SystemExit(f"error: {clone} is not an edgeflux clone (no dvc.yaml): run from the clone or give --clone")
    device_id = args.device_id or f"{args.pool}-{clone.name}"
    queue = device_id if args.pool != "cloud" else None   # what fleet runs address a device by
    worker = PrefectWorker(args.pool, args.api_url, clone, device_id=device_id, work_queue=queue,
                           tracking_uri=args.tracking_uri, poll_s=args.poll_s, password=load_password(),
                           log_path=clone / ".edgeflux" / f"worker-{device_id}.log")
    with worker:
        print(f"{worker.name} in {clone}: runs of pool {args.pool!r}" +
              (f" and of its own queue {queue!r}" if queue else "") + "; Ctrl-C stops it", flush=True)
        return follow([worker])


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.servers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cloud = sub.add_parser("cloud", help="the Prefect server and the MLflow tracking server, until Ctrl-C",
                           description="The Prefect server and the MLflow tracking server for the cloud host and its "
                                       "devices, until Ctrl-C.")
    cloud.add_argument("--dir", default=".edgeflux/servers", help="their databases, artifacts and logs (default: %(default)s)")
    cloud.add_argument("--host", default="127.0.0.1", help="interface to listen on; 0.0.0.0 for devices on the network, which needs the "
                       "servers' password (--init-auth) (default: %(default)s)")
    cloud.add_argument("--public-host", default=None, help="the name devices reach this host by, for the printed URLs")
    cloud.add_argument("--prefect-port", type=int, default=4200, help="default: %(default)s")
    cloud.add_argument("--mlflow-port", type=int, default=5000, help="default: %(default)s")
    cloud.add_argument("--allowed-hosts", default=None,
                       help="MLflow's allowed Host headers when devices use a DNS name, e.g. 'cloud.lan:5000' "
                            "(default: localhost and private IPs)")
    cloud.add_argument("--init-auth", action="store_true",
                       help="write the servers' password file first (a random password, mode 0600; kept if it "
                            "exists): needed for any --host but loopback (see docs/cli.md, Security)")
    cloud.add_argument("--deploy", action="store_true", help="create the work pools and deployments (pipeline.deploy) once up")
    cloud.add_argument("--follow", action="store_true", help="print the servers' logs here as they grow")
    worker = sub.add_parser("worker", help="a Prefect process worker for one device (or the cloud), until Ctrl-C",
                            description="A Prefect process worker in this clone that runs the flow runs of its pool "
                                        "(and of its device's own queue), until Ctrl-C.")
    worker.add_argument("--pool", required=True, choices=["cloud", "jetson", "pi"], help="its work pool")
    worker.add_argument("--device-id", default=None,
                        help="this device's name in runs and in MLflow, and (jetson, pi) the work queue of its own that "
                             "fleet runs address it by (default: <pool>-<clone dir>)")
    worker.add_argument("--clone", default=".", help="the clone the flow runs work in (default: this directory)")
    worker.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"), help="default: $PREFECT_API_URL")
    worker.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="the MLflow server (default: $MLFLOW_TRACKING_URI)")
    worker.add_argument("--poll-s", type=float, default=None, help="how often it asks for runs (Prefect's default: 10 s)")
    args = parser.parse_args(argv)
    cli_logging()
    # Ctrl-C and `kill` both stop the services cleanly: SIGINT even when a shell started this in the background
    # (which ignores it there), SIGTERM as from systemd or `docker stop`
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return serve_cloud(args) if args.command == "cloud" else run_worker(args)
    except (ServiceError, AuthError) as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
