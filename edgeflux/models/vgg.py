"""CIFAR-style VGG-11/16/19 as units: conv3x3-BN-ReLU(-MaxPool) units and one Linear classifier.

The configurations are torchvision's (`torchvision.models.vgg.cfgs` "A", "D", "E"); the
classifier is the CIFAR one (a single Linear on the flattened final feature map) instead of
torchvision's 4096-4096 MLP behind a 7x7 adaptive pool.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.vgg import cfgs as _TV_CFGS

from .units import UnitModel

VGG_CFGS: dict[str, list[int | str]] = {"vgg11": _TV_CFGS["A"], "vgg16": _TV_CFGS["D"], "vgg19": _TV_CFGS["E"]}


def scale_channels(channels: int, width: float) -> int:
    """Channel count under a width multiplier: round to nearest, never below 8."""
    return max(8, int(round(channels * width)))


def build_vgg(
    name: str, num_classes: int, in_channels: int, width: float, image_size: int, batch_norm: bool
) -> UnitModel:
    """VGG `name` as units; a MaxPool2d belongs to the conv unit it follows."""
    cfg = VGG_CFGS[name]
    units: list[tuple[str, str, nn.Module]] = []
    c_in, size, i = in_channels, image_size, 0
    while i < len(cfg):
        c_out = scale_channels(int(cfg[i]), width)
        layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1)]
        if batch_norm:
            layers.append(nn.BatchNorm2d(c_out))
        layers.append(nn.ReLU(inplace=True))
        i += 1
        if i < len(cfg) and cfg[i] == "M":
            layers.append(nn.MaxPool2d(2))
            size //= 2
            i += 1
        units.append((f"conv{len(units) + 1}", "conv", nn.Sequential(*layers)))
        c_in = c_out
    if size < 1:
        pools = cfg.count("M")
        raise ValueError(
            f"image_size={image_size} is too small for {name}: its {pools} max-pools need at least "
            f"{2**pools} pixels; resize or pad the images"
        )
    units.append(("classifier", "classifier", nn.Sequential(nn.Flatten(1), nn.Linear(c_in * size * size, num_classes))))
    model = UnitModel(
        name, units, num_classes=num_classes, in_channels=in_channels, image_size=image_size, width=width
    )
    _init_like_torchvision(model)
    return model


def _init_like_torchvision(model: nn.Module) -> None:
    # torchvision's VGG init: without BN (BitTrain's variant) PyTorch's default conv init
    # trains a 16-19 layer plain net much worse than kaiming fan_out.
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
