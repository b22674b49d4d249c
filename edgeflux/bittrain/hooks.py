"""Compressed saved activations through torch.autograd.graph.saved_tensors_hooks.

    with compressed_activations(units=model) as ca:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    ca.summary()["total"]     # dense vs stored vs theoretical bytes, sparsity, counts

The paper needed a libtorch extension; PyTorch's saved-tensor hooks are the "autograd library
integration similar to the checkpointing API" it names as future work. Every tensor autograd
saves for backward inside the block passes through ``pack``; an *activation* (see below) of at
least ``min_bytes`` is stored as a sparse bitmap (edgeflux.bittrain.bitmap) when that is smaller
than the dense tensor, and restored in backward by ``unpack``. At low sparsity the bitmap is
bigger (the paper's -3% rows): those tensors stay dense.

What is never compressed (returned as is): parameters (leaf tensors that require grad) and views
of them (``weight.t()`` saved by addmm), any leaf that requires grad, non-floating tensors, tensors
whose storage belongs to a parameter or buffer of the given units, tensor subclasses, sparse/meta
tensors, and tensors that do not own their memory exactly (a view of a larger storage, an
expanded tensor: compressing them frees nothing).

Integer indices (``narrow_indices=True``, the default): max-pool saves an int64 index per output
element, 8 bytes, half the bytes of the pooled activation itself (2x2 windows). Their values are
positions within one feature map (< H*W), so an int64 tensor of at least ``min_bytes`` whose values
all fit int16 (or int32) is stored in that dtype and widened back in backward: exact, 4x (2x)
smaller. It is not a bitmap (indices are not sparse), and is reported apart (``index_*`` stats).

A tensor saved by several operations (a ReLU output that the next conv and a max-pool also save)
is compressed once: packs are deduplicated by tensor identity (id() checked through a weak
reference, so a freed tensor whose id is reused can never alias) and version (an in-place change
after the first save makes a new entry).

Exactness: with ``threshold=0`` and no ``store_dtype`` a restored tensor has the same bits, shape,
dtype and strides as the saved one, so gradients are bit-identical to plain training.
``threshold > 0`` prunes |x| < threshold (the paper's activation pruning) and ``store_dtype``
(e.g. torch.float16) rounds the stored values: both approximate, by design. A tensor that is kept
dense is stored in ``store_dtype`` too when that is smaller (fp16 activation storage).

Safety: saved-tensor hooks switch off autograd's own check that a saved tensor was not modified
in place before backward (identity hooks included); ``unpack`` performs that check itself and
raises SavedTensorModifiedError, as plain autograd would.

Activation masks (``activation_masks=True``, the default; needs ``units``): an in-place ReLU6 or
Hardtanh makes autograd save a copy of its input, which its backward reads only as lo < x < hi.
The activation's output has the same mask and is saved anyway by the next conv, so with lossless
storage the copy is not stored at all: backward reads the output's bitmap instead (restored once
for both); otherwise the copy is held as a 1-bit mask (rule 1 of edgeflux.bittrain.doublemask;
exact either way). In MobileNetV2 these copies are a third of the saved bytes, all non-zero, so a
bitmap could not shrink them.

``double_mask=True`` adds the BatchNorm rules of edgeflux.bittrain.doublemask (paper Section 3.1);
see there for which are exact and which are approximate.

Nesting: torch.utils.checkpoint(use_reentrant=False) installs its own hooks inside a checkpointed
region (innermost hooks win), so nothing is saved there and nothing is compressed; the
checkpoint's saved inputs go through these hooks and are restored exactly before recomputation.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Iterable

import torch
from torch import Tensor

from edgeflux.memory import (OUTSIDE_UNITS, SavedTensorModifiedError, StoredBound, StoredOverBudget, UnitsArg,
                             UnitTracker, resolve_units)

from . import kernel
from .bitmap import compress_if_smaller, count_kept, dense_in_memory, flat_view, resolve_store_dtype
from .doublemask import DoubleMask
from .packed import Kept, Narrowed, Packed, UnitStats, narrow_index_dtype, version_source  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

__all__ = ["CompressedActivations", "SavedTensorModifiedError", "UnitStats", "compressed_activations"]

SMALL_BATCH_BYTES = 1 << 16   # small saved tensors held for one batched count (see _count_later)


# ----------------------------------------------------------------------------- the context

class CompressedActivations:
    """Context manager: saved activations stored as bitmaps inside the block; per-unit stats.

    Use compressed_activations(...) to make one. Entering it installs the saved-tensor hooks (and
    the module hooks for unit attribution / double_mask); leaving removes them. Tensors saved
    inside stay compressed after the block and are restored whenever backward runs. Stats add up
    over every use of the same object.
    """

    def __init__(self, threshold: float = 0.0, min_bytes: int = 4096, store_dtype: str | torch.dtype | None = None,
                 double_mask: bool = False, units: UnitsArg = None, exclude: Iterable[Tensor] = (),
                 narrow_indices: bool = True, activation_masks: bool = True) -> None:
        if not (isinstance(threshold, (int, float)) and threshold >= 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        if not (isinstance(min_bytes, int) and min_bytes >= 0):
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self.threshold = float(threshold)
        self.min_bytes = min_bytes
        self.store_dtype = resolve_store_dtype(store_dtype)
        self.double_mask = bool(double_mask)
        self.narrow_indices = bool(narrow_indices)
        self.activation_masks = bool(activation_masks)
        self.unit_pairs, self._modules = resolve_units(units)
        self._model = units if isinstance(units, torch.nn.Module) else None   # a UnitModel reports its running unit
        # Parameters and buffers of the units (and `exclude`): recognised by storage address,
        # pinned so that the addresses stay theirs while this object lives.
        # (one walk over the modules: this runs once per training step)
        self._submodules = list({id(s): s for m in self._modules for s in m.modules()}.values())
        self._pinned = [t for mod in self._submodules
                        for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None] + list(exclude)
        self._excluded = {t.data_ptr() - t.storage_offset() * t.element_size() for t in self._pinned if t.numel() > 0}
        self.stats: dict[str, UnitStats] = {name: UnitStats() for name, _ in self.unit_pairs}
        self.stats.setdefault(OUTSIDE_UNITS, UnitStats())
        self.not_activations = 0     # packs returned as is: parameters, buffers, indices, ...
        self._to_narrow: list[Narrowed] = []   # index holders to narrow at the next pack
        # id(tensor) -> (weakref to it, its version, weakref to its holder): the weakref makes a
        # reused id (a freed tensor's) a miss; cleared when the block ends
        self._seen: dict[int, tuple[Any, int, Any]] = {}
        self._tracker: UnitTracker | None = None
        self._hooks: Any = None
        self._dm: Any = None
        self.awaiting_output: Any = None     # a masked.MaskOnly waiting to see the next saved tensor
        self._to_count: list[tuple[Tensor, UnitStats, int]] = []   # small tensors not counted yet
        self._to_count_bytes = 0
        self.trajectory: list[int] = []       # stored bytes after each activation saved (StoredBound's envelope)
        self.bound: StoredBound | None = None   # set by the step that trains under a budget
        if self.double_mask and not self._modules:
            log.warning("double_mask needs the model (units=model or (name, module) pairs) to find its "
                        "BatchNorm and activation modules; without it only plain compression is applied")

    # -- context protocol
    def __enter__(self) -> CompressedActivations:
        if self._hooks is not None:
            raise RuntimeError("this compressed_activations context is already active; make a new one to nest")
        self._tracker = UnitTracker(self.unit_pairs, model=self._model).__enter__()
        if (self.double_mask or self.activation_masks) and self._modules:
            dm = DoubleMask(self, self._submodules, bn_rules=self.double_mask)
            if dm.bns or dm.acts:                # (no module of interest: no per-tensor checks at all)
                self._dm = dm.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._hooks = None
            if self._dm is not None:
                self._dm.__exit__(*exc)
                self._dm = None
            self._tracker.__exit__(*exc)
            self._seen = {}
            with torch.no_grad():
                self._narrow_pending()
            self._count_pending()

    # -- pack
    def is_activation(self, t: Tensor) -> bool:
        """True for tensors this context may compress (see the module docstring)."""
        if type(t) is not Tensor or not t.is_floating_point() or t.layout is not torch.strided or t.is_meta:
            return False     # Parameters, subclasses, integer/bool tensors, sparse, meta
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return False     # a parameter (or a leaf input that requires grad), or a view of one
        # the storage's address, without making a storage object (this runs for every saved tensor)
        return not (t.numel() > 0 and t.data_ptr() - t.storage_offset() * t.element_size() in self._excluded)

    def unit_stats(self) -> UnitStats:
        """Stats of the unit whose forward is running now."""
        name = self._tracker.current if self._tracker is not None else OUTSIDE_UNITS
        stats = self.stats.get(name)
        return stats if stats is not None else self.stats.setdefault(name, UnitStats())

    def _pack(self, t: Tensor) -> Any:
        # no grad mode needed: everything below works on detached tensors (t.detach() first)
        if self._to_narrow:
            self._narrow_pending()
        if self.awaiting_output is not None:
            self.resolve_awaiting(t)
        if not self.is_activation(t):
            self.not_activations += 1
            if self.narrow_indices and t.dtype == torch.int64:
                return self.store_index(t)
            return Kept(t)
        stats = self.unit_stats()
        stats.packs += 1
        holder = self._holder(t, stats)
        self._record()
        return holder

    def _holder(self, t: Tensor, stats: UnitStats) -> Any:
        entry = self._seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            holder = entry[2]()
            if holder is not None:
                return holder
        if self._dm is not None and self._dm.in_call:
            special = self._dm.pack(t, stats)        # (only makes holders of detached tensors)
            if special is not None:
                return special
        return self.store_shared(t, stats)

    def stored_total(self) -> int:
        return sum(s.stored_bytes for s in self.stats.values())

    def _record(self) -> None:
        """The stored total after this activation: kept (a measured step's ``trajectory``), and held to the
        bound (a store that allocates is refused before it allocates, in ``store``; a tensor merely kept
        alive is refused here)."""
        stored = self.stored_total()
        if self.bound is not None and self.bound.room(len(self.trajectory), stored) < 0:
            raise StoredOverBudget(f"stored activations {stored} B after save {len(self.trajectory)}")
        self.trajectory.append(stored)

    def _room(self) -> int | None:
        """What the activation being stored may add (StoredBound); None without a bound."""
        return None if self.bound is None else self.bound.room(len(self.trajectory), self.stored_total())

    def store_shared(self, t: Tensor, stats: UnitStats) -> Kept | Packed:
        """store(t), remembered: later saves of the same tensor (same version) get this holder."""
        holder = self.store(t, stats)
        self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(holder))
        if self._dm is not None and self._dm.waiting:
            with torch.no_grad():                    # may finish a BatchNorm input (computes)
                self._dm.stored(t, holder)
        return holder

    def _unpack(self, packed: Any) -> Tensor:
        if self._to_count:      # backward has begun: count the small tensors while their holders still keep them
            self._count_pending()
        return packed.unpack()

    def resolve_awaiting(self, t: Tensor | None) -> None:
        """An in-place ReLU6's input copy waits for the next save (t), which may be its output."""
        waiting, self.awaiting_output = self.awaiting_output, None
        if waiting is not None:
            with torch.no_grad():
                waiting.resolve(t)

    def store(self, t: Tensor, stats: UnitStats) -> Kept | Packed:
        """Store activation t (no deduplication): bitmap, store_dtype copy, or as is; update stats."""
        n, itemsize = t.numel(), t.element_size()
        dense = n * itemsize
        stats.tensors += 1
        stats.dense_bytes += dense
        stats.numel += n
        value_size = self.store_dtype.itemsize if self.store_dtype is not None else itemsize
        d = t.detach()
        if dense < self.min_bytes:
            stats.small += 1
            stats.stored_bytes += dense
            stats.theoretical_bytes += math.ceil(n / 8)
            self._count_later(d, stats, value_size)
            return Kept(t)
        if not _owns_exactly(d):
            nnz = count_kept(d, self.threshold)
            stats.nnz += nnz
            stats.theoretical_bytes += value_size * nnz + math.ceil(n / 8)
            stats.stored_bytes += dense
            stats.kept_dense += 1
            return Kept(t)
        flat, stride = flat_view(d)
        cast_bytes = n * value_size
        # a bitmap only when smaller than dense and than a plain store_dtype copy (most BN inputs:
        # counted, not compressed), and when it fits the bound (room: nothing allocated otherwise)
        limit, room = min(dense - 1, cast_bytes), self._room()
        bitmap, nnz = compress_if_smaller(flat, d.shape, stride, self.threshold, self.store_dtype,
                                          max_bytes=limit if room is None else max(0, min(limit, room)))
        if room is not None and bitmap is None and min(math.ceil(n / 8) + nnz * value_size, cast_bytes) > room:
            raise StoredOverBudget(f"a saved activation of {n} elements does not fit the {room} B left")
        stats.nnz += nnz
        stats.theoretical_bytes += math.ceil(n / 8) + nnz * value_size
        if bitmap is not None:
            holder: Kept | Packed = Packed(bitmap, t)
            stats.compressed += 1
        elif cast_bytes < dense:
            holder = Packed(d.to(self.store_dtype), t)
            stats.cast += 1
        else:
            holder = Kept(t)
            stats.kept_dense += 1
        stats.stored_bytes += holder.nbytes
        return holder

    def _count_later(self, d: Tensor, stats: UnitStats, value_size: int) -> None:
        """Small tensors' non-zeros are counted in batches: one kernel call per tensor (MobileNetV2 saves
        ~100 BatchNorm means and inverse stds a step) cost more than counting them. A batch is counted
        when backward begins (the first unpack: until then their holders keep them alive anyway), at
        the end of the block, or when it reaches SMALL_BATCH_BYTES (a bound on what it keeps alive)."""
        self._to_count.append((d, stats, value_size))
        self._to_count_bytes += d.numel() * d.element_size()
        if self._to_count_bytes >= SMALL_BATCH_BYTES:
            self._count_pending()

    def _count_pending(self) -> None:
        pending, self._to_count, self._to_count_bytes = self._to_count, [], 0
        if not pending:
            return
        # The tensors first: kernel.available() compiles the CPU kernel on first use, which a CUDA run never needs.
        if all(d.is_cpu and d.dtype in kernel.FLOAT_DTYPES and d.is_contiguous() for d, _, _ in pending) \
                and kernel.available():
            counts = kernel.count_each([d for d, _, _ in pending], self.threshold)
        else:
            counts = [count_kept(d, self.threshold) for d, _, _ in pending]
        for (_, stats, value_size), nnz in zip(pending, counts):
            stats.nnz += nnz
            stats.theoretical_bytes += value_size * nnz

    def store_index(self, t: Tensor) -> Kept | Narrowed:
        """An int64 tensor (max-pool indices): in int16/int32 when its values fit, else as is."""
        d = t.detach()
        dense = d.numel() * 8
        if (dense < self.min_bytes or type(t) is not Tensor or t.layout != torch.strided or t.requires_grad
                or not _owns_exactly(d)):
            return Kept(t)
        flat, stride = flat_view(d)
        holder = Narrowed(flat, t, stride, self.unit_stats())
        self._to_narrow.append(holder)
        return holder

    def _narrow_pending(self) -> None:
        pending, self._to_narrow = self._to_narrow, []
        for holder in pending:
            holder.narrow()

    # -- reporting
    def total(self) -> UnitStats:
        """All units' stats added up."""
        self._count_pending()
        out = UnitStats()
        for s in self.stats.values():
            out.add(s)
        return out

    def summary(self) -> dict[str, Any]:
        """Plain dicts: the options, the total, and per unit (in unit order; OUTSIDE_UNITS last)."""
        self._count_pending()
        return {
            "options": {"threshold": self.threshold, "min_bytes": self.min_bytes, "narrow_indices": self.narrow_indices,
                        "store_dtype": str(self.store_dtype).removeprefix("torch.") if self.store_dtype else None,
                        "double_mask": self.double_mask, "activation_masks": self.activation_masks},
            "total": self.total().to_dict(),
            "units": {name: s.to_dict() for name, s in self.stats.items()},
            "not_activations": self.not_activations,
        }


def _owns_exactly(t: Tensor) -> bool:
    """t fills its whole storage, gap-free: compressing it lets that memory go."""
    return (t.storage_offset() == 0 and (t.is_contiguous() or dense_in_memory(t))
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def compressed_activations(threshold: float = 0.0, min_bytes: int = 4096, store_dtype: str | torch.dtype | None = None,
                           double_mask: bool = False, units: UnitsArg = None,
                           exclude: Iterable[Tensor] = (), narrow_indices: bool = True,
                           activation_masks: bool = True) -> CompressedActivations:
    """Store the activations autograd saves inside the ``with`` block as sparse bitmaps.

    threshold: 0 = exact (bit-identical gradients); > 0 prunes |x| < threshold (approximate).
    min_bytes: saved tensors smaller than this stay as they are.
    store_dtype: "float16"/torch.float16 stores values in half precision (approximate); None keeps them.
    double_mask: BatchNorm/activation mask propagation (edgeflux.bittrain.doublemask).
    units: the model (a UnitModel: per-unit stats; its parameters and buffers are never compressed)
    or (name, module) pairs; None attributes everything to "(outside units)".
    exclude: more tensors never to compress (e.g. a batch the caller keeps anyway).
    narrow_indices: store int64 index tensors (max-pool indices) as int16/int32 when they fit (exact).
    activation_masks: the input copy an in-place ReLU6/Hardtanh saves is served from its stored output
    (lossless storage) or held as its 1-bit pass mask (exact: its backward reads nothing else; rule 1 of
    edgeflux.bittrain.doublemask). Needs units.
    """
    return CompressedActivations(threshold=threshold, min_bytes=min_bytes, store_dtype=store_dtype,
                                 double_mask=double_mask, units=units, exclude=exclude, narrow_indices=narrow_indices,
                                 activation_masks=activation_masks)
