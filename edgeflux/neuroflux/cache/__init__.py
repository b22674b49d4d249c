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

The modules, by job: ``manifest`` (the directory format and the checks before a read: completeness,
version, producer, size and sha256), ``shards`` (a shard file's content per storage), ``writer``
(CacheWriter), ``reader`` (ActivationCache, TensorSource), ``batches`` (Batches and its prefetch
thread); the options are in ``edgeflux.neuroflux.options``, which imports no torch.
"""
from __future__ import annotations

from ..options import STORAGES, CacheOptions
from .batches import Batches
from .manifest import CacheCorruptError, CacheNotFoundError, CacheStaleError, cache_hash, is_complete
from .reader import ActivationCache, TensorSource
from .writer import CacheWriter

__all__ = [
    "ActivationCache",
    "Batches",
    "CacheCorruptError",
    "CacheOptions",
    "CacheNotFoundError",
    "CacheStaleError",
    "CacheWriter",
    "STORAGES",
    "TensorSource",
    "cache_hash",
    "is_complete",
]
