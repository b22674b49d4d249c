"""Measuring the memory of one training step: one API for CPU and CUDA.

    mem = measure_step(training_step_fn(model, opt, x, y), model=model, optimizer=opt, inputs=(x, y))
    mem.peak_bytes, mem.activation_bytes, mem.saved_by_unit, mem.rss_peak_bytes

What is measured, and how:

* CUDA: the caching allocator's own counter, ``torch.cuda.max_memory_allocated`` after
  ``torch.cuda.reset_peak_memory_stats`` (method ``"cuda_allocator"``).
* CPU: the exact peak of live tensor bytes during the step (method ``"cpu_live_tensors"``).
  ``LiveTensorTracker`` is a ``TorchDispatchMode``: every tensor an aten op returns (or takes,
  if it was not seen yet) has its untyped storage counted once, keyed by the storage object,
  added when first seen and subtracted when the storage is freed (a weakref callback on the
  storage object: PyTorch keeps a storage's Python object alive exactly as long as the storage,
  so the callback fires when the memory is released). Tensors that exist before the step
  (parameters, buffers, gradients, optimizer state, the batch) are seeded, deduplicated by
  storage. "Live tensor bytes" are storage bytes: what the allocator hands out to tensors,
  not scratch buffers a kernel allocates and frees inside one op (e.g. oneDNN workspaces),
  and not the allocator's or Python's own overhead.
* Bytes saved for backward (``count_saved_tensors``): counted in
  ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage (a ReLU output that
  the next conv also saves counts once), parameters and buffers excluded (their memory exists
  anyway), attributed to the unit whose forward is running.
* Process peak RSS (a 1 ms sampling thread) and USS after the step (psutil): a cross-check
  of the process as a whole (interpreter, libraries, allocator caches), never the exact figure.

Why our own tracker and not ``torch.distributed._tools.mem_tracker.MemTracker``: both were
evaluated on torch 2.14.1 / CPU and give identical, exact peaks (the tests compare them), but
MemTracker is a private API inside ``torch.distributed`` (absent on PyTorch builds without
distributed support, which edge builds can be), it installs global module and optimizer hooks
and monkey-patches ``UntypedStorage.resize_`` for the whole process, and it does not say which
of the tensors alive at the peak were gradients *at that moment* in the categories this
project reports. The dispatch-mode tracker is ~100 lines, has no global side effects, and
records allocation/free times so any group of tensors can be attributed to the peak exactly.
"""
from __future__ import annotations

import copy
import gc
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

log = logging.getLogger(__name__)

