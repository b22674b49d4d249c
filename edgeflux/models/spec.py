"""Which model a stage trains (params.yaml's ``model`` keys): torch-free, so params are checked without torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from edgeflux.options import Options

# the zoo's models (edgeflux/models/zoo.py builds each; it checks that the two lists agree)
MODEL_NAMES = ("vgg11", "vgg16", "vgg19", "resnet18", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")
# torchvision's architectures as they are (edgeflux/models/torchvision_arch.py, which checks the same)
TORCHVISION_NAMES = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "resnet18",
                     "resnet34", "resnet50", "vgg11_bn", "vgg16_bn")
ALL_NAMES = tuple(dict.fromkeys(MODEL_NAMES + TORCHVISION_NAMES))


class ModelSpec(Options):
    """Which model: one of the zoo's (32-px CIFAR-style stems, any width) or, with ``arch: torchvision``,
    torchvision's ImageNet architecture unchanged, optionally with its weights from a state_dict file."""

    arch: Literal["zoo", "torchvision"] = "zoo"
    name: Literal[ALL_NAMES]
    width: float = Field(1.0, gt=0, le=4)
    batch_norm: bool = True
    pretrained_path: str | None = None   # zoo: a torchvision file mapped by structure (edgeflux/models/weights.py)
    weights: str | None = None           # torchvision: a state_dict file loaded strictly (never downloaded)

    @model_validator(mode="after")
    def _fits_the_arch(self) -> ModelSpec:
        names = TORCHVISION_NAMES if self.arch == "torchvision" else MODEL_NAMES
        if self.name not in names:
            raise ValueError(f"{self.name!r} is not a {self.arch} model; {self.arch} models: {', '.join(names)}")
        if self.arch == "torchvision" and (self.width != 1.0 or not self.batch_norm or self.pretrained_path):
            raise ValueError("arch torchvision builds the architecture as torchvision does: width, batch_norm and "
                             "pretrained_path are the zoo's; give its weights with `weights: PATH`")
        if self.arch == "zoo" and self.weights:
            raise ValueError("`weights` loads a torchvision state_dict strictly into arch: torchvision; for the "
                             "zoo's models use pretrained_path")
        return self

    @property
    def key(self) -> str:
        """A file-name-safe id, e.g. 'mobilenet_v2-w0.5' (the zoo) or 'tv-resnet18' (torchvision)."""
        if self.arch == "torchvision":
            return f"tv-{self.name}"
        return f"{self.name}-w{self.width:g}" + ("" if self.batch_norm else "-nobn")

    def build_args(self, num_classes: int, in_channels: int, image_size: int, seed: int | None) -> dict:
        """build_model keyword arguments (the weights file aside: its tensors are in the saved state_dict).
        Saved in model files and hashed into run signatures: a zoo model's keys, order and values must stay
        as they are, so ``arch`` is there only for torchvision's."""
        args = dict(name=self.name, num_classes=num_classes, in_channels=in_channels, width=self.width,
                    image_size=image_size, batch_norm=self.batch_norm, seed=seed)
        return args | ({"arch": "torchvision"} if self.arch == "torchvision" else {})

    def weights_path(self) -> str | None:
        """The file a stage builds the model from: build_model's pretrained_path or weights."""
        return self.weights if self.arch == "torchvision" else self.pretrained_path
