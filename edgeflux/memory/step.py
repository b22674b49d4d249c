"""Measuring one training step: the figure a memory budget is held against.

The figure must not be below the real peak of the step that trains, scratch inside ops included, so it
is read from the allocator that serves the step: on CUDA the caching allocator's own counter
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), on CPU the allocator's events
over the plain step (``edgeflux.memory.allocator``) above what exists before it (parameters, buffers,
optimizer state, the batch). Gradients from an earlier step are dropped first, as every edgeflux step
does at its start (``zero_grad(set_to_none=True)``): the CPU allocator does not report freeing memory
allocated before it was observed. ``measure_training_step`` measures the step a trainer runs, built by
the same factory, on a copy of the model.
"""
from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edgeflux.models.units import train_mode
from edgeflux.step import StepContext, StepFactory, TrainStep

from .blocks import split_blocks_exactly
from .process import RssSampler, uss_bytes
from .allocator import alive_at_peak_and_end, allocator_events, data_pointers, peak_of
from .saved import count_saved_tensors
from .tracker import storage_of as _storage, track_live_tensors

log = logging.getLogger(__name__)


@dataclass
class StepMemory:
    """Memory of one training step. peak_bytes is measured; rss/uss are a process-level cross-check."""
    device: str
    method: str                      # "cuda_allocator" | "cpu_allocator"
    peak_bytes: int                  # the allocator's peak over the step, scratch inside ops included
    param_bytes: int                 # the categories below: alive at the peak (CPU) / after the step (CUDA)
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int            # peak - params - buffers - grads - optimizer: activations, saved, temps, input
    saved_bytes: int                 # saved for backward, deduplicated, parameters and buffers excluded
    saved_by_unit: dict[str, int] = field(default_factory=dict)
    rss_peak_bytes: int | None = None    # process peak RSS during the step (sampled), not exact
    uss_bytes: int | None = None         # process USS after the step, not exact
    buffer_bytes: int = 0                # BN running statistics etc.
    activation_storage: dict | None = None   # the step context's own accounting (e.g. BitTrain's summary)
    # stored bytes after each stored activation (BitTrain), per context the step entered (a block step: one
    # per unit): what edgeflux.memory.StoredBound holds later batches to; not written out (to_dict)
    stored_envelope: list[list[int]] | None = None

    def set_stored(self, storage: dict, stored_by_unit: dict[str, int]) -> None:
        """A step context with saved-tensor hooks of its own (BitTrain) is innermost, so the generic
        count of saved tensors saw nothing: what was saved for backward is what the context stored."""
        self.activation_storage = storage
        self.saved_by_unit = dict(stored_by_unit)
        self.saved_bytes = sum(self.saved_by_unit.values())

    def to_dict(self) -> dict:
        # unit_order: saved_by_unit's keys in model order (JSON files are written with sorted keys)
        out = {**asdict(self), "unit_order": list(self.saved_by_unit)}
        del out["stored_envelope"]
        return out


def _tensors_of_state(optimizer: torch.optim.Optimizer | None) -> Iterator[Tensor]:
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))


def _unique_bytes(tensors: Iterable[Tensor]) -> int:
    storages = {id(st): st.nbytes() for st in map(_storage, tensors) if st is not None}
    return sum(storages.values())


def _held_tensors(model: nn.Module) -> list[Tensor]:
    """State a module holds outside its parameters and buffers, which it lists in ``held_tensors()``
    (edgeflux.mobiletl.FrozenBottom: a frozen int8 network): counted with the buffers."""
    return [t for m in model.modules() if hasattr(m, "held_tensors") for t in m.held_tensors()]