MiB = 2**20
OUTSIDE_UNITS = "(outside units)"   # saved bytes of ops that run in no unit (e.g. the loss)


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: ``format_bytes(12_900_000) == "12.3 MiB"``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def budget_at_least(n: int) -> str:
    """A budget to paste into params.yaml that covers n bytes: format_bytes rounded *up* to its last
    digit (``budget_at_least(7_553_476) == "7.3MiB"``; format_bytes says "7.2 MiB", which is less)."""
    for unit, size in (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if n < 1024 * size or unit == "GiB":
            return f"{int(n)}B" if unit == "B" else f"{math.ceil(n * 10 / size) / 10:.1f}{unit}"
    raise AssertionError("unreachable")


def _storage(t: Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without real memory (meta, sparse, ...)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


# ----------------------------------------------------------------------------- live tensors

@dataclass(slots=True)
class _Record:
    nbytes: int
    born: int                # tracker clock when first seen
    died: int | None = None  # tracker clock when freed (None: alive when tracking stopped)
    label: str | None = None


class LiveTensorTracker(TorchDispatchMode):
    """Exact running and peak bytes of live tensor storages (see the module docstring)."""

    def __init__(self, track_inputs: bool = True) -> None:
        super().__init__()
        self.track_inputs = track_inputs  # also count pre-existing tensors an op reads, from first sight
        self.current_bytes = 0
        self.peak_bytes = 0
        self._clock = 0
        self._peak_clock = 0
        self._records: list[_Record] = []
        self._live: dict[int, tuple[_Record, weakref.ref]] = {}   # id(storage) -> record, weakref

    def track(self, t: Tensor, label: str | None = None) -> None:
        """Count `t`'s storage from now on (once per storage); `label` names its category."""
        st = _storage(t)
        if st is None:
            return
        key = id(st)
        entry = self._live.get(key)
        if entry is not None:
            rec = entry[0]
            if label is not None and rec.label is None:
                rec.label = label
            if st.nbytes() != rec.nbytes:   # resized in place (e.g. an out= op grew it)
                self._add(st.nbytes() - rec.nbytes)
                rec.nbytes = st.nbytes()
            return
        # Allocate everything first: a GC pass triggered here may free storages, whose
        # callbacks must not interleave with the counter update below.
        rec = _Record(st.nbytes(), 0, None, label)
        ref = weakref.ref(st, partial(self._on_free, key))
        self._live[key] = (rec, ref)
        self._records.append(rec)
        self._add(rec.nbytes)
        rec.born = self._clock

    def label(self, t: Tensor, label: str) -> None:
        """Set the category of an already tracked tensor (e.g. gradients created during the step)."""
        st = _storage(t)
        entry = self._live.get(id(st)) if st is not None else None
        if entry is None:
            log.debug("label %r: tensor of shape %s was never seen by the tracker", label, tuple(t.shape))
            return
        entry[0].label = label

    def bytes_at_peak(self) -> dict[str | None, int]:
        """Bytes alive at the moment of the peak, per label (None: unlabelled)."""
        out: dict[str | None, int] = {}
        for r in self._records:
            if r.born <= self._peak_clock and (r.died is None or r.died > self._peak_clock):
                out[r.label] = out.get(r.label, 0) + r.nbytes
        return out

    def _add(self, delta: int) -> None:
        self._clock += 1
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_clock = self._clock

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._add(-entry[0].nbytes)
            entry[0].died = self._clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.track_inputs:
            tree_map_only(Tensor, self.track, (args, kwargs))
        out = func(*args, **(kwargs or {}))
        tree_map_only(Tensor, self.track, out)
        return out

    def stop(self) -> None:
        """Stop following frees: the counters keep their values at this moment."""
        self._live.clear()   # dropping the weakrefs drops their callbacks


@contextmanager
def track_live_tensors(seed: Iterable[Tensor] = (), track_inputs: bool = True) -> Iterator[LiveTensorTracker]:
    """Exact peak of live tensor bytes inside the block; `seed` tensors count from the start.

    The seeds are not kept alive by the tracker (only weak references), so a seeded gradient
    that the step frees (zero_grad(set_to_none=True)) stops counting when it is freed.
    """
    tracker = LiveTensorTracker(track_inputs=track_inputs)
    for t in seed:
        tracker.track(t)
    try:
        with tracker:
            yield tracker
    finally:
        tracker.stop()


# ----------------------------------------------------------------------------- saved for backward

UnitsArg = nn.Module | Sequence[tuple[str, nn.Module]] | None


def resolve_units(units: UnitsArg) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    """(name, module) pairs to attribute to, and the modules whose parameters/buffers they cover.

    units: None (no attribution); a UnitModel (its unit_names/units); any other nn.Module (its
    named children, or the module itself when it has none); or (name, module) pairs.
    """
    if units is None:
        return [], []
    if isinstance(units, nn.Module):
        if hasattr(units, "units") and hasattr(units, "unit_names"):
            return list(zip(units.unit_names, units.units)), [units]
        children = list(units.named_children())
        return (children or [(type(units).__name__, units)]), [units]
    pairs = list(units)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], nn.Module)):
            raise TypeError(f"units must be a module or (name, module) pairs, got an element {pair!r}")
    return pairs, [m for _, m in pairs]


