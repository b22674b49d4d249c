"""PyTorch models in MLflow's format: logged to a stage's run, registered in MLflow's model registry, or saved
in a directory that ``mlflow models serve`` serves."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from edgeflux.errors import UserError

from .parents import git_commit

log = logging.getLogger(__name__)

# Beside MLmodel in a directory save_model_dir writes: the sha256 of every other file, which check_model_dir
# recomputes before the directory is served (as every torch file edgeflux writes carries its content digest).
MANIFEST = "edgeflux-sha256.json"


class ModelDirError(ValueError, UserError):
    """A saved model directory that is missing files, holds others, or whose files changed since it was saved."""


def log_model(model, name: str, example=None, registered_name: str | None = None, tags: dict | None = None):
    """``model`` logged to the active run as ``name``; with ``registered_name``, also a new version of that model
    in the registry, tagged with ``tags`` (which name its ``edgeflux.stage``) and the git commit."""
    import mlflow.pytorch

    info = mlflow.pytorch.log_model(model, name=name, **_model_kwargs(example))
    return _register(info, name, registered_name, tags)


def log_onnx_model(path: str | Path, name: str, example, registered_name: str, tags: dict | None = None):
    """The ONNX file at ``path`` logged to the active run as ``name`` (MLflow's onnx flavor: ``mlflow.pyfunc``
    runs it in onnxruntime) and registered as a new version of ``registered_name``, tagged as log_model does."""
    import mlflow.onnx
    import onnx

    info = mlflow.onnx.log_model(onnx.load(str(path)), name=name, input_example=example.detach().cpu().numpy(),
                                 onnx_execution_providers=["CPUExecutionProvider"],   # what every device has
                                 pip_requirements=[f"onnxruntime=={_version('onnxruntime')}",
                                                   f"onnx=={_version('onnx')}"])
    return _register(info, name, registered_name, tags)


def _register(info, name: str, registered_name: str | None, tags: dict | None):
    if registered_name:
        import mlflow

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
    (tmp / MANIFEST).write_text(json.dumps({"sha256": _digests(tmp)}, indent=2, sort_keys=True) + "\n")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _digests(directory: Path) -> dict[str, str]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def check_model_dir(path: str | Path, fix: str) -> None:
    """ModelDirError naming the first file of ``path`` (a directory save_model_dir wrote) that is missing, extra,
    or not the file that was saved; ``fix`` says how to get a good copy back."""
    path = Path(path)
    try:
        saved = json.loads((path / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelDirError(f"{path}: no readable {MANIFEST} (the checksums save_model_dir writes), so it cannot be "
                            f"checked before it is served; {fix}") from None
    found = _digests(path)
    for name in sorted(saved.keys() | found.keys()):
        if saved.get(name) != found.get(name):
            what = "is missing" if name not in found else "was not saved with it" if name not in saved else \
                "differs from the file that was saved (damaged or changed)"
            raise ModelDirError(f"{path / name} {what}; {fix}")


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
