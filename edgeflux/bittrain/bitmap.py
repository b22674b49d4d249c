"""BitTrain's sparse bitmap format (paper Section 3.2, Algorithms 1 and 2), in vectorised torch ops.

    packed = compress(activation)              # bitmap (1 bit per element) + the non-zero values
    packed.nbytes                              # ceil(n/8) + nnz * itemsize, exactly
    torch.equal(packed.decompress(), activation)

A tensor of n elements with nnz non-zeros is held as

* ``bitmap``: uint8, ceil(n/8) bytes; bit i%8 of byte i//8 (little-endian within the byte) is 1
  where element i is kept. The padding bits of the last byte are 0.
* ``values``: the kept elements in order, nnz of them, in the tensor's dtype or ``store_dtype``.
* shape, strides, dtype and device.

Elements are taken in *memory order*: a tensor whose elements fill its memory without gaps or
overlaps (contiguous, channels_last, any permutation) is read straight from memory and restored
with exactly the same strides, so the backward kernels that read it take the same code path and
produce bit-identical gradients. Other tensors (slices with gaps, expanded tensors) are read
through ``reshape(-1)`` and restored contiguous.

"Zero" is decided on the bit pattern, not on ``== 0``: -0.0 is kept as a value, so a round trip
with threshold 0 reproduces every bit (NaN and inf included). With ``threshold > 0`` an element
is dropped when ``|x| < threshold`` (the paper's activation pruning; compared in the tensor's
dtype), which drops -0.0 as well; NaN is never ``< threshold`` and is kept.

Two implementations write the same bytes. On CPU, a compiled C++ kernel (kernel.py,
bitmap_kernel.cpp; AVX-512 compress/expand where the CPU has it) counts in one pass and writes
bitmap and values in a second, and restores in one pass, with no temporaries. Elsewhere (CUDA, or
where no compiler is available) the torch ops below do it.

Why not a library format: torch's sparse COO/CSR layouts store 8-byte indices per non-zero
(efficient only above ~80% sparsity, the paper's Figure 6), and there is no bit-packing op in
torch. Packing folds each 8-byte group of the 0/1 mask, read as an int64, into one byte with three
shift-or steps; unpacking gathers from a 256-entry table of 8-byte bit patterns. Selecting the
values is a branch-free scatter through the running count of kept elements (CPU), restoring
them a gather through that count from [0, values...]: on CPU each is 1.5-2x faster than
nonzero/masked_scatter_. Both run in chunks (see _chunk) so that their temporaries (mask, packing
words, index buffers) stay small: for the whole tensor they would be 3-4x its bytes, added to the
forward's peak while compressing and to backward's while restoring.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from . import kernel

__all__ = ["BitmapTensor", "compress", "compress_if_smaller", "count_kept", "theoretical_bytes", "FloatTensorRequired",
           "dense_in_memory", "flat_view", "pack_bits", "pack_mask", "unpack_bits", "unpack_mask"]

# _UNPACK[b] is an int64 whose 8 bytes are the bits of b (byte k = bit k): one gather per byte
_UNPACK: dict[torch.device, Tensor] = {}
_UNPACK32: dict[torch.device, Tensor] = {}   # [256, 8] int32: row b = the bits of b
# Selecting/restoring values runs in chunks whose index buffers (12-16 bytes per element) are
# transient memory at backward's peak: a chunk is about 1/16 of the tensor (so the buffers stay
# near a quarter of the tensor's own bytes), between MIN_CHUNK and MAX_CHUNK elements (per-chunk
# overhead vs buffer size; multiples of 8 so that chunks start on a bitmap byte).
MIN_CHUNK, MAX_CHUNK = 1 << 15, 1 << 18
# The compiled path (kernel.py) splits a tensor into blocks of this many elements for its threads.
KERNEL_BLOCK = 1 << 16


# options.STORE_DTYPE_NAMES names the same (params are checked without torch); tests/test_bittrain.py holds them equal
STORE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


def resolve_store_dtype(store_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'float16' / torch.float16 -> torch.float16; None -> None (keep each tensor's dtype)."""
    if store_dtype is None or isinstance(store_dtype, torch.dtype):
        if isinstance(store_dtype, torch.dtype) and not store_dtype.is_floating_point:
            raise ValueError(f"store_dtype must be a floating dtype, got {store_dtype}")
        return store_dtype
    try:
        return STORE_DTYPES[str(store_dtype)]
    except KeyError:
        raise ValueError(f"store_dtype must be one of {', '.join(STORE_DTYPES)} or None, "
                         f"got {store_dtype!r}") from None


