"""PyTorch models in MLflow's format: logged to a stage's run, registered in MLflow's model registry, or saved
in a directory that ``mlflow models serve`` serves."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .parents import git_commit

log = logging.getLogger(__name__)


def log_model(model, name: str, example=None, registered_name: str | None = None, tags: dict | None = None):
    """``model`` logged to the active run as ``name``; with ``registered_name``, also a new version of that model
    in the registry, tagged with ``tags`` (which name its ``edgeflux.stage``) and the git commit."""
    import mlflow.pytorch

    info = mlflow.pytorch.log_model(model, name=name, **_model_kwargs(example))
    if registered_name:
        tags = dict(tags or {})
        if commit := git_commit():
            tags["edgeflux.git_commit"] = commit
        version = mlflow.register_model(info.model_uri, registered_name, tags=tags)
        info.registered_model_version = version.version
        log.info("MLflow: model %s of stage %s registered as %s version %s", name, tags.get("edgeflux.stage"),
                 registered_name, version.version)
    return info


def _model_kwargs(example) -> dict:
    """What log_model and save_model_dir give MLflow: the input example (numpy) and the environment. pip_requirements
    given: MLflow would otherwise resolve the environment by importing and inspecting every package, slow and noisy
    on a device."""
    return {"input_example": example.detach().cpu().numpy() if example is not None else None,
            "pip_requirements": [f"torch=={_torch_version()}"]}


def save_model_dir(model, path: str | Path, example) -> None:
    """A PyTorch model in MLflow's format in directory ``path``: what ``mlflow models serve -m path`` serves, float32
    [N, ...] like ``example`` in (any N), the model's output out (logits [N, classes]).

    Exported in eval mode (the mode is restored after): MLflow exports the module (torch.export), so a model in
    training mode would be served with BatchNorm's batch statistics and dropout. Replaced atomically: written
    beside ``path``, then renamed over it, so a kill never leaves half a model; a kill between the two renames
    leaves the previous model in ``<path>.old``, which the next call puts back first."""
    import mlflow.pytorch

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if old.exists() and not path.exists():
        old.rename(path)   # the previous call was killed between its renames
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    modes = [(m, m.training) for m in model.modules()]   # each its own: a frozen BatchNorm may be in eval already
    try:
        mlflow.pytorch.save_model(model.eval(), str(tmp), **_model_kwargs(example))
    finally:
        for module, training in modes:
            module.training = training
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
