"""Which model a stage trains (params.yaml's ``model`` keys): torch-free, so params are checked without torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeflux.options import Options

# the zoo's models (edgeflux/models/zoo.py builds each; it checks that the two lists agree)
MODEL_NAMES = ("vgg11", "vgg16", "vgg19", "resnet18", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")


class ModelSpec(Options):
    """Which model of the zoo, how wide, and optional torchvision weights on disk."""

    name: Literal[MODEL_NAMES]
    width: float = Field(1.0, gt=0, le=4)
    batch_norm: bool = True
    pretrained_path: str | None = None

    @property
    def key(self) -> str:
        """A file-name-safe id, e.g. 'mobilenet_v2-w0.5'."""
        return f"{self.name}-w{self.width:g}" + ("" if self.batch_norm else "-nobn")

    def build_args(self, num_classes: int, in_channels: int, image_size: int, seed: int | None) -> dict:
        """build_model keyword arguments (pretrained_path aside). Saved in model files and hashed into
        run signatures: keys, order and values must stay as they are."""
        return dict(name=self.name, num_classes=num_classes, in_channels=in_channels, width=self.width,
                    image_size=image_size, batch_norm=self.batch_norm, seed=seed)