def _chunk(n: int) -> int:
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << max(n // 16 - 1, 1).bit_length()))
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FloatTensorRequired(TypeError):
    """compress() was given a tensor that is not floating point."""


def theoretical_bytes(numel: int, nnz: int, itemsize: int = 4) -> int:
    """The paper's bitmap size M_b = itemsize * nnz + numel / 8, with the bitmap rounded up to whole bytes."""
    return itemsize * nnz + math.ceil(numel / 8)


def _unpack_table(device: torch.device) -> Tensor:
    table = _UNPACK.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _UNPACK[device] = bits.to(torch.uint8).contiguous().view(torch.int64).view(-1).to(device)
    return table


def dense_in_memory(t: Tensor) -> bool:
    """True when t's elements fill a gap-free, non-overlapping block of memory (any dim order)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_view(t: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """t's elements as a 1-D tensor in memory order (a view when possible), and the strides to restore."""
    if t.is_contiguous():                 # the common case, without the stride walk below
        return t.view(-1), tuple(t.stride())
    if dense_in_memory(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset()), tuple(t.stride())
    return t.reshape(-1), _contiguous_strides(t.shape)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _keep_mask(flat: Tensor, threshold: float) -> Tensor:
    """Bool mask padded with False to a multiple of 8 elements: True where the element is stored."""
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.bool, device=flat.device)
    mask = padded[:n]
    if threshold > 0:   # prune |x| < threshold (zeros and -0.0 included); NaN is not < threshold: kept
        torch.lt(flat.abs(), threshold, out=mask)
        mask.logical_not_()
    else:               # the bit pattern: keeps -0.0
        torch.ne(flat.view(_INT_VIEW[flat.element_size()]), 0, out=mask)
    return padded


def pack_bits(padded: Tensor) -> Tensor:
    """Bool mask (length a multiple of 8) -> uint8 bitmap, 8 elements per byte.

    Little-endian machines (x86, the ARM of Jetson and Raspberry Pi): each group of 8 mask bytes
    (0/1) is read as one int64 word with bit b_k at position 8k; three shift-or folds gather
    b_0..b_7 into the lowest byte (w |= w >> 7 puts b_{k+1} next to b_k; >> 14 and >> 28 do the
    same for pairs and quads) and the cast keeps that byte. Elsewhere: a weighted sum per group.
    """
    if sys.byteorder != "little":
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=padded.device)
        return (padded.view(torch.uint8).view(-1, 8) * weights).sum(1, dtype=torch.uint8)
    w = padded.view(torch.uint8).view(torch.int64)
    a = w >> 7
    a |= w
    b = a >> 14
    a |= b
    torch.bitwise_right_shift(a, 28, out=b)
    a |= b
    return (a & 0xFF).to(torch.uint8)


def unpack_bits(bitmap: Tensor, n: int) -> Tensor:
    """uint8 bitmap -> bool mask of n elements (a gather from a 256-entry table of 8-byte patterns)."""
    table = _unpack_table(bitmap.device)
    return table.index_select(0, bitmap.to(torch.int32)).view(torch.bool)[:n]


def pack_mask(mask: Tensor) -> Tensor:
    """A bool tensor as a 1-bit mask: uint8, 8 elements per byte in memory order (element i is bit i % 8
    of byte i // 8), ceil(numel / 8) bytes. What a backward that reads only "where" needs to keep
    (BitTrain's double mask, MobileTL's sign-backward activations); ``unpack_mask`` inverts it."""
    flat = mask.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.bool, device=mask.device)
    padded[:n] = flat
    return pack_bits(padded)


