"""What the prepare stage reads (params.yaml's ``data`` section): torch-free, so params are checked
without torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeflux.options import Options

DATASETS = ("fashion-mnist", "mnist", "mnist-subset", "cifar10", "cifar100", "imagefolder")
NORMALIZATIONS = ("dataset", "imagenet")


class DataParams(Options):
    dataset: Literal[DATASETS] = "fashion-mnist"
    root: str | None = None
    download: bool = False
    image_size: int = Field(32, ge=8, le=512)
    channels: Literal[1, 3] | None = None
    val_fraction: float = Field(0.1, gt=0, lt=1)
    split_by: Literal["data", "classes", "none"] = "data"
    source_fraction: float = Field(0.5, gt=0, lt=1)
    source_classes: list[int] | None = None
    seed: int = 0
    test_fraction: float = Field(0.2, gt=0, lt=1)   # imagefolder without train/ and test/: the test split carved
    # dataset: mean/std of the train split; imagenet: torchvision's ImageNet statistics, which models trained from
    # ImageNet weights expect
    normalize: Literal[NORMALIZATIONS] = "dataset"
