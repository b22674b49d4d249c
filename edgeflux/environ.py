"""The environment of the tools edgeflux runs: Prefect, MLflow and DVC offline and quiet (no telemetry, no
phoning home), and this interpreter's own commands first on PATH.

Devices may be offline, and a run's output should show the user's stages, not tracebacks from
background services trying to reach the internet. Every variable is read by the tool itself
(nothing here touches logging levels, so real errors stay visible).

    os.environ.update(offline_env())               # before `import prefect` (see below)
    subprocess.run(cmd, env=offline_env(os.environ))

Set them before importing prefect: `import prefect` reads DO_NOT_TRACK for its first-import
analytics and builds its settings then; the ephemeral server started by the first flow run gets
the client's environment, so PREFECT_SERVER_ANALYTICS_ENABLED set later does still reach it, but
one rule (before the import) is simpler than knowing which setting is read when.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

OFFLINE_ENV: dict[str, str] = {
    # Prefect's server (the ephemeral one every in-process flow run starts, and `prefect server start`)
    # runs a "telemetry heartbeat" service at startup and every 10 minutes
    # (prefect/server/services/telemetry.py): it POSTs to https://sens-o-matic.prefect.io/ (offline:
    # "ERROR ... Failed to send telemetry: Name or service not known") and, on a new database, first
    # writes its session id in a read-then-insert DEFERRED sqlite transaction (telemetry.py:37-54)
    # that races the client's first writes (flow, flow run): SQLite answers "database is locked"
    # at once (a WAL read lock cannot be upgraded; no busy timeout helps) and docket logs the failed
    # task with a ~100-line traceback under the `docket.dependencies` logger, which Prefect's own
    # "database is locked" log filter (server/api/server.py:166-174: uvicorn.error, docket.worker)
    # does not cover. DO_NOT_TRACK does not reach this service; only this setting turns it off
    # (its enabled_getter, telemetry.py:64-65), which removes both the network call and the race.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # The client-side half: Prefect's SDK analytics (Amplitude events from prefect/_internal/analytics,
    # checked at `import prefect` and at every event) and MLflow's telemetry (mlflow/telemetry/utils.py)
    # both honour the DO_NOT_TRACK convention.
    "DO_NOT_TRACK": "true",
    # MLflow's own switch for its usage telemetry (config.mlflow-telemetry.io); explicit, so it does not
    # depend on MLflow keeping DO_NOT_TRACK support.
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # DVC's usage analytics (a daemon POSTing to analytics.dvc.org after a command): the environment
    # switch, for repos whose config lacks `core.analytics false` (a fresh clone on a device, a test repo).
    "DVC_NO_ANALYTICS": "true",
}


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The offline variables, added to (and overriding) ``base`` when given.

    ``offline_env()``: only the variables (for ``os.environ.update``);
    ``offline_env(os.environ)``: a full environment for a subprocess.
    """
    return {**(base or {}), **OFFLINE_ENV}


def venv_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, offline, with this interpreter's `bin` first on PATH: MLflow execs `uvicorn` by name,
    DVC stages run `python -m ...`, and both must be this venv's."""
    bin_dir = str(Path(sys.executable).parent)
    env = offline_env(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **(extra or {})}
