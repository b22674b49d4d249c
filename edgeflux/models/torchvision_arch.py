"""torchvision's ImageNet architectures as they are (stem, strides, classifier), as UnitModels.

`arch: torchvision` in a model spec: `torchvision.models.<name>(weights=None, num_classes=n)` unchanged,
cut into the units every technique works at, the modules themselves (no copies), in forward order:

    MobileNetV2/V3   stem (features[0]), irb1..irbN (each InvertedResidual), last_conv, classifier
    EfficientNet-B0  stem, mbconv1..mbconv16 (each MBConv, kind inverted_residual), last_conv, classifier
    ResNet-18/34/50  stem (conv1, bn1, relu, maxpool), block1.0..block4.B (torchvision's layerS.B), classifier
    VGG-11/16 (BN)   conv1..convN (each conv + BN + ReLU, with the max-pool that follows it), classifier

The classifier unit is avgpool + flatten + torchvision's head, so the model computes exactly what
torchvision's does (tests/test_torchvision_arch.py compares the logits). Weights come from a state_dict
file loaded strictly (`load_strict`): never a download. A 1-channel data set meets the 3-channel stem
through `RepeatChannels`, which the log reports.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torchvision import models as tvm

from .spec import TORCHVISION_NAMES
from .units import UnitModel
from .weights import HOW_TO_SAVE, WeightsError, read_state_dict

log = logging.getLogger(__name__)

# spec.py names them for params.yaml (torch-free); the assert below holds the two together
TORCHVISION_FAMILIES = {
    "mobilenet_v2": "mobilenet", "mobilenet_v3_small": "mobilenet", "mobilenet_v3_large": "mobilenet",
    "efficientnet_b0": "efficientnet", "resnet18": "resnet", "resnet34": "resnet", "resnet50": "resnet",
    "vgg11_bn": "vgg", "vgg16_bn": "vgg",
}
assert tuple(TORCHVISION_FAMILIES) == TORCHVISION_NAMES, "edgeflux/models/spec.py lists the same names"


class RepeatChannels(nn.Module):
    """A gray image as the RGB one an ImageNet stem expects: the channel repeated, no parameters."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a view, not a copy; no branch on the shape, so torch.fx traces it (MobileTL's int8 bottom)
        return x.expand(-1, self.channels, -1, -1)


def build_torchvision(name: str, num_classes: int, in_channels: int, image_size: int,
                      weights: str | Path | None = None) -> UnitModel:
    """torchvision's ``name`` for ``num_classes`` as units; ``weights``: a state_dict file loaded strictly."""
    if name not in TORCHVISION_FAMILIES:
        raise ValueError(f"unknown torchvision model {name!r}; choose one of: {', '.join(TORCHVISION_FAMILIES)}")
    if in_channels not in (1, 3):
        raise ValueError(f"{name} takes RGB images: data with {in_channels} channels cannot feed it; "
                         f"set data.channels: 3")
    tv = getattr(tvm, name)(weights=None, num_classes=num_classes)
    if weights is not None:
        load_strict(tv, name, weights)
    units = _UNITS[TORCHVISION_FAMILIES[name]](tv)
    if in_channels == 1:
        stem_name, kind, stem = units[0]   # every family's stem is an nn.Sequential
        units[0] = (stem_name, kind, nn.Sequential(RepeatChannels(3), *stem.children()))
        log.info("%s: 1-channel images are repeated to the 3 channels its stem takes", name)
    return UnitModel(name, units, num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                     width=1.0)


def _mobilenet(tv: nn.Module) -> list[tuple[str, str, nn.Module]]:
    f = tv.features
    pool = tv.avgpool if hasattr(tv, "avgpool") else nn.AdaptiveAvgPool2d(1)   # V2 pools in its forward
    return [("stem", "conv", f[0]), *((f"irb{i}", "inverted_residual", f[i]) for i in range(1, len(f) - 1)),
            ("last_conv", "conv", f[-1]), ("classifier", "classifier", nn.Sequential(pool, nn.Flatten(1), tv.classifier))]


def _efficientnet(tv: nn.Module) -> list[tuple[str, str, nn.Module]]:
    f = tv.features
    blocks = [b for stage in f[1:-1] for b in stage]
    return [("stem", "conv", f[0]), *((f"mbconv{i}", "inverted_residual", b) for i, b in enumerate(blocks, 1)),
            ("last_conv", "conv", f[-1]),
            ("classifier", "classifier", nn.Sequential(tv.avgpool, nn.Flatten(1), tv.classifier))]


def _resnet(tv: nn.Module) -> list[tuple[str, str, nn.Module]]:
    stem = nn.Sequential(tv.conv1, tv.bn1, tv.relu, tv.maxpool)
    blocks = [(f"block{s}.{b}", "residual", block) for s in range(1, 5) for b, block in enumerate(getattr(tv, f"layer{s}"))]
    return [("stem", "conv", stem), *blocks,
            ("classifier", "classifier", nn.Sequential(tv.avgpool, nn.Flatten(1), tv.fc))]


def _vgg(tv: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """One unit per conv: conv, BN, ReLU and the max-pool after them (as the zoo's VGG cuts it)."""
    groups: list[list[nn.Module]] = []
    for m in tv.features:
        if isinstance(m, nn.Conv2d):
            groups.append([])
        groups[-1].append(m)
    units = [(f"conv{i}", "conv", nn.Sequential(*g)) for i, g in enumerate(groups, 1)]
    return [*units, ("classifier", "classifier", nn.Sequential(tv.avgpool, nn.Flatten(1), tv.classifier))]


_UNITS = {"mobilenet": _mobilenet, "efficientnet": _efficientnet, "resnet": _resnet, "vgg": _vgg}


def _head_keys(tv: nn.Module) -> set[str]:
    """The tensors of the last Linear: the ImageNet classifier a file holds, re-made for the data's classes."""
    last = [n for n, m in tv.named_modules() if isinstance(m, nn.Linear)][-1]
    return {f"{last}.weight", f"{last}.bias"}


def load_strict(tv: nn.Module, name: str, path: str | Path) -> list[str]:
    """Copy every tensor of the file into ``tv``: names and shapes must all match, except the classifier's
    last Linear when the data has another number of classes (kept as built). Returns the tensors kept."""
    path = Path(path)
    state = read_state_dict(path, name)
    ours = tv.state_dict()
    head = _head_keys(tv)
    missing = sorted(set(ours) - set(state))
    unexpected = sorted(set(state) - set(ours))
    wrong = sorted(k for k in set(ours) & set(state) if ours[k].shape != state[k].shape and k not in head)
    if missing or unexpected or wrong:
        first = (f"{len(missing)} of its tensors missing (e.g. {missing[0]})" if missing else
                 f"{len(unexpected)} tensors it does not have (e.g. {unexpected[0]})" if unexpected else
                 f"{len(wrong)} shapes differ (e.g. {wrong[0]}: file {tuple(state[wrong[0]].shape)}, "
                 f"{name} {tuple(ours[wrong[0]].shape)})")
        raise WeightsError(f"{path} is not a {name} state_dict: {first}; make it with "
                           f"{HOW_TO_SAVE.format(name=name, file=path.name)}")
    replaced = sorted(k for k in head if ours[k].shape != state[k].shape)
    tv.load_state_dict({k: v for k, v in state.items() if k not in replaced}, strict=False)
    log.info("%s: %d tensors loaded from %s%s", name, len(state) - len(replaced), path,
             f"; re-made for the data's classes: {', '.join(replaced)}" if replaced else "")
    return replaced
