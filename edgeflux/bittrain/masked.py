"""The saved-tensor holders of double_mask's rules (edgeflux.bittrain.doublemask explains the rules and
their math): what each keeps when autograd saves the tensor, and what it restores in backward.

MaskOnly: an in-place Hardtanh's input copy (rule 1). BNInput: a BatchNorm input stored through the
following activation's mask (rules 2 and 3). DoubleMask decides which saved tensor gets which holder.
"""
from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from edgeflux.memory import check_saved_version

from . import kernel
from .bitmap import BitmapTensor, flat_view, pack_mask, unpack_bits
from .packed import Kept, Packed, UnitStats, version_source

if TYPE_CHECKING:
    from .hooks import CompressedActivations

__all__ = ["BNInput", "DoubleMaskError", "MaskOnly"]

MIN_SCALE = 1e-6         # |a_c| below this: BN is not invertible for that channel


class DoubleMaskError(RuntimeError):
    """double_mask's exact eval-mode rule found a BatchNorm output with a consumer besides its activation."""


def _passes(r: Tensor, lo: float, hi: float) -> Tensor:
    """P: where the activation passes the gradient (its output strictly inside (lo, hi))."""
    p = r > lo
    if hi != math.inf:
        p &= r < hi
    return p


def _channel_view(v: Tensor, like: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class MaskOnly:
    """An in-place Hardtanh's saved input copy y, read by its backward only as lo < y < hi (rule 1):
    served from the activation's stored output, or held as a 1-bit mask."""

    __slots__ = ("ctx", "stats", "lo", "hi", "pending", "holder", "output_of", "output", "bitmap", "shape", "stride",
                 "dtype", "__weakref__")

    def __init__(self, ctx: CompressedActivations, t: Tensor, stats: UnitStats, lo: float, hi: float) -> None:
        self.ctx, self.stats, self.lo, self.hi = ctx, stats, lo, hi
        self.pending: Tensor | None = t.detach()      # until the activation module returns
        self.holder: Kept | Packed | None = None    # when not confirmed: stored normally
        self.output_of: tuple[Any, int] | None = None  # (weakref to r, its version) until resolve()
        self.output: Packed | None = None            # the activation output's bitmap (lossless storage)
        self.bitmap: Tensor | None = None             # else the mask
        self.shape, self.dtype = t.shape, t.dtype
        self.stride: tuple[int, ...] = ()

    def confirm(self, r: Tensor) -> None:
        """The module returned r = act(y) in place. Lossless storage: wait for the next save (see
        resolve); otherwise store y's mask now."""
        ctx = self.ctx
        if (ctx.threshold == 0 and ctx.store_dtype is None and r.shape == self.shape and r.dtype == self.dtype
                and ctx.is_activation(r)):
            self.output_of = (weakref.ref(r), r._version)
            ctx.awaiting_output = self
        else:
            self.resolve(None)

    def resolve(self, t: Tensor | None) -> None:
        """t: the next saved tensor. When it is r (the next operation reads the activation's output:
        a conv does, first thing), y is served from r's bitmap; otherwise y is stored as its mask."""
        c, self.pending = self.pending, None
        ctx, s, n = self.ctx, self.stats, c.numel()
        flat, self.stride = flat_view(c)
        if t is not None and self.output_of is not None and self.output_of[0]() is t and self.output_of[1] == t._version:
            holder = ctx.store_shared(t, ctx.unit_stats())   # the save of t that follows gets this holder too
            if isinstance(holder, Packed) and isinstance(holder.data, BitmapTensor):
                self.output = holder             # a copy: later in-place changes to r cannot reach it
        self.output_of = None
        if self.output is None:
            if kernel.usable(flat):
                self.bitmap, _ = kernel.range_mask(flat, self.lo, self.hi)
            else:
                self.bitmap = pack_mask(_passes(flat, self.lo, self.hi))
        # not in numel/nnz/theoretical_bytes: the copy is never a bitmap candidate (and counting its
        # non-zeros would cost one more pass over it)
        s.tensors += 1
        s.mask_only += 1
        s.dense_bytes += n * c.element_size()
        s.stored_bytes += 0 if self.bitmap is None else self.bitmap.numel()

    def reject(self) -> None:
        c, self.pending = self.pending, None
        self.holder = self.ctx.store(c, self.stats)

    def unpack(self) -> Tensor:
        if self.pending is not None:
            return self.pending
        if self.holder is not None:
            return self.holder.unpack()
        if self.output is not None:
            return self.output.restore()         # (no version check: the stored copy is r as it was saved)
        n = math.prod(self.shape)
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.bitmap.device)
        flat = out.as_strided((n,), (1,))
        mid = (self.lo + self.hi) / 2 if self.hi != math.inf else self.lo + 1.0
        if kernel.usable(flat):
            kernel.fill_from_mask(self.bitmap, mid, self.lo, flat)
        else:
            flat.fill_(self.lo)
            flat.masked_fill_(unpack_bits(self.bitmap, n), mid)
        return out


