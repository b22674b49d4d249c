"""What every loader returns (RawDataset) and the errors of a dataset that is missing or malformed: below both
edgeflux.data.load and edgeflux.data.imagefolder, which load_raw dispatches to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgeflux.errors import UserError


class DatasetNotFoundError(FileNotFoundError, UserError):
    """A dataset is not on disk in any place looked in (message lists them and the fixes)."""


class DatasetFormatError(ValueError, UserError):
    """A dataset file exists but is not what it should be (truncated, wrong format)."""


@dataclass
class RawDataset:
    """A dataset as found on disk: uint8 [N, C, H, W] images and int64 [N] labels."""

    name: str
    classes: list[str]
    train_images: torch.Tensor = field(repr=False)
    train_labels: torch.Tensor = field(repr=False)
    test_images: torch.Tensor = field(repr=False)
    test_labels: torch.Tensor = field(repr=False)
    sources: list[str]  # files (or, for imagefolder, folders) it was read from
    given_val: int = 0  # the last given_val train images are the dataset's own val split (imagefolder's val/)
    notes: dict = field(default_factory=dict)  # how the loader read it, for the manifest (imagefolder)
