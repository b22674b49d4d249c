"""One NeuroFlux block: its units as one module, its step (Algorithm 2's local losses), its exits, and
the batch its measured step allows under the budget.

    block = LocalBlock(learners[3:6], prefix=None)                     # prefix: classic LL's frozen units
    step = BlockStep.factory(optimizer_factory(opts), context)(block)  # an edgeflux.step Step
    loss = step(x, y)                                                  # every unit learns from its own loss

The block step is a step like backprop's: edgeflux.train.train_loop runs it and the budget measures it
(edgeflux.memory.measure_training_step), built by the same factory.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.memory import (CONTENT_SAMPLES, StepMemory, StoredBound, StoredOverBudget, choose_batch, format_bytes,
                             measure_training_step)
from edgeflux.models.units import eval_mode
from edgeflux.step import OptimizerFactory, StepContext, StepFactory, no_context, trainable_parameters
from edgeflux.train import TrainOptions, optimizer_factory

from .aux import LocalLearner
from .cache import Batches

log = logging.getLogger(__name__)


class Prefix(nn.Module):
    """The trained units before a block, frozen in eval mode: classic local learning's input path."""

    def __init__(self, learners: Sequence[LocalLearner]) -> None:
        super().__init__()
        self.units = nn.ModuleList(learner.unit for learner in learners)
        self.train(False)   # BatchNorm on running statistics, and never updating them

    def forward(self, x: Tensor) -> Tensor:
        for unit in self.units:
            x = unit(x)
        return x

    def train(self, mode: bool = True) -> Prefix:   # always inference: these units are trained already
        return super().train(False)


class LocalBlock(nn.Module):
    """A block's learners (trained) and, for classic local learning, the frozen units before it."""

    def __init__(self, learners: Sequence[LocalLearner], prefix: nn.Module | None = None) -> None:
        super().__init__()
        self.learners = nn.ModuleList(learners)
        self.prefix = prefix


class BlockStep:
    """Algorithm 2, lines 2-8, for one batch: each unit learns from its own local loss, in order.

    One optimizer holds the block's parameters; after zero_grad(set_to_none) only the current unit has
    gradients, and SGD/Adam skip parameters without one, so each step() updates exactly the unit that was
    just backpropagated (the same as one optimizer per unit). The unit's output goes on detached: no
    gradient crosses a unit boundary.
    """

    def __init__(self, model: LocalBlock, optimizer: torch.optim.Optimizer, context: StepContext | None = None,
                 bounds: Sequence[StoredBound] | None = None):
        self.model, self.optimizer = model, optimizer
        self.context = context or no_context
        self.entered: list = []     # each unit's context object of the last call (their accounting)
        self.bounds = bounds        # per unit: content-dependent storage (BitTrain) held to what was measured
        self.split_batches = 0      # unit batches trained in parts to stay under the bound (TrainStep's rule)

    @classmethod
    def factory(cls, optimizer_factory: OptimizerFactory, context: StepContext | None = None,
                bounds: Sequence[StoredBound] | None = None) -> StepFactory:
        """block -> a BlockStep whose optimizer holds the learners' trainable parameters (not the prefix's)."""
        return lambda block: cls(block, optimizer_factory(trainable_parameters(block.learners)), context, bounds)

    def __call__(self, x: Tensor, y: Tensor) -> float:
        if self.model.prefix is not None:     # classic local learning: recompute the input through trained units
            with torch.no_grad():
                x = self.model.prefix(x)
        loss_sum = 0.0
        self.entered = []
        for i, learner in enumerate(self.model.learners):
            self.optimizer.zero_grad(set_to_none=True)
            x, loss = self._unit(learner, x, y, self.bounds[i] if self.bounds else None, 1.0)
            self.optimizer.step()
            loss_sum += loss
        return loss_sum / len(self.model.learners)

    def _unit(self, learner: LocalLearner, x: Tensor, y: Tensor, bound: StoredBound | None,
              weight: float) -> tuple[Tensor, float]:
        """One unit's forward and backward (gradients scaled by ``weight``): its detached output and loss. As in
        edgeflux.step.TrainStep, a batch that would outgrow the bound is trained as its halves, whose outputs
        are written into one tensor for the next unit."""
        try:
            with self.context(learner) as unit_context:
                if bound is not None and unit_context is not None:
                    unit_context.bound = bound
                out, logits = learner.forward_with_output(x)
                loss = F.cross_entropy(logits, y)
                (loss if weight == 1.0 else loss * weight).backward()
        except StoredOverBudget:
            if len(y) == 1:
                raise
        else:
            self.entered.append(unit_context)
            return out.detach(), loss.item() * weight
        self.split_batches += 1   # the aborted forward's tensors are freed by now (outside the except clause)
        half, n = len(y) // 2, len(y)
        first, loss = self._unit(learner, x[:half], y[:half], bound, weight * half / n)
        out = first.new_empty((n, *first.shape[1:]))
        out[:half] = first
        del first
        second, more = self._unit(learner, x[half:], y[half:], bound, weight * (n - half) / n)
        out[half:] = second
        return out, loss + more

    def units(self) -> list[tuple[str, nn.Module]]:
        return [(f"unit{i}", m) for i, m in enumerate(self.model.learners)]

    def activation_storage(self) -> tuple[dict, dict[str, int]] | None:
        if not self.entered or not all(hasattr(c, "summary") for c in self.entered):
            return None
        stored = {f"unit{i}": c.summary()["total"] for i, c in enumerate(self.entered)}
        return {"units": stored}, {name: unit["stored_bytes"] for name, unit in stored.items()}


