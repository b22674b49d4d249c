"""Batches of any size over a cache or TensorSource, re-chunked across shard boundaries, with a
background thread that prefetches shards (see the package docstring for why not DataLoader).
"""
from __future__ import annotations

import hashlib
import math
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batches"]


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
                # ops on the prefetch thread slowed every training step (see the package docstring).
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
