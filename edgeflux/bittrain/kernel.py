"""The compiled CPU loops for bitmap compress/decompress (bitmap_kernel.cpp), built on first use.

    from edgeflux.bittrain import kernel
    kernel.available()        # True once the extension is built and loaded (None of this is needed on CUDA)

Why compiled: in torch ops, selecting the kept values needs a mask, a running count and a
scatter (4-6 passes over memory plus temporaries), which made a VGG-16 training step 1.5-2x
slower on CPU. The C++ loops read the tensor once to count and once to write, and restore it in
one pass. torch.utils.cpp_extension builds them with the machine's C++ compiler and ninja the
first time they are needed (about half a minute) and caches the library under
``$TORCH_EXTENSIONS_DIR`` (default ~/.cache/torch_extensions); later processes load it in
milliseconds. Both formats are the same bytes: either path restores what the other stored.

When the build is not possible (no compiler: ``apt-get install g++``; no ninja: ``pip install
ninja``) a warning says so once and bitmap.py keeps using its torch-op path: slower, same results.
``EDGEFLUX_BITTRAIN_KERNEL=0`` turns the compiled path off; ``with kernel.disabled():`` does so
for a block of code (the benchmark compares the two).
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bitmap_kernel.cpp")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_state: dict[str, object] = {}
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


def available() -> bool:
    """True when the compiled ops are loaded (building them on the first call)."""
    if getattr(_disabled, "on", False) or not enabled_by_env():
        return False
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _build()
    return bool(_state["ok"])


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load
        log.info("building the BitTrain bitmap kernel (first use on this machine; cached afterwards)")
        load(name="edgeflux_bitmap", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
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
    return flat.device.type == "cpu" and flat.dtype in FLOAT_DTYPES and flat.is_contiguous() and available()


def compress(flat: torch.Tensor, threshold: float, store_dtype: torch.dtype | None, max_bytes: int,
             block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(bitmap, values, nnz) of 1-D ``flat``; empty bitmap and values when it would exceed max_bytes (>= 0)."""
    return torch.ops.edgeflux_bitmap.compress(flat, float(threshold), store_dtype, max_bytes, block)


def decompress_into(bitmap: torch.Tensor, values: torch.Tensor, block: int, out: torch.Tensor) -> None:
    torch.ops.edgeflux_bitmap.decompress_into(bitmap, values, block, out)
