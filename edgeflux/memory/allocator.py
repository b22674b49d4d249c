"""The CPU allocator's own account of a step: every allocation and free, in order, and the peak.

PyTorch's CPU allocator reports each allocation and free (pointer, size) to the profiler when memory
profiling is on (``torch.profiler.profile(profile_memory=True)``): tensors, and the scratch a kernel
allocates and frees inside one op (e.g. ``convolution_backward``'s column buffer), which no tensor-level
count sees. The step runs as it does in training: nothing is wrapped or intercepted, so autograd takes
the same paths (inside a ``TorchDispatchMode`` it treats every tensor as subclass-like and accumulates
some gradients out of place, a different execution).

Only what is allocated during the step is in the events. What exists before it (parameters, buffers,
optimizer state, the batch) is counted by the caller from the tensors themselves; a free of memory that
was allocated before the step is not reported (the allocator's profiler table does not know its size),
so the caller must not seed tensors that the step frees: ``measure_step`` drops gradients before the
step, as every edgeflux step does first (``zero_grad(set_to_none=True)``).

Why the profiler's event tree (``kineto_results.experimental_event_tree()``, the structure
``torch.profiler._memory_profiler`` reads) and not its public event list: only the tree's allocation
records carry the pointer, which pairs a free with its allocation (a stale entry in the allocator's size
table can report the free of an older block at a reused address: pairing by pointer ignores it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

# Kineto, under the profiler, prints two lines per session and a GPU probe error on CPU-only machines;
# a step measured per batch size would fill a stage's log. Read when the profiler first starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


@dataclass
class AllocatorPeak:
    peak_bytes: int                        # the most bytes allocated during the step at once, above its start
    at_peak: dict[int, int]                # pointer -> bytes of the allocations alive at that moment
    alive_at_end: dict[int, tuple[int, int]]   # pointer -> (bytes, allocation order) still allocated after the step
    at_peak_order: dict[int, int]          # pointer -> allocation order, for the allocations alive at the peak


def allocator_events(step: Callable[[], Any]) -> list[tuple[int, int]]:
    """Run step() and return its CPU allocations (+bytes) and frees (-bytes) as (pointer, bytes), in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            records.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    records.sort(key=lambda r: r[0])
    return [(ptr, size) for _, ptr, size in records]


def peak_of(events: list[tuple[int, int]]) -> AllocatorPeak:
    """The running total of the step's own allocations and its maximum (frees paired with allocations by pointer)."""
    live: dict[int, tuple[int, int]] = {}
    current = peak = 0
    snapshot: dict[int, tuple[int, int]] = {}
    for order, (ptr, size) in enumerate(events):
        if size > 0:
            if ptr in live:          # a free at the same instant, recorded after this allocation
                current -= live.pop(ptr)[0]
            live[ptr] = (size, order)
            current += size
            if current > peak:
                peak, snapshot = current, dict(live)
        elif ptr in live:
            current -= live.pop(ptr)[0]
    return AllocatorPeak(peak, {p: s for p, (s, _) in snapshot.items()}, live,
                         {p: o for p, (_, o) in snapshot.items()})


def alive_at_peak_and_end(result: AllocatorPeak, pointers: set[int]) -> int:
    """Bytes at the peak of the allocations at `pointers` that are still alive after the step (e.g. the
    gradients the step made: a pointer is paired with the same allocation at both moments)."""
    return sum(size for ptr, size in result.at_peak.items()
               if ptr in pointers and result.alive_at_end.get(ptr, (0, -1))[1] == result.at_peak_order[ptr])


def data_pointers(tensors) -> set[int]:
    """The storages' data pointers of `tensors` (what the allocator's events name)."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
