"""The one training loop every trainer calls: epochs, LR schedule, evaluation points, accuracy curve,
checkpoints and exact resume, progress, and the hooks fine-tuning methods need.

    step = TrainStep.factory(optimizer_factory(opts), context=context)(model)    # edgeflux.step
    result = train_loop(step, lambda epoch: batches(x, y, 64, shuffle=True, seed=epoch),
                        Schedule(epochs=3, steps_per_epoch=math.ceil(len(x) / 64), evals_per_epoch=2, seed=0),
                        evaluate=lambda: {"val_acc": evaluate(model, *val)}, run=TrainRun(checkpoint=path))

The loop does not know what a step does: backprop's ``TrainStep``, NeuroFlux's block step (local
losses) and the fine-tuning methods' steps are all called the same way, and the memory budget
measures the same steps (``edgeflux.memory.measure_training_step``). It owns:

* the schedule: a per-step cosine LR over ``epochs * steps_per_epoch`` steps;
* evaluation points, ``evals_per_epoch`` per epoch, and an accuracy-vs-time history in which time
  counts training only (evaluation excluded), so curves of different methods compare fairly. Each
  row has the wall time (``time_s``) and the process's CPU time (``cpu_s``, every thread): on a
  machine that other work loads, wall time stretches and CPU time barely;
* modes: the model trains in ``train_mode`` (modules a method keeps in eval, e.g. frozen BatchNorm,
  stay so) and evaluation restores every submodule's own mode;
* resume: with ``run.checkpoint`` set (``TrainRun``: what a run carries from its trainer down to the
  loop), the full state (model, optimizer, scheduler, RNG, history, elapsed time) is written atomically
  after every epoch; a rerun with the same signature continues from the next epoch, and because each
  epoch's batches are a function of (seed, epoch) the result equals an uninterrupted run;
* hooks: ``before_step(result)`` runs before every step (a method that re-selects its trainable tensors
  at run time does it here; the optimizer holds every tensor that may train, and skips those without a
  gradient), ``run.on_epoch_end(epoch, result)`` after each epoch's checkpoint.

``fit`` is backprop on in-memory tensors through this loop.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import Tensor, nn

from edgeflux.checkpoint import (load_checkpoint, rng_state, run_signature, save_checkpoint, set_rng_state,
                                 tensor_digest)
from edgeflux.data import Images, batches
from edgeflux.errors import UserError
from edgeflux.models.units import eval_mode, train_mode
from edgeflux.memory.blocks import split_blocks_exactly
from edgeflux.memory.bound import StoredBound
from edgeflux.memory.options import MemoryOptions
from edgeflux.options import LR_SCALINGS, OPTIMIZER_NAMES, TrainOptions
from edgeflux.step import Step, StepContext, TrainStep, Tricks, no_context
from edgeflux.tricks.accumulate import Accumulation
from edgeflux.tricks.options import TrickOptions

log = logging.getLogger(__name__)

__all__ = ["LR_SCALINGS", "OPTIMIZERS", "MemoryOptions", "Schedule", "TrainOptions", "TrainResult", "TrainRun",
           "evaluate", "fit", "load_checkpoint", "make_optimizer", "optimizer_factory", "progress_bar",
           "resolve_device", "rng_state", "run_signature", "save_checkpoint", "set_rng_state", "tensor_digest",
           "train_loop"]

CHECKPOINT_FORMAT = 2   # in every checkpoint's signature: a file of another layout is never loaded

OPTIMIZERS = {"sgd": lambda params, o: torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay),
              "adam": lambda params, o: torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "edgeflux/options.py names the optimizers params.yaml takes"


class DeviceUnavailableError(RuntimeError, UserError):
    """The params ask for a device this machine does not have."""


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            seen = f"{count} CUDA device(s) visible" if count else "no CUDA device is visible to torch"
            raise DeviceUnavailableError(f"device {name!r} was asked for but {seen} (torch {torch.__version__}); "
                                         f"set device: cpu (or auto) in params.yaml")
    return device


def make_optimizer(params, opts: TrainOptions) -> torch.optim.Optimizer:
    return OPTIMIZERS[opts.optimizer](params, opts)


def optimizer_factory(opts: TrainOptions) -> Callable[..., torch.optim.Optimizer]:
    return lambda params: make_optimizer(params, opts)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor | Images, y: Tensor, batch_size: int = 512,
             device: torch.device | str = "cpu") -> float:
    """Top-1 accuracy in [0, 1], in eval mode; every submodule's own mode is restored after.

    Budgeted trainers pass their training batch size: inference at the same batch needs less
    memory than a training step (nothing is saved for backward), so evaluation stays in budget.
    """
    correct = 0
    with eval_mode(model):
        for i in range(0, len(x), batch_size):
            logits = model(x[i:i + batch_size].to(device))
            correct += (logits.argmax(1).cpu() == y[i:i + batch_size]).sum().item()
    return correct / max(1, len(x))


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)   # rows: step, epoch, time_s, train_loss, val_acc, ...
    train_time_s: float = 0.0
    train_cpu_s: float = 0.0        # the process's CPU time over the same spans (every thread): steadier than wall
    steps: int = 0
    epochs_done: int = 0
    resumed_from_epoch: int = 0
    extra: dict = field(default_factory=dict)   # state a hook keeps (checkpointed with the run)
    split_batches: int = 0   # in this process: batches trained in halves to stay under the budget (StoredBound)
    stopped: bool = False    # ended at an evaluation that met TrainRun.until, before its epochs were done

    @property
    def best_val_acc(self) -> float:
        return max((r["val_acc"] for r in self.history), default=0.0)


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn())


@dataclass(frozen=True)
class TrainRun:
    """How one training run is carried out, kept and shown: what travels unchanged from the trainer that
    starts it (train_under_budget, fine-tuning, a NeuroFlux block) through fit down to train_loop.

    device: where the step runs. checkpoint: the run's full state is written there after every epoch (None:
    not resumable). signature: what else defines the run, beside what fit adds (options, batch, data), e.g.
    the weights a fine-tuning run starts from; a checkpoint of another signature is never resumed.
    desc: the run's name in the progress bar and the log. on_epoch_end(epoch, result): after each epoch's
    checkpoint. keep_checkpoint: leave the checkpoint after the last epoch (a caller with work after training
    keeps it until that work is saved, so that a kill in between does not retrain); else it is deleted.
    offset: (steps, wall seconds, CPU seconds) already on the curve before this run (NeuroFlux's earlier blocks).

    What fit builds the step with (the loop itself does not read these): context(model) is entered around each
    forward and backward (how activations are saved, e.g. BitTrain), and the batch-size measurement uses the
    same one; loss_fn(model(x), y) is the training loss (a model with several exits returns them all while
    training); make_before_step(step, train, batch_size) builds the loop's ``before_step`` hook for the step
    that trains (e.g. ElasticTrainer's selection); track_test: also record test accuracy at every evaluation
    (time-to-target curves; never used to choose anything). until(row): training ends after the first
    evaluation whose row makes it true (a benchmark's target accuracy or time limit), mid-epoch or not.
    eval_batch: the evaluations' batch (None: the training batch, whose inference fits the budget; a benchmark
    that does not time evaluation may evaluate faster at a larger one). batch_hint: the batch another search
    found under the same budget (the plan's, for method: auto): the batch search confirms it in three measured
    steps (batch 1, it, and one more) instead of searching again, or searches as usual when it is not the
    largest that fits.
    """
    device: torch.device | str = "cpu"
    checkpoint: Path | None = None
    signature: str = ""
    desc: str = "train"
    on_epoch_end: Callable[[int, TrainResult], None] | None = None
    keep_checkpoint: bool = False
    offset: tuple[int, float, float] = (0, 0.0, 0.0)
    context: StepContext | None = None
    loss_fn: Callable[[Any, Tensor], Tensor] = F.cross_entropy
    make_before_step: Callable[[Step, tuple, int], Callable[[TrainResult], None]] | None = None
    track_test: bool = False
    stored_bound: StoredBound | None = None
    until: Callable[[dict], bool] | None = None
    eval_batch: int | None = None
    tricks: TrickOptions | None = None   # memory tricks (edgeflux.tricks) of the step that trains and is measured
    batch_hint: int | None = None

    def step_tricks(self, micro: int, measuring: bool = False) -> Tricks | None:
        """The Tricks a step at this (micro-)batch applies: with accumulation, where its micro-batches fall
        (in fit: the epoch's groups, set by fit; measuring: the costliest position, see Accumulation)."""
        if self.tricks is None or not self.tricks.on():
            return None
        return Tricks(self.tricks, Accumulation.measuring(micro, self.tricks.effective_batch)
                      if self.tricks.accumulate and measuring else None)


@dataclass(frozen=True)
class Schedule:
    """How long train_loop trains and when it evaluates: ``epochs`` of ``steps_per_epoch`` steps (the cosine LR
    spans them all), ``evals_per_epoch`` evaluation points per epoch; ``seed`` seeds the global RNG of a fresh run."""
    epochs: int
    steps_per_epoch: int
    evals_per_epoch: int
    seed: int


@dataclass
class _Loop:
    """What one run of train_loop holds: the step, its schedule and the run's settings."""
    step: Step
    scheduler: torch.optim.lr_scheduler.LRScheduler
    eval_points: set[int]
    steps_per_epoch: int
    evaluate: Callable[[], dict]
    device: torch.device
    run: TrainRun
    before_step: Callable[[TrainResult], None] | None


def train_loop(step: Step, batches: Callable[[int], Iterable[tuple[Tensor, Tensor]]], schedule: Schedule,
               evaluate: Callable[[], dict], run: TrainRun | None = None,
               before_step: Callable[[TrainResult], None] | None = None) -> TrainResult:
    """Train ``step.model`` for ``schedule.epochs`` epochs of ``batches(epoch)`` (see the module docstring).

    evaluate(): the row fields at an evaluation point (at least ``val_acc``), in eval mode.
    run: device, checkpoint, signature, desc, on_epoch_end, keep_checkpoint and offset (TrainRun).
    before_step(result): runs before every step.
    """
    run = run or TrainRun()
    epochs, steps_per_epoch, evals_per_epoch = schedule.epochs, schedule.steps_per_epoch, schedule.evals_per_epoch
    total = steps_per_epoch * epochs
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(step.optimizer, T_max=total)
    loop = _Loop(step, scheduler, {round(steps_per_epoch * k / evals_per_epoch) for k in range(1, evals_per_epoch + 1)},
                 steps_per_epoch, evaluate, torch.device(run.device), run, before_step)
    signature = run_signature(run=run.signature, checkpoint_format=CHECKPOINT_FORMAT)
    checkpoint = run.checkpoint
    result = _resume(loop, checkpoint, signature, epochs)
    if result is None:
        result = TrainResult()
        torch.manual_seed(schedule.seed)
    if loop.device.type == "cuda":
        split_blocks_exactly()   # as where the step was measured: its peak does not depend on what came before
    train_mode(step.model)
    with progress_bar() as progress:
        task = progress.add_task(run.desc, total=total, completed=result.epochs_done * steps_per_epoch, status="")
        for epoch in range(result.epochs_done, epochs):
            _run_epoch(loop, batches(epoch), epoch, result, progress, task)
            if result.stopped:
                break
            result.epochs_done = epoch + 1
            if checkpoint is not None:
                save_checkpoint(checkpoint, {
                    "signature": signature, "model": step.model.state_dict(), "optimizer": step.optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": rng_state(), "result": dict(vars(result))})
            if run.on_epoch_end is not None:
                run.on_epoch_end(epoch, result)
    if checkpoint is not None and not run.keep_checkpoint and checkpoint.exists():
        checkpoint.unlink()
    return result


def _resume(loop: _Loop, checkpoint: Path | None, signature: str, epochs: int) -> TrainResult | None:
    if checkpoint is None or (state := load_checkpoint(checkpoint, signature)) is None:
        return None
    loop.step.model.load_state_dict(state["model"])
    loop.step.optimizer.load_state_dict(state["optimizer"])
    loop.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    result = TrainResult(**state["result"])
    result.resumed_from_epoch = result.epochs_done
    log.info("%s: resuming from checkpoint %s after epoch %d/%d", loop.run.desc, checkpoint, result.epochs_done, epochs)
    return result


def _run_epoch(loop: _Loop, epoch_batches: Iterable[tuple[Tensor, Tensor]], epoch: int, result: TrainResult,
               progress: Progress, task) -> None:
    loss_sum, loss_n = 0.0, 0
    tick, cpu_tick = time.perf_counter(), time.process_time()

    def clock() -> None:   # evaluation is outside both clocks
        result.train_time_s += time.perf_counter() - tick
        result.train_cpu_s += time.process_time() - cpu_tick

    for i, (xb, yb) in enumerate(epoch_batches, start=1):
        if loop.before_step is not None:
            loop.before_step(result)
        loss = loop.step(xb.to(loop.device, non_blocking=True), yb.to(loop.device, non_blocking=True))
        loop.scheduler.step()
        result.steps += 1
        loss_sum += loss * len(yb)
        loss_n += len(yb)
        if i in loop.eval_points:
            clock()
            offset = loop.run.offset
            row = {"step": offset[0] + result.steps, "epoch": epoch + i / loop.steps_per_epoch,
                   "time_s": offset[1] + result.train_time_s, "cpu_s": offset[2] + result.train_cpu_s,
                   "train_loss": loss_sum / loss_n, **loop.evaluate()}
            train_mode(loop.step.model)
            result.history.append(row)
            log.info("%s: epoch %.2f step %d loss %.4f val_acc %.4f (%.1fs training, %.1f CPU s)", loop.run.desc,
                     row["epoch"], row["step"], row["train_loss"], row["val_acc"], row["time_s"], row["cpu_s"])
            progress.update(task, status=f"loss {row['train_loss']:.3f} val {row['val_acc']:.3f}")
            if loop.run.until is not None and loop.run.until(row):
                result.stopped = True
                return
            loss_sum, loss_n = 0.0, 0
            tick, cpu_tick = time.perf_counter(), time.process_time()
        progress.advance(task)
    clock()


def _describe(context: Callable) -> object:
    """A stable description of a step context for run signatures (its options, not its address)."""
    owner = getattr(context, "__self__", None)
    return owner.model_dump() if hasattr(owner, "model_dump") else getattr(context, "__qualname__", repr(context))


def fit(model: nn.Module, train: tuple[Tensor | Images, Tensor], val: tuple[Tensor | Images, Tensor],
        opts: TrainOptions, batch_size: int, run: TrainRun | None = None,
        test: tuple[Tensor | Images, Tensor] | None = None) -> TrainResult:
    """Backprop: train ``model`` in place for ``opts.epochs`` epochs at ``batch_size`` through train_loop.

    run: how the run is carried out (TrainRun: device, checkpoint, context, loss_fn, hooks, ...). Each epoch's
    shuffle, and its augmentation with opts.augment (training batches only), is seeded by (opts.seed, epoch).
    test: the split evaluated at every evaluation point when ``run.track_test``.
    """
    run = run or TrainRun()
    device = torch.device(run.device)
    context = run.context or no_context
    x_train, y_train = train
    step = fit_step(model.to(device), opts, batch_size, run, len(y_train))

    def evaluate_now() -> dict:
        size = run.eval_batch or batch_size
        row = {"val_acc": evaluate(model, *val, batch_size=size, device=device)}
        if run.track_test:
            row["test_acc"] = evaluate(model, *test, batch_size=size, device=device)
        return row

    schedule = Schedule(opts.epochs, math.ceil(len(x_train) / batch_size), opts.evals_per_epoch, opts.seed)
    result = train_loop(step, lambda epoch: batches(x_train, y_train, batch_size, shuffle=True,
                                                    seed=opts.seed * 1000 + epoch, augment=opts.augment),
                        schedule, evaluate_now,
                        replace(run, device=device, signature=_fit_signature(opts, batch_size, context, train, val, run)),
                        run.make_before_step(step, train, batch_size) if run.make_before_step else None)
    result.split_batches = step.split_batches
    if step.split_batches:
        log.info("%s: %d of %d batches stored denser activations than the measured ones and were trained in "
                 "halves to stay under the budget", run.desc, step.split_batches, result.steps)
    return result


def fit_step(model: nn.Module, opts: TrainOptions, batch_size: int, run: TrainRun, samples: int) -> TrainStep:
    """The step fit trains ``model`` with at ``batch_size`` on ``samples`` samples an epoch: its optimizer at the
    learning rate of the samples one update takes (with accumulation, the group's), its context, loss, stored
    bound and tricks. edgeflux.plan times the same step."""
    tricks = run.step_tricks(batch_size)
    if tricks is not None and run.tricks.accumulate:
        tricks = replace(tricks, accumulation=Accumulation.for_epoch(samples, batch_size, run.tricks.effective_batch))
        # the scheduler steps per micro-batch, the optimizer per group: torch's warning about the order is moot
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
    per_update = tricks.accumulation.effective if tricks is not None and tricks.accumulation else batch_size
    return TrainStep.factory(optimizer_factory(opts.model_copy(update={"lr": opts.lr_for(per_update)})),
                             loss_fn=run.loss_fn, context=run.context or no_context, bound=run.stored_bound,
                             tricks=tricks)(model)


def _fit_signature(opts: TrainOptions, batch_size: int, context: StepContext, train: tuple, val: tuple,
                   run: TrainRun) -> str:
    """What a fit run is: options, batch, how activations are saved, and the data (a checkpoint of a run on a
    split prepared differently since is not resumed). Not the starting weights: a fresh process builds them
    anew; a caller fine-tuning loaded weights passes their identity (and its method) as ``run.signature``."""
    parts = dict(opts=opts.model_dump(), batch_size=batch_size, context=_describe(context),
                 data=tensor_digest(*train, *val))
    if run.loss_fn is not F.cross_entropy:   # only then: the signatures of existing checkpoints stay as they were
        parts["loss"] = run.loss_fn.__qualname__
    if run.tricks is not None and run.tricks.on():
        parts["tricks"] = run.tricks.model_dump()
    return run_signature(**parts, start=run.signature) if run.signature else run_signature(**parts)
