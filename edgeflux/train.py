"""The backprop training loop every stage shares: progress, history, resumable checkpoints.

``fit`` trains a model on in-memory tensors with SGD/Adam and a per-step cosine schedule,
evaluates on the validation split a few times per epoch, and records an accuracy-vs-time
history where time counts training only (evaluation excluded), so curves of different methods
compare fairly.

Resume: with ``checkpoint`` set, the full training state (model, optimizer, scheduler, RNG,
history, elapsed time) is written atomically after every epoch. A rerun with the same
checkpoint path and the same run signature continues from the next epoch, and because each
epoch's shuffle is seeded by (seed, epoch) the result equals an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from edgeflux.artifacts import atomic_write
from edgeflux.config import TrainOptions
from edgeflux.data import Images, batches
from edgeflux.memory import StepContext, no_context

log = logging.getLogger(__name__)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but no CUDA device is visible; set device: cpu (or auto)")
    return torch.device(name)


def make_optimizer(params, opts: TrainOptions) -> torch.optim.Optimizer:
    if opts.optimizer == "adam":
        return torch.optim.Adam(params, lr=opts.lr, weight_decay=opts.weight_decay)
    return torch.optim.SGD(params, lr=opts.lr, momentum=opts.momentum, weight_decay=opts.weight_decay)


def optimizer_factory(opts: TrainOptions) -> Callable[..., torch.optim.Optimizer]:
    return lambda params: make_optimizer(params, opts)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512,
             device: torch.device | str = "cpu") -> float:
    """Top-1 accuracy in [0, 1]; restores the model's train/eval mode.

    Budgeted trainers pass their training batch size: inference at the same batch needs less
    memory than a training step (nothing is saved for backward), so evaluation stays in budget.
    """
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i:i + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == y[i:i + batch_size]).sum().item()
    model.train(was_training)
    return correct / max(1, len(x))


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)   # rows: step, epoch, time_s, train_loss, val_acc
    train_time_s: float = 0.0
    steps: int = 0
    epochs_done: int = 0
    resumed_from_epoch: int = 0

    @property
    def best_val_acc(self) -> float:
        return max((r["val_acc"] for r in self.history), default=0.0)


def run_signature(**parts) -> str:
    """A short hash of what defines a run; a checkpoint of a different run is never resumed."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tensor_digest(*tensors: torch.Tensor | Images) -> str:
    """sha256 over the tensors' dtypes, shapes and bytes: any changed value, label or sample order shows.

    (Hashes the memory in place, ~1 GB/s; a contiguous CPU tensor is not copied. Images are
    hashed as what defines their values: the uint8 pixels and the normalisation.)
    """
    h = hashlib.sha256()
    flat = [part for t in tensors for part in ((t.pixels, t.mean, t.std) if isinstance(t, Images) else (t,))]
    for t in flat:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{list(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def rng_state() -> dict:
    """The global RNG states a resumed run must continue from: CPU, and every CUDA device's when CUDA
    is in use (dropout on a GPU draws from the CUDA generator)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def set_rng_state(state: dict | torch.Tensor) -> None:
    """Restore what rng_state() returned (a bare tensor: a checkpoint that kept the CPU state only)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _describe(context: Callable) -> Any:
    """A stable description of a step context for run signatures (its options, not its address)."""
    owner = getattr(context, "__self__", None)
    return owner.model_dump() if hasattr(owner, "model_dump") else getattr(context, "__qualname__", repr(context))


def save_checkpoint(path: Path, state: dict) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))  # a kill mid-write leaves the previous checkpoint


def load_checkpoint(path: Path, signature: str) -> dict | None:
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file: start over rather than crash
        log.warning("ignoring unreadable checkpoint %s (%s); training from scratch", path, exc)
        return None
    if state.get("signature") != signature:
        log.info("checkpoint %s belongs to another configuration; training from scratch", path)
        return None
    return state


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn())


