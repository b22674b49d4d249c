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
from torch import nn

from edgeflux.config import MemoryOptions, TrainOptions
from edgeflux.memory import (BatchFit, StepContext, StepMemory, format_bytes, largest_over_batches,
                             max_batch_under_budget, measure_training_peak)
from edgeflux.train import TrainResult, evaluate, fit, optimizer_factory

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
            "steps": self.train.steps,
            "val_acc": self.train.history[-1]["val_acc"] if self.train.history else 0.0,
            "best_val_acc": self.train.best_val_acc,
            "test_acc": self.test_acc,
            "params": self.params,
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
                 context: StepContext | None = None) -> tuple[int, BatchFit | None, StepMemory]:
    """The largest batch (≤ memory.max_batch) whose measured training-step peak fits memory.budget.

    Steps are measured on real training samples, under the same activation context as training.
    Where the context stores activations by their content (BitTrain: a bitmap's size is the batch's
    non-zeros), the peak of a batch size is the largest over CONTENT_SAMPLES disjoint batches.
    """
    make_opt = optimizer_factory(opts)
    measured: dict[int, StepMemory] = {}
    sample_shape = tuple(train[0].shape[1:])
    max_batch = min(memory.max_batch, len(train[0]))

    def measure(batch: int, i: int) -> StepMemory:
        data = train[0][i * batch:(i + 1) * batch], train[1][i * batch:(i + 1) * batch]
        return measure_training_peak(model, make_opt, sample_shape, num_classes, batch, device=device, data=data,
                                     context=context)

    def peak(batch: int) -> int:
        m = largest_over_batches(lambda i: measure(batch, i), available=len(train[0]) // batch)
        measured[batch] = m
        log.info("measured peak at batch %d: %s", batch, format_bytes(m.peak_bytes))
        return m.peak_bytes

    if memory.budget is None:
        peak(opts.batch_size)
        return opts.batch_size, None, measured[opts.batch_size]
    fitted = max_batch_under_budget(peak, memory.budget, max_batch)
    log.info("budget %s: batch %d fits (measured peak %s; batch 1 needs %s)", format_bytes(memory.budget),
             fitted.batch_size, format_bytes(fitted.peak_bytes), format_bytes(fitted.min_feasible_bytes))
    return fitted.batch_size, fitted, measured[fitted.batch_size]


def train_under_budget(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                       test: tuple[torch.Tensor, torch.Tensor], num_classes: int, opts: TrainOptions,
                       memory: MemoryOptions, device: torch.device, checkpoint: Path | None = None,
                       desc: str = "backprop", context: StepContext | None = None,
                       track_test: bool = False) -> BudgetedRun:
    """Backprop at the largest batch that fits memory.budget (measured). track_test: the history also
    records test accuracy at each evaluation (for time-to-target benchmarks)."""
    batch, batch_fit, step_memory = choose_batch(model, train, num_classes, opts, memory, device, context)
    result = fit(model, train, val, opts, batch, device=device, checkpoint=checkpoint, desc=f"{desc} (batch {batch})",
                 context=context, test=test if track_test else None)
    test_acc = evaluate(model, *test, batch_size=batch, device=device)
    log.info("%s: test accuracy %.4f after %.1fs of training", desc, test_acc, result.train_time_s)
    return BudgetedRun(batch, batch_fit, step_memory, result, test_acc, sum(p.numel() for p in model.parameters()))
