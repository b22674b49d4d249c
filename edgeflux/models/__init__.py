"""Model zoo: CIFAR-style CNNs (32x32 inputs) exposed as ordered lists of units.

    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, width=0.25)
    model.describe()            # per-unit names, kinds, shapes, parameter counts
    model.forward_until(x, 5)   # activation after units[0:5]
    model.head(5)               # units[5:] as an nn.Sequential sharing the modules
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "spec": ["MODEL_NAMES", "ModelSpec"],
    "zoo": ["BUILDERS", "build_model"],
    "units": ["UNIT_KINDS", "UnitInfo", "UnitModel", "count_params", "eval_mode"],
    "vgg": ["VGG_CFGS", "scale_channels"],
    "weights": ["WeightsError", "WeightsFileNotFoundError", "load_torchvision_weights", "read_state_dict"],
    "torchvision_arch": ["build_torchvision", "load_strict"],
})
