"""The cloud model server: MLflow's own (`mlflow models serve`), started and always stopped on loopback.

    with ModelServer("models/meanet/cloud") as server:      # waits for GET /ping
        CloudClient(server.url)(x)                          # POST /invocations {"inputs": ...}

    python -m pipeline.cloud --model models/meanet/cloud    # serve until Ctrl-C

`--env-manager local` serves from this environment: the default builds a virtualenv and pip-installs
torch, which an offline device cannot do. The server runs in its own process group, so stopping it
(SIGTERM, then SIGKILL after a grace period) also stops the uvicorn worker it starts; it needs the venv's
`bin` on PATH, since it execs `uvicorn` by name. On Linux it also dies with the thread that started it
(PR_SET_PDEATHSIG; MLflow does the same for its uvicorn), so a killed stage leaves no server behind:
start it from a thread that outlives it (the main thread, as stages and the CLI do).
"""
from __future__ import annotations

import argparse
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

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class CloudServerError(RuntimeError):
    """The model server did not start (a bad model path, a port in use, a missing command)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (another process may take it before the server binds it: rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port. SO_REUSEADDR as uvicorn sets it: a port whose connections
    are only in TIME_WAIT (a server just stopped) is free for it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _is_uri(model: str) -> bool:
    """runs:/..., models:/..., s3://...: checked by the server, not here."""
    return "://" in model or ":/" in model


class ModelServer:
    """`mlflow models serve -m <model> --env-manager local -h <host> -p <port>` as a context manager; see the
    module docstring. ``port`` None: a free one. ``log_path`` None: a temp file (kept, for post-mortems)."""

    def __init__(self, model: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 ready_timeout_s: float = 120.0, log_path: str | Path | None = None) -> None:
        self.model, self.host, self.port = str(model), host, port or free_port(host)
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(log_path) if log_path else None   # None: a temp file, made by start()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ModelServer:
        """Start the server and wait for it to answer /ping; CloudServerError (server stopped) when it cannot."""
        if self.process is not None:
            raise RuntimeError(f"the model server on {self.url} is already started")
        self._check_startable()
        self.log_path = self.log_path or _temp_log()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting the cloud model server for %s on %s (log: %s)", self.model, self.url, self.log_path)
        with self.log_path.open("wb") as out:   # the child keeps its own descriptor
            # preexec_fn, unsafe beside threads in general: _die_with_parent only calls an already resolved prctl.
            self.process = subprocess.Popen(self._command(), stdout=out, stderr=subprocess.STDOUT, env=_server_env(),
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_die_with_parent)  # noqa: PLW1509
        try:
            self._wait_ready()
        except BaseException:   # Ctrl-C while waiting too: never leave a server behind
            self.stop()
            raise
        return self

    def _check_startable(self) -> None:
        if not _is_uri(self.model) and not (Path(self.model) / "MLmodel").is_file():
            what = "no MLflow model" if not Path(self.model).exists() else "no MLmodel file (not an MLflow model)"
            raise CloudServerError(f"{what} at {self.model}: give a directory written by "
                                   "edgeflux.tracking.save_model_dir (the cloud model: `dvc repro meanet_cloud`)")
        if _port_in_use(self.host, self.port):
            raise CloudServerError(f"port {self.port} on {self.host} is in use: stop what listens there "
                                   "or choose another port (--port)")

    def _command(self) -> list[str]:
        # `python -m mlflow` with this interpreter: works whether or not the venv's scripts are on PATH.
        return [sys.executable, "-m", "mlflow", "models", "serve", "-m", self.model, "--env-manager", "local",
                "-h", self.host, "-p", str(self.port)]

    def _wait_ready(self) -> None:
        start = time.monotonic()
        with httpx.Client(timeout=1.0, trust_env=False) as http:   # our own server: never through HTTP_PROXY
            while time.monotonic() - start < self.ready_timeout_s:
                if self.process.poll() is not None:
                    raise CloudServerError(f"the model server exited with code {self.process.returncode} before it "
                                           f"was ready ({self._last_log_line()}): fix that, see {self.log_path}")
                try:
                    if http.get(f"{self.url}/ping").status_code == 200:
                        log.info("cloud model server ready on %s after %.1f s", self.url, time.monotonic() - start)
                        return
                except httpx.HTTPError:
                    pass   # not listening yet
                time.sleep(0.25)
        raise CloudServerError(f"the model server on {self.url} was not ready after {self.ready_timeout_s:g} s "
                               f"({self._last_log_line()}): raise the ready timeout (params.yaml: "
                               f"meanet.client.ready_timeout_s) or see {self.log_path}")

    def _last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return f"last log line: {lines[-1][:300]}" if lines else "no output"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after grace_s; safe to call twice.

        The group, not the process: the mlflow command's uvicorn child would otherwise keep answering on the port."""
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        if not _wait_group_gone(process, grace_s):
            log.warning("cloud model server on %s ignored SIGTERM for %g s: killing it", self.url, grace_s)
            _signal_group(process.pid, signal.SIGKILL)
            _wait_group_gone(process, 2.0)   # SIGKILL is not instant either: stopped means stopped
        process.wait()
        log.info("cloud model server on %s stopped", self.url)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _temp_log() -> Path:
    fd, path = tempfile.mkstemp(prefix="mlflow-serve-", suffix=".log")
    os.close(fd)
    return Path(path)


def _server_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)   # MLflow execs `uvicorn` by name
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread dies (resolved beforehand: little runs here)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
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


def _wait_group_gone(process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        process.poll()   # reap the leader: it is our child, no init reaps it
        if not _group_alive(process.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/meanet/cloud",
                        help="an MLflow model directory or URI (default: the meanet_cloud stage's models/meanet/cloud)")
    parser.add_argument("--port", type=int, default=5001, help="port to listen on (default: 5001; 0: a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback; 0.0.0.0 serves devices on the network)")
    parser.add_argument("--ready-timeout-s", type=float, default=120.0,
                        help="seconds to wait for the server to answer /ping (default: 120)")
    parser.add_argument("--log", default=None, help="the server's output goes here (default: a temp file)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per /ping otherwise
    try:
        with ModelServer(args.model, args.port or None, args.host, args.ready_timeout_s, args.log) as server:
            print(f"serving {args.model} on {server.url} (POST /invocations); Ctrl-C stops it")
            server.process.wait()
            raise CloudServerError(f"the model server exited with code {server.process.returncode} "
                                   f"({server._last_log_line()}): see {server.log_path}")
    except CloudServerError as exc:
        parser.exit(1, f"error: {exc}\n")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
