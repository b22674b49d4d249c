"""The cloud host's servers and a device's worker, each the tool's own command (see pipeline.service).

    with PrefectServer(home) as prefect, MLflowServer(store) as mlflow:
        with PrefectWorker("pi", prefect.api_url, clone, tracking_uri=mlflow.url, device_id="pi-01"):
            ...

By hand, the same commands (README, "Cloud and devices"):

    prefect server start --host 0.0.0.0 --port 4200
    mlflow server --backend-store-uri sqlite:///mlflow-server.db --artifacts-destination ./mlartifacts ...
    EDGEFLUX_HOME=$PWD prefect worker start --pool pi --type process --name pi-01

A worker runs each flow run in a child process that inherits its environment: `EDGEFLUX_HOME` (the clone
the deployments' pull step enters), `EDGEFLUX_DEVICE_ID` and `MLFLOW_TRACKING_URI` travel that way.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.service import Service, ServiceError, venv_env


class PrefectServer(Service):
    """`prefect server start` with its database under ``home`` (PREFECT_HOME). ``scheduler_loop_s``: how often
    the scheduler creates runs for cron deployments (Prefect's default: 60 s)."""

    name = "Prefect server"
    timeout_fix = "raise the ready timeout (a first start migrates a new database: ~8 s here)"

    def __init__(self, home: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 scheduler_loop_s: float | None = None, **kwargs) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        extra = {"PREFECT_HOME": str(self.home)}
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


class MLflowServer(Service):
    """`mlflow server` with a sqlite store and the artifacts it serves (devices upload them over HTTP)."""

    name = "MLflow server"
    timeout_fix = "raise the ready timeout"

    def __init__(self, store: str | Path, port: int | None = None, host: str = "127.0.0.1", workers: int = 1,
                 **kwargs) -> None:
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        kwargs.setdefault("log_path", self.store / "server.log")
        super().__init__(port, host, **kwargs)

    @property
    def probe_url(self) -> str:
        return f"{self.url}/health"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.store}/mlflow.db",
                "--artifacts-destination", str(self.store / "artifacts"), "--host", self.host,
                "--port", str(self.port), "--workers", str(self.workers)]


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
                 **kwargs) -> None:
        self.pool, self.work_queue = pool, work_queue
        self.clone = Path(clone).resolve()
        self.device_id = device_id or f"{pool}-{self.clone.name}"
        super().__init__(port, host, cwd=self.clone, **kwargs)
        extra = {"PREFECT_API_URL": api_url, "EDGEFLUX_HOME": str(self.clone), "EDGEFLUX_DEVICE_ID": self.device_id,
                 "PREFECT_WORKER_WEBSERVER_HOST": self.host, "PREFECT_WORKER_WEBSERVER_PORT": str(self.port),
                 "PREFECT_HOME": str(self.clone / ".prefect")}
        if tracking_uri:
            extra["MLFLOW_TRACKING_URI"] = tracking_uri
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
