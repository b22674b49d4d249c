"""MobileNetV2 / V3-small / V3-large from torchvision's builders, adapted to 32x32 inputs.

What is changed relative to `torchvision.models.<name>(weights=None, width_mult=w,
num_classes=n)`, and nothing else:

1. Stem: the stride of `features[0][0]` (3x3 conv) goes from 2 to 1. torchvision downsamples
   five times (/32), which takes a 32x32 image to 1x1; with the stem at stride 1 it goes
   /16 and a 32x32 image ends at 2x2 (MobileNetV2: 32 -> 32 -> 16 -> 8 -> 4 -> 2; the same
   for both V3s).
2. When in_channels != 3 that conv is replaced by a new Conv2d(in_channels, same out
   channels, 3x3, stride 1, padding 1, no bias), initialised as torchvision does
   (kaiming normal, fan_out). With in_channels == 3 the torchvision conv object is kept.
3. Optional (`relax_first_downsample=True`, not the default): the first stride-2
   inverted-residual block also gets stride 1 (its depthwise conv), the kuangliu
   pytorch-cifar recipe; a 32x32 image then ends at 4x4. `use_res_connect` is left as
   torchvision built it (False for those blocks), so parameters and structure are unchanged.

The units are the torchvision module objects themselves: features[0] ("stem", kind "conv"),
each InvertedResidual ("irb1".."irbN", numbered as their index in torchvision's `features`),
features[-1] ("last_conv", kind "conv"), and avgpool + flatten + torchvision's `classifier`
Sequential ("classifier"). Parameter count therefore equals torchvision's except for the stem
conv's input channels.
"""

from __future__ import annotations

from torch import nn
from torchvision import models as tvm
from torchvision.models import mobilenetv2, mobilenetv3

from .units import UnitModel

BUILDERS = {
    "mobilenet_v2": tvm.mobilenet_v2,
    "mobilenet_v3_small": tvm.mobilenet_v3_small,
    "mobilenet_v3_large": tvm.mobilenet_v3_large,
}
INVERTED_RESIDUALS = (mobilenetv2.InvertedResidual, mobilenetv3.InvertedResidual)


def build_mobilenet(
    name: str,
    num_classes: int,
    in_channels: int,
    width: float,
    image_size: int,
    relax_first_downsample: bool = False,
) -> UnitModel:
    """torchvision's `name` at width_mult=`width`, adapted to small inputs (see module doc)."""
    tv = BUILDERS[name](weights=None, width_mult=width, num_classes=num_classes)
    features = tv.features
    _adapt_stem(features[0], in_channels)
    if relax_first_downsample:
        _relax_first_downsample(features)

    units: list[tuple[str, str, nn.Module]] = [("stem", "conv", features[0])]
    for i in range(1, len(features) - 1):
        block = features[i]
        if not isinstance(block, INVERTED_RESIDUALS):
            raise TypeError(f"{name}: expected an InvertedResidual at features[{i}], got {type(block).__name__}")
        units.append((f"irb{i}", "inverted_residual", block))
    units.append(("last_conv", "conv", features[-1]))
    # V2 pools functionally in its forward; V3 has an avgpool module: reuse it where it exists
    pool = tv.avgpool if hasattr(tv, "avgpool") else nn.AdaptiveAvgPool2d(1)
    units.append(("classifier", "classifier", nn.Sequential(pool, nn.Flatten(1), tv.classifier)))
    return UnitModel(name, units, num_classes=num_classes, in_channels=in_channels, image_size=image_size, width=width)


def _adapt_stem(stem: nn.Sequential, in_channels: int) -> None:
    conv = stem[0]
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"expected the stem to start with a Conv2d, got {type(conv).__name__}")
    if in_channels == conv.in_channels:
        conv.stride = (1, 1)
        return
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=1,
        padding=conv.padding,
        bias=conv.bias is not None,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    stem[0] = new


def _relax_first_downsample(features: nn.Sequential) -> None:
    for block in features[1:-1]:
        strided = [m for m in block.modules() if isinstance(m, nn.Conv2d) and m.stride == (2, 2)]
        if strided:
            for conv in strided:
                conv.stride = (1, 1)
            if hasattr(block, "stride"):
                block.stride = 1
            block._is_cn = False
            return
