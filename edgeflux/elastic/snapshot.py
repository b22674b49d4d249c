"""A context that lets the profiler and the importance probe train the model and leave it as it was."""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["Snapshot"]


class Snapshot:
    """Sets which tensors require gradients; restores the model's own flags, weights, statistics and the
    optimizer's state on exit."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def __enter__(self) -> Snapshot:
        self.flags = {name: p.requires_grad for name, p in self.model.named_parameters()}
        self.state = copy.deepcopy(self.model.state_dict())
        self.opt_state = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return self

    def train_only(self, params: Sequence[Tensor], keep: set[int]) -> None:
        for p in params:
            p.requires_grad_(id(p) in keep)

    def __exit__(self, *exc) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model.load_state_dict(self.state)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.opt_state)
        for name, p in self.model.named_parameters():
            p.requires_grad_(self.flags[name])
