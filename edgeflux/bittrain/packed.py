"""What CompressedActivations stores for each saved tensor (the holders its pack hook returns and its
unpack hook reads back) and the per-unit accounting of what was stored. doublemask builds and reads
these holders too, so they live apart from the hooks that install both."""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from edgeflux.memory import check_saved_version

from . import kernel
from .bitmap import BitmapTensor

__all__ = ["Kept", "Narrowed", "Packed", "UnitStats", "narrow_index_dtype", "version_source"]

# ----------------------------------------------------------------------------- accounting

@dataclass
class UnitStats:
    """What happened to the activations one unit saved (bytes are logical: numel * itemsize)."""

    packs: int = 0              # saves of activations (a tensor saved by k operations counts k)
    tensors: int = 0            # distinct activations stored
    compressed: int = 0         # stored as a bitmap
    cast: int = 0               # stored dense in store_dtype (smaller than dense, not worth a bitmap)
    kept_dense: int = 0         # >= min_bytes but kept as is: a bitmap would not be smaller, or not its own memory
    small: int = 0              # below min_bytes: kept as is
    double_masked: int = 0      # BatchNorm inputs stored through the next activation's mask (doublemask)
    mask_only: int = 0          # in-place ReLU6 input copies: read from the stored output, or a 1-bit mask (doublemask)
    dense_bytes: int = 0        # what plain training holds for these tensors
    stored_bytes: int = 0       # what is held instead
    # numel, nnz, theoretical_bytes: over the activations considered for a bitmap (all but mask_only)
    numel: int = 0
    nnz: int = 0                # elements a bitmap keeps (non-zero bit pattern and, if pruning, |x| >= threshold)
    theoretical_bytes: int = 0  # the paper's M_b = itemsize * nnz + numel / 8, summed (value itemsize as stored)
    narrowed: int = 0           # int64 index tensors stored as int16/int32 (not activations; not in the bytes above)
    index_dense_bytes: int = 0  # their int64 bytes
    index_stored_bytes: int = 0  # what is held instead

    def add(self, other: UnitStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with derived ratios: sparsity, stored/dense, reduction (1 - stored/dense)."""
        d = asdict(self)
        d["sparsity"] = 1 - self.nnz / self.numel if self.numel else 0.0
        d["stored_fraction"] = self.stored_bytes / self.dense_bytes if self.dense_bytes else 1.0
        d["reduction"] = 1 - d["stored_fraction"]
        return d


# ----------------------------------------------------------------------------- what pack returns

class Kept:
    """A tensor stored as is (detached: no reference cycle through its grad_fn), version-checked."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: Tensor) -> None:
        self.tensor = t.detach()        # shares t's storage and version counter
        self.version = t._version

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def unpack(self) -> Tensor:
        t = self.tensor
        return t if t._version == self.version else check_saved_version(t, self.version)   # (raises)


class Narrowed:
    """An int64 index tensor held in a narrower integer dtype; unpack widens it back, same strides.

    Narrowing is deferred to the next pack (or the end of the block): at the moment max-pool saves
    its indices, its input (the dense activation) is still alive, and the narrow copy would add to
    the forward's peak there; one operation later that input is gone. The dtype is decided then too
    (one pass on CPU: the kernel's narrow_index converts and checks the range together); a tensor
    whose values fit neither int16 nor int32 stays int64. After the first unpack only the widened
    tensor is kept (see Packed).
    """

    __slots__ = ("data", "shape", "stride", "source", "version", "stats", "_restored", "__weakref__")

    def __init__(self, flat: Tensor, t: Tensor, stride: tuple[int, ...], stats: UnitStats) -> None:
        self.data = flat                 # int64 until narrow(), then int16/int32, then int64 again once unpacked
        self.shape, self.stride, self.stats = t.shape, stride, stats
        self.source = version_source(t)
        self.version = t._version
        self._restored = False

    def narrow(self) -> None:
        if self.data.dtype != torch.int64 or self._restored:
            return
        flat = self.data
        if kernel.usable_for_indices(flat):
            narrow = kernel.narrow_index(flat)
            if narrow.numel() != flat.numel():
                return                   # some value needs int64
        else:
            dtype = narrow_index_dtype(flat)
            if dtype is None:
                return
            narrow = flat.to(dtype)
        self.data = narrow
        self.stats.narrowed += 1
        self.stats.index_dense_bytes += flat.numel() * 8
        self.stats.index_stored_bytes += narrow.numel() * narrow.element_size()

    def unpack(self) -> Tensor:
        src = self.source()
        if src is not None:
            check_saved_version(src, self.version)
        if not self._restored:
            if self.data.dtype == torch.int64:        # not narrowed (a value needs int64): the original memory
                out = self.data.as_strided(self.shape, self.stride)
            else:
                out = torch.empty_strided(self.shape, self.stride, dtype=torch.int64, device=self.data.device)
                out.as_strided((out.numel(),), (1,)).copy_(self.data)
            self.data, self._restored = out, True
        return self.data


def version_source(t: Tensor) -> weakref.ref:
    """A weak reference that sees in-place changes to t for as long as its memory lives: to t's base
    when t is a view (views share their base's version counter; a temporary view saved by an
    operation can die while the base is changed through another alias), else to t."""
    return weakref.ref(t._base if t._base is not None else t)


def narrow_index_dtype(t: Tensor) -> torch.dtype | None:
    """int16 or int32 when every value of int64 tensor t fits it, else None (one aminmax pass)."""
    if t.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.aminmax(t))
    for dtype in (torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return None


class Packed:
    """A compressed activation: a BitmapTensor or a dense copy in store_dtype.

    The first unpack *replaces* the compressed data with the restored tensor: the operation that
    asked for it holds that tensor until its backward is done anyway, so keeping the compressed
    copy beside it would only add its bytes to backward's peak. Later unpacks (a tensor saved by
    several operations, e.g. max-pool and ReLU reading one ReLU output; backward again with
    retain_graph=True) get the restored tensor, never a second decompression; the holder is
    released with the last consumer's saved variables, as in plain autograd.
    """

    __slots__ = ("data", "dtype", "source", "version", "__weakref__")

    def __init__(self, data: BitmapTensor | Tensor, t: Tensor) -> None:
        self.data: BitmapTensor | Tensor = data
        self.dtype = t.dtype
        self.source = version_source(t)   # to check in-place changes while the original is still alive
        self.version = t._version

    @property
    def nbytes(self) -> int:
        d = self.data
        return d.nbytes if isinstance(d, BitmapTensor) else d.untyped_storage().nbytes()

    @property
    def restored(self) -> bool:
        return isinstance(self.data, Tensor) and self.data.dtype == self.dtype

    def unpack(self) -> Tensor:
        src = self.source()
        if src is not None:
            check_saved_version(src, self.version)
        return self.restore()

    def restore(self) -> Tensor:
        """The stored tensor, restored once (no version check: for readers of the saved value itself)."""
        if not self.restored:     # (no grad mode needed: the stored data never requires grad)
            d = self.data
            self.data = d.decompress() if isinstance(d, BitmapTensor) else d.to(self.dtype)
        return self.data
