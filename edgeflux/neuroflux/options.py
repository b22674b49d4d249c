"""NeuroFlux's options of its own (params.yaml: ``neuroflux.aux``, ``neuroflux.cache``).

Kept apart from ``edgeflux.neuroflux.cache`` and free of torch so that the params schema
(``edgeflux.config``) can validate params.yaml without importing torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from edgeflux.options import Bytes, Options

if TYPE_CHECKING:
    import torch

__all__ = ["AUGMENT_REFUSED", "AUX_MODES", "STORAGES", "CacheOptions"]

AUX_MODES = ("adaptive", "classic")   # the auxiliary networks (edgeflux.neuroflux.aux)
STORAGES = ("dense", "float16", "bittrain")
# Why NeuroFlux refuses augment.enabled: every block after the first trains on its cache of the previous block's
# outputs for the un-augmented training images, written once, so augmentation could reach the first block only.
AUGMENT_REFUSED = ("NeuroFlux trains every block after the first on cached activations of the un-augmented training "
                   "images, so augmentation cannot apply to them; set neuroflux.augment.enabled: false")

_FLOAT32_BYTES = 4   # torch.float32.itemsize: the compute dtype when the caller names none


class CacheOptions(Options):
    """How NeuroFlux stores block activations on disk (params.yaml: neuroflux.cache)."""

    storage: Literal[STORAGES] = "dense"   # float16: half the disk, approximate
    threshold: float = Field(0.0, ge=0)   # bittrain: prune |x| < threshold (0: exact)
    # a shard holds as many samples as fit this many bytes in the compute dtype (at least one): what
    # reading a cache keeps in memory is a few shards, so on a device this bounds the input pipeline
    shard_size: Bytes = Field(4 * 2**20, ge=1)
    shard_samples: int | None = Field(None, ge=1)   # samples per shard instead (tests, benchmarks): overrides shard_size

    @model_validator(mode="after")
    def _threshold_needs_bittrain(self) -> CacheOptions:
        # checked here, not when the first cache is written: that happens after the block has trained
        if self.threshold and self.storage != "bittrain":
            raise ValueError(f"threshold {self.threshold:g} prunes bitmap values: it needs storage: bittrain "
                             f"(storage is {self.storage}); set threshold: 0 or storage: bittrain")
        return self

    def samples_per_shard(self, sample_shape: Sequence[int], dtype: torch.dtype | None = None) -> int:
        """Samples a shard holds; ``dtype`` is the samples' dtype (None: float32)."""
        if self.shard_samples is not None:
            return self.shard_samples
        itemsize = _FLOAT32_BYTES if dtype is None else dtype.itemsize
        return max(1, self.shard_size // (math.prod(sample_shape) * itemsize))
