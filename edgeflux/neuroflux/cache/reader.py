"""Reading shard by shard: a finished cache directory (ActivationCache) or tensors in memory
(TensorSource), behind one interface that Batches reads.

The interface splits a read in two so that Batches can prefetch on a thread without torch ops
there: ``fetch_shard`` (file I/O and hashing only) and ``decode_shard`` (torch, on the caller's thread).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from edgeflux.memory import format_bytes

from .manifest import CacheCorruptError, CacheStaleError, fix_hint, is_complete, load_manifest, read_verified
from .shards import decode_payload, dtype_from_name

__all__ = ["ActivationCache", "TensorSource"]


class ActivationCache:
    """A finished cache directory, read shard by shard; every read checks size and sha256 first."""

    def __init__(self, directory: Path, manifest: dict) -> None:
        self.directory, self.manifest = directory, manifest
        self.dtype = dtype_from_name(manifest["dtype"])
        self.sample_shape = tuple(manifest["sample_shape"])
        self._shards = manifest["shards"]

    @classmethod
    def open(cls, directory: str | Path, producer: str | None = None) -> ActivationCache:
        """Open a complete cache. CacheNotFoundError (a FileNotFoundError) without a manifest;
        CacheStaleError (a ValueError) when ``producer`` is given and the cache was made by another."""
        directory = Path(directory)
        manifest = load_manifest(directory)
        if producer is not None and manifest["producer"] != producer:
            raise CacheStaleError(f"activation cache {directory} was produced by {manifest['producer'][:16]}..., "
                                  f"not {producer[:16]}... (another block config, weights or input); "
                                  f"{fix_hint(directory)}")
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

    def read_shard(self, i: int) -> tuple[Tensor, Tensor]:
        """Shard i as (x in the compute dtype, y int64), after checking its size and sha256."""
        return self.decode_shard(i, self.fetch_shard(i))

    def fetch_shard(self, i: int) -> bytes:
        """Shard i's file, size and sha256 checked: file I/O and hashing only (no torch op)."""
        if not 0 <= i < self.num_shards:
            raise IndexError(f"shard {i} out of range: {self.directory} has {self.num_shards} shards")
        return read_verified(self.directory, self._shards[i])

    def decode_shard(self, i: int, data: bytes) -> tuple[Tensor, Tensor]:
        """What fetch_shard(i) returned, as (x in the compute dtype, y int64)."""
        shard = self._shards[i]
        path = self.directory / shard["file"]
        x, y = decode_payload(data, self.storage, self.dtype)
        expected = (shard["count"], *self.sample_shape)
        if tuple(x.shape) != expected or tuple(y.shape) != (shard["count"],) or y.dtype != torch.int64:
            raise CacheCorruptError(path, "content does not match the manifest", expected, tuple(x.shape))
        return x, y

    def verify(self) -> None:
        """Check every shard's size and sha256 (no deserialising); CacheCorruptError on the first mismatch."""
        for shard in self._shards:
            read_verified(self.directory, shard)

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
