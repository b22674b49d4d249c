"""MLflow's plugin hook for ``mlflow-artifacts:/`` (pyproject.toml, entry point group ``mlflow.artifact_repository``).

A clone's sqlite store keeps its artifacts at ``mlflow-artifacts:/`` locations next to the store
(``edgeflux.tracking.store``), which MLflow alone resolves only through a tracking server. MLflow loads this entry
point when it is imported, in any process of the environment edgeflux is installed in, so plain MLflow
(``mlflow.pyfunc.load_model("models:/...")``, ``MlflowClient().list_artifacts``) reads the store a clone writes
without the user importing edgeflux. This module imports nothing of edgeflux until MLflow asks for a repository:
MLflow loads it while it is itself being imported.
"""


def artifact_repository(artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None):
    from edgeflux.tracking.scheme import proxied_artifact_repository

    return proxied_artifact_repository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)
