"""BitTrain: saved activations stored as sparse bitmaps (Hosny, Neseem, Reda, SEC 2021).

    opts = BitTrainOptions(enabled=True)                       # threshold 0: bit-identical gradients
    with opts.context(model) as ca:                            # any trainer's step
        F.cross_entropy(model(x), y).backward()
    ca.summary()["total"]["reduction"]                         # fraction of saved bytes saved

    training_step_fn(model, opt, x, y, context=opts.context)   # as an edgeflux.memory StepContext

Modules: bitmap (the format), hooks (saved-tensor hooks), packed (what the hooks store, accounting),
doublemask (BatchNorm / activation mask propagation: the rules and the pairing), masked (the holders
of its rules). pack_mask/unpack_mask: 1-bit masks
(8 elements per byte), also what MobileTL's sign-backward activations keep. Unit attribution: edgeflux.memory.UnitTracker.
"""
from __future__ import annotations

from .bitmap import BitmapTensor, FloatTensorRequired, compress, pack_mask, theoretical_bytes, unpack_mask
from .hooks import CompressedActivations, SavedTensorModifiedError, UnitStats, compressed_activations
from .options import BitTrainOptions

__all__ = [
    "BitTrainOptions",
    "BitmapTensor",
    "CompressedActivations",
    "FloatTensorRequired",
    "SavedTensorModifiedError",
    "UnitStats",
    "compress",
    "compressed_activations",
    "pack_mask",
    "theoretical_bytes",
    "unpack_mask",
]
