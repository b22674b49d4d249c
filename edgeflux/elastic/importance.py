"""Tensor importance (the paper's Section 4, Eq. 2, 5 and 6): how much a tensor's recent update reduced the loss,
to first order,

    I[k] = - sum_i dL/dw_i * dw_i        over tensor k's weights,

where dw is one optimizer update (with the optimizer's own state and learning rate, as training would take it)
on a probe batch and dL/dw the loss gradient on that batch at the updated weights. Positive: the update lowers
the loss. The first-order terms add up over weights (Eq. 6), so importances of tensors compare and sum, which
the selector needs. Every tensor takes part, trained or not at the moment: a tensor left out now can come back.

The model, its statistics and the optimizer's state are restored afterwards: the probe only looks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.elastic.profile import Snapshot
from edgeflux.step import Step

__all__ = ["tensor_importance"]


def tensor_importance(step: Step, names: Sequence[str], x: Tensor, y: Tensor) -> list[float]:
    """I[k] for the tensors ``names`` (module docstring) on the probe batch (x, y), with the step's optimizer
    and context. The model is left as it was."""
    model: nn.Module = step.model
    by_name = dict(model.named_parameters())
    params = [by_name[n] for n in names]
    with Snapshot(model, step.optimizer) as flags:
        flags.train_only(params, {id(p) for p in params})
        before = [p.detach().clone() for p in params]
        step(x, y)                                     # one update of every tensor
        update = [p.detach() - b for p, b in zip(params, before)]
        del before
        with step.context(model):
            loss = getattr(step, "loss_fn", F.cross_entropy)(model(x), y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [0.0 if g is None else -float((g * d).sum()) for g, d in zip(grads, update)]