def _reports_running_unit(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> bool:
    """model is a UnitModel and `units` are exactly its units (same names, same modules, same order)."""
    names, modules = getattr(model, "unit_names", None), getattr(model, "units", None)
    return (hasattr(type(model), "running_unit") and names is not None and modules is not None
            and [n for n, _ in units] == list(names) and all(m is u for (_, m), u in zip(units, modules)))


class UnitTracker:
    """Which unit's forward is running, for saved-tensor attribution.

        with UnitTracker([("conv1", m1), ("conv2", m2)]) as where:
            ...                       # inside a saved_tensors_hooks pack hook: where.current

    A saved tensor belongs to the innermost unit whose forward is running when autograd saves
    it, or to OUTSIDE_UNITS (e.g. the loss). One tracker for SavedTensorCounter and BitTrain's
    accounting, so both attribute the same tensor to the same unit.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], model: nn.Module | None = None) -> None:
        """model: a UnitModel whose units these are; its forward reports the running unit itself
        (UnitModel.running_unit), so no module hooks are needed (they cost every unit call)."""
        self.units = list(units)
        self.model = model if model is not None and _reports_running_unit(model, self.units) else None
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        """The innermost running unit, or OUTSIDE_UNITS."""
        if self.model is not None:
            name = self.model.running_unit
            return name if name is not None else OUTSIDE_UNITS
        return self._stack[-1] if self._stack else OUTSIDE_UNITS

    def _enter(self, name: str, _module: nn.Module, _inputs: Any) -> None:
        self._stack.append(name)

    def _exit(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> UnitTracker:
        if self.model is not None:
            return self
        for name, module in self.units:
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
            # always_call: a forward that raises still pops its name
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was modified in place before backward used it."""


def check_saved_version(t: Tensor, saved_version: int) -> Tensor:
    """Autograd's own in-place check, which custom saved-tensor hooks otherwise switch off."""
    if t._version != saved_version:
        raise SavedTensorModifiedError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.dtype}{list(t.shape)}] is at version {t._version}; expected version {saved_version} "
            f"(checked by edgeflux, whose saved-tensor hooks replace autograd's own check). "
            f"Avoid modifying tensors in place between forward and backward, e.g. use an out-of-place op")
    return t


