"""The cloud model server: MLflow's own (`mlflow models serve`), started and always stopped on loopback;
its client is edgeflux.meanet.cloud.

    with ModelServer("models/meanet/cloud") as server:      # waits for GET /ping
        CloudClient(server.url)(x)                          # POST /invocations {"inputs": ...}

    python -m pipeline.cloud --model models/meanet/cloud    # serve until Ctrl-C (the command line)

`--env-manager local` serves from this environment: the default builds a virtualenv and pip-installs
torch, which an offline device cannot do. The server runs in its own process group, so stopping it
(SIGTERM, then SIGKILL after a grace period) also stops the uvicorn worker it starts; it needs the venv's
`bin` on PATH, since it execs `uvicorn` by name. On Linux it also dies with the thread that started it
(PR_SET_PDEATHSIG; MLflow does the same for its uvicorn), so a killed stage leaves no server behind:
start it from a thread that outlives it (the main thread, as stages and the CLI do).
"""
from __future__ import annotations

import sys
from pathlib import Path

from edgeflux.errors import UserError
from edgeflux.service import Service, ServiceError


class CloudServerError(ServiceError, UserError):
    """The model server did not start (a bad model path, a port in use, a missing command)."""


def _is_uri(model: str) -> bool:
    """runs:/..., models:/..., s3://...: checked by the server, not here."""
    return "://" in model or ":/" in model


class ModelServer(Service):
    """`mlflow models serve -m <model> --env-manager local -h <host> -p <port>` as a context manager; see the
    module docstring. ``port`` None: a free one. ``log_path`` None: a temp file (kept, for post-mortems)."""

    name = "cloud model server"
    timeout_fix = "raise the ready timeout (params.yaml: meanet.client.ready_timeout_s)"
    open_fix = ("MLflow's model server has no authentication of its own: serve it on loopback and let devices reach "
                "it through the reverse proxy of docs/cli.md (Security: TLS and the fleet's password)")

    def __init__(self, model: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 ready_timeout_s: float = 120.0, log_path: str | Path | None = None) -> None:
        super().__init__(port, host, ready_timeout_s, log_path)
        self.model = str(model)

    @property
    def probe_url(self) -> str:
        return f"{self.url}/ping"

    def start(self) -> ModelServer:
        """Start the server and wait for it to answer /ping; CloudServerError (server stopped) when it cannot."""
        try:
            return super().start()
        except CloudServerError:
            raise
        except ServiceError as exc:
            raise CloudServerError(str(exc)) from None

    def check_startable(self) -> None:
        super().check_startable()   # beyond loopback: refused, whatever the model
        if not _is_uri(self.model) and not (Path(self.model) / "MLmodel").is_file():
            what = "no MLflow model" if not Path(self.model).exists() else "no MLmodel file (not an MLflow model)"
            raise CloudServerError(f"{what} at {self.model}: give a directory written by "
                                   "edgeflux.tracking.save_model_dir (the cloud model: `dvc repro meanet_cloud`)")
        if not _is_uri(self.model):   # a damaged model would be served and answer wrongly, not fail
            from edgeflux.tracking.models import ModelDirError, check_model_dir

            try:
                check_model_dir(self.model, "restore it (`dvc checkout models/meanet/cloud`) or rebuild it "
                                            "(`dvc repro -f meanet_cloud`)")
            except ModelDirError as exc:
                raise CloudServerError(str(exc)) from None

    def command(self) -> list[str]:
        # `python -m mlflow` with this interpreter: works whether or not the venv's scripts are on PATH.
        return [sys.executable, "-m", "mlflow", "models", "serve", "-m", self.model, "--env-manager", "local",
                "-h", self.host, "-p", str(self.port)]