def fit(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
        opts: TrainOptions, batch_size: int, *, device: torch.device | str = "cpu",
        checkpoint: Path | None = None, signature: str = "", desc: str = "train",
        on_epoch_end: Callable[[int, TrainResult], None] | None = None,
        context: StepContext | None = None, test: tuple[torch.Tensor, torch.Tensor] | None = None) -> TrainResult:
    """Train ``model`` in place for ``opts.epochs`` epochs at ``batch_size``.

    ``context(model)`` is entered around each forward and backward (how activations are saved,
    e.g. BitTrain); the batch-size measurement uses the same one.

    ``on_epoch_end(epoch, result)`` runs after each epoch's checkpoint is written (tests use it to
    interrupt a run). Deletes the checkpoint when training completes. ``test``: also record test
    accuracy at every evaluation (benchmarks' time-to-target curves; never used to choose anything).
    """
    device = torch.device(device)
    context = context or no_context
    model.to(device).train()
    x_train, y_train = train
    steps_per_epoch = math.ceil(len(x_train) / batch_size)
    total_steps = steps_per_epoch * opts.epochs
    eval_points = {round(steps_per_epoch * k / opts.evals_per_epoch) for k in range(1, opts.evals_per_epoch + 1)}

    optimizer = make_optimizer(model.parameters(), opts)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    result = TrainResult()
    start_epoch = 0
    # What the run is: options, batch, how activations are saved, and the data (a checkpoint of a run
    # on a split prepared differently since is not resumed). Not the starting weights: a fresh process
    # builds them anew; a caller fine-tuning loaded weights adds their identity to `signature`.
    signature = signature or run_signature(opts=opts.model_dump(), batch_size=batch_size, context=_describe(context),
                                           data=tensor_digest(x_train, y_train, *val))
    if checkpoint is not None and (state := load_checkpoint(checkpoint, signature)):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        result = TrainResult(**state["result"])
        start_epoch = result.resumed_from_epoch = result.epochs_done
        log.info("%s: resuming from checkpoint %s after epoch %d/%d", desc, checkpoint, start_epoch, opts.epochs)
    else:
        torch.manual_seed(opts.seed)

    with progress_bar() as progress:
        task = progress.add_task(desc, total=total_steps, completed=start_epoch * steps_per_epoch, status="")
        for epoch in range(start_epoch, opts.epochs):
            loss_sum, loss_n = 0.0, 0
            tick = time.perf_counter()
            loader = batches(x_train, y_train, batch_size, shuffle=True, seed=opts.seed * 1000 + epoch)
            for i, (xb, yb) in enumerate(loader, start=1):
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with context(model):
                    loss = F.cross_entropy(model(xb), yb)
                    loss.backward()
                optimizer.step()
                scheduler.step()
                result.steps += 1
                loss_sum += loss.item() * len(xb)
                loss_n += len(xb)
                if i in eval_points:
                    result.train_time_s += time.perf_counter() - tick
                    val_acc = evaluate(model, *val, batch_size=batch_size, device=device)
                    model.train()
                    row = {"step": result.steps, "epoch": epoch + i / steps_per_epoch, "time_s": result.train_time_s,
                           "train_loss": loss_sum / loss_n, "val_acc": val_acc}
                    if test is not None:
                        row["test_acc"] = evaluate(model, *test, batch_size=batch_size, device=device)
                        model.train()
                    result.history.append(row)
                    log.info("%s: epoch %.2f step %d loss %.4f val_acc %.4f (%.1fs training)", desc,
                             row["epoch"], row["step"], row["train_loss"], val_acc, result.train_time_s)
                    progress.update(task, status=f"loss {row['train_loss']:.3f} val {val_acc:.3f}")
                    loss_sum, loss_n = 0.0, 0
                    tick = time.perf_counter()
                progress.advance(task)
            result.train_time_s += time.perf_counter() - tick
            result.epochs_done = epoch + 1
            if checkpoint is not None:
                save_checkpoint(checkpoint, {
                    "signature": signature, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": rng_state(),
                    "result": {k: v for k, v in vars(result).items()},
                })
            if on_epoch_end is not None:
                on_epoch_end(epoch, result)
    if checkpoint is not None and checkpoint.exists():
        checkpoint.unlink()
    return result
