"""The compact early-exit model: the shallowest exit that is as good as the best one.

    k = select_exit(val_acc, params, tolerance=0.005)
    compact = ExitModel(learners, k)           # units[0..k] + unit k's auxiliary head, one nn.Module

Every unit trained by local learning has its own classifier (its auxiliary head), so every unit
is a possible exit (paper, Section 5.4). Accuracy saturates part-way through the network
("overthinking"): the exit with the fewest parameters whose *validation* accuracy is within
``tolerance`` of the best is chosen; the test split only reports the result.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from .aux import LocalLearner


def select_exit(val_acc: Sequence[float], params: Sequence[int], tolerance: float = 0.005) -> int:
    """Index of the exit with the fewest parameters among those within ``tolerance`` of the best accuracy."""
    if not val_acc or len(val_acc) != len(params):
        raise ValueError(f"select_exit needs one accuracy and one parameter count per exit "
                         f"(got {len(val_acc)} and {len(params)})")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0 (an accuracy difference, 0.005 = 0.5 points), got {tolerance}")
    best = max(val_acc)
    candidates = [i for i, acc in enumerate(val_acc) if acc >= best - tolerance]
    return min(candidates, key=lambda i: (params[i], i))


class ExitModel(nn.Module):
    """units[0..k] followed by unit k's auxiliary head (or the model's own classifier at the last unit)."""

    def __init__(self, learners: Sequence[LocalLearner], exit_index: int) -> None:
        super().__init__()
        if not 0 <= exit_index < len(learners):
            raise IndexError(f"exit {exit_index} is outside 0..{len(learners) - 1}")
        self.units = nn.ModuleList(learner.unit for learner in learners[:exit_index + 1])
        self.head = learners[exit_index].aux or nn.Identity()
        self.exit_index = exit_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return self.head(x)


@torch.no_grad()
def throughput(model: nn.Module, sample_shape: Sequence[int], batch: int = 64, seconds: float = 2.0,
               device: torch.device | str = "cpu") -> float:
    """Inference images per second at ``batch`` (eval mode; warm-up excluded), measured for ~``seconds``."""
    was_training = model.training
    model.eval()
    x = torch.randn(batch, *sample_shape, device=device)
    model(x)
    images, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or images == 0:
        model(x)
        images += batch
    model.train(was_training)
    return images / elapsed