def _parameters(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[Tensor]:
    params = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    return list({id(p): p for p in params}.values())


def measure_step(step: Callable[[], Any], *, model: nn.Module | None = None, optimizer=None,
                 inputs: Sequence[Tensor] = (), units: Sequence[tuple[str, nn.Module]] | None = None,
                 device: str | torch.device = "cpu", process_stats: bool = True, keep_grads: bool = False) -> StepMemory:
    """Run `step()` once and measure its memory.

    model/optimizer/inputs: the tensors that exist before the step, counted in the peak from
    the start and reported per category. units: (name, module) pairs for saved_by_unit;
    defaults to zip(model.unit_names, model.units) when the model has them. process_stats=False
    leaves out the process cross-check (rss_peak_bytes, uss_bytes: None): reading USS parses
    /proc/self/smaps_rollup, ~7 ms, and the RSS sampler is a thread polling beside the step,
    which a caller that keeps only peak_bytes (the NeuroFlux profiler) need not pay for.
    keep_grads: the step adds to the gradients there are (a micro-batch of an accumulating step that does
    not open its group): they are held from the start, counted as such, not dropped first.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"measure_step supports 'cpu' and 'cuda' devices, not {device}")
    if units is None and model is not None and hasattr(model, "units") and hasattr(model, "unit_names"):
        units = list(zip(model.unit_names, model.units))
    params = _parameters(model, optimizer)
    buffers = [*model.buffers(), *_held_tensors(model)] if model is not None else []

    if device.type == "cpu" and not keep_grads:
        for p in params:      # what the step's zero_grad(set_to_none=True) frees first (see module docstring)
            p.grad = None
    with _collector_paused(full=device.type == "cuda"), \
            (RssSampler() if process_stats else nullcontext()) as rss, \
            count_saved_tensors(units, params + buffers) as saved:
        if device.type == "cuda":
            peak, at_peak = _cuda_peak(step, device), None
        else:
            peak, at_peak = _cpu_allocator_peak(step, params, buffers, optimizer, inputs)

    if at_peak is None:   # CUDA: the persistent tensors as they are after the step
        at_peak = {"param": _unique_bytes(params), "buffer": _unique_bytes(buffers),
                   "grad": _unique_bytes(p.grad for p in params if p.grad is not None),
                   "optimizer": _unique_bytes(_tensors_of_state(optimizer))}
    known = {k: at_peak.get(k, 0) for k in ("param", "buffer", "grad", "optimizer")}
    return StepMemory(
        device=str(device),
        method="cuda_allocator" if device.type == "cuda" else "cpu_allocator",
        peak_bytes=int(peak),
        param_bytes=known["param"], grad_bytes=known["grad"], optimizer_bytes=known["optimizer"],
        activation_bytes=int(peak) - sum(known.values()),
        saved_bytes=saved.total_bytes, saved_by_unit=dict(saved.by_unit),
        rss_peak_bytes=rss.peak if process_stats else None, uss_bytes=uss_bytes() if process_stats else None,
        buffer_bytes=known["buffer"],
    )


def _cpu_allocator_peak(step: Callable[[], Any], params: list[Tensor], buffers: list[Tensor],
                        optimizer: torch.optim.Optimizer | None, inputs: Sequence[Tensor]) -> tuple[int, dict[str, int]]:
    """The CPU allocator's peak over step(): what exists before it (by storage, each counted once) plus the
    most the step's own allocations reach (edgeflux.memory.allocator), and the bytes per category at that moment."""
    before: dict[int, tuple[str, int]] = {}
    for label, tensors in (("param", params), ("buffer", buffers), ("optimizer", _tensors_of_state(optimizer)),
                           ("grad", [p.grad for p in params if p.grad is not None]), ("input", inputs)):
        for t in tensors:
            st = _storage(t)
            if st is not None and st.nbytes():
                before.setdefault(st.data_ptr(), (label, st.nbytes()))
    result = peak_of(allocator_events(step))
    at_peak: dict[str, int] = {}
    for label, nbytes in before.values():
        at_peak[label] = at_peak.get(label, 0) + nbytes
    # made during the step and alive from the peak to its end: the gradients (and state a first step creates)
    for label, tensors in (("grad", [p.grad for p in params if p.grad is not None]),
                           ("optimizer", list(_tensors_of_state(optimizer)))):
        at_peak[label] = at_peak.get(label, 0) + alive_at_peak_and_end(result, data_pointers(tensors) - before.keys())
    return sum(nbytes for _, nbytes in before.values()) + result.peak_bytes, at_peak


@contextmanager
def _collector_paused(full: bool) -> Iterator[None]:
    """Collect young cyclic garbage, then keep the cycle collector off for the block (restored after).

    Garbage of earlier steps must not be freed inside a measured step: a collection at some
    moment of the step would free what it holds (an old gradient, say) at a moment that depends
    on the allocation history. So the young generations, where the garbage of the steps just
    before lies, are collected first (milliseconds), and inside the block nothing is freed but by
    reference counting. Not a full collection: it walks every object of the process (torch,
    MLflow, Prefect: ~130 ms a call on the 2-core VM) and took two thirds of NeuroFlux's profiling
    time. Older garbage is rare, and on CPU it enters the peak only if it holds a storage the step
    reads or seeds (memory really held, then). The CUDA allocator counts every allocated byte, so
    there (``full``) all garbage is collected first.
    """
    gc.collect(2 if full else 1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _cuda_peak(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes the CUDA caching allocator handed to tensors during `step()`, its blocks split to the
    request (edgeflux.memory.blocks), as in the training loop."""
    split_blocks_exactly()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)   # the peak restarts at what is allocated now
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def warm_up(step, x: Tensor, y: Tensor) -> None:
    """The steps before a measured one, so that it runs as in the middle of training: one step, which creates the
    optimizer's state (SGD momentum, Adam moments). A step that accumulates micro-batches (every > 1) steps its
    optimizer only where a group closes: it runs a whole group and the next group's micro-batches but the last,
    so that the measured one closes a group with that state alive through its backward."""
    accumulation = getattr(step, "accumulation", None)
    for _ in range(2 * accumulation.every - 1 if accumulation is not None and accumulation.every > 1 else 1):
        step(x, y)


def measure_training_step(model: nn.Module, make_step: StepFactory, warmup: tuple[Tensor, Tensor],
                          batch: tuple[Tensor, Tensor], device: str | torch.device = "cpu",
                          process_stats: bool = True) -> StepMemory:
    """Measure one steady-state step of ``make_step(copy of model)`` on ``batch``; ``model`` is untouched.

    The step is the one the trainer runs (the same factory builds both), on a deep copy in training mode
    (modules a method keeps in eval mode stay so). It warms up on ``warmup`` first (warm_up), so that
    optimizer state (SGD momentum, Adam moments) exists as it does during training; the next step is
    measured. process_stats: see measure_step.

    Random draws (dropout masks, which BitTrain's stored bytes depend on) come from seed 0 in a forked
    generator: the same batch measures the same every time, and the trainer's random stream is left as it was.
    """
    device = torch.device(device)
    if device.type == "cuda":   # before the copy and the warm-up step allocate: their blocks are exact too
        split_blocks_exactly()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        net = train_mode(copy.deepcopy(model).to(device))
        step = make_step(net)
        warm_up(step, warmup[0].to(device), warmup[1].to(device))
        x, y = batch[0].to(device), batch[1].to(device)
        accumulation = getattr(step, "accumulation", None)
        memory = measure_step(lambda: step(x, y), model=net, optimizer=step.optimizer, inputs=(x, y),
                              units=step.units(), device=device, process_stats=process_stats,
                              keep_grads=accumulation is not None and accumulation.every > 1)
    if (stored := step.activation_storage()) is not None:
        memory.set_stored(*stored)
        entered = step.entered if isinstance(step.entered, list) else [step.entered]   # a block step: per unit
        trajectories = [getattr(c, "trajectory", None) for c in entered]
        memory.stored_envelope = (None if any(t is None for t in trajectories)
                                  else [list(t) for t in trajectories])
    return memory


def live_tensor_peak(model: nn.Module, make_step: StepFactory, warmup: tuple[Tensor, Tensor],
                     batch: tuple[Tensor, Tensor]) -> int:
    """The exact peak of live tensor bytes (track_live_tensors) over the steady-state step that
    measure_training_step measures, on CPU: what a tensor-level count sees, without the scratch kernels
    allocate inside one op. For comparison only: a budget is held against the allocator's figure."""
    net = train_mode(copy.deepcopy(model))
    step = make_step(net)
    warm_up(step, *warmup)
    for p in net.parameters():
        p.grad = None
    state = [*net.parameters(), *net.buffers(), *batch, *_tensors_of_state(step.optimizer)]
    with track_live_tensors(seed=state) as tracker:
        step(*batch)
    return tracker.peak_bytes


def measure_training_peak(model: nn.Module, optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                          sample_shape: Sequence[int], num_classes: int, batch: int,
                          device: str | torch.device = "cpu", data: tuple[Tensor, Tensor] | None = None,
                          context: StepContext | None = None, process_stats: bool = True) -> StepMemory:
    """measure_training_step of the standard TrainStep at batch size `batch`.

    Inputs: the first `batch` samples of `data` when given (real images: activation sparsity, which
    compressed storage depends on, is that of the data), else random inputs of shape [batch, *sample_shape]
    and random labels (the warm-up step gets a draw of its own). `context` wraps forward and backward as in
    training (see edgeflux.step.TrainStep).
    """
    gen = torch.Generator().manual_seed(batch)

    def batch_tensors() -> tuple[Tensor, Tensor]:
        if data is not None:
            if len(data[0]) < batch:
                raise ValueError(f"cannot measure batch {batch} on {len(data[0])} samples")
            return data[0][:batch].clone(), data[1][:batch].clone()
        x = torch.randn(batch, *sample_shape, generator=gen)
        return x, torch.randint(0, num_classes, (batch,), generator=gen)

    warmup = batch_tensors()
    return measure_training_step(model, TrainStep.factory(optimizer_factory, context=context), warmup,
                                 batch_tensors(), device, process_stats)