def unpack_mask(bitmap: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """The bool tensor of ``shape`` (contiguous) that ``pack_mask`` packed into ``bitmap``."""
    return unpack_bits(bitmap, math.prod(shape)).view(shape)


def _unpack_int32(bitmap: Tensor, n: int) -> Tensor:
    """uint8 bitmap -> int32 0/1 per element (n of them), straight from a table of 8 int32 per byte."""
    table = _UNPACK32.get(bitmap.device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _UNPACK32[bitmap.device] = bits.to(torch.int32).to(bitmap.device)
    return table.index_select(0, bitmap.to(torch.int32)).view(-1)[:n]


@dataclass(eq=False)
class BitmapTensor:
    """A tensor stored as a bitmap plus its kept values; ``decompress()`` gives the tensor back."""

    bitmap: Tensor            # uint8 [ceil(numel / 8)]
    values: Tensor            # [nnz], dtype == store dtype
    shape: torch.Size
    stride: tuple[int, ...]   # strides of the tensor decompress() returns
    dtype: torch.dtype        # dtype of the original tensor (and of decompress()'s result)

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def sparsity(self) -> float:
        """Fraction of elements not stored (zeros, and pruned values)."""
        n = self.numel
        return 1.0 - self.nnz / n if n else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes really held: the bitmap's storage plus the values' storage."""
        return self.bitmap.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

    @property
    def dense_bytes(self) -> int:
        """Bytes of the tensor in its dense form (numel * itemsize of the original dtype)."""
        return self.numel * self.dtype.itemsize

    def theoretical_bytes(self) -> int:
        """The paper's M_b for this tensor, with the stored values' itemsize."""
        return theoretical_bytes(self.numel, self.nnz, self.values.element_size())

    def decompress(self) -> Tensor:
        """The dense tensor: zeros where nothing was stored, the values elsewhere (cast back to dtype)."""
        n = self.numel
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        flat = out.as_strided((n,), (1,))
        values = self.values
        if kernel.usable(flat):
            kernel.decompress_into(self.bitmap, values, KERNEL_BLOCK, flat)
            return out
        if self.device.type != "cpu":
            flat.zero_()
            flat.masked_scatter_(unpack_bits(self.bitmap, n), values.to(self.dtype))
            return out
        # Per chunk: ext = [0, this chunk's values...]; element i reads ext[number of set bits up
        # to and including i] when its bit is set, ext[0] = 0 otherwise. A gather, 2x faster on
        # CPU than masked_scatter_, with buffers of one chunk (this runs at backward's peak).
        done, size = 0, _chunk(n)
        for start in range(0, n, size):
            stop = min(start + size, n)
            bits = _unpack_int32(self.bitmap[start // 8: (stop + 7) // 8], stop - start)
            idx = bits.cumsum(0, dtype=torch.int32)
            k = int(idx[-1])
            ext = torch.empty(k + 1, dtype=self.dtype)
            ext[0] = 0
            ext[1:] = values[done: done + k]          # casts a store_dtype chunk back
            done += k
            idx *= bits
            torch.index_select(ext, 0, idx, out=flat[start:stop])
        return out

    def __repr__(self) -> str:
        return (f"BitmapTensor(shape={tuple(self.shape)}, dtype={self.dtype}, store={self.values.dtype}, "
                f"nnz={self.nnz}, nbytes={self.nbytes}, device={self.device})")


def compress(t: Tensor, threshold: float = 0.0, store_dtype: torch.dtype | None = None) -> BitmapTensor:
    """Store floating-point tensor ``t`` as a bitmap plus its non-zero values.

    threshold: 0 keeps every element whose bits are not all zero (exact round trip);
    > 0 also drops |x| < threshold (pruning). store_dtype: dtype of the stored values
    (e.g. torch.float16 halves them; approximate); None keeps t's dtype.
    Works on any device and any layout; gradients are not tracked (the result is data).
    """
    if not t.is_floating_point():
        raise FloatTensorRequired(
            f"compress() stores floating-point tensors, got dtype {t.dtype}; keep integer/bool tensors "
            f"(e.g. max-pool indices, masks) as they are")
    if threshold < 0 or math.isnan(threshold):
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    with torch.no_grad():
        flat, stride = flat_view(t.detach())
        return compress_if_smaller(flat, t.shape, stride, threshold, store_dtype)[0]


def count_kept(t: Tensor, threshold: float = 0.0) -> int:
    """Elements of ``t`` a bitmap keeps: non-zero bit pattern, and |x| >= threshold when pruning.

    On CPU the compiled kernel counts (one pass, no allocation; 20-40x faster than count_nonzero);
    otherwise allocation-free for threshold 0 (count_nonzero reduces without a mask), chunked with a threshold.
    """
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous() and kernel.usable(t):
        return kernel.count(t.view(-1), threshold, KERNEL_BLOCK)
    if threshold == 0:
        return int(torch.count_nonzero(t.view(_INT_VIEW[t.element_size()])))
    flat = t.reshape(-1)
    size = _chunk(n)
    return sum(int(torch.count_nonzero(_keep_mask(flat[i:i + size], threshold))) for i in range(0, n, size))


def compress_if_smaller(flat: Tensor, shape: torch.Size, stride: tuple[int, ...], threshold: float,
                        store_dtype: torch.dtype | None, max_bytes: int | None = None) -> tuple[BitmapTensor | None, int]:
    """The BitmapTensor of the memory-order elements ``flat`` and how many it keeps; (None, kept)
    when ``max_bytes`` is given and the bitmap would be larger (nothing is allocated then).

    The compiled kernel (kernel.py) counts and compresses in one call; the torch-op path counts
    first (count_nonzero needs no mask) and compresses chunk by chunk.
    """
    n = flat.numel()
    if n and kernel.usable(flat):
        bitmap, values, nnz = kernel.compress(flat, threshold, store_dtype, -1 if max_bytes is None else max_bytes,
                                              KERNEL_BLOCK)
        if max_bytes is not None and bitmap.numel() == 0:
            return None, nnz
        return BitmapTensor(bitmap=bitmap, values=values, shape=torch.Size(shape), stride=stride, dtype=flat.dtype), nnz
    nnz = count_kept(flat, threshold)
    value_size = (store_dtype or flat.dtype).itemsize
    if max_bytes is not None and math.ceil(n / 8) + nnz * value_size > max_bytes:
        return None, nnz
    return _compress_flat(flat, shape, stride, threshold, store_dtype, nnz), nnz


def _compress_flat(flat: Tensor, shape: torch.Size, stride: tuple[int, ...], threshold: float,
                   store_dtype: torch.dtype | None, nnz: int | None = None) -> BitmapTensor:
    """The torch-op path of compress_if_smaller, built chunk by chunk (any device).

    Compression runs while the forward still holds the dense tensor, so its temporaries add to
    the forward's peak: the bitmap and the values are allocated once at their final size, and
    every intermediate (the keep-mask, the packing words, the scatter buffers) is one chunk's.
    On CPU the values of a chunk are selected by a branch-free scatter through the running count
    of kept elements (kept element i goes to slot count(i), dropped ones to slot 0 of a chunk
    buffer); torch.nonzero's per-element branch makes boolean indexing ~1.5x slower on random masks.
    """
    n, dtype = flat.numel(), flat.dtype
    if nnz is None:
        nnz = count_kept(flat, threshold)
    bitmap = torch.empty(math.ceil(n / 8), dtype=torch.uint8, device=flat.device)
    values = torch.empty(nnz, dtype=store_dtype or dtype, device=flat.device)
    size = _chunk(n)
    cpu = flat.device.type == "cpu"
    if cpu and n:
        buf = torch.empty(size + 1, dtype=dtype)
        ones = torch.empty(size, dtype=torch.int64)    # the chunk's mask as 0/1 int64
        dest = torch.empty(size, dtype=torch.int64)
    base = 0
    for start in range(0, n, size):                    # size is a multiple of 8: chunks start on a byte
        stop = min(start + size, n)
        chunk = flat[start:stop]
        padded = _keep_mask(chunk, threshold)
        bitmap[start // 8: (stop + 7) // 8] = pack_bits(padded)
        mask = padded[:stop - start]
        if not cpu:
            kept = chunk[mask]
            values[base: base + kept.numel()] = kept
            base += kept.numel()
            continue
        m, d = ones[:stop - start], dest[:stop - start]
        m.copy_(mask)
        torch.cumsum(m, 0, out=d)
        k = int(d[-1])
        d *= m
        buf.scatter_(0, d, chunk)
        values[base: base + k] = buf[1: k + 1]         # casts to store_dtype
        base += k
    if base != nnz:
        raise RuntimeError(f"compress: {base} elements kept but {nnz} counted (was the tensor modified meanwhile?)")
    return BitmapTensor(bitmap=bitmap, values=values, shape=torch.Size(shape), stride=stride, dtype=dtype)