class SavedTensorCounter:
    """Bytes saved for backward, deduplicated by storage, persistent tensors excluded, per unit."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]], exclude: Iterable[Tensor]) -> None:
        self.total_bytes = 0
        self.by_unit: dict[str, int] = {name: 0 for name, _ in units} | {OUTSIDE_UNITS: 0}
        self.where = UnitTracker(units)
        # Pin the excluded storages so their ids stay unique (they are alive anyway).
        self._excluded = {id(st): st for st in map(_storage, exclude) if st is not None}
        self._seen: dict[int, weakref.ref] = {}

    def pack(self, t: Tensor) -> tuple[Tensor, int]:
        # detach: returning t itself would make an op's saved output hold its own grad_fn (a
        # reference cycle that outlives the step); the version restores autograd's in-place check.
        packed = (t if isinstance(t, nn.Parameter) else t.detach(), t._version)
        st = _storage(t)
        if isinstance(t, nn.Parameter) or st is None or id(st) in self._excluded or id(st) in self._seen:
            return packed
        key = id(st)
        self._seen[key] = weakref.ref(st, lambda _r, k=key: self._seen.pop(k, None))
        self.total_bytes += st.nbytes()
        unit = self.where.current
        self.by_unit[unit] = self.by_unit.get(unit, 0) + st.nbytes()
        return packed

    @staticmethod
    def unpack(packed: tuple[Tensor, int]) -> Tensor:
        return check_saved_version(*packed)


@contextmanager
def count_saved_tensors(units: Sequence[tuple[str, nn.Module]] | None = None,
                        params: Iterable[Tensor] = ()) -> Iterator[SavedTensorCounter]:
    """Count the bytes autograd saves for backward inside the block.

    units: (name, module) pairs; a saved tensor is attributed to the innermost unit whose
    forward is running, or to OUTSIDE_UNITS (e.g. the loss), so by_unit sums to total_bytes.
    params: tensors whose storage is not counted when saved (parameters, buffers);
    nn.Parameter instances are always excluded. Saved tensors are restored unchanged, so
    training is unaffected. An inner saved_tensors_hooks (e.g. BitTrain's) takes precedence,
    and then this counter sees nothing.
    """
    counter = SavedTensorCounter(list(units or []), params)
    with counter.where, torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield counter


def saved_bytes_by_node(output: Tensor, exclude: Iterable[Tensor] = ()) -> dict[str, int]:
    """Bytes autograd holds for the backward of ``output``, per graph node type (``ConvolutionBackward0``, ...).

    Read from the graph itself (every node's ``_saved_*`` tensors, each storage counted once, for the
    first node that holds it in a walk from ``output``; the storages of ``exclude`` (parameters,
    buffers) and nn.Parameter never counted), so it answers what count_saved_tensors cannot: which
    operations the saved bytes belong to (e.g. the input copies an in-place ReLU6 saves). Its total
    equals count_saved_tensors' for the same forward. Call it before backward, on a graph built
    without saved-tensor hooks (reading a saved tensor runs a hook's unpack: BitTrain would restore).
    """
    # (a saved tensor's storage object is made anew on each read: storages are told apart by address)
    excluded = {st.data_ptr() for st in map(_storage, exclude) if st is not None and st.nbytes()}
    seen: set[int] = set()
    by_node: dict[str, int] = {}
    todo, visited = [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                st = _storage(t) if isinstance(t, Tensor) and not isinstance(t, nn.Parameter) else None
                if st is None or not st.nbytes() or st.data_ptr() in excluded or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                kind = type(node).__name__
                by_node[kind] = by_node.get(kind, 0) + st.nbytes()
        todo += [fn for fn, _ in node.next_functions]
    return dict(sorted(by_node.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------- process RSS/USS

class _RssSampler:
    """Peak process RSS sampled every `interval` seconds on a background thread."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak: int | None = None
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        try:
            rss = self._proc.memory_info().rss
        except psutil.Error:
            return
        self.peak = rss if self.peak is None else max(self.peak, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> _RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def retain_freed_heap(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc's malloc to serve CPU tensors up to ``mmap_threshold`` bytes from its heap and to
    keep freed heap memory for reuse (process-wide, for the rest of the process; CPU only).

    By default glibc gives every allocation above its (adaptive) threshold fresh pages from the
    kernel and returns them on free, so a training step that allocates and frees the same
    activation sizes every step pays a page fault per 4 KiB each time (measured by
    bench/bittrain.py's --malloc retain; PyTorch's CPU performance guide suggests jemalloc or
    tcmalloc for the same reason). Peak memory is unchanged; the process's RSS stays at its
    peak instead of shrinking between steps. Returns False (and changes nothing) where the C
    library is not glibc. 32 MiB is the largest threshold glibc accepts on 64-bit machines.
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    if ok:
        log.info("glibc malloc: heap serves allocations up to %s and keeps freed memory", format_bytes(mmap_threshold))
    return ok


def _uss_bytes() -> int | None:
    try:
        return int(psutil.Process().memory_full_info().uss)
    except (psutil.Error, AttributeError):   # AccessDenied, or no USS on this platform
        return None


# ----------------------------------------------------------------------------- one step

@dataclass
class StepMemory:
    """Memory of one training step. peak_bytes is measured; rss/uss are a process-level cross-check."""
    device: str
    method: str                      # "cuda_allocator" | "cpu_live_tensors"
    peak_bytes: int                  # measured peak of live tensor bytes (CUDA: max_memory_allocated)
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

    def set_stored(self, storage: dict, stored_by_unit: dict[str, int]) -> None:
        """A step context with saved-tensor hooks of its own (BitTrain) is innermost, so the generic
        count of saved tensors saw nothing: what was saved for backward is what the context stored."""
        self.activation_storage = storage
        self.saved_by_unit = dict(stored_by_unit)
        self.saved_bytes = sum(self.saved_by_unit.values())

    def to_dict(self) -> dict:
        # unit_order: saved_by_unit's keys in model order (JSON files are written with sorted keys)
        return {**asdict(self), "unit_order": list(self.saved_by_unit)}


def _tensors_of_state(optimizer: torch.optim.Optimizer | None) -> Iterator[Tensor]:
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))


def _unique_bytes(tensors: Iterable[Tensor]) -> int:
    storages = {id(st): st.nbytes() for st in map(_storage, tensors) if st is not None}
    return sum(storages.values())


def _parameters(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[Tensor]:
    params = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    return list({id(p): p for p in params}.values())


def _seed(tracker: LiveTensorTracker, params: list[Tensor], buffers: list[Tensor],
          optimizer: torch.optim.Optimizer | None, inputs: Sequence[Tensor]) -> None:
    # A function of its own so that no reference to a seeded tensor (e.g. last step's
    # gradient, which the step frees) outlives it.
    for p in params:
        tracker.track(p, "param")
    for b in buffers:
        tracker.track(b, "buffer")
    for p in params:
        if p.grad is not None:
            tracker.track(p.grad, "grad")
    for t in _tensors_of_state(optimizer):
        tracker.track(t, "optimizer")
    for t in inputs:
        tracker.track(t, "input")


def _label_after_step(tracker: LiveTensorTracker, params: list[Tensor],
                      optimizer: torch.optim.Optimizer | None) -> None:
    # Gradients and optimizer state created during the step are only known once it is done.
    for p in params:
        if p.grad is not None:
            tracker.label(p.grad, "grad")
    for t in _tensors_of_state(optimizer):
        tracker.label(t, "optimizer")


def measure_step(step: Callable[[], Any], *, model: nn.Module | None = None, optimizer=None,
                 inputs: Sequence[Tensor] = (), units: Sequence[tuple[str, nn.Module]] | None = None,
                 device: str | torch.device = "cpu", process_stats: bool = True) -> StepMemory:
    """Run `step()` once and measure its memory.

    model/optimizer/inputs: the tensors that exist before the step, counted in the peak from
    the start and reported per category. units: (name, module) pairs for saved_by_unit;
    defaults to zip(model.unit_names, model.units) when the model has them. process_stats=False
    leaves out the process cross-check (rss_peak_bytes, uss_bytes: None): reading USS parses
    /proc/self/smaps_rollup, ~7 ms, and the RSS sampler is a thread polling beside the step,
    which a caller that keeps only peak_bytes (the NeuroFlux profiler) need not pay for.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"measure_step supports 'cpu' and 'cuda' devices, not {device}")
    if units is None and model is not None and hasattr(model, "units") and hasattr(model, "unit_names"):
        units = list(zip(model.unit_names, model.units))
    params = _parameters(model, optimizer)
    buffers = list(model.buffers()) if model is not None else []

    with _collector_paused(full=device.type == "cuda"), \
            (_RssSampler() if process_stats else nullcontext()) as rss, \
            count_saved_tensors(units, params + buffers) as saved:
        if device.type == "cuda":
            peak, at_peak = _cuda_peak(step, device), None
        else:
            with track_live_tensors() as tracker:
                _seed(tracker, params, buffers, optimizer, inputs)
                step()
                _label_after_step(tracker, params, optimizer)
            peak, at_peak = tracker.peak_bytes, tracker.bytes_at_peak()

    if at_peak is None:   # CUDA: the persistent tensors as they are after the step
        at_peak = {"param": _unique_bytes(params), "buffer": _unique_bytes(buffers),
                   "grad": _unique_bytes(p.grad for p in params if p.grad is not None),
                   "optimizer": _unique_bytes(_tensors_of_state(optimizer))}
    known = {k: at_peak.get(k, 0) for k in ("param", "buffer", "grad", "optimizer")}
    return StepMemory(
        device=str(device),
        method="cuda_allocator" if device.type == "cuda" else "cpu_live_tensors",
        peak_bytes=int(peak),
        param_bytes=known["param"], grad_bytes=known["grad"], optimizer_bytes=known["optimizer"],
        activation_bytes=int(peak) - sum(known.values()),
        saved_bytes=saved.total_bytes, saved_by_unit=dict(saved.by_unit),
        rss_peak_bytes=rss.peak if process_stats else None, uss_bytes=_uss_bytes() if process_stats else None,
        buffer_bytes=known["buffer"],
    )


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
    """Peak bytes the CUDA caching allocator handed to tensors during `step()`."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)   # the peak restarts at what is allocated now
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


StepContext = Callable[[nn.Module], AbstractContextManager]


def no_context(model: nn.Module) -> AbstractContextManager:
    """The StepContext of plain training: nothing changes how activations are saved."""
    return nullcontext()


def training_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                     loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
                     context: StepContext | None = None) -> Callable[[], float]:
    """One standard training step as a closure: zero_grad(set_to_none), forward, loss, backward, step.

    context(model): entered around forward and backward (e.g. BitTrain's compressed saved
    activations), so a measured step stores activations exactly as the trainer does.
    """
    context = context or no_context

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with context(model) as entered:
            loss = loss_fn(model(x), y)
            loss.backward()
        step.context = entered   # measure_training_peak reads its accounting, if it has any
        optimizer.step()
        return loss.item()
    return step


def measure_training_peak(model: nn.Module, optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                          sample_shape: Sequence[int], num_classes: int, batch: int,
                          device: str | torch.device = "cpu", data: tuple[Tensor, Tensor] | None = None,
                          context: StepContext | None = None, process_stats: bool = True) -> StepMemory:
    """Measure one steady-state training step of a copy of `model` at batch size `batch`.

    A deep copy and a fresh optimizer take one warm-up step first, so that optimizer state
    (SGD momentum, Adam moments) exists as it does during training; the next step is measured.
    Inputs: the first `batch` samples of `data` when given (real images: activation sparsity,
    which compressed storage depends on, is that of the data), else random inputs of shape
    [batch, *sample_shape] and random labels. `context` wraps forward and backward as in
    training (see training_step_fn). `model` is untouched. process_stats: see measure_step.
    """
    device = torch.device(device)
    net = copy.deepcopy(model).to(device).train()
    optimizer = optimizer_factory(net.parameters())
    gen = torch.Generator().manual_seed(batch)

    def batch_tensors() -> tuple[Tensor, Tensor]:
        if data is not None:
            if len(data[0]) < batch:
                raise ValueError(f"cannot measure batch {batch} on {len(data[0])} samples")
            return data[0][:batch].clone().to(device), data[1][:batch].clone().to(device)
        x = torch.randn(batch, *sample_shape, generator=gen).to(device)
        y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)
        return x, y

    training_step_fn(net, optimizer, *batch_tensors(), context=context)()   # warm-up: creates the optimizer state
    x, y = batch_tensors()
    units = list(zip(net.unit_names, net.units)) if hasattr(net, "units") and hasattr(net, "unit_names") else None
    step = training_step_fn(net, optimizer, x, y, context=context)
    memory = measure_step(step, model=net, optimizer=optimizer, inputs=(x, y), units=units, device=device,
                          process_stats=process_stats)
    if hasattr(step.context, "summary"):
        summary = step.context.summary()
        memory.set_stored(summary, {name: unit["stored_bytes"] for name, unit in summary["units"].items()})
    return memory


# ----------------------------------------------------------------------------- batch size under a budget

CONTENT_SAMPLES = 3   # batches measured per batch size when activation storage depends on the values


def largest_over_batches(measure: Callable[[int], StepMemory], available: int,
                         samples: int = CONTENT_SAMPLES) -> StepMemory:
    """measure(0), or, where the step stores activations by their content (``activation_storage`` is
    set: BitTrain's bitmap holds the batch's non-zeros), the largest peak of measure(i) over the first
    min(samples, available) disjoint batches i: one batch's peak would not bound the others'."""
    step = measure(0)
    if step.activation_storage is not None:
        for i in range(1, min(samples, available)):
            step = max(step, measure(i), key=lambda s: s.peak_bytes)
    return step


class BudgetTooSmallError(RuntimeError):
    """Even batch size 1 does not fit the memory budget."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int) -> None:
        self.budget_bytes, self.min_feasible_bytes = int(budget_bytes), int(min_feasible_bytes)
        need = f"{format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes)"
        super().__init__(
            f"the memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the measured peak "
            f"of one training step at batch size 1, {need}: the smallest feasible budget is {need} (measured); "
            f"raise the budget to at least {budget_at_least(min_feasible_bytes)} or choose a smaller/narrower model")


@dataclass
class BatchFit:
    """The largest batch whose measured peak fits the budget, and the measurements behind it."""
    batch_size: int
    peak_bytes: int                      # measured at batch_size
    budget_bytes: int
    measurements: list[tuple[int, int]]  # (batch, measured peak), every point measured, by batch
    slope_bytes_per_sample: float        # estimate: least-squares line bytes = slope*batch + intercept
    intercept_bytes: float               # estimate
    r2: float                            # of that line over the measurements
    min_feasible_bytes: int              # measured peak at batch 1


def fit_linear(batches: Sequence[float], values: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares line values = a*batches + b; returns (a, b, r2). One point: (0, value, 1)."""
    n = len(batches)
    if n == 0 or n != len(values):
        raise ValueError(f"fit_linear needs equally many batches and values (got {n} and {len(values)})")
    mx, my = sum(batches) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in batches)
    if sxx == 0:
        return 0.0, float(my), 1.0
    a = sum((x - mx) * (y - my) for x, y in zip(batches, values)) / sxx
    b = my - a * mx
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(batches, values))
    ss_tot = sum((y - my) ** 2 for y in values)
    return float(a), float(b), 1.0 if ss_tot == 0 else float(1 - ss_res / ss_tot)


