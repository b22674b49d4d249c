"""MobileTL's two memory-saving layers (Chiang et al., AAAI 2023, Section "Efficient Transfer Learning Block").

``ShiftOnlyBatchNorm``: an intermediate BatchNorm of an inverted-residual block with its scale and
statistics frozen and its shift trained (Eq. 1-2). With gamma, mu and sigma constant, the layer is
y = a * x + b per channel (a = gamma / sqrt(var + eps)), so dL/dx = a * dL/dy and dL/dbeta = sum dL/dy:
neither reads x. torch's own batch_norm saves its input for backward whatever requires grad; this
Function saves nothing.

``SignBackward``: ReLU6, Hard-Swish (and ReLU) with the forward unchanged and the backward replaced by
the paper's signed function (Table 2): dL/da_i = dL/da_{i+1} * 1[a_i >= 0]. All backward reads is
where a_i >= 0, kept as a 1-bit mask packed 8 per byte (``edgeflux.bittrain.pack_mask``) and saved
through ``ctx.save_for_backward``, so the saved-tensor hooks (the memory count, BitTrain) see it.

Both keep the module's parameters and buffers under the names of the layer they replace, so a
transformed model's state_dict loads into the plain model and back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.bittrain import pack_mask, unpack_mask

__all__ = ["ACTIVATIONS", "ShiftOnlyBatchNorm", "SignBackward", "shift_only", "sign_backward"]

ACTIVATIONS = {nn.ReLU6: "relu6", nn.Hardswish: "hardswish", nn.ReLU: "relu"}
_FORWARD = {"relu6": F.relu6, "hardswish": F.hardswish, "relu": F.relu}


class _ShiftOnlyBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, weight: Tensor, mean: Tensor, var: Tensor, eps: float) -> Tensor:
        # weight, mean and var are frozen (no gradient flows to them), so a is a constant of the layer:
        # the per-channel scale is kept on ctx (C numbers of the layer, not an activation)
        ctx.scale = weight * torch.rsqrt(var + eps)
        return F.batch_norm(x, mean, var, weight, bias, training=False, eps=eps)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape = (1, -1) + (1,) * (grad.dim() - 2)
        grad_x = grad * ctx.scale.view(shape) if ctx.needs_input_grad[0] else None
        grad_bias = grad.sum(dim=[d for d in range(grad.dim()) if d != 1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None, None, None, None


class ShiftOnlyBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d normalising with its frozen running statistics and frozen scale; only the shift trains.

    It is in that state whatever ``train()``/``eval()`` says: the statistics never move, and nothing is
    saved for backward."""

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d) -> ShiftOnlyBatchNorm:
        if not bn.affine or not bn.track_running_stats:
            raise ValueError("a shift-only BatchNorm needs an affine BatchNorm with running statistics")
        new = cls(bn.num_features, eps=bn.eps, momentum=bn.momentum).to(bn.weight.device, bn.weight.dtype)
        new.load_state_dict(bn.state_dict())
        new.weight.requires_grad_(False)
        new.bias.requires_grad_(bn.bias.requires_grad)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return _ShiftOnlyBN.apply(x, self.bias, self.weight.detach(), self.running_mean, self.running_var, self.eps)


def shift_only(bn: nn.BatchNorm2d) -> ShiftOnlyBatchNorm:
    return ShiftOnlyBatchNorm.from_batchnorm(bn)


class _SignBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kind: str) -> Tensor:
        ctx.shape = x.shape
        ctx.save_for_backward(pack_mask(x >= 0))
        return _FORWARD[kind](x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (bits,) = ctx.saved_tensors
        keep = unpack_mask(bits, ctx.shape)
        return grad.contiguous().masked_fill(keep.logical_not_(), 0), None


class SignBackward(nn.Module):
    """An activation (``kind``: relu6, hardswish or relu) whose backward is 1[x >= 0] from a 1-bit mask."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind not in _FORWARD:
            raise ValueError(f"no sign-backward form for activation {kind!r}; allowed: {', '.join(_FORWARD)}")
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return _FORWARD[self.kind](x)        # inference: no mask to keep
        return _SignBackward.apply(x, self.kind)

    def extra_repr(self) -> str:
        return self.kind


def sign_backward(act: nn.Module) -> SignBackward:
    kind = ACTIVATIONS.get(type(act))
    if kind is None:
        raise ValueError(f"no sign-backward form for {type(act).__name__}; allowed: "
                         f"{', '.join(t.__name__ for t in ACTIVATIONS)}")
    return SignBackward(kind)