class BNInput:
    """A BatchNorm input stored through the following activation's mask (rules 2 and 3)."""

    __slots__ = ("ctx", "stats", "module", "node", "pending", "version", "source", "holder", "mode", "values",
                 "r_holder", "lo", "hi", "scale", "shift", "shape", "stride", "dtype", "__weakref__")

    def __init__(self, ctx: CompressedActivations, x: Tensor, stats: UnitStats, module: nn.Module) -> None:
        self.ctx, self.stats, self.module = ctx, stats, module
        self.node: Any = None
        self.pending: Tensor | None = x.detach()
        self.version = x._version
        self.source = version_source(x)
        self.holder: Kept | Packed | None = None
        self.mode = ""
        self.values: Tensor | None = None
        self.r_holder: Any = None
        self.lo = self.hi = 0.0
        self.scale: Tensor | None = None
        self.shift: Tensor | None = None
        self.shape, self.stride, self.dtype = x.shape, x.stride(), x.dtype

    def fallback(self) -> None:
        """No activation followed (or its bounds are not exact in x's dtype): store x normally."""
        if self.pending is not None:
            x, self.pending = self.pending, None
            self.holder = self.ctx.store(x, self.stats)
            self.node = None

    def finalize(self, r: Tensor, r_holder: Any, lo: float, hi: float) -> None:
        x = self.pending
        ctx, m = self.ctx, self.module
        lossless = ctx.threshold == 0 and ctx.store_dtype is None
        seen = r.detach() if lossless else r_holder.unpack()     # r as backward will see it
        p = _passes(seen, lo, hi)
        batch_stats = m.training or (m.running_mean is None and m.running_var is None)
        if batch_stats:
            scale, shift = self._affine(x)
            if scale is None or bool((scale.abs() < MIN_SCALE).any()):
                self.fallback()
                return
            keep = ~p
        else:
            scale = shift = None
            keep = p
        values = x[keep]
        if ctx.store_dtype is not None and ctx.store_dtype.itemsize < values.element_size():
            values = values.to(ctx.store_dtype)
        extra = 0 if scale is None else 2 * scale.numel() * scale.element_size()
        size = values.numel() * values.element_size() + extra
        n = x.numel()
        if size >= n * x.element_size():
            self.fallback()
            return
        self.pending = None
        self.mode = "reconstruct" if batch_stats else "exact"
        self.values, self.r_holder, self.lo, self.hi = values, r_holder, lo, hi
        self.scale, self.shift = scale, shift
        s = self.stats
        s.tensors += 1
        s.double_masked += 1
        s.numel += n
        s.dense_bytes += n * x.element_size()
        s.stored_bytes += size
        nnz = int(torch.count_nonzero(x))
        s.nnz += nnz
        vsize = ctx.store_dtype.itemsize if ctx.store_dtype else x.element_size()
        s.theoretical_bytes += vsize * nnz + math.ceil(n / 8)
        if self.mode == "exact" and self.node is not None:
            self.node.register_prehook(self._check_gradient)
        self.node = None

    def _affine(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Per-channel a, b with y = a * x + b, from the batch statistics BN itself saved."""
        m, node = self.module, self.node
        mean = invstd = None
        if type(node).__name__ == "NativeBatchNormBackward0":   # CPU (and CUDA without cuDNN)
            mean, invstd = node._saved_result1, node._saved_result2
        if mean is None or invstd is None or mean.numel() != x.shape[1] or invstd.numel() != x.shape[1]:
            dims = [d for d in range(x.dim()) if d != 1]
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            invstd = torch.rsqrt(var + m.eps)
        a = invstd if m.weight is None else m.weight.detach() * invstd
        b = -mean * a if m.bias is None else m.bias.detach() - mean * a
        return a.to(x.dtype).contiguous(), b.to(x.dtype).contiguous()

    def _check_gradient(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        g = grad_outputs[0]
        if g is None or self.r_holder is None:
            return
        with torch.no_grad():
            outside = ~_passes(self.r_holder.unpack(), self.lo, self.hi)
            if bool((g.ne(0) & outside).any()):
                raise DoubleMaskError(
                    "double_mask: a BatchNorm output (eval mode) receives gradient where its activation blocks it, "
                    "so it has another consumer and its input cannot be masked exactly. Turn double_mask off "
                    "for this model (bittrain.double_mask: false)")

    def unpack(self) -> Tensor:
        src = self.source()
        if src is not None:
            check_saved_version(src, self.version)
        if self.pending is not None:
            return self.pending
        if self.holder is not None:
            return self.holder.unpack()
        with torch.no_grad():
            r = self.r_holder.unpack()
            p = _passes(r, self.lo, self.hi)
            out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=r.device)
            values = self.values.to(self.dtype)
            if self.mode == "exact":
                out.zero_()
                out.masked_scatter_(p, values)
            else:
                torch.div(r - _channel_view(self.shift, r), _channel_view(self.scale, r), out=out)
                out.masked_scatter_(~p, values)
        return out
