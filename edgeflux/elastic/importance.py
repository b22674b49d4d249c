"""Tensor importance (the paper's Section 4, Eq. 2, 5 and 6): how much a tensor's next update reduces the loss,
to first order,

    I[k] = - sum_i dL/dw_i * dw_i        over tensor k's weights,

where dL/dw is the loss gradient on a probe batch and dw the update the optimizer makes from that gradient
(with its own state and learning rate, as training would take it). Positive: the update lowers the loss. The
first-order terms add up over weights (Eq. 6), so importances of tensors compare and sum, which the selector
needs. Every tensor takes part, trained or not at the moment: a tensor left out now can come back. One forward
and backward pass on the probe gives both the gradient and, through one optimizer step, the update.

Under Adam a tensor with no optimizer state yet (never selected) moves by lr * sign(g) in every weight, so its
I is lr * |g|_1: a sum over its weights that ranks big tensors first whatever their gradients (SGD's update is
lr * g, whose I = lr * |g|^2 weighs each weight by its own gradient). That is still the loss one Adam step of
the tensor removes, to first order. ``per_weight`` divides each I[k] by tensor k's element count, the mean gain
of one of its weights, so that size alone does not rank; the selector then favours many small tensors, whose
summed gain is small. bench.elastic measures both under Adam.

The model, its statistics and the optimizer's state are restored afterwards: the probe only looks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.elastic.snapshot import Snapshot
from edgeflux.step import Step

__all__ = ["scaled", "tensor_importance", "update_gains"]


def tensor_importance(step: Step, names: Sequence[str], x: Tensor, y: Tensor, per_weight: bool = False) -> list[float]:
    """I[k] for the tensors ``names`` (module docstring) on the probe batch (x, y), with the step's optimizer
    and context; per_weight: each divided by the tensor's element count. The model is left as it was."""
    model: nn.Module = step.model
    by_name = dict(model.named_parameters())
    params = [by_name[n] for n in names]
    with Snapshot(model, step.optimizer) as flags:
        flags.train_only(params, {id(p) for p in params})
        step.optimizer.zero_grad(set_to_none=True)
        with step.context(model):
            getattr(step, "loss_fn", F.cross_entropy)(model(x), y).backward()
        out = update_gains(step.optimizer, params)
    return scaled(out, params, per_weight)


def scaled(gains: Sequence[float], params: Sequence[Tensor], per_weight: bool) -> list[float]:
    """The importances as the selector takes them: each over its tensor's element count with ``per_weight``."""
    return [i / p.numel() for i, p in zip(gains, params)] if per_weight else list(gains)


def update_gains(optimizer, params: Sequence[Tensor]) -> list[float]:
    """I[k] = -sum(g * dw) of each of ``params`` from the gradients they hold: takes the optimizer's step to see
    its update (the caller restores the weights and the optimizer's state)."""
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    before = [p.detach().clone() for p in params]
    optimizer.step()
    return [0.0 if g is None else -float((g * (p.detach() - b)).sum()) for g, p, b in zip(grads, params, before)]
