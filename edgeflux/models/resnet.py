"""CIFAR-style ResNet-18 as units: a 3x3 stem, eight torchvision BasicBlocks, a pooled Linear.

Differs from torchvision's ImageNet ResNet-18 only in the stem (3x3 stride 1 instead of
7x7 stride 2 + max pool), so the blocks are torchvision's own `BasicBlock` class.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, conv1x1, conv3x3

from .units import UnitModel
from .vgg import scale_channels

STAGE_CHANNELS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)
BLOCKS_PER_STAGE = 2


def build_resnet18(num_classes: int, in_channels: int, width: float, image_size: int) -> UnitModel:
    """ResNet-18 units: "stem", "block1.0" .. "block4.1" (torchvision's layerS.B), "classifier"."""
    planes = [scale_channels(c, width) for c in STAGE_CHANNELS]
    stem = nn.Sequential(conv3x3(in_channels, planes[0]), nn.BatchNorm2d(planes[0]), nn.ReLU(inplace=True))
    units: list[tuple[str, str, nn.Module]] = [("stem", "conv", stem)]
    inplanes = planes[0]
    for stage, (p, stride) in enumerate(zip(planes, STAGE_STRIDES), start=1):
        for b in range(BLOCKS_PER_STAGE):
            s = stride if b == 0 else 1
            downsample = None
            if s != 1 or inplanes != p:
                downsample = nn.Sequential(conv1x1(inplanes, p, s), nn.BatchNorm2d(p))
            units.append((f"block{stage}.{b}", "residual", BasicBlock(inplanes, p, s, downsample)))
            inplanes = p
    classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(inplanes, num_classes))
    units.append(("classifier", "classifier", classifier))
    model = UnitModel(
        "resnet18", units, num_classes=num_classes, in_channels=in_channels, image_size=image_size, width=width
    )
    # torchvision's ResNet init (the Linear keeps PyTorch's default, as there)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model
