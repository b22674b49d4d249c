"""Where runs and their artifacts go, and the UI that shows them.

Where runs go: ``MLFLOW_TRACKING_URI`` when it is set; otherwise sqlite ``mlflow.db`` at the root of
the repository, found from ``DVC_ROOT``, which DVC sets for every stage it runs, else from the
working directory. Not the working directory first: ``dvc exp run --temp`` and queued experiments run
their stages in a copy of the repository under ``.dvc/tmp/exps/`` that DVC deletes afterwards, and
for those DVC sets ``DVC_ROOT`` to the original repository.

Where artifacts go: ``mlruns/<experiment>`` next to ``mlflow.db``, recorded relative to the store so
that a moved or copied clone keeps working. MLflow keeps no relative local path (it makes an
experiment's artifact location absolute when the experiment is created, and each run's artifacts go
under its experiment's), so a sqlite store's experiment is created with the location
``mlflow-artifacts:/<experiment>``: MLflow's own scheme for artifacts served by a tracking server
from its ``--artifacts-destination``. ``ui_command()`` starts the UI with ``--artifacts-destination
<store dir>/mlruns``, and in every process that imports this package the scheme resolves, for a sqlite
tracking URI, to ``<store dir>/mlruns`` (for an http(s) one, MLflow's proxy as usual: see ``scheme``).
"""
from __future__ import annotations

import os
import re
import shlex
import sqlite3
import sys
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from sqlalchemy.exc import SQLAlchemyError

EXPERIMENT = os.environ.get("EDGEFLUX_EXPERIMENT", "edgeflux")
ARTIFACTS_DIR = "mlruns"          # next to a sqlite store's file: where ``mlflow-artifacts:/`` resolves
PROXIED_SCHEME = "mlflow-artifacts"
SQLITE = "sqlite:///"


def tracking_uri() -> str:
    """Where runs go (see the module docstring)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"{SQLITE}{repo_root() / 'mlflow.db'}"


def repo_root() -> Path:
    """The repository a stage belongs to: in a DVC experiment, the original, not DVC's temporary copy."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()


def sqlite_file(uri: str) -> Path | None:
    """The file of a sqlite store (as the URI names it); None for any other store."""
    return Path(uri.removeprefix(SQLITE).split("?")[0]) if uri.startswith(SQLITE) else None


def _store_dir(uri: str) -> Path | None:
    """The directory of a sqlite store's file; None for any other store (a server keeps its own artifacts)."""
    db = sqlite_file(uri)
    return db.resolve().parent if db else None


def _outside(location: str, directory: Path) -> bool:
    """Whether an artifact location is a local path outside ``directory`` (remote locations work from anywhere)."""
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return False
    return not Path(url2pathname(parsed.path)).resolve().is_relative_to(directory)


def artifacts_root(uri: str) -> Path | None:
    """Where ``mlflow-artifacts:/`` URIs resolve for the sqlite store at ``uri`` (``mlruns`` next to its file,
    what ui_command() gives the UI as ``--artifacts-destination``); None for a server's store."""
    store_dir = _store_dir(uri)
    return store_dir / ARTIFACTS_DIR if store_dir else None


def _store_location(name: str) -> str:
    """A new experiment's artifact location in a sqlite store: relative to the store (see the module docstring)."""
    directory = re.sub(r"[^\w.-]", "_", name).lstrip(".") or "_"
    return f"{PROXIED_SCHEME}:/{directory}"


def ui_command() -> str:
    """The command a user runs to browse what was tracked (with this interpreter's mlflow, so it
    works from a shell where the virtualenv is not activated); for a sqlite store, with the directory
    its ``mlflow-artifacts:/`` locations resolve to (see the module docstring)."""
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    if mlflow_bin.is_relative_to(Path.cwd()):
        mlflow_bin = mlflow_bin.relative_to(Path.cwd())
    uri = tracking_uri()
    command = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "ui", "--backend-store-uri", uri]
    if root := artifacts_root(uri):
        command += ["--artifacts-destination", str(root)]
    return shlex.join(command)


def ui_url(base: str = "http://127.0.0.1:5000") -> str:
    """The address of the experiment's runs in the UI at ``base``, in its Machine learning view (MLflow 3.17's UI
    picks GenAI or Machine learning by a switch in its sidebar, GenAI unless changed, not by the experiment's
    kind tag); the list of experiments when the store is not a sqlite file here that has the experiment."""
    uri, experiment = tracking_uri(), None
    if (db := sqlite_file(uri)) and db.is_file():
        try:
            experiment = MlflowClient(uri).get_experiment_by_name(EXPERIMENT)
        except (SQLAlchemyError, sqlite3.DatabaseError, MlflowException, OSError):
            pass
    where = f"experiments/{experiment.experiment_id}/runs" if experiment else "experiments"
    return f"{base.rstrip('/')}/#/{where}?workflowType=machine_learning"
