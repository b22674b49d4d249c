"""MobileTL: memory- and compute-efficient fine-tuning of inverted-residual models (Chiang et al., AAAI 2023).

    transform_block(model.units[i])        # shift-only intermediate BNs, 1-bit sign-backward activations
    bottom = quantize_bottom(units[:start], calibration_batches)   # frozen, forward-only, int8

The method (``mobiletl``) and its baselines (``ft_all``, ``ft_last``, ``ft_bn``, ``ft_bias``, ``ft_blocks``)
run through one harness, ``edgeflux.finetune``. Modules: ops (the two layers), transform (the IRB rewrite,
which units are the top k), quantize (the int8 bottom).
"""
from __future__ import annotations

from .ops import ShiftOnlyBatchNorm, SignBackward, shift_only, sign_backward
from .quantize import FrozenBottom, quantize_bottom, quantized_engine
from .transform import BlocksError, count_irbs, replace_module, top_start, transform_block

__all__ = ["BlocksError", "FrozenBottom", "ShiftOnlyBatchNorm", "SignBackward", "count_irbs", "quantize_bottom",
           "quantized_engine", "replace_module", "shift_only", "sign_backward", "top_start", "transform_block"]