def measure_block_peak(learners: Sequence[LocalLearner], make_optimizer: OptimizerFactory, x: Tensor, y: Tensor,
                       prefix: nn.Module | None = None, context: StepContext | None = None,
                       device: torch.device | str = "cpu", process_stats: bool = True) -> StepMemory:
    """Measured memory of one steady-state block step (on copies: see measure_training_step)."""
    return measure_training_step(LocalBlock(learners, prefix), BlockStep.factory(make_optimizer, context),
                                 (x.clone(), y), (x, y), device, process_stats)


def fit_block_batch(learners: Sequence[LocalLearner], opts: TrainOptions, source, planned: int,
                    budget_bytes: int | None, prefix: nn.Module | None, context: StepContext | None,
                    device: torch.device) -> tuple[int, StepMemory]:
    """The planned batch if its measured block step fits the budget, else the largest that does
    (edgeflux.memory.choose_batch, on the source's first CONTENT_SAMPLES batches of the planned size)."""
    batches = iter(Batches(source, planned, shuffle=False))
    samples = [batch for _, batch in zip(range(CONTENT_SAMPLES), batches)]
    getattr(batches, "close", lambda: None)()   # stop the prefetcher: these batches are all we need
    data = torch.cat([x for x, _ in samples]), torch.cat([y for _, y in samples])
    make_optimizer = optimizer_factory(opts)
    choice = choose_batch(lambda x, y: measure_block_peak(learners, make_optimizer, x.clone(), y.clone(), prefix, context,
                                                          device),
                          data, budget_bytes=budget_bytes, max_batch=planned, preferred=planned)
    if choice.batch_size < min(planned, len(data[0])):   # (a training set smaller than the batch caps it too)
        log.warning("block step at the planned batch %d measured over the budget %s: training at batch %d (%s)",
                    planned, format_bytes(budget_bytes), choice.batch_size, format_bytes(choice.memory.peak_bytes))
    return choice.batch_size, choice.memory


@torch.no_grad()
def forward_block(learners: Sequence[LocalLearner], x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output of the block's last unit and every unit's exit logits."""
    logits = []
    for learner in learners:
        x, z = learner.forward_with_output(x)
        logits.append(z)
    return x, logits


@torch.no_grad()
def evaluate_exits(learners: Sequence[LocalLearner], source, batch_size: int, device: torch.device,
                   prefix: nn.Module | None = None, writer=None) -> list[float]:
    """Accuracy of each unit's exit over a split (eval mode); optionally writes the block's output to a cache."""
    correct = [0] * len(learners)
    total = 0
    with eval_mode(nn.ModuleList(learners)):
        for xb, yb in Batches(source, batch_size, shuffle=False):
            xb = xb.to(device)
            if prefix is not None:
                xb = prefix(xb)
            out, logits = forward_block(learners, xb)
            for i, z in enumerate(logits):
                correct[i] += (z.argmax(1).cpu() == yb).sum().item()
            total += len(yb)
            if writer is not None:
                writer.append(out, yb)
    return [c / max(1, total) for c in correct]


@torch.no_grad()
def out_shape(learners: Sequence[LocalLearner], source, prefix: nn.Module | None = None) -> tuple[int, ...]:
    """Per-sample shape of the block's output."""
    ref = next(learners[0].parameters())
    x = torch.zeros(1, *source.sample_shape, device=ref.device, dtype=ref.dtype)
    if prefix is not None:
        x = prefix(x)
    with eval_mode(nn.ModuleList(learners)):
        return tuple(forward_block(learners, x)[0].shape[1:])
