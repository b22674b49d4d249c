"""What every subcommand shares: the parser class, one-line usage errors, the --tracking-uri flag, reading
MLflow's runs."""
from __future__ import annotations

import argparse
import os
import textwrap
from datetime import UTC, datetime
from edgeflux.auth import HOW, export_credentials
from edgeflux.errors import UserError

RAW = argparse.RawDescriptionHelpFormatter


def wrap(text: str) -> str:
    return textwrap.fill(text, 96)   # descriptions: the raw formatter (which keeps the examples' layout) wraps nothing


class UsageError(UserError):
    """A bad argument or input, reported as one line (exit 2) before anything runs."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: scripts and people read one line; the usage is one --help away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def tracking_uri_flag(p) -> None:
    p.add_argument("--tracking-uri", metavar="URI", help="the MLflow store or server, e.g. http://cloud:5000 "
                   "(default: $MLFLOW_TRACKING_URI, else sqlite mlflow.db at the project root)")


def _iso(ms: int | None) -> str | None:
    return datetime.fromtimestamp(ms / 1000, UTC).astimezone().isoformat(timespec="seconds") if ms else None


def local_time(iso: str | None) -> str:
    return (iso or "-")[:19].replace("T", " ")   # local time to the second, for tables


def mlflow_client(uri: str):
    """MLflow's client for ``uri``; a server that does not answer is a UsageError naming it (one line, no
    retries for minutes and no traceback)."""
    if uri.startswith(("http://", "https://")):
        export_credentials()   # the fleet's password (edgeflux.auth), where the environment has none
        _check_server(uri)
    # a CLI should not retry an unreachable server for minutes (MLflow's defaults): a few tries, then say so
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _check_server(uri: str) -> None:
    """One request as the client will make them (with the credentials it has): a server that does not answer,
    or refuses them, is one line here rather than a traceback after MLflow's retries."""
    import httpx

    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    try:
        answer = httpx.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                           auth=(user, password) if user and password else None, timeout=10.0)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach MLflow at {uri} ({type(exc).__name__}: {exc}): start it (edgeflux servers "
                         "on the cloud host) or give the right --tracking-uri / MLFLOW_TRACKING_URI") from None
    if answer.status_code in (401, 403):
        why = "refused the password given" if password else "needs the servers' password"
        raise UsageError(f"MLflow at {uri} {why} ({answer.status_code}): {HOW}")


def store_missing(uri: str) -> bool:
    """A sqlite store not created yet: reading it would create an empty one (and its migrations)."""
    from edgeflux.tracking.store import sqlite_file

    db = sqlite_file(uri)
    return db is not None and not db.exists()


def run_info(run) -> dict:
    tags = run.data.tags
    return {"run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
            "start_time": _iso(run.info.start_time), "end_time": _iso(run.info.end_time),
            "preset": tags.get("edgeflux.preset"), "dvc_exp": tags.get("edgeflux.dvc_exp"),
            "host": tags.get("edgeflux.host") or tags.get("host")}
