"""Long-running helper processes (servers, workers), started on loopback and always stopped.

A `Service` is one command run in its own process group (edgeflux.process), with its output in a log
file, ready once an HTTP probe answers 200. Stopping signals the whole group (SIGTERM, then SIGKILL after a
grace period), so the children a command starts (uvicorn under `mlflow server`, a flow-run process under a
Prefect worker) go with it. On Linux the service also dies with the thread that started it
(PR_SET_PDEATHSIG), so a killed test, stage or bench leaves nothing behind: start it from a thread that
outlives it.

The services edgeflux runs (each the tool's own command, as its users start it by hand):

    ModelServer (edgeflux.meanet.server)   mlflow models serve     MEANet's cloud model
    PrefectServer (pipeline.servers)       prefect server start    flow runs, deployments, schedules, pools
    MLflowServer (pipeline.servers)        mlflow server           every stage's run, from every machine
    PrefectWorker (pipeline.servers)       prefect worker start    runs a pool's flow runs in its own clone
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from edgeflux.auth import HOW, is_loopback
from edgeflux.environ import venv_env
from edgeflux.process import kill_group, start_group, stop_group

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A service did not start (a bad argument, a port in use, a missing command, a crash)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (another process may take it before the server binds it: rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port. SO_REUSEADDR as uvicorn sets it: a port whose connections
    are only in TIME_WAIT (a server just stopped) is free for it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class Service:
    """One command in its own process group; a context manager. Subclasses give `command()` and `probe_url`."""

    name = "service"
    timeout_fix = "raise its ready timeout"   # what to do when it is not ready in time
    # whether it checks the credentials of edgeflux.auth: only such a service may listen beyond loopback
    authenticated = False
    open_fix = f"set the servers' password first: {HOW}"

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", ready_timeout_s: float = 120.0,
                 log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(log_path) if log_path else None   # None: a temp file, made by start()
        self.env, self.cwd = env, cwd
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def probe_url(self) -> str:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def check_startable(self) -> None:
        """Raise ServiceError naming the fix before anything starts."""
        if not self.authenticated and not is_loopback(self.host):   # first: before any check a subclass adds
            raise ServiceError(f"the {self.name} would answer anyone who reaches {self.host} without "
                               f"authentication: {self.open_fix}")
        if port_in_use(self.host, self.port):
            raise ServiceError(f"port {self.port} on {self.host} is in use: stop what listens there or choose "
                               f"another port for the {self.name}")

    def start(self) -> Service:
        """Start the command and wait for its probe; ServiceError (the process stopped) when it cannot."""
        if self.process is not None:
            raise RuntimeError(f"the {self.name} on {self.url} is already started")
        self.check_startable()
        self.log_path = self.log_path or _temp_log(self.name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting the %s on %s (log: %s)", self.name, self.url, self.log_path)
        with self.log_path.open("wb") as out:   # the child keeps its own descriptor
            self.process = start_group(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                       env=self.env or venv_env(), cwd=self.cwd, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:   # Ctrl-C while waiting too: never leave a service behind
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        start = time.monotonic()
        with httpx.Client(timeout=1.0, trust_env=False) as http:   # our own server: never through HTTP_PROXY
            while time.monotonic() - start < self.ready_timeout_s:
                if self.process.poll() is not None:
                    raise ServiceError(f"the {self.name} exited with code {self.process.returncode} before it was "
                                       f"ready ({self.last_log_line()}): fix that, see {self.log_path}")
                try:
                    if http.get(self.probe_url).status_code == 200:
                        log.info("%s ready on %s after %.1f s", self.name, self.url, time.monotonic() - start)
                        return
                except httpx.HTTPError:
                    pass   # not listening yet
                time.sleep(0.25)
        raise ServiceError(f"the {self.name} on {self.url} was not ready after {self.ready_timeout_s:g} s "
                           f"({self.last_log_line()}): {self.timeout_fix}, or see {self.log_path}")

    def last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except (OSError, AttributeError):
            return "no log"
        return f"last log line: {lines[-1][:300]}" if lines else "no output"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL to what is left of it after grace_s; safe to call twice."""
        process, self.process = self.process, None
        if process is None:
            return
        stop_group(process, grace_s, f"{self.name} on {self.url}")
        log.info("%s on %s stopped", self.name, self.url)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a power cut or the OOM killer would."""
        process, self.process = self.process, None
        if process is not None:
            kill_group(process)

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _temp_log(name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"edgeflux-{name.replace(' ', '-')}-", suffix=".log")
    os.close(fd)
    return Path(path)

