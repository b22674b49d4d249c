"""The memory tricks a PyTorch user reaches for first, as edgeflux options that compose with every technique:
gradient accumulation, activation checkpointing, the optimizer step in backward (edgeflux.tricks.options), and
lean layers (edgeflux.tricks.lean: frozen layers and activations save only what the input's gradient
needs), which fine-tuning applies by default."""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "options": ["TRICK_LABELS", "TRICK_NAMES", "TrickOptions"],
    "accumulate": ["Accumulation"],
    "fused": ["step_in_backward"],
    "lean": ["LeanBatchNorm2d", "LeanConv2d", "LeanReLU", "LeanReLU6", "lean_layers", "plain_layers"],
    "recompute": ["NotCheckpointableError", "checkpointed", "segment_bounds"],
})
