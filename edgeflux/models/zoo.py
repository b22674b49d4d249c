"""The zoo's builders: a model by name, as a UnitModel (edgeflux.models)."""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .mobilenet import build_mobilenet
from .resnet import build_resnet18
from .units import UnitModel, count_params
from .spec import MODEL_NAMES
from .torchvision_arch import build_torchvision
from .vgg import build_vgg
from .weights import load_torchvision_weights

log = logging.getLogger(__name__)

# (num_classes, in_channels, width, image_size, batch_norm) -> model; build_model checks the arguments
Builder = Callable[[int, int, float, int, bool], UnitModel]


def _vgg(name: str) -> Builder:
    return lambda num_classes, in_channels, width, image_size, batch_norm: build_vgg(
        name, num_classes, in_channels, width, image_size, batch_norm)


def _resnet18(num_classes: int, in_channels: int, width: float, image_size: int, batch_norm: bool) -> UnitModel:
    return build_resnet18(num_classes, in_channels, width, image_size)   # always with BatchNorm


def _mobilenet(name: str) -> Builder:
    return lambda num_classes, in_channels, width, image_size, batch_norm: build_mobilenet(
        name, num_classes, in_channels, width, image_size)                # always with BatchNorm


BUILDERS: dict[str, Builder] = {
    "vgg11": _vgg("vgg11"),
    "vgg16": _vgg("vgg16"),
    "vgg19": _vgg("vgg19"),
    "resnet18": _resnet18,
    "mobilenet_v2": _mobilenet("mobilenet_v2"),
    "mobilenet_v3_small": _mobilenet("mobilenet_v3_small"),
    "mobilenet_v3_large": _mobilenet("mobilenet_v3_large"),
}
assert tuple(BUILDERS) == MODEL_NAMES, "edgeflux/models/spec.py names the zoo's models for params.yaml"



@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Weights drawn from ``seed`` (None: from the global RNG), the global RNG left as it was."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def build_model(
    name: str,
    num_classes: int = 10,
    in_channels: int = 1,
    width: float = 1.0,
    image_size: int = 32,
    batch_norm: bool = True,
    pretrained_path: str | Path | None = None,
    seed: int | None = None,
    arch: str = "zoo",
) -> UnitModel:
    """Build zoo model `name` as a UnitModel (``arch="torchvision"``: torchvision's architecture as it is,
    edgeflux/models/torchvision_arch.py, with ``pretrained_path`` loaded strictly; width and batch_norm unused).

    seed: initialise the weights from this seed (the global RNG is left as it was), so the same
    params give the same model in every run; None draws from the global RNG.

    width scales channels (VGG/ResNet: max(8, round(c * width)); MobileNets: torchvision's
    width_mult). batch_norm=False exists for VGG only (BitTrain's BN-free variant).
    pretrained_path: a torchvision state_dict file to map onto the model (never downloaded).
    """
    if arch == "torchvision":
        with _seeded(seed):
            return build_torchvision(name, num_classes, in_channels, image_size, pretrained_path)
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
        raise ValueError(f"width must be a positive number (e.g. 1.0 or 0.25), got {width!r}")
    for arg, value in (("num_classes", num_classes), ("in_channels", in_channels), ("image_size", image_size)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if not batch_norm and not name.startswith("vgg"):
        raise ValueError(f"batch_norm=False is only available for VGG models, not {name!r}")

    with _seeded(seed):
        model = BUILDERS[name](num_classes, in_channels, width, image_size, batch_norm)
    log.info(
        "built %s: width %g, %d units, %d params, %d classes, %d input channels",
        name, width, len(model.units), count_params(model), num_classes, in_channels,
    )

    if pretrained_path is not None:
        summary = load_torchvision_weights(model, pretrained_path)
        log.info(
            "%s: %d tensors loaded from %s, skipped %s, missing %d",
            name, len(summary["loaded"]), pretrained_path, [k for k, _ in summary["skipped"]], len(summary["missing"]),
        )
    return model
