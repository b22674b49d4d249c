"""NeuroFlux's activation cache (paper Section 5.3): a trained block's outputs on disk, read back by
the next block in its own batch size while a background thread prefetches the next shards.

    with CacheWriter("cache/neuroflux/block0/train", producer=sig, sample_shape=(16, 16, 16)) as w:
        for xb, yb in ...:
            w.append(block(xb), yb)                       # any batch size, any device
    cache = ActivationCache.open("cache/neuroflux/block0/train", producer=sig)
    for xb, yb in Batches(cache, batch_size=37, shuffle=True, seed=0, epoch=3):
        ...                                              # exactly 37 per batch, across shard boundaries

One cache is one directory:

* ``shard-00000.pt`` ...: a contiguous range of samples each (``shard_samples``; the worker sizes
  shards by bytes, ``neuroflux.cache.shard_size``),
  a ``torch.save`` of plain tensors and ints only (``x`` or the BitTrain bitmap fields, and ``y``
  int64), so reading uses ``torch.load(weights_only=True)`` and never unpickles a class.
  Each shard file is written atomically (temp file, fsync, rename).
* ``manifest.json``, written last and atomically: format version, ``producer`` (the caller's
  hash of what produced the activations), ``num_samples``, ``sample_shape``, ``dtype`` (the
  compute dtype readers get back), ``storage`` and, per shard, file, start, count, bytes on disk
  and the sha256 of the file. A directory without a manifest is incomplete and is never read.

Storage: ``dense`` (as computed: exact); ``float16`` (x stored in half precision and returned in
the compute dtype: approximate, relative error <= 2**-11; a shard with values beyond float16's
range is stored in the compute dtype instead, with a warning and ``full_precision`` in the manifest);
``bittrain`` (each shard's x as a BitTrain bitmap, ``edgeflux.bittrain.compress``: ReLU outputs
are about half zeros, so a shard is about 1/32 + nnz/numel of its dense size; exact with
threshold 0 and ``value_dtype=None``, approximate when values are pruned or stored as float16).

Every shard's size and sha256 are checked before it is deserialised: a flipped bit on an SD card
raises CacheCorruptError naming the file instead of training on garbage (the controller then
rebuilds the cache from the block's saved weights).

Why not torch.utils.data.DataLoader: the things this needs are not what it gives.
(1) Reading in shards, each verified whole before use, with samples re-chunked across shard
boundaries into any batch size, means a "sample" is not the unit of reading: a map-style
Dataset with per-sample ``__getitem__`` would load or hold a whole shard per index (or the
whole cache); an IterableDataset with ``batch_size=None`` would do the work below anyway.
(2) Exact resume needs the order to be a pure function of (seed, epoch) on one torch.Generator,
without the global RNG; (3) overlapping reads with compute only needs one thread, since
file reads and sha256 (hashlib releases the GIL on large buffers) release the GIL;
DataLoader's ``num_workers>0`` forks worker processes, each a copy of the
interpreter and torch (heavy on a Raspberry Pi with 1-4 GiB), and ``num_workers=0`` does not
prefetch at all. So Batches is a small thread plus a bounded queue.

The thread only fetches (``fetch_shard``: file bytes, size and sha256); decoding
(``decode_shard``: torch.load, float16 to float32, bitmap decompression, normalising uint8
images) runs on the training thread. Torch ops on a second thread slowed every training
step on a 2-core CPU by more than the decoding costs on the training thread: measured in
``bench/prefetch.py`` (``bench/results/prefetch.md``).

Shuffling permutes the shard order and the samples within each shard, not the whole cache:
memory stays at a few shards. Batches are then as random as the stored order, which is random
here because ``edgeflux.data.prepare`` shuffles every split and caches are written in that order.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from edgeflux.artifacts import atomic_write, write_json
from edgeflux.bittrain import BitmapTensor, compress
from edgeflux.memory import format_bytes
from edgeflux.options import Bytes, Options

__all__ = [
    "ActivationCache",
    "Batches",
    "CacheCorruptError",
    "CacheOptions",
    "CacheNotFoundError",
    "CacheStaleError",
    "CacheWriter",
    "TensorSource",
    "cache_hash",
    "is_complete",
]

log = logging.getLogger(__name__)

FORMAT = "edgeflux-activation-cache"
VERSION = 1
MANIFEST = "manifest.json"
STORAGES = ("dense", "float16", "bittrain")


class CacheOptions(Options):
    """How NeuroFlux stores block activations on disk (params.yaml: neuroflux.cache)."""

    storage: Literal[STORAGES] = "dense"   # float16: half the disk, approximate
    threshold: float = Field(0.0, ge=0)   # bittrain: prune |x| < threshold (0: exact)
    # a shard holds as many samples as fit this many bytes in the compute dtype (at least one): what
    # reading a cache keeps in memory is a few shards, so on a device this bounds the input pipeline
    shard_size: Bytes = Field(4 * 2**20, ge=1)
    shard_samples: int | None = Field(None, ge=1)   # samples per shard instead (tests, benchmarks): overrides shard_size

    @model_validator(mode="after")
    def _threshold_needs_bittrain(self) -> CacheOptions:
        # checked here, not when the first cache is written: that happens after the block has trained
        if self.threshold and self.storage != "bittrain":
            raise ValueError(f"threshold {self.threshold:g} prunes bitmap values: it needs storage: bittrain "
                             f"(storage is {self.storage}); set threshold: 0 or storage: bittrain")
        return self

    def samples_per_shard(self, sample_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        if self.shard_samples is not None:
            return self.shard_samples
        return max(1, self.shard_size // (math.prod(sample_shape) * dtype.itemsize))


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.pt"


def _fix(directory: Path) -> str:
    return f"delete {directory} and rerun; edgeflux rebuilds it"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CacheCorruptError(RuntimeError):
    """A shard (or the manifest) does not match what the manifest recorded: size, sha256 or content."""

    def __init__(self, path: Path, problem: str, expected: Any = None, actual: Any = None) -> None:
        self.path, self.expected, self.actual = Path(path), expected, actual
        detail = f" (expected {expected}, found {actual})" if expected is not None or actual is not None else ""
        super().__init__(f"activation cache file {path}: {problem}{detail}; {_fix(Path(path).parent)}")


class CacheNotFoundError(FileNotFoundError):
    """No complete cache in the directory: it is missing, or its writer never finished (no manifest)."""


class CacheStaleError(ValueError):
    """The cache was produced by something else (another block config, weights or input) than asked for."""


def cache_hash(manifest: dict) -> str:
    """Identity of a cache's content: its producer plus every shard's sha256 (for the next block's producer)."""
    ident = {"format": manifest["format"], "version": manifest["version"], "producer": manifest["producer"],
             "shards": [s["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- writing

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
        full_precision = half and not _fits_float16(x)
        if full_precision:
            log.warning("activation cache %s: shard %d has values beyond float16's range (|x| up to %.4g); "
                        "stored in %s instead", self.directory, len(self._shards),
                        float(x[x.isfinite()].abs().max()), _dtype_name(self.dtype))
        if self.storage == "dense" or (self.storage == "float16" and full_precision):
            payload = {"x": _compact(x)}
        elif self.storage == "float16":
            payload = {"x": _compact(x.to(torch.float16))}
        else:
            packed = compress(x.contiguous(), threshold=self.threshold,
                              store_dtype=None if full_precision else self.value_dtype)
            payload = {"bitmap": _compact(packed.bitmap), "values": _compact(packed.values),
                       "shape": list(packed.shape), "stride": list(packed.stride)}
        payload["y"] = _compact(y)
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        name = _shard_name(len(self._shards))
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
        manifest = {
            "format": FORMAT, "version": VERSION, "producer": self.producer, "num_samples": self._written,
            "sample_shape": list(self.sample_shape), "dtype": _dtype_name(self.dtype), "storage": self.storage,
            "threshold": self.threshold,
            "value_dtype": _dtype_name(self.value_dtype) if self.value_dtype is not None else None,
            "shard_samples": self.shard_samples, "label_dtype": "int64", "shards": self._shards,
        }
        write_json(self.directory / MANIFEST, manifest)
        nbytes = sum(s["bytes"] for s in self._shards)
        log.info("activation cache %s: wrote %d samples in %d shards, %s (%s), in %.2f s", self.directory,
                 self._written, len(self._shards), format_bytes(nbytes), self.storage,
                 time.perf_counter() - self._tick)


def _fits_float16(x: Tensor) -> bool:
    """Every finite value of x stays finite in float16 (|x| < 65520 rounds to at most 65504)."""
    return not bool((x.isfinite() & (x.abs() >= 65520)).any())


def _compact(t: Tensor) -> Tensor:
    """t if it is contiguous and owns exactly its storage, else a compact copy: torch.save writes a
    view's whole storage, so a shard sliced from the writer's buffer would carry the entire buffer."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- reading

def _load_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.exists():
        if directory.is_dir() and any(directory.glob("shard-*.pt")):
            raise CacheNotFoundError(f"activation cache {directory} is incomplete (shards but no {MANIFEST}: its "
                                     f"writer was interrupted); {_fix(directory)}")
        raise CacheNotFoundError(f"no activation cache at {directory} (no {MANIFEST}); run the block that writes it")
    try:
        manifest = json.loads(path.read_text())
        ok = manifest.get("format") == FORMAT and manifest.get("storage") in STORAGES and "shards" in manifest
    except (ValueError, AttributeError) as exc:
        raise CacheCorruptError(path, f"unreadable manifest ({exc})") from exc
    if not ok:
        raise CacheCorruptError(path, "not an edgeflux activation-cache manifest")
    if manifest["version"] != VERSION:
        raise CacheStaleError(f"activation cache {directory} has format version {manifest['version']}, this "
                              f"edgeflux reads version {VERSION}; {_fix(directory)}")
    return manifest


def is_complete(directory: str | Path, producer: str) -> bool:
    """Cheap check (no hashing): manifest present, same producer, every shard file there at its recorded size."""
    directory = Path(directory)
    try:
        manifest = _load_manifest(directory)
    except (CacheNotFoundError, CacheCorruptError, CacheStaleError):
        return False
    if manifest["producer"] != producer:
        return False
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            return False
    return True


class ActivationCache:
    """A finished cache directory, read shard by shard; every read checks size and sha256 first."""

    def __init__(self, directory: Path, manifest: dict) -> None:
        self.directory, self.manifest = directory, manifest
        self.dtype = _dtype(manifest["dtype"])
        self.sample_shape = tuple(manifest["sample_shape"])
        self._shards = manifest["shards"]

    @classmethod
    def open(cls, directory: str | Path, producer: str | None = None) -> ActivationCache:
        """Open a complete cache. CacheNotFoundError (a FileNotFoundError) without a manifest;
        CacheStaleError (a ValueError) when ``producer`` is given and the cache was made by another."""
        directory = Path(directory)
        manifest = _load_manifest(directory)
        if producer is not None and manifest["producer"] != producer:
            raise CacheStaleError(f"activation cache {directory} was produced by {manifest['producer'][:16]}..., "
                                  f"not {producer[:16]}... (another block config, weights or input); "
                                  f"{_fix(directory)}")
        return cls(directory, manifest)

    is_complete = staticmethod(is_complete)

    @property
    def num_samples(self) -> int:
        return self.manifest["num_samples"]

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def storage(self) -> str:
        return self.manifest["storage"]

    @property
    def nbytes(self) -> int:
        """Bytes of the shard files on disk (as recorded in the manifest)."""
        return sum(s["bytes"] for s in self._shards)

    def shard_count(self, i: int) -> int:
        return self._shards[i]["count"]

    def _read_verified(self, i: int) -> bytes:
        shard = self._shards[i]
        path = self.directory / shard["file"]
        if not path.is_file():
            raise CacheCorruptError(path, "shard file missing")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise CacheCorruptError(path, "wrong size in bytes", shard["bytes"], size)
        data = path.read_bytes()
        if len(data) != shard["bytes"]:   # changed between stat and read
            raise CacheCorruptError(path, "wrong size in bytes", shard["bytes"], len(data))
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard["sha256"]:
            raise CacheCorruptError(path, "sha256 mismatch", shard["sha256"], digest)
        return data

    def read_shard(self, i: int) -> tuple[Tensor, Tensor]:
        """Shard i as (x in the compute dtype, y int64), after checking its size and sha256."""
        return self.decode_shard(i, self.fetch_shard(i))

    def fetch_shard(self, i: int) -> bytes:
        """Shard i's file, size and sha256 checked: file I/O and hashing only (no torch op)."""
        if not 0 <= i < self.num_shards:
            raise IndexError(f"shard {i} out of range: {self.directory} has {self.num_shards} shards")
        return self._read_verified(i)

    def decode_shard(self, i: int, data: bytes) -> tuple[Tensor, Tensor]:
        """What fetch_shard(i) returned, as (x in the compute dtype, y int64)."""
        shard = self._shards[i]
        path = self.directory / shard["file"]
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if self.storage == "bittrain":
            x = BitmapTensor(bitmap=payload["bitmap"], values=payload["values"], shape=torch.Size(payload["shape"]),
                             stride=tuple(payload["stride"]), dtype=self.dtype).decompress()
        else:
            x = payload["x"].to(self.dtype)
        y = payload["y"]
        expected = (shard["count"], *self.sample_shape)
        if tuple(x.shape) != expected or tuple(y.shape) != (shard["count"],) or y.dtype != torch.int64:
            raise CacheCorruptError(path, "content does not match the manifest", expected, tuple(x.shape))
        return x, y

    def verify(self) -> None:
        """Check every shard's size and sha256 (no deserialising); CacheCorruptError on the first mismatch."""
        for i in range(self.num_shards):
            self._read_verified(i)

    def labels(self) -> Tensor:
        """All labels in cache order (reads and verifies every shard)."""
        ys = [self.read_shard(i)[1] for i in range(self.num_shards)]
        return torch.cat(ys) if ys else torch.empty(0, dtype=torch.int64)

    def __repr__(self) -> str:
        return (f"ActivationCache({str(self.directory)!r}, samples={self.num_samples}, shape={self.sample_shape}, "
                f"storage={self.storage}, shards={self.num_shards}, {format_bytes(self.nbytes)})")


class TensorSource:
    """In-memory (x, y) with ActivationCache's reading interface: block 0 reads the dataset like a cache."""

    def __init__(self, x: Tensor, y: Tensor, shard_samples: int = 2048) -> None:
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if shard_samples < 1:
            raise ValueError(f"shard_samples must be >= 1, got {shard_samples}")
        self.x, self.y, self.shard_samples = x, y, shard_samples

    @property
    def num_samples(self) -> int:
        return len(self.x)

    @property
    def num_shards(self) -> int:
        return math.ceil(len(self.x) / self.shard_samples)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def shard_count(self, i: int) -> int:
        return min(self.shard_samples, len(self.x) - i * self.shard_samples)

    def read_shard(self, i: int) -> tuple[Tensor, Tensor]:
        return self.decode_shard(i, self.fetch_shard(i))

    def fetch_shard(self, i: int) -> int:
        """Nothing to read: the data is in memory."""
        if not 0 <= i < self.num_shards:
            raise IndexError(f"shard {i} out of range: {self.num_shards} shards")
        return i

    def decode_shard(self, i: int, _fetched: int) -> tuple[Tensor, Tensor]:
        """Shard i: views of plain tensors; edgeflux.data.Images normalise their uint8 pixels here."""
        start = i * self.shard_samples
        return self.x[start:start + self.shard_samples], self.y[start:start + self.shard_samples]


# ----------------------------------------------------------------------------- batching

def _generator(seed: int, epoch: int) -> torch.Generator:
    # A hash, not seed + epoch: (seed 1, epoch 0) and (seed 0, epoch 1) must differ.
    digest = hashlib.sha256(f"edgeflux.batches/{seed}/{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


_DONE = object()


class Batches:
    """Batches of exactly ``batch_size`` (the last may be smaller unless drop_last) over a cache or TensorSource.

    Samples are re-chunked across shard boundaries, each yielded once per epoch. With
    ``prefetch`` > 0 a background thread reads (and verifies) up to ``prefetch`` shards ahead,
    so memory holds about prefetch + 2 shards; its errors (CacheCorruptError) re-raise here, and
    it stops when the loop ends, breaks or raises. prefetch=0 reads in the caller's thread.
    Shuffle: shard order and the order within each shard are drawn from a torch.Generator
    seeded by (seed, epoch) only, so a resumed run sees the same batches (global RNG untouched).
    """

    def __init__(self, source, batch_size: int, shuffle: bool = False, seed: int = 0, epoch: int = 0,
                 prefetch: int = 2, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.source, self.batch_size = source, batch_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        self.prefetch, self.drop_last = prefetch, drop_last

    def __len__(self) -> int:
        n = self.source.num_samples
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _shards(self, stop: threading.Event | None = None) -> Iterator[tuple[int, Any, Tensor | None]]:
        """(shard index, what fetch_shard returned, order within the shard or None) per shard, in epoch order.

        The order is applied batch by batch (a gather of one batch), not to the whole shard: a
        shuffled copy of the shard would double what the reader holds.
        """
        gen = _generator(self.seed, self.epoch) if self.shuffle else None
        n = self.source.num_shards
        order = torch.randperm(n, generator=gen).tolist() if gen is not None else range(n)
        for i in order:
            if stop is not None and stop.is_set():
                return
            fetched = self.source.fetch_shard(i)
            yield i, fetched, torch.randperm(self.source.shard_count(i), generator=gen) if gen is not None else None

    def _prefetched(self) -> Iterator[tuple[int, Any, Tensor | None]]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():   # a timeout, so that a consumer gone away never leaves us blocked
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in self._shards(stop):
                    if not put(item):
                        return
                put(_DONE)
            except BaseException as exc:   # handed to the consumer, which re-raises it
                put(exc)

        thread = threading.Thread(target=produce, name=f"edgeflux-prefetch-{id(self):x}", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():   # drain, so a blocked put wakes at once; then the thread ends
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        bs = self.batch_size
        xs: list[Tensor] = []
        ys: list[Tensor] = []
        have = 0
        shards = self._prefetched() if self.prefetch > 0 else self._shards()
        try:
            for i, fetched, perm in shards:
                # Deserialising, converting and normalising run here, on the training thread: torch
                # ops on the prefetch thread slowed every training step (see the module docstring).
                x, y = self.source.decode_shard(i, fetched)
                pos, n = 0, len(y)
                while pos < n:
                    take = min(bs - have, n - pos)
                    if perm is None:     # a view of the shard
                        xs.append(x[pos:pos + take])
                        ys.append(y[pos:pos + take])
                    else:
                        idx = perm[pos:pos + take]
                        xs.append(x[idx])
                        ys.append(y[idx])
                    have += take
                    pos += take
                    if have == bs:
                        # one piece: a view of the shard, no copy
                        yield (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
                        xs, ys, have = [], [], 0
            if have and not self.drop_last:
                yield (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
        finally:
            close = getattr(shards, "close", None)
            if close is not None:
                close()
