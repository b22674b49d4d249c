"""Activation checkpointing over a model's units (torch.utils.checkpoint, non-reentrant).

Chen et al.'s rule: n units in about sqrt(n) segments; here the segments are balanced by the units' output
sizes (one shape-only forward, ``UnitModel.describe``), since a unit's saved activations grow with its output.
Every segment but the last keeps only its input during forward and recomputes its activations in backward;
the last segment's are needed at once, so it runs as usual (as torch.utils.checkpoint.checkpoint_sequential).

The known trap (pytorch/pytorch#96136): a training-mode BatchNorm inside a recomputed segment updates its
running statistics a second time in the recomputation. The recomputation here runs those layers as the forward
did (it must save the same tensors) and then puts their running statistics back as they were before it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from edgeflux.errors import UserError


class NotCheckpointableError(ValueError, UserError):
    """The model has no units to checkpoint."""


def segment_bounds(sizes: list[int], segments: int | None) -> list[tuple[int, int]]:
    """[start, stop) of each segment over units with these output sizes: ``segments`` (None: round(sqrt(n)))
    contiguous groups, cut where the running sum of sizes passes each equal share."""
    n = len(sizes)
    count = min(n, segments or max(1, round(math.sqrt(n))))
    total, cuts, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1], start=1):
        running += size
        left = count - len(cuts)   # segments still to start, the one a cut here would start included
        if left and ((running >= total * len(cuts) / count and n - i >= left) or n - i == left):
            cuts.append(i)
    return list(zip(cuts, cuts[1:] + [n]))


@contextmanager
def _statistics_kept(modules: list[nn.Module]) -> Iterator[None]:
    """The running statistics of the training-mode BatchNorm layers in ``modules`` as they were on entry,
    whatever runs inside (the recomputation: it must save the same tensors as the forward, so the layers
    run unchanged and what they update is put back)."""
    norms = [m for seg in modules for m in seg.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(norms, kept):
                m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(count)


def checkpointed(model: nn.Module, segments: int | None = None) -> Callable[[Tensor], Tensor]:
    """model's forward with activation checkpointing over its units (see the module docstring)."""
    if not (hasattr(model, "units") and hasattr(model, "describe")):
        raise NotCheckpointableError(f"tricks.checkpoint needs a model made of units (edgeflux.models), not a "
                                     f"{type(model).__name__}; turn tricks.checkpoint off for it")
    sizes = [math.prod(info.out_shape) for info in model.describe()]
    bounds = segment_bounds(sizes, segments)
    groups = [list(model.units[a:b]) for a, b in bounds]

    def run(group: list[nn.Module]) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            for unit in group:
                x = unit(x)
            return x
        return forward

    def forward(x: Tensor) -> Tensor:
        for group in groups[:-1]:
            x = checkpoint(run(group), x, use_reentrant=False,
                           context_fn=lambda g=group: (nullcontext(), _statistics_kept(g)))
        return run(groups[-1])(x)

    forward.bounds = bounds
    return forward