def max_batch_under_budget(measure: Callable[[int], int], budget_bytes: int, max_batch: int) -> BatchFit:
    """The largest batch <= max_batch whose measured peak, measure(batch), is <= budget_bytes.

    Measures batch 1 (BudgetTooSmallError if it is over budget) and batch 8, extrapolates the
    line through the two largest measurements to the budget until a measurement lands over
    it, then interpolates inside the bracket (Illinois regula falsi). Every guess lies strictly
    between the largest batch measured under budget and the smallest measured over it, so the
    bracket shrinks each time. A linear peak takes 4 measurements, a clearly curved one ~10.
    The answer is a measured fact: the returned batch was measured under budget and batch+1
    was measured over it (or the batch is max_batch). The fitted line in the result is an
    estimate over all measurements, reported beside them.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    measured: dict[int, int] = {}

    def m(batch: int) -> int:
        if batch not in measured:
            measured[batch] = int(measure(batch))
            log.debug("batch %d: measured peak %s", batch, format_bytes(measured[batch]))
        return measured[batch]

    if m(1) > budget_bytes:
        raise BudgetTooSmallError(budget_bytes, measured[1])
    lo, hi = 1, max_batch + 1   # lo: largest batch measured under budget; hi: smallest over (max_batch+1: none)
    if max_batch > 1:
        if m(min(max_batch, 8)) <= budget_bytes:
            lo = min(max_batch, 8)
        else:
            hi = 8
    # Illinois-style regula falsi on the integers: when the same end of the bracket moves twice
    # in a row (the peak is not linear here), the other end's excess over the budget is halved
    # so the next guess lands nearer to it instead of crawling.
    weight = {"lo": 1.0, "hi": 1.0}
    last_moved = None
    while hi - lo > 1:
        if hi <= max_batch:     # bracketed: interpolate between its ends
            f_lo = (measured[lo] - budget_bytes) * weight["lo"]
            f_hi = (measured[hi] - budget_bytes) * weight["hi"]
            guess = lo + math.floor((hi - lo) * -f_lo / (f_hi - f_lo))
        else:                   # not yet: extrapolate from the two largest batches measured
            (b1, p1), (b2, p2) = sorted(measured.items())[-2:]
            slope = (p2 - p1) / (b2 - b1)
            guess = b1 + math.floor((budget_bytes - p1) / slope) if slope > 0 else hi - 1
        guess = min(max(guess, lo + 1), hi - 1)
        moved = "lo" if m(guess) <= budget_bytes else "hi"
        if moved == "lo":
            lo = guess
        else:
            hi = guess
        weight[moved] = 1.0
        if moved == last_moved:
            weight["hi" if moved == "lo" else "lo"] /= 2
        last_moved = moved

    a, b, r2 = fit_linear(list(measured), list(measured.values()))
    return BatchFit(batch_size=lo, peak_bytes=measured[lo], budget_bytes=int(budget_bytes),
                    measurements=sorted(measured.items()), slope_bytes_per_sample=a, intercept_bytes=b,
                    r2=r2, min_feasible_bytes=measured[1])
