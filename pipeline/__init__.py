"""Orchestration: Prefect flows that run the DVC stages (dvc.yaml stays the only stage graph)."""
