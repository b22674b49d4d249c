"""Validating the time model on this device: the measured backward time of tensor selections against what
``predict_backward`` predicts from the profile."""
from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.elastic.profile import TensorTiming, measure_backward, predict_backward
from edgeflux.step import StepContext, no_context

__all__ = ["random_selections", "validate_time_model"]


def validate_time_model(model: nn.Module, timing: TensorTiming, masks: Sequence[Sequence[bool]], x: Tensor,
                        y: Tensor, *, context: StepContext = no_context, loss_fn=F.cross_entropy, repeats: int = 5,
                        warmup: int = 1) -> list[dict]:
    """Predicted against measured backward time for each selection in ``masks``: rows with ``predicted_s``,
    ``measured_s`` (median of ``repeats``; the selections are measured in turn, round after round, so that a
    drift of the machine's speed touches all) and ``error`` ((predicted - measured) / measured)."""
    runs = [[measure_backward(model, timing.names, mask, x, y, context=context, loss_fn=loss_fn, repeats=1, warmup=0)
             for mask in masks] for _ in range(warmup + repeats)][warmup:]
    rows = []
    for i, mask in enumerate(masks):
        measured, predicted = statistics.median(r[i] for r in runs), predict_backward(timing, mask)
        rows.append({"selected": sum(map(bool, mask)), "deepest": list(map(bool, mask)).index(True) if any(mask) else None,
                     "predicted_s": predicted, "measured_s": measured, "error": (predicted - measured) / measured})
    return rows


def random_selections(n: int, count: int, seed: int = 0, always: Sequence[int] = ()) -> list[list[bool]]:
    """Selections to validate the time model with: a deepest tensor drawn uniformly, each tensor above it
    selected with probability 1/2, the ``always`` indices (the classifier) selected."""
    rng = random.Random(seed)
    masks = []
    for _ in range(count):
        deepest = rng.randrange(n)
        mask = [k == deepest or (k > deepest and rng.random() < 0.5) or k in always for k in range(n)]
        masks.append(mask)
    return masks
