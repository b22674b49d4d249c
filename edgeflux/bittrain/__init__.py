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
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "bitmap": ["BitmapTensor", "FloatTensorRequired", "compress", "pack_mask", "theoretical_bytes", "unpack_mask"],
    "hooks": ["CompressedActivations", "SavedTensorModifiedError", "UnitStats", "compressed_activations"],
    "options": ["BitTrainOptions"],
})
