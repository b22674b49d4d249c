"""The exact peak of live tensor bytes in a block of code: a TorchDispatchMode counting storages.

Every tensor an aten op returns (or takes, if it was not seen yet) has its untyped storage counted once,
keyed by the storage object, added when first seen and subtracted when the storage is freed (a weakref
callback on the storage object: PyTorch keeps a storage's Python object alive exactly as long as the
storage). Storage bytes are what the allocator hands to tensors: not scratch a kernel allocates and frees
inside one op. Running a step inside a dispatch mode also changes it slightly (autograd treats every tensor
as subclass-like and accumulates some gradients out of place), which is why the measured training step
reads the allocator instead (edgeflux.memory.step); the tracker counts tensors in any code, e.g. a bitmap's bytes.

Why our own tracker and not ``torch.distributed._tools.mem_tracker.MemTracker``: both give identical, exact
peaks (the tests compare them), but MemTracker is a private API inside ``torch.distributed`` (absent on
PyTorch builds without distributed support, which edge builds can be), it installs global module and
optimizer hooks and monkey-patches ``UntypedStorage.resize_`` for the whole process. This tracker has no
global side effects and records allocation/free times so any group of tensors can be attributed to the peak.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

log = logging.getLogger(__name__)


def storage_of(t: Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without real memory (meta, sparse, ...)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


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
        st = storage_of(t)
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
        st = storage_of(t)
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

