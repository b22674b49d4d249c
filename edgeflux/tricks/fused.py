"""The optimizer step in backward (PyTorch's tutorial "How to save memory by fusing the optimizer step into
the backward pass"): each parameter is updated by the run's own optimizer as soon as its gradient is complete
(``Tensor.register_post_accumulate_grad_hook``), and its gradient is freed, so no full set of gradients is held.

One optimizer keeps every parameter's state, learning rate and schedule (checkpoints and the LR scheduler see
the optimizer a plain step uses); the hook runs its ``step()`` with ``param_groups`` narrowed to the one
parameter, so each update is the optimizer's own arithmetic on one tensor, in torch's fused kernel (equal to
the full step's for-loop update to float rounding).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


FUSED = True


@contextmanager
def step_in_backward(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, a backward pass steps ``optimizer`` on each of its parameters as its gradient completes."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}

    def update(p: Tensor) -> None:
        groups = optimizer.param_groups
        # torch's fused kernel (SGD, Adam): one pass, no temporaries of the parameter's size beside the live
        # activations (the for-loop update makes up to three: weight decay, Adam's denominator)
        optimizer.param_groups = [{**group_of[id(p)], "params": [p], "fused": FUSED, "foreach": False}]
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = groups
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(update)
               for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
