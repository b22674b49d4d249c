"""Standard backpropagation under a memory budget: the baseline every technique is compared to.

The batch size is not a guess: the peak memory of a steady-state training step is *measured*
(``edgeflux.memory``) at a few batch sizes, and the largest batch whose measured peak stays
within the budget is used. If even batch 1 does not fit, ``BudgetTooSmallError`` says what the
smallest feasible budget is.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from edgeflux.memory import BatchFit, StepMemory, choose_batch, measure_training_step, stored_bounds
from edgeflux.step import TrainStep
from edgeflux.train import MemoryOptions, TrainOptions, TrainResult, TrainRun, evaluate, fit, optimizer_factory

log = logging.getLogger(__name__)


@dataclass
class BudgetedRun:
    batch_size: int
    batch_fit: BatchFit | None          # None when no budget was set
    step_memory: StepMemory             # measured at batch_size
    train: TrainResult
    test_acc: float
    params: int
    measure_s: float = 0.0              # wall seconds spent finding batch_size (measured steps), before training

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
            "split_batches": self.train.split_batches,
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


def fit_model_batch(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], opts: TrainOptions,
                    memory: MemoryOptions, run: TrainRun | None = None) -> tuple[int, BatchFit | None, StepMemory]:
    """The batch fit trains the whole ``model`` with: the largest (<= memory.max_batch) whose measured backprop
    step fits memory.budget (edgeflux.memory.choose_batch, here given that step to measure); without a budget,
    opts.batch_size, measured.

    Steps are measured on real training samples, with the step fit trains with (TrainStep with run's context,
    loss_fn and tricks, on run.device). With run.tricks.accumulate the batch is the micro-batch, at most the
    effective batch, measured where it closes a group (its gradients added to the group's, then the optimizer
    step). run.batch_hint: where the search looks first (max_batch_under_budget's hint).
    """
    run = run or TrainRun()

    def measure(x: torch.Tensor, y: torch.Tensor) -> StepMemory:
        make_step = TrainStep.factory(optimizer_factory(opts), loss_fn=run.loss_fn, context=run.context,
                                      tricks=run.step_tricks(len(y), measuring=True))
        return measure_training_step(model, make_step, (x.clone(), y.clone()), (x.clone(), y.clone()), run.device)

    accumulating = run.tricks is not None and run.tricks.accumulate
    max_batch = min(memory.max_batch, run.tricks.effective_batch) if accumulating else memory.max_batch
    preferred = None if memory.budget is not None else min(opts.batch_size, max_batch)
    choice = choose_batch(measure, train, budget_bytes=memory.budget, max_batch=max_batch, preferred=preferred,
                          hint=run.batch_hint)
    return choice.batch_size, choice.fit, choice.memory


def train_under_budget(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                       test: tuple[torch.Tensor, torch.Tensor], opts: TrainOptions, run: TrainRun | None = None,
                       memory: MemoryOptions | None = None) -> BudgetedRun:
    """Backprop at the largest batch whose measured step fits memory.budget (None: no budget, opts.batch_size).
    run: fit's (TrainRun: device, checkpoint, signature, context, loss_fn, hooks, track_test); the measured
    step uses its context and loss_fn too. The test split is scored once after training (and at every
    evaluation with run.track_test)."""
    run, memory = run or TrainRun(), memory or MemoryOptions()
    started = time.perf_counter()
    batch, batch_fit, step_memory = fit_model_batch(model, train, opts, memory, run)
    measure_s = time.perf_counter() - started
    # every batch, not only the measured ones, under the budget: content-dependent storage held to the measured
    bounds = stored_bounds(step_memory, memory.budget)
    result = fit(model, train, val, opts, batch, replace(run, desc=f"{run.desc} (batch {batch})",
                                                         stored_bound=bounds[0] if bounds else None), test)
    test_acc = evaluate(model, *test, batch_size=run.eval_batch or batch, device=run.device)
    log.info("%s: test accuracy %.4f after %.1fs of training", run.desc, test_acc, result.train_time_s)
    return BudgetedRun(batch, batch_fit, step_memory, result, test_acc, sum(p.numel() for p in model.parameters()),
                       measure_s)
