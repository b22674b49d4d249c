"""Lean layers: a layer saves for backward only what its input's gradient needs.

PyTorch's convolution saves its input whatever ``weight.requires_grad`` says, and an eval-mode BatchNorm
saves its input too; only the weight's gradient reads it. ReLU6 saves its float input where the gradient needs
one bit per element (is the input inside (0, 6)). Every fine-tuning method that passes gradients through frozen
layers (FT-Bias, FT-BN, ElasticTrainer's unselected tensors between selected ones) holds those tensors for
nothing: TinyTL's bias-only training is cheap in memory only when nothing else is kept. ``lean_layers(model)``
turns every ``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.ReLU`` and ``nn.ReLU6`` of a model into a subclass that saves:

* convolution, while its weight is frozen: the weight (a parameter, held anyway); the input's gradient is a
  transposed convolution of the output's gradient (``torch.nn.grad.conv2d_input``, the kernel autograd calls),
  the bias's the output gradient's sum;
* eval-mode BatchNorm, while its weight is frozen: a per-channel scale; it is the affine map
  ``x * scale + shift`` with ``scale`` a constant (frozen weight over the running deviation) and ``shift``
  carrying the trainable bias;
* ReLU and ReLU6: a bit-packed mask of where the gradient passes (edgeflux.bittrain.pack_mask), the exact
  derivative (torch's passes gradient where lower < x < upper, and so does the mask). Where the next layer
  trains, it saves the activation itself anyway; the mask is 1/32 of it.

The choice is made per call, so a layer whose weight a method unfreezes at run time (ElasticTrainer) saves its
input again; without gradients (inference, export) the layers run torch's own forward. State dict keys, the
modules' identity and their outputs are unchanged (the BatchNorm's to float rounding: see the tests).
Linear layers need nothing: autograd already saves only the weight when the weight is frozen.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.bittrain.bitmap import pack_mask, unpack_mask


class _FrozenConv2d(torch.autograd.Function):
    """conv2d whose weight takes no gradient: saves the weight only, not the input."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.conf = (x.shape, stride, padding, dilation, groups, bias is not None)
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        shape, stride, padding, dilation, groups, has_bias = ctx.conf
        grad_x = (torch.nn.grad.conv2d_input(shape, weight, grad, stride, padding, dilation, groups)
                  if ctx.needs_input_grad[0] else None)
        grad_bias = grad.sum((0, 2, 3)) if has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None, None, None, None


def _needs_lean(x: Tensor, weight: Tensor | None) -> bool:
    return torch.is_grad_enabled() and x.requires_grad and (weight is None or not weight.requires_grad)


class LeanConv2d(nn.Conv2d):
    """nn.Conv2d that saves no input while its weight is frozen (see the module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_lean(x, self.weight) or self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super().forward(x)
        return _FrozenConv2d.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class LeanBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d that, in eval mode with its weight frozen, is an affine map saving no input."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training or self.running_var is None or not _needs_lean(x, self.weight):
            return super().forward(x)
        with torch.no_grad():
            scale = torch.rsqrt(self.running_var + self.eps)
            if self.weight is not None:
                scale = scale * self.weight
            shift = -self.running_mean * scale
        shift = shift + self.bias if self.bias is not None else shift   # the bias's gradient flows from here
        return torch.addcmul(shift.view(1, -1, 1, 1), x, scale.view(1, -1, 1, 1))


class _MaskedClamp(torch.autograd.Function):
    """clamp(x, lower, upper) (in place when asked) saving one bit per element: lower < x < upper."""

    @staticmethod
    def forward(ctx, x: Tensor, lower: float, upper: float | None, inplace: bool) -> Tensor:
        inside = x > lower
        if upper is not None:
            inside.logical_and_(x < upper)
        ctx.save_for_backward(pack_mask(inside))
        del inside
        ctx.shape = x.shape
        if inplace:
            ctx.mark_dirty(x)
            return x.clamp_(lower, upper)
        return x.clamp(lower, upper)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (bits,) = ctx.saved_tensors
        return grad.contiguous().masked_fill(unpack_mask(bits, ctx.shape).logical_not_(), 0), None, None, None


class LeanReLU(nn.ReLU):
    """nn.ReLU saving a 1-bit mask for backward instead of its output."""

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        return _MaskedClamp.apply(x, 0.0, None, self.inplace)


class LeanReLU6(nn.ReLU6):
    """nn.ReLU6 saving a 1-bit mask for backward instead of its input."""

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        return _MaskedClamp.apply(x, 0.0, 6.0, self.inplace)


LEAN = {nn.Conv2d: LeanConv2d, nn.BatchNorm2d: LeanBatchNorm2d, nn.ReLU: LeanReLU, nn.ReLU6: LeanReLU6}


ACTIVATIONS = (nn.ReLU, nn.ReLU6)


def lean_layers(model: nn.Module, frozen: bool = True) -> int:
    """Make every plain Conv2d, BatchNorm2d, ReLU and ReLU6 of ``model`` lean, in place (their class changes;
    parameters, buffers and hooks stay); returns how many. Subclasses (e.g. MobileTL's shift-only BatchNorm)
    are left as they are: they choose what they save themselves. frozen=False: the activations only, whose
    backward is the same whatever trains (ElasticTrainer times each tensor's backward in one fixed graph)."""
    changed = 0
    for module in model.modules():
        if (lean := LEAN.get(type(module))) is not None and (frozen or type(module) in ACTIVATIONS):
            module.__class__ = lean
            changed += 1
    return changed


def plain_layers(model: nn.Module) -> nn.Module:
    """Undo lean_layers in place (e.g. before handing a model to an exporter that traces its forward)."""
    plain = {v: k for k, v in LEAN.items()}
    for module in model.modules():
        if (cls := plain.get(type(module))) is not None:
            module.__class__ = cls
    return model
