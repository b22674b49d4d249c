"""The IRB transform (the paper's Figure 2) and where the top k blocks of a model start.

In each of the top ``blocks`` inverted-residual units (nearest the output):

* every BatchNorm but the last (after the expansion and the depthwise convolution) becomes a
  ``ShiftOnlyBatchNorm``: scale and statistics frozen, shift trained, nothing saved;
* the last BatchNorm (after the projection) is left as it is: scale, shift and statistics train;
* every ReLU6 / Hard-Swish / ReLU of the block's conv-norm-activation layers becomes a
  ``SignBackward`` (forward unchanged, backward from a 1-bit mask);
* squeeze-and-excitation is kept as it is (its tensors are per-channel vectors), convolutions train.

Parameter and buffer names are unchanged, so the fine-tuned weights load into the plain model.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchvision.ops import SqueezeExcitation

from edgeflux.errors import UserError
from edgeflux.models import UnitModel

from .ops import ACTIVATIONS, shift_only, sign_backward

__all__ = ["BlocksError", "count_irbs", "replace_module", "top_start", "transform_block"]


class BlocksError(ValueError, UserError):
    """A `blocks` value or a model that the top-k fine-tuning methods cannot use."""


def _irb_indices(model: UnitModel) -> list[int]:
    return [i for i, kind in enumerate(model.unit_kinds) if kind == "inverted_residual"]


def count_irbs(model: UnitModel) -> int:
    return len(_irb_indices(model))


def top_start(model: UnitModel, blocks: int, key: str = "finetune.blocks", irb_only: bool = False) -> int:
    """The index of the first unit that trains when the top ``blocks`` blocks do (plus what follows them:
    the last 1x1 conv, the "feature fusion" layer, and the classifier, which train in every setting).

    Blocks are the model's inverted-residual units (MobileNets) or, with ``irb_only`` False, any unit
    below the last conv and the classifier (VGG, ResNet)."""
    irbs = _irb_indices(model)
    if irb_only and not irbs:
        raise BlocksError(f"{key.rsplit('.', 1)[0]}.method mobiletl needs a model built of inverted-residual blocks; "
                          f"{model.name} has none: use mobilenet_v2, mobilenet_v3_small or mobilenet_v3_large, "
                          f"or method ft_blocks")
    candidates = irbs or [i for i, kind in enumerate(model.unit_kinds) if kind in ("conv", "residual")][:-1]
    if not isinstance(blocks, int) or not 1 <= blocks <= len(candidates):
        raise BlocksError(f"{key} = {blocks!r}: {model.name} has {len(candidates)} "
                          f"{'inverted-residual ' if irbs else ''}blocks; allowed: 1..{len(candidates)}")
    return candidates[-blocks]


def replace_module(root: nn.Module, path: str, make: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Put ``make(old)`` where ``root``'s submodule ``path`` (a dotted name) is; returns the new module."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    new = make(getattr(parent, name))
    setattr(parent, name, new)
    return new


def transform_block(block: nn.Module) -> dict:
    """Apply the MobileTL transform to one inverted-residual block in place; returns what changed."""
    in_se = {f"{n}." for n, m in block.named_modules() if isinstance(m, SqueezeExcitation)}

    def outside_se(path: str) -> bool:
        return not any(path.startswith(p) for p in in_se)

    modules = [(n, m) for n, m in block.named_modules() if n and outside_se(n)]
    norms = [n for n, m in modules if isinstance(m, nn.BatchNorm2d)]
    acts = [n for n, m in modules if type(m) in ACTIVATIONS]
    if len(norms) < 2:
        raise BlocksError(f"expected an inverted-residual block with at least two BatchNorms, found {len(norms)}")
    for path in norms[:-1]:
        replace_module(block, path, shift_only)
    for path in acts:
        replace_module(block, path, sign_backward)
    return {"shift_only_norms": norms[:-1], "trained_norm": norms[-1], "sign_backward": acts}
