"""Orchestration: Prefect flows that run the DVC stages (dvc.yaml stays the only stage graph)."""

import logging


def cli_logging() -> None:
    """The pipeline's command lines log INFO lines as plain messages; httpx's one line per request (Prefect's
    and MLflow's clients, readiness polls) is left out: it says nothing a user acts on."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
