"""Writing a cache directory: shards as batches fill them, the manifest last."""
from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path

import torch
from torch import Tensor

from edgeflux.artifacts import atomic_write, write_json
from edgeflux.memory import format_bytes

from ..options import STORAGES
from .manifest import FORMAT, MANIFEST, VERSION, shard_name
from .shards import dtype_name, encode_payload, fits_float16

__all__ = ["CacheWriter"]

log = logging.getLogger(__name__)


class CacheWriter:
    """Write one cache directory; a context manager. The manifest appears only on a clean exit.

    On enter the directory is started afresh (an old manifest first, then old shards), so a rerun
    after an interrupted write never mixes runs. ``append`` takes batches of any size on any
    device; full shards are written as they fill, so the writer holds at most one shard plus one
    batch in memory. ``value_dtype`` (bittrain only): dtype of the stored non-zero values, e.g.
    torch.float16 (approximate); None keeps the compute dtype.
    """

    def __init__(self, directory: str | Path, producer: str, sample_shape: tuple[int, ...] | torch.Size,
                 dtype: torch.dtype = torch.float32, storage: str = "dense", threshold: float = 0.0,
                 shard_samples: int = 2048, value_dtype: torch.dtype | None = None) -> None:
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        if shard_samples < 1:
            raise ValueError(f"shard_samples must be >= 1, got {shard_samples}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point compute dtype, got {dtype}")
        if storage != "bittrain" and (threshold or value_dtype is not None):
            raise ValueError(f"threshold and value_dtype apply to storage='bittrain' only (storage={storage!r})")
        if threshold < 0 or math.isnan(threshold):
            raise ValueError(f"threshold must be >= 0, got {threshold!r}")
        self.directory = Path(directory)
        self.producer = producer
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.dtype, self.storage, self.threshold = dtype, storage, float(threshold)
        self.shard_samples = shard_samples
        self.value_dtype = value_dtype if value_dtype != dtype else None
        self._xs: list[Tensor] = []
        self._ys: list[Tensor] = []
        self._buffered = 0
        self._shards: list[dict] = []
        self._written = 0
        self._open = False

    def __enter__(self) -> CacheWriter:
        self.directory.mkdir(parents=True, exist_ok=True)
        # The manifest goes first: if we die while clearing, the directory is already "incomplete".
        (self.directory / MANIFEST).unlink(missing_ok=True)
        for stale in [*self.directory.glob("shard-*.pt"), *self.directory.glob("*.tmp")]:
            stale.unlink()
        self._tick = time.perf_counter()
        self._open = True
        return self

    def append(self, x: Tensor, y: Tensor) -> None:
        """Buffer a batch (moved to CPU, cast to the compute dtype); write every shard that fills."""
        if not self._open:
            raise RuntimeError("CacheWriter.append outside its with-block")
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(f"sample shape {tuple(x.shape[1:])} != the cache's {self.sample_shape}")
        if len(x) == 0:
            return
        self._xs.append(x.detach().to("cpu", self.dtype))
        self._ys.append(y.detach().to("cpu", torch.int64))
        self._buffered += len(x)
        if self._buffered >= self.shard_samples:
            x_all, y_all = torch.cat(self._xs), torch.cat(self._ys)
            full = self._buffered // self.shard_samples * self.shard_samples
            for start in range(0, full, self.shard_samples):
                stop = start + self.shard_samples
                self._write_shard(x_all[start:stop], y_all[start:stop])
            # clone: the rest must not keep the whole concatenated buffer alive
            self._xs, self._ys = [x_all[full:].clone()], [y_all[full:].clone()]
            self._buffered -= full

    def _write_shard(self, x: Tensor, y: Tensor) -> None:
        # Half precision overflows beyond +-65504: such a shard keeps the compute dtype (readers cast
        # every shard to it anyway) rather than handing the next block inf where it had finite values.
        half = self.storage == "float16" or self.value_dtype == torch.float16
        full_precision = half and not fits_float16(x)
        if full_precision:
            log.warning("activation cache %s: shard %d has values beyond float16's range (|x| up to %.4g); "
                        "stored in %s instead", self.directory, len(self._shards),
                        float(x[x.isfinite()].abs().max()), dtype_name(self.dtype))
        data = encode_payload(x, y, self.storage, self.threshold, self.value_dtype, full_precision)
        name = shard_name(len(self._shards))
        atomic_write(self.directory / name, lambda p: p.write_bytes(data))   # (fsync'd: atomic_write)
        self._shards.append({"file": name, "start": self._written, "count": len(y), "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest(), "full_precision": full_precision})
        self._written += len(y)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._open = False
        if exc_type is not None:
            # No manifest: the directory stays incomplete and is never read; the shards are left for inspection.
            log.warning("activation cache %s: writer interrupted after %d samples in %d shards (%s); "
                        "no manifest written, the cache is incomplete", self.directory, self._written,
                        len(self._shards), exc_type.__name__)
            self._xs, self._ys = [], []
            return
        if self._buffered:
            self._write_shard(torch.cat(self._xs), torch.cat(self._ys))
        self._xs, self._ys, self._buffered = [], [], 0
        write_json(self.directory / MANIFEST, self._manifest())
        nbytes = sum(s["bytes"] for s in self._shards)
        log.info("activation cache %s: wrote %d samples in %d shards, %s (%s), in %.2f s", self.directory,
                 self._written, len(self._shards), format_bytes(nbytes), self.storage,
                 time.perf_counter() - self._tick)

    def _manifest(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "producer": self.producer, "num_samples": self._written,
            "sample_shape": list(self.sample_shape), "dtype": dtype_name(self.dtype), "storage": self.storage,
            "threshold": self.threshold,
            "value_dtype": dtype_name(self.value_dtype) if self.value_dtype is not None else None,
            "shard_samples": self.shard_samples, "label_dtype": "int64", "shards": self._shards,
        }
