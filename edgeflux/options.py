"""The base of every options class (params.yaml sections and the library's own option sets), memory
sizes with units, and the options every trainer shares. Torch-free: params.yaml is checked without torch.

Validation is pydantic's: strict types, unknown keys rejected, frozen. Memory sizes take units:
``300MB`` (decimal, 10^6), ``1.5GiB`` (binary, 2^30), ``4096B``. A bare number is refused,
because ``300`` could mean bytes or megabytes, and so is a lowercase ``b`` (``24Mb`` is megabits).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_bytes(value: str | int) -> int:
    """'300MB' -> 300_000_000, '1.5GiB' -> 1_610_612_736. Integers and unit-less strings are refused."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(
            f"a memory size needs a unit, e.g. '{value}MB' or '{value}MiB' "
            f"(allowed units: {', '.join(_pretty_units())})"
        )
    match = _BYTES_RE.match(value)
    if not match:
        raise ValueError(
            f"cannot read {value!r} as a memory size; write a number and a unit, e.g. '300MB' or "
            f"'1.5GiB' (allowed units: {', '.join(_pretty_units())})"
        )
    number, unit = match.groups()
    if unit.upper() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; allowed units: {', '.join(_pretty_units())}")
    if unit.endswith("b"):   # b is a bit by convention (24Mb: megabits): never read it as bytes
        fix = f"'{number}{unit[0].upper()}B' or '{number}{unit[0].upper()}iB'" if len(unit) > 1 else f"'{number}B'"
        raise ValueError(f"{value!r}: a lowercase b means bits; write bytes with a capital B, e.g. {fix}")
    size = int(round(float(number) * _UNITS[unit.upper()]))
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def _pretty_units() -> list[str]:
    return [u if len(u) <= 2 else u[0] + "iB" for u in _UNITS]


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class Options(BaseModel):
    """Strict, closed and frozen: an unknown key or a value of the wrong type is an error."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


OPTIMIZER_NAMES = ("sgd", "adam")   # edgeflux.train.OPTIMIZERS builds them
LR_SCALINGS = {"constant": lambda ratio: 1.0, "linear": lambda ratio: ratio, "sqrt": lambda ratio: ratio ** 0.5}


class AugmentOptions(Options):
    """Random augmentation of the training batches (edgeflux.data.feed.augment_pixels); evaluation never is.

    scale: the share of the image's area a random-resized crop keeps, drawn uniformly from [lo, hi]. torchvision's
    ImageNet default is [0.08, 1]; small fine-tuning sets lose too much of each image at that, hence [0.35, 1].
    """

    enabled: bool = False
    scale: list[float] = [0.35, 1.0]
    flip: bool = True   # horizontal flip of half the images

    @field_validator("scale")
    @classmethod
    def _area_range(cls, scale: list[float]) -> list[float]:
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError("scale is [lo, hi] with 0 < lo <= hi <= 1, e.g. [0.35, 1.0]")
        return scale


class TrainOptions(Options):
    """Options every trainer shares, so that stages read the same names."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(0.05, gt=0)
    # lr is for a batch of lr_reference_batch; a trainer at another batch (NeuroFlux's blocks each have their
    # own) scales it (linear: Goyal et al.'s rule; sqrt: milder; constant: as is)
    lr_scaling: Literal[tuple(LR_SCALINGS)] = "constant"
    lr_reference_batch: int = Field(32, ge=1)
    optimizer: Literal[OPTIMIZER_NAMES] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    max_train_samples: int | None = Field(None, ge=1)
    evals_per_epoch: int = Field(2, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    augment: AugmentOptions = AugmentOptions()   # of the training batches only; off by default

    def lr_for(self, batch: int) -> float:
        """The learning rate of a run at `batch` (lr_scaling from lr_reference_batch)."""
        return self.lr * LR_SCALINGS[self.lr_scaling](batch / self.lr_reference_batch)
