"""The process around a step: peak RSS (sampled), USS, and glibc malloc's handling of freed memory.

A cross-check of the process as a whole (interpreter, libraries, allocator caches), never the exact figure.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import psutil

from .sizes import format_bytes

log = logging.getLogger(__name__)


class RssSampler:
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

    def __enter__(self) -> RssSampler:
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


def uss_bytes() -> int | None:
    try:
        return int(psutil.Process().memory_full_info().uss)
    except (psutil.Error, AttributeError):   # AccessDenied, or no USS on this platform
        return None

