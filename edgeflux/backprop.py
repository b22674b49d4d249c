"""Standard backpropagation under a memory budget: the baseline every technique is compared to.

The batch size is not a guess: the peak memory of a steady-state training step is *measured*
(``edgeflux.memory``) at a few batch sizes, and the largest batch whose measured peak stays
within the budget is used. If even batch 1 does not fit, ``BudgetTooSmallError`` says what the
smallest feasible budget is.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgeflux.memory import BatchFit, StepMemory, measure_training_step
from edgeflux.memory import choose_batch as choose_batch_under_budget
from edgeflux.step import StepContext, TrainStep
from edgeflux.train import MemoryOptions, TrainOptions, TrainResult, evaluate, fit, optimizer_factory

log = logging.getLogger(__name__)


@dataclass
class BudgetedRun:
    batch_size: int
    batch_fit: BatchFit | None          # None when no budget was set
    step_memory: StepMemory             # measured at batch_size
    train: TrainResult
    test_acc: float
    params: int

    def metrics(self) -> dict:
        """Flat metrics under the names every stage shares (see edgeflux.tracking)."""
        out = {
            "batch_size": self.batch_size,
            "peak_mem_bytes": self.step_memory.peak_bytes,
            "saved_bytes": self.step_memory.saved_bytes,
            "train_time_s": self.train.train_time_s,
            "train_cpu_s": self.train.train_cpu_s,
            "steps": self.train.steps,
            "val_acc": self.train.history[-1]["val_acc"] if self.train.history else 0.0,
            "best_val_acc": self.train.best_val_acc,
            "test_acc": self.test_acc,
            "params": self.params,
            "trainable_params": self.params,   # backprop trains every parameter
        }
        if storage := self.step_memory.activation_storage:   # e.g. BitTrain: saved bytes dense vs as stored
            total = storage["total"]
            out.update(saved_dense_bytes=total["dense_bytes"], saved_stored_bytes=total["stored_bytes"],
                       saved_reduction=total["reduction"], activation_sparsity=total["sparsity"])
        if self.batch_fit is not None:
            out.update(budget_bytes=self.batch_fit.budget_bytes, min_feasible_bytes=self.batch_fit.min_feasible_bytes,
                       fit_slope_bytes_per_sample=self.batch_fit.slope_bytes_per_sample,
                       fit_intercept_bytes=self.batch_fit.intercept_bytes, fit_r2=self.batch_fit.r2)
        return out

    def memory_report(self) -> dict:
        return {"step_memory": self.step_memory.to_dict(),
                "batch_fit": asdict(self.batch_fit) if self.batch_fit is not None else None}


def choose_batch(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], num_classes: int, opts: TrainOptions,
                 memory: MemoryOptions, device: torch.device,
                 context: StepContext | None = None, loss_fn=F.cross_entropy) -> tuple[int, BatchFit | None, StepMemory]:
    """The largest batch (<= memory.max_batch) whose measured training-step peak fits memory.budget
    (edgeflux.memory.choose_batch); without a budget, opts.batch_size, measured.

    Steps are measured on real training samples, with the step fit trains with (TrainStep, the same context).
    """
    make_step = TrainStep.factory(optimizer_factory(opts), loss_fn=loss_fn, context=context)

    def measure(x: torch.Tensor, y: torch.Tensor) -> StepMemory:
        return measure_training_step(model, make_step, (x.clone(), y.clone()), (x.clone(), y.clone()), device)

    choice = choose_batch_under_budget(measure, train, budget_bytes=memory.budget, max_batch=memory.max_batch,
                                       preferred=opts.batch_size if memory.budget is None else None)
    return choice.batch_size, choice.fit, choice.memory


def train_under_budget(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                       test: tuple[torch.Tensor, torch.Tensor], num_classes: int, opts: TrainOptions,
                       memory: MemoryOptions, device: torch.device, checkpoint: Path | None = None,
                       desc: str = "backprop", context: StepContext | None = None,
                       track_test: bool = False, signature: str = "", make_before_step=None,
                       loss_fn=F.cross_entropy) -> BudgetedRun:
    """Backprop at the largest batch that fits memory.budget (measured). track_test: the history also
    records test accuracy at each evaluation (for time-to-target benchmarks). signature: what else
    defines the run for its checkpoint (fit's `signature`: e.g. the weights it starts from).
    make_before_step: fit's (a method that re-selects its trainable tensors while training). loss_fn: fit's
    (several exits trained jointly); the measured step uses it too."""
    batch, batch_fit, step_memory = choose_batch(model, train, num_classes, opts, memory, device, context, loss_fn)
    result = fit(model, train, val, opts, batch, device=device, checkpoint=checkpoint, desc=f"{desc} (batch {batch})",
                 context=context, test=test if track_test else None, signature=signature,
                 make_before_step=make_before_step, loss_fn=loss_fn)
    test_acc = evaluate(model, *test, batch_size=batch, device=device)
    log.info("%s: test accuracy %.4f after %.1fs of training", desc, test_acc, result.train_time_s)
    return BudgetedRun(batch, batch_fit, step_memory, result, test_acc, sum(p.numel() for p in model.parameters()))
