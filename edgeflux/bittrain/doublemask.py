"""double_mask: propagating an activation's mask to what BatchNorm and the activation save.

The paper (Section 3.1) applies Liu et al.'s double-mask BatchNorm so that the sparsity of a
ReLU reaches the BatchNorm activations, which are otherwise dense. Here that idea is applied to
*storage only* (the forward computation is never changed) and split by what the math allows.

Setting: y = BN(x) (per channel c: y = a_c * x + b_c), r = act(y) with act = ReLU or an in-place
ReLU6/Hardtanh(lo, hi). Let P = {lo < r < hi} (for ReLU: r > 0), the positions where act passes
the gradient; outside P, dL/dy = 0 when act is y's only consumer.

1. Exact, always: an *in-place* ReLU6/Hardtanh makes autograd save a clone of its input (the
   pre-activation y; torch saves ``original_self`` for hardtanh_'s backward), which is read only
   as ``lo < y < hi`` by hardtanh_backward. Its output r = clamp(y, lo, hi) has exactly that mask
   (r equals y strictly inside (lo, hi) and a bound outside; NaN is inside neither), and r is saved
   anyway by the next operation (the following conv): so when storage is lossless the copy is
   dropped and backward gets r, restored once for both readers; nothing is stored for the copy.
   Pruning or fp16 storage could move a stored r onto a bound (|r| < threshold becomes 0, 5.9999
   rounds to 6.0), and an r kept as is could be changed in place later: in those cases the copy is
   stored as a 1-bit mask of P instead and restored as (lo+hi)/2 inside P and lo outside, which
   gives hardtanh_backward the same mask. Bit-identical gradients either way. Recognised when,
   inside an in-place nn.Hardtanh/nn.ReLU6 module, a clone of the module's input is saved, and
   confirmed after the module returns (its output's grad_fn is HardtanhBackward0 on that input);
   otherwise the clone is stored normally.

2. Exact, BatchNorm in eval mode (running statistics; frozen-BN fine-tuning): BN backward is
   dx = dy * a and d_gamma = sum(dy * x_hat). Outside P, dy = 0, so x is not read there (0 * x_hat
   contributes a zero either way). BN's saved input is stored on P only (no bitmap of its own: P
   comes from the stored activation output r) and restored with zeros outside P. Exact *if* the
   activation is the only consumer of y; this is verified in backward (a pre-hook on BN's grad
   node checks dy == 0 outside P) and a violation raises DoubleMaskError instead of computing a
   wrong gradient.

3. Approximate, BatchNorm in training mode (batch statistics): BN backward
   dx = (gamma * invstd / N) * (N dy - sum(dy) - x_hat * sum(dy * x_hat)) needs x_hat at *every*
   position (the last term), also where dy = 0, so masking x by P is not exact (it is wrong by
   the full x_hat term outside P). What is done instead: x is stored only outside P (where r
   carries no information about y) and reconstructed inside P from r = y by inverting BN's
   per-channel affine map, x = (r - b_c) / a_c, with a_c = gamma_c * invstd_c,
   b_c = beta_c - mean_c * a_c taken from the batch statistics BN saved. The only error is
   floating-point rounding of that inversion (relative error of x ~1e-7, amplified by 1/|a_c|);
   gradients are close, not bit-identical (measured in tests/test_bittrain.py and
   bench/bittrain.py). Channels with |a_c| < 1e-6 are not invertible; if any exists the tensor
   is stored normally. Memory: the BN input drops from 4n bytes to 4|not P| bytes, sharing r's bitmap.

Pairing (2/3): BN's saved input is held until a saved tensor r with r.grad_fn = ReluBackward0 or
HardtanhBackward0 whose input edge is that BN's grad node is saved (relu_/relu/relu6 applied to
the BN output, in place or not); if none is saved before the next BN call (e.g. ResNet's bn2,
whose output goes into the residual add), the input is stored normally at that point.
BN inputs saved by another operation too (already deduplicated) are left to plain compression.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .masked import BNInput, DoubleMaskError, MaskOnly
from .packed import UnitStats

if TYPE_CHECKING:
    from .hooks import CompressedActivations

log = logging.getLogger(__name__)

__all__ = ["DoubleMask", "DoubleMaskError"]

ACTIVATION_NODES = ("ReluBackward0", "HardtanhBackward0")
MAX_PENDING = 4          # BN inputs waiting for their activation (one suffices in every zoo model)


def _bounds(node: Any) -> tuple[float, float]:
    if type(node).__name__ == "ReluBackward0":
        return 0.0, math.inf
    return float(node._saved_min_val), float(node._saved_max_val)


def _bounds_exact_in(dtype: torch.dtype, *bounds: float) -> bool:
    """Every bound is a value of dtype. Hardtanh's backward compares the saved value, in float, with
    the Python bound; the masks here compare in the tensor's dtype, with the bound rounded to it
    (bfloat16(0.1) > 0.1). Where a bound is not exact in the dtype the two can disagree: those
    tensors are stored normally (ReLU and ReLU6 bounds, 0 and 6, are exact in every float dtype)."""
    return all(math.isinf(b) or float(torch.tensor(b, dtype=dtype)) == b for b in bounds)


class DoubleMask:
    """Module hooks on the BatchNorm and in-place Hardtanh modules of the units, and the pairing."""

    def __init__(self, ctx: CompressedActivations, modules: list[nn.Module], bn_rules: bool = True) -> None:
        """modules: every module of the model (each once; CompressedActivations walks the model once
        per step for both). bn_rules: rules 2 and 3 (BatchNorm inputs) besides rule 1; False: rule 1
        alone (exact)."""
        self.ctx = ctx
        self.in_call = False     # a hooked module's forward is running: pack() may claim a saved tensor
        self.bns = [s for s in modules if isinstance(s, nn.modules.batchnorm._BatchNorm)] if bn_rules else []
        self.acts = [s for s in modules if isinstance(s, nn.Hardtanh) and s.inplace]
        self._handles: list[Any] = []
        self._bn_call: tuple[nn.Module, Tensor] | None = None
        self._bn_holder: BNInput | None = None
        self._pending: deque[BNInput] = deque()
        self._act_call: tuple[nn.Module, Any, Tensor] | None = None
        self._act_holder: MaskOnly | None = None

    def __enter__(self) -> DoubleMask:
        for bn in self.bns:
            self._handles.append(bn.register_forward_pre_hook(self._bn_pre))
            self._handles.append(bn.register_forward_hook(self._bn_post, always_call=True))
        for act in self.acts:
            self._handles.append(act.register_forward_pre_hook(self._act_pre))
            self._handles.append(act.register_forward_hook(self._act_post, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with torch.no_grad():
            while self._pending:
                self._pending.popleft().fallback()
            if self._act_holder is not None and self._act_holder.pending is not None:
                self._act_holder.reject()
            self.ctx.resolve_awaiting(None)
        self._bn_call = self._bn_holder = self._act_call = self._act_holder = None
        self.in_call = False

    # -- module hooks
    def _bn_pre(self, module: nn.Module, inputs: tuple) -> None:
        # In every zoo model a BN's activation output is saved before the next BN runs: older
        # pending inputs will not be paired, store them now rather than holding them dense.
        with torch.no_grad():
            while self._pending:
                self._pending.popleft().fallback()
        self._bn_call = (module, inputs[0]) if inputs and isinstance(inputs[0], Tensor) else None
        self._bn_holder = None
        self.in_call = self._bn_call is not None or self._act_call is not None

    def _bn_post(self, module: nn.Module, _inputs: tuple, output: Any) -> None:
        holder, self._bn_holder, self._bn_call = self._bn_holder, None, None
        self.in_call = self._act_call is not None
        if holder is None:
            return
        node = output.grad_fn if isinstance(output, Tensor) else None
        with torch.no_grad():
            if node is None:
                holder.fallback()
                return
            holder.node = node
            self._pending.append(holder)
            while len(self._pending) > MAX_PENDING:
                self._pending.popleft().fallback()

    def _act_pre(self, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        self._act_call = (module, x.grad_fn, x) if x is not None and x.grad_fn is not None else None
        self._act_holder = None
        self.in_call = self._bn_call is not None or self._act_call is not None

    def _act_post(self, module: nn.Module, _inputs: tuple, output: Any) -> None:
        call, holder = self._act_call, self._act_holder
        self._act_call = self._act_holder = None
        self.in_call = self._bn_call is not None
        if holder is None or holder.pending is None:
            return
        node = output.grad_fn if isinstance(output, Tensor) else None
        confirmed = (call is not None and type(node).__name__ == "HardtanhBackward0"
                     and node.next_functions[0][0] is call[1])
        with torch.no_grad():
            holder.confirm(output) if confirmed else holder.reject()

    @property
    def waiting(self) -> bool:
        """BatchNorm inputs wait for their activation's output (stored() may pair one)."""
        return bool(self._pending)

    # -- called from CompressedActivations._pack
    def pack(self, t: Tensor, stats: UnitStats) -> Any:
        """A special holder for t (BN input / Hardtanh input copy), or None for normal storage."""
        if self._bn_call is not None and self._bn_holder is None and t is self._bn_call[1]:
            self._bn_holder = BNInput(self.ctx, t, stats, self._bn_call[0])
            return self._bn_holder
        call = self._act_call
        if (call is not None and self._act_holder is None and t.grad_fn is not None
                and type(t.grad_fn).__name__ == "CloneBackward0"
                and t.grad_fn.next_functions[0][0] is call[1] and t.shape == call[2].shape):
            module = call[0]
            lo, hi = float(module.min_val), float(module.max_val)
            if not _bounds_exact_in(t.dtype, lo, hi):
                return None
            self._act_holder = MaskOnly(self.ctx, t, stats, lo, hi)
            return self._act_holder
        return None

    def stored(self, t: Tensor, holder: Any) -> None:
        """t was stored normally: if it is act(BN output) for a pending BN input, finalize that."""
        if not self._pending or t.grad_fn is None or type(t.grad_fn).__name__ not in ACTIVATION_NODES:
            return
        src = t.grad_fn.next_functions[0][0]
        for bn in self._pending:
            if bn.node is src:
                self._pending.remove(bn)
                lo, hi = _bounds(t.grad_fn)
                if _bounds_exact_in(t.dtype, lo, hi):
                    bn.finalize(t, holder, lo, hi)
                else:
                    bn.fallback()
                return
