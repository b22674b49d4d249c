"""One training step: what every trainer runs and what the memory budget measures.

    make_step = TrainStep.factory(optimizer_factory(opts), context=opts.bittrain.context)
    step = make_step(model)      # the optimizer holds the model's trainable parameters
    loss = step(x, y)            # zero_grad(set_to_none), forward, loss, backward, optimizer step

A trainer never writes a step of its own. The training loop (``edgeflux.train.train_loop``) calls
a step, and the batch chooser (``edgeflux.memory.choose_batch``, through
``edgeflux.memory.measure_training_step``) measures a step built by the same factory on a copy of
the model: what the budget is held against is the step that trains. NeuroFlux's block step
(``edgeflux.neuroflux.block.BlockStep``: every unit of a block learns from its own local loss) has
the same shape; neither the loop nor the measurement knows which step it runs.

A step is any object with:

* ``model``: the module that trains (its parameters, buffers and train/eval modes);
* ``optimizer``: built over the model's trainable parameters (``trainable_parameters``);
* ``__call__(x, y) -> float``: one step on a batch, returning the loss;
* ``units()``: (name, module) pairs that saved activations are attributed to, or None;
* ``activation_storage()``: the step context's own accounting of the last call (BitTrain's
  bytes as stored, per unit), or None when the context stores activations as autograd does.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.memory.bound import StoredBound, StoredOverBudget
from edgeflux.tricks.accumulate import Accumulation
from edgeflux.tricks.fused import step_in_backward
from edgeflux.tricks.options import TrickOptions
from edgeflux.tricks.recompute import checkpointed

StepContext = Callable[[nn.Module], AbstractContextManager]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def no_context(model: nn.Module) -> AbstractContextManager:
    """The StepContext of plain training: nothing changes how activations are saved."""
    return nullcontext()


class Step(Protocol):
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __call__(self, x: Tensor, y: Tensor) -> float: ...

    def units(self) -> list[tuple[str, nn.Module]] | None: ...

    def activation_storage(self) -> tuple[dict, dict[str, int]] | None: ...


StepFactory = Callable[[nn.Module], Step]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a step updates: those that require gradients (a fine-tuning method freezes the rest)."""
    return [p for p in model.parameters() if p.requires_grad]


def unit_pairs(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """(name, unit) of a UnitModel, for saved-bytes attribution; None for any other module."""
    if hasattr(model, "units") and hasattr(model, "unit_names"):
        return list(zip(model.unit_names, model.units))
    return None


@dataclass(frozen=True)
class Tricks:
    """The memory tricks a TrainStep applies (edgeflux.tricks): the options, and with accumulation on, where
    each micro-batch falls in its group (a template: every step the factory builds gets a fresh copy)."""
    options: TrickOptions = TrickOptions()
    accumulation: Accumulation | None = None

    def fresh(self) -> Tricks:
        return replace(self, accumulation=replace(self.accumulation) if self.accumulation is not None else None)


class TrainStep:
    """The standard step: zero_grad(set_to_none), forward, loss, backward, optimizer step.

    context(model) is entered around forward and backward (e.g. BitTrain's compressed saved
    activations), so a measured step stores activations exactly as the trainer does. tricks: checkpointing
    (the forward), the step in backward (the update) and accumulation (which call opens and closes a group),
    edgeflux.tricks; the measured step applies the same.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy, context: StepContext | None = None,
                 bound: StoredBound | None = None, tricks: Tricks | None = None):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.context = context or no_context
        self.entered: Any = None    # the context object of the last call (its accounting, if it has one)
        self.bound = bound          # content-dependent storage (BitTrain) held to what was measured
        self.split_batches = 0      # batches trained in parts because whole they would have outgrown the bound
        tricks = tricks or Tricks()
        self.forward = checkpointed(model, tricks.options.segments) if tricks.options.checkpoint else model
        self.fused = tricks.options.fused_step
        self.accumulation = tricks.accumulation

    @classmethod
    def factory(cls, optimizer_factory: OptimizerFactory, loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                context: StepContext | None = None, bound: StoredBound | None = None,
                tricks: Tricks | None = None) -> StepFactory:
        """model -> a TrainStep whose optimizer holds the model's trainable parameters."""
        return lambda model: cls(model, optimizer_factory(trainable_parameters(model)), loss_fn, context, bound,
                                 tricks.fresh() if tricks is not None else None)

    def __call__(self, x: Tensor, y: Tensor) -> float:
        """One step on (x, y); with accumulation, one micro-batch (the optimizer steps when it closes a group).
        The loss returned is the batch's mean loss."""
        opens, closes, weight = self.accumulation.next() if self.accumulation is not None else (True, True, 1.0)
        if opens:
            self.optimizer.zero_grad(set_to_none=True)
        with step_in_backward(self.optimizer) if self.fused else nullcontext():
            loss = self._accumulate(x, y, weight)
        if closes and not self.fused:
            self.optimizer.step()
        return loss / weight

    def _accumulate(self, x: Tensor, y: Tensor, weight: float) -> float:
        """Forward and backward of the batch, its gradients scaled by ``weight`` and added to .grad. A batch
        whose stored activations would outgrow the bound (StoredOverBudget, raised before the store that would
        break it) is trained as its two halves, each weighted by its share: the mean loss's gradient, the same
        as the whole batch's except through BatchNorm, which sees each half's statistics (with the step in
        backward, each half's share is applied as its own update)."""
        try:
            with self.context(self.model) as entered:
                if self.bound is not None and entered is not None:
                    entered.bound = self.bound
                loss = self.loss_fn(self.forward(x), y)
                (loss if weight == 1.0 else loss * weight).backward()
        except StoredOverBudget:
            if len(y) == 1:
                raise
        else:
            self.entered = entered
            return loss.item() * weight
        # outside the except clause: the aborted forward's tensors (held by the traceback) are freed by now
        self.split_batches += 1
        half = len(y) // 2
        return (self._accumulate(x[:half], y[:half], weight * half / len(y))
                + self._accumulate(x[half:], y[half:], weight * (len(y) - half) / len(y)))

    def units(self) -> list[tuple[str, nn.Module]] | None:
        return unit_pairs(self.model)

    def activation_storage(self) -> tuple[dict, dict[str, int]] | None:
        if not hasattr(self.entered, "summary"):
            return None
        summary = self.entered.summary()
        return summary, {name: unit["stored_bytes"] for name, unit in summary["units"].items()}


def training_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                     loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                     context: StepContext | None = None) -> Callable[[], float]:
    """A TrainStep bound to one batch: a closure for edgeflux.memory.measure_step and benchmarks."""
    return partial(TrainStep(model, optimizer, loss_fn, context), x, y)
