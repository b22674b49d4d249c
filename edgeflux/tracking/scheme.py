"""``mlflow-artifacts:/`` locations resolved next to a sqlite store, in every process that imports this package.

MLflow resolves the scheme only through a tracking server's proxy; a sqlite store's experiments use it too
(``store``: their artifacts then stay relative to the store), so the scheme is registered here with a
repository that, for a sqlite tracking URI, reads and writes under ``artifacts_root()``, as a tracking server
started by ``ui_command()`` serves it.
"""
from __future__ import annotations

from urllib.parse import urlparse
from urllib.request import url2pathname

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

from .store import PROXIED_SCHEME, artifacts_root


def proxied_artifact_repository(artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None):
    """The artifact repository of an ``mlflow-artifacts:`` URI: with a sqlite tracking URI, the directory it names
    under artifacts_root(), as a tracking server started by ui_command() serves it; otherwise MLflow's (the
    tracking server proxies it)."""
    parsed = urlparse(artifact_uri)
    root = artifacts_root(tracking_uri or mlflow.get_tracking_uri())
    if root is None or parsed.netloc:
        return MlflowArtifactsRepository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)
    path = (root / url2pathname(parsed.path).lstrip("/")).resolve()
    if not path.is_relative_to(root.resolve()):
        raise MlflowException(f"artifact URI {artifact_uri} points outside {root}")
    return LocalArtifactRepository(str(path), tracking_uri=tracking_uri, registry_uri=registry_uri)


_artifact_repository_registry.register(PROXIED_SCHEME, proxied_artifact_repository)
