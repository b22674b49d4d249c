"""BitTrain's options: the ``bittrain:`` section of every trainer in params.yaml, and a step context."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

from pydantic import Field

from edgeflux.options import Options

STORE_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")   # bitmap.STORE_DTYPES: their torch dtypes


class BitTrainOptions(Options):
    """Store saved activations as sparse bitmaps. ``context`` is an edgeflux StepContext: pass it to any trainer."""

    enabled: bool = False
    threshold: float = Field(0.0, ge=0)   # 0: exact (bit-identical gradients); > 0 prunes |x| < threshold
    min_bytes: int = Field(4096, ge=0)    # smaller saved tensors stay dense
    store_dtype: Literal[STORE_DTYPE_NAMES] | None = None   # non-zero values' dtype
    double_mask: bool = False             # BatchNorm/activation mask propagation (edgeflux.bittrain.doublemask)
    narrow_indices: bool = True           # int64 max-pool indices held as int16/int32 when they fit (exact)
    activation_masks: bool = True         # in-place ReLU6/Hardtanh input copies read from the output (exact)

    @property
    def exact(self) -> bool:
        """True when gradients are bit-identical to plain training (no pruning, no fp16, no approximate rule)."""
        return not self.enabled or (self.threshold == 0 and self.store_dtype is None and not self.double_mask)

    def context(self, units: Any = None) -> AbstractContextManager:
        """A compressed_activations context for these options, or nullcontext() when disabled.

        units: the model (or (name, module) pairs), for per-unit accounting.
        """
        if not self.enabled:
            return nullcontext()
        from .hooks import compressed_activations   # torch: only when training, not when checking params

        return compressed_activations(threshold=self.threshold, min_bytes=self.min_bytes,
                                      store_dtype=self.store_dtype, double_mask=self.double_mask, units=units,
                                      narrow_indices=self.narrow_indices, activation_masks=self.activation_masks)

    def to_dict(self) -> dict:
        return self.model_dump()
