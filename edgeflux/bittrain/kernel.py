"""The compiled CPU loops for bitmap compress/decompress (bitmap_kernel.cpp), built on first use.

    from edgeflux.bittrain import kernel
    kernel.available()        # True once the extension is built and loaded (None of this is needed on CUDA)

Why compiled: in torch ops, selecting the kept values needs a mask, a running count and a
scatter (4-6 passes over memory plus temporaries), which made a VGG-16 training step 1.5-2x
slower on CPU. The C++ loops read the tensor once to count and once to write, and restore it in
one pass. torch.utils.cpp_extension builds them with the machine's C++ compiler and ninja the
first time they are needed (about 15 s on a 2-core VM) and caches the library under
``$TORCH_EXTENSIONS_DIR`` (default ~/.cache/torch_extensions); later processes load it in
milliseconds. Both formats are the same bytes: either path restores what the other stored.

When the build is not possible (no compiler: ``apt-get install g++``; no ninja: ``pip install
ninja``) a warning says so once and bitmap.py keeps using its torch-op path: slower, same results.
``EDGEFLUX_BITTRAIN_KERNEL=0`` turns the compiled path off; ``with kernel.disabled():`` does so
for a block of code (the benchmark compares the two). ``with kernel.portable_loops():`` keeps the
compiled path but without its AVX-512 loops: the loops an ARM board runs, testable on x86.
"""
from __future__ import annotations

import logging
import os
import platform
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bitmap_kernel.cpp")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_loaded: bool | None = None      # None until the first call to available(); then whether the ops are loaded
_lock = threading.Lock()
_disabled = threading.local()


def enabled_by_env() -> bool:
    return os.environ.get("EDGEFLUX_BITTRAIN_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


@contextmanager
def disabled() -> Iterator[None]:
    """Inside the block (this thread) bitmaps are made and restored by the torch-op path (to compare the two)."""
    before = getattr(_disabled, "on", False)
    _disabled.on = True
    try:
        yield
    finally:
        _disabled.on = before


@contextmanager
def portable_loops() -> Iterator[None]:
    """Inside the block the compiled ops run their portable C++ loops, not the AVX-512 ones (process-wide;
    for tests: on a CPU without AVX-512, such as a Jetson's or a Raspberry Pi's, these are the only loops)."""
    if not available():
        raise RuntimeError("the compiled bitmap kernel is not available (see kernel.available())")
    before = torch.ops.edgeflux_bitmap.set_vector_loops(False)
    try:
        yield
    finally:
        torch.ops.edgeflux_bitmap.set_vector_loops(before)


def available() -> bool:
    """True when the compiled ops are loaded (building them on the first call) and not switched off.

    EDGEFLUX_BITTRAIN_KERNEL is read once, at that first call; this runs for every saved tensor, so
    it is kept to a flag and a thread-local lookup.
    """
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = enabled_by_env() and _build()
    return _loaded and not getattr(_disabled, "on", False)


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load
        log.info("building the BitTrain bitmap kernel (first use on this machine; cached afterwards)")
        # -mpopcnt: every x86-64 CPU since 2008 counts bits in one instruction; without the flag
        # __builtin_popcount is a library call (the bitmap's offsets are counted per block)
        popcnt = ["-mpopcnt"] if platform.machine().lower() in ("x86_64", "amd64") else []
        load(name="edgeflux_bitmap", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp", *popcnt],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        torch.ops.edgeflux_bitmap.compress   # noqa: B018 - raises if the library did not register
        return True
    except Exception as exc:   # no compiler / ninja / headers: the torch-op path still works
        log.warning("BitTrain's compiled bitmap kernel is unavailable (%s: %s); using the slower torch-op "
                    "path. Fix: apt-get install g++ and pip install ninja, or set EDGEFLUX_BITTRAIN_KERNEL=0 "
                    "to silence this.", type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else "")
        return False


def usable(flat: torch.Tensor) -> bool:
    """The compiled ops handle this tensor (contiguous 1-D, CPU, float; stored values may be any float dtype)."""
    return flat.is_cpu and flat.dtype in FLOAT_DTYPES and flat.is_contiguous() and available()


def usable_for_indices(flat: torch.Tensor) -> bool:
    """narrow_index handles this tensor (contiguous 1-D int64 on CPU)."""
    return flat.is_cpu and flat.dtype == torch.int64 and flat.is_contiguous() and available()


def compress(flat: torch.Tensor, threshold: float, store_dtype: torch.dtype | None, max_bytes: int,
             block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(bitmap, values, nnz) of 1-D ``flat``; empty bitmap and values when it would exceed max_bytes (>= 0)."""
    return torch.ops.edgeflux_bitmap.compress(flat, float(threshold), store_dtype, max_bytes, block)


def count(flat: torch.Tensor, threshold: float, block: int) -> int:
    """Elements of 1-D ``flat`` a bitmap keeps (compress's counting pass alone: max_bytes 0 allocates nothing)."""
    return torch.ops.edgeflux_bitmap.compress(flat, float(threshold), None, 0, block)[2]


def count_each(tensors: list[torch.Tensor], threshold: float) -> list[int]:
    """Elements each contiguous CPU float tensor keeps, in one call (for many small tensors)."""
    return torch.ops.edgeflux_bitmap.count_each(tensors, float(threshold))


def decompress_into(bitmap: torch.Tensor, values: torch.Tensor, block: int, out: torch.Tensor) -> None:
    torch.ops.edgeflux_bitmap.decompress_into(bitmap, values, block, out)


def narrow_index(flat: torch.Tensor) -> torch.Tensor:
    """int64 1-D CPU ``flat`` copied as int16 (or int32) when all its values fit; an empty tensor when none does."""
    return torch.ops.edgeflux_bitmap.narrow_index(flat)


def range_mask(flat: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, int]:
    """(uint8 bitmap of lo < x < hi over 1-D ``flat``, elements with a non-zero bit pattern), one pass.

    hi = inf: no upper bound; NaN is never inside.
    """
    return torch.ops.edgeflux_bitmap.range_mask(flat, float(lo), float(hi))


def fill_from_mask(bitmap: torch.Tensor, inside: float, outside: float, out: torch.Tensor) -> None:
    """out[i] = inside where bit i of ``bitmap`` is set, else outside (1-D ``out``)."""
    torch.ops.edgeflux_bitmap.fill_from_mask(bitmap, float(inside), float(outside), out)
