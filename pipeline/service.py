"""Long-running helper processes (servers, workers), started on loopback and always stopped.

A `Service` is one command run in its own process group, with its output in a log file, ready once an
HTTP probe answers 200. Stopping signals the whole group (SIGTERM, then SIGKILL after a grace period), so
the children a command starts (uvicorn under `mlflow server`, a flow-run process under a Prefect worker)
go with it. On Linux the service also dies with the thread that started it (PR_SET_PDEATHSIG), so a
killed test, stage or bench leaves nothing behind: start it from a thread that outlives it.

The services edgeflux runs (each the tool's own command, as its users start it by hand):

    ModelServer (pipeline.cloud)   mlflow models serve      MEANet's cloud model
    PrefectServer                  prefect server start     flow runs, deployments, schedules, work pools
    MLflowServer                   mlflow server            every stage's run, from every machine
    PrefectWorker                  prefect worker start     runs a pool's flow runs in its own clone
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from pipeline.settings import offline_env

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def venv_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, offline, with this interpreter's `bin` first on PATH: MLflow execs `uvicorn` by name,
    DVC stages run `python -m ...`, and both must be this venv's."""
    bin_dir = str(Path(sys.executable).parent)
    env = offline_env(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **(extra or {})}


class Service:
    """One command in its own process group; a context manager. Subclasses give `command()` and `probe_url`."""

    name = "service"
    timeout_fix = "raise its ready timeout"   # what to do when it is not ready in time

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
            # preexec_fn, unsafe beside threads in general: die_with_parent only calls an already resolved prctl.
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env or venv_env(), cwd=self.cwd, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509
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
        signal_group(process.pid, signal.SIGTERM)
        if not wait_group_gone(process, grace_s):
            log.warning("%s on %s ignored SIGTERM for %g s: killing it", self.name, self.url, grace_s)
            signal_group(process.pid, signal.SIGKILL)
            wait_group_gone(process, 2.0)   # SIGKILL is not instant either: stopped means stopped
        process.wait()
        log.info("%s on %s stopped", self.name, self.url)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a power cut or the OOM killer would."""
        if self.process is not None:
            signal_group(self.process.pid, signal.SIGKILL)
            wait_group_gone(self.process, 5.0)
            self.process.wait()
            self.process = None

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _temp_log(name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"edgeflux-{name.replace(' ', '-')}-", suffix=".log")
    os.close(fd)
    return Path(path)


_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread dies (resolved beforehand: little runs here)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether a live process is in the group. Zombies do not count: they hold no port and no memory, and one
    that no init reaps (a container whose PID 1 does not) would make every stop wait out its grace period."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):   # gone meanwhile
            continue
    return False


def wait_group_gone(process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        process.poll()   # reap the leader: it is our child, no init reaps it
        if not group_alive(process.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
