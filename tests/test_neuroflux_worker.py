"""NeuroFlux's worker and controller on real data: local gradients, the budget, caches, resume, rebuild."""
from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edgeflux.config import NeuroFluxParams
from edgeflux.memory import no_context
from edgeflux.neuroflux.cache import ActivationCache
from edgeflux.neuroflux.aux import exit_params
from edgeflux.neuroflux.exit import ExitModel, select_exit
from edgeflux.neuroflux.model import build_learners
from edgeflux.neuroflux.partition import Block
from edgeflux.neuroflux.block import BlockStep, LocalBlock
from edgeflux.train import optimizer_factory
from edgeflux.neuroflux.worker import CacheOptions, train_blocks

REPO = Path(__file__).resolve().parents[1]
SPEC = dict(name="vgg11", num_classes=10, in_channels=1, width=0.125, image_size=32, batch_norm=True, seed=0)
AUX = dict(mode="adaptive", classic_filters=256, pool=2, seed=0)


def splits(data, n_train=384, n_eval=128):
    from edgeflux.data import tensors

    return {"train": tensors(data, "target_train", limit=n_train), "val": tensors(data, "target_val", limit=n_eval),
            "test": tensors(data, "target_test", limit=n_eval)}


def opts(**kw):
    base = dict(epochs=2, lr=0.05, momentum=0.9, weight_decay=5e-4, evals_per_epoch=1, seed=0)
    return NeuroFluxParams(**{**base, **kw})


def three_blocks(n_units):
    cut = [0, 2, 5, n_units]
    return [Block(index=i, units=tuple(range(cut[i], cut[i + 1])), batch_size=b) for i, b in enumerate((32, 48, 64))]


# ----------------------------------------------------------------------------- Algorithm 2, one batch

def test_block_step_updates_each_unit_from_its_own_local_loss(mnist_subset):
    """Plain SGD (lr 1, no momentum/decay): each unit's change equals minus autograd's gradient of ITS local
    loss, on the input the unit before it produced before being updated (Algorithm 2, lines 3-7)."""
    _, learners = build_learners(SPEC, AUX)
    block = learners[:3]
    x, y = splits(mnist_subset)["train"][0][:16], splits(mnist_subset)["train"][1][:16]
    before = copy.deepcopy(block)
    expected, inp = [], x
    for learner in before:
        out, logits = learner.forward_with_output(inp)
        grads = torch.autograd.grad(F.cross_entropy(logits, y), list(learner.parameters()))
        expected.append([p.detach() - g for p, g in zip(learner.parameters(), grads)])
        inp = out.detach()
    step = BlockStep.factory(lambda params: torch.optim.SGD(params, lr=1.0), context=no_context)(LocalBlock(block))
    step(x, y)
    for learner, want in zip(block, expected):
        for p, w in zip(learner.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    untouched = learners[3]
    assert all(p.grad is None for p in untouched.parameters())


# ----------------------------------------------------------------------------- controller

@pytest.fixture(scope="module")
def trained(tmp_path_factory, mnist_subset):
    """One complete cached run: 3 blocks, 2 epochs each, a budget every block must respect."""
    workdir = tmp_path_factory.mktemp("nf") / "cache"
    _, learners = build_learners(SPEC, AUX)
    blocks = three_blocks(len(learners))
    result = train_blocks(learners, blocks, splits(mnist_subset), opts(), workdir=workdir, budget_bytes=8_000_000,
                          cache=CacheOptions(storage="dense", shard_samples=100))
    return workdir, learners, blocks, result


def test_every_block_measured_within_budget(trained):
    _, _, blocks, result = trained
    assert [b.units for b in result.blocks] == [list(b.units) for b in blocks]
    for b in result.blocks:
        assert 0 < b.peak_bytes <= 8_000_000
        assert 1 <= b.batch_size <= b.planned_batch
    assert len(result.unit_val_acc) == sum(len(b.units) for b in blocks)
    assert max(result.unit_val_acc) > 0.3   # MNIST after 2 short epochs per block: well above chance


def test_finished_blocks_are_parked_without_gradients(trained):
    """Only the block in training occupies the device (paper Section 3.1); a finished one keeps no grads."""
    _, learners, _, _ = trained
    assert all(p.grad is None and p.device.type == "cpu" for learner in learners for p in learner.parameters())


def test_tensor_digest_sees_any_change_of_values_labels_or_order(mnist_subset):
    from edgeflux.train import tensor_digest

    x, y = splits(mnist_subset)["train"]
    x = x[:]   # the digest of float tensors (block outputs); Images: tests/test_data.py
    base = tensor_digest(x, y)
    assert tensor_digest(x.clone(), y.clone()) == base
    assert tensor_digest(x.transpose(2, 3).contiguous().transpose(2, 3), y) == base   # layout does not matter
    swapped = y.clone()
    i, j = 0, int((y != y[0]).nonzero()[0])
    swapped[i], swapped[j] = y[j], y[i]                   # same label sum, same values: a sum-based hash misses it
    assert tensor_digest(x, swapped) != base
    order = torch.arange(len(y))
    order[[5, 6]] = order[[6, 5]]
    assert tensor_digest(x[order], y[order]) != base
    nudged = x.clone()
    nudged.view(-1)[-1] += 1e-3
    assert tensor_digest(nudged, y) != base


def test_budget_below_the_planned_batch_lowers_the_batch(mnist_subset, tmp_path):
    _, learners = build_learners(SPEC, AUX)
    block = [Block(index=0, units=(0, 1), batch_size=64)]
    result = train_blocks(learners[:2], block, splits(mnist_subset, 64, 32), opts(epochs=1), workdir=tmp_path,
                          budget_bytes=3_000_000, cache=CacheOptions(shard_samples=64))
    b = result.blocks[0]
    assert b.batch_size < 64 and b.peak_bytes <= 3_000_000


def test_cache_shards_are_sized_in_bytes(mnist_subset, tmp_path):
    """neuroflux.cache.shard_size bounds a shard's bytes (what a reader holds a few of), whatever the block's output."""
    assert CacheOptions(shard_size="10000B").samples_per_shard((16, 8, 8)) == 2          # 4,096 bytes a sample
    assert CacheOptions(shard_size="10000B").samples_per_shard((16, 64, 64)) == 1        # never empty
    assert CacheOptions(shard_size="10000B", shard_samples=7).samples_per_shard((16, 8, 8)) == 7
    _, learners = build_learners(SPEC, AUX)
    train_blocks(learners[:2], [Block(index=0, units=(0, 1), batch_size=16)], splits(mnist_subset, 64, 32),
                 opts(epochs=1), workdir=tmp_path, cache=CacheOptions(shard_size="64KiB"))
    cache = ActivationCache.open(tmp_path / "block0" / "train")
    sample_bytes = math.prod(cache.sample_shape) * 4
    assert cache.manifest["shard_samples"] == 64 * 1024 // sample_bytes
    assert cache.num_shards == math.ceil(64 / cache.manifest["shard_samples"]) > 1


def test_cached_activations_are_the_trained_blocks_outputs(trained, mnist_subset):
    """The next block's input is exactly block 0's output in eval mode: no forward pass needed later."""
    workdir, learners, blocks, _ = trained
    x = splits(mnist_subset)["train"][0]
    cache = ActivationCache.open(workdir / "block0" / "train")
    assert cache.num_samples == len(x)
    cached, labels = cache.read_shard(0)
    block0 = [learners[i] for i in blocks[0].units]
    for m in block0:
        m.eval()
    with torch.no_grad():
        out = x[:len(cached)]
        for learner in block0:
            out = learner.unit(out)
    for m in block0:
        m.train()
    torch.testing.assert_close(cached, out, rtol=1e-5, atol=1e-6)
    assert torch.equal(labels, splits(mnist_subset)["train"][1][:len(cached)])


def test_exit_accuracies_match_the_exit_models(trained, mnist_subset):
    _, learners, _, result = trained
    test = splits(mnist_subset)["test"]
    params = [exit_params(learners, k) for k in range(len(learners))]
    k = select_exit(result.unit_val_acc, params, tolerance=0.005)
    model = ExitModel(learners, k).eval()
    with torch.no_grad():
        acc = (model(test[0][:]).argmax(1) == test[1]).float().mean().item()
    assert acc == pytest.approx(result.unit_test_acc[k], abs=1 / len(test[1]) + 1e-9)
    assert params[k] == sum(p.numel() for p in model.parameters())
    assert result.unit_val_acc[k] >= max(result.unit_val_acc) - 0.005


# ----------------------------------------------------------------------------- resume and rebuild

DRIVER = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    import torch
    from edgeflux.config import NeuroFluxParams
    from edgeflux.data import load_raw, prepare, tensors
    from edgeflux.neuroflux.model import build_learners
    from edgeflux.neuroflux.partition import Block
    from edgeflux.neuroflux.worker import CacheOptions, train_blocks
    torch.set_num_threads(1)
    out, kill_at = Path(sys.argv[1]), os.environ.get("KILL_AT")
    data = prepare(load_raw("mnist-subset"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    splits = {s: tensors(data, "target_" + s, limit=n) for s, n in (("train", 256), ("val", 96), ("test", 96))}
    model, learners = build_learners(%(spec)r, %(aux)r)
    cut = [0, 2, 5, len(learners)]
    blocks = [Block(index=i, units=tuple(range(cut[i], cut[i + 1])), batch_size=b) for i, b in enumerate((32, 48, 64))]
    def on_epoch_end(block, epoch):
        if kill_at == f"{block}:{epoch}":
            os.kill(os.getpid(), signal.SIGKILL)   # as hard as a power cut: no cleanup runs
    opts = NeuroFluxParams(epochs=2, lr=0.05, evals_per_epoch=1, seed=0)
    result = train_blocks(learners, blocks, splits, opts, workdir=out / "cache", checkpoint_dir=out / "ckpt",
                          cache=CacheOptions(storage="dense", shard_samples=100), on_epoch_end=on_epoch_end)
    torch.save({"learners": [l.state_dict() for l in learners], "val": result.unit_val_acc,
                "skipped": [b.skipped for b in result.blocks], "resumed": [b.resumed_from_epoch for b in result.blocks],
                "rebuilt": [b.rebuilt_caches for b in result.blocks]}, out / "result.pt")
''') % {"spec": SPEC, "aux": AUX}


def run_driver(tmp: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KILL_AT", None)
    if kill_at:
        env["KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(script), str(tmp)], env=env, capture_output=True, text=True,
                          timeout=600)


def load_result(tmp: Path) -> dict:
    return torch.load(tmp / "result.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = run_driver(tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, load_result(tmp)


def assert_same_learners(a: dict, b: dict) -> None:
    for sa, sb in zip(a["learners"], b["learners"], strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    assert a["val"] == b["val"]


@pytest.mark.slow   # a training process killed, then resumed
def test_sigkill_mid_block_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
    _, reference = uninterrupted
    killed = run_driver(tmp_path, kill_at="1:0")          # after block 1's first epoch checkpoint
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "result.pt").exists()
    assert (tmp_path / "ckpt" / "block1.pt").exists() and (tmp_path / "cache" / "block0" / "block.json").exists()
    resumed = run_driver(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = load_result(tmp_path)
    assert result["skipped"] == [True, False, False]      # block 0 reused, not retrained
    assert result["resumed"][1] == 1                      # block 1 continued after its first epoch
    assert_same_learners(result, reference)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_cache_shard_is_detected_and_rebuilt(uninterrupted, tmp_path, damage):
    ref_dir, reference = uninterrupted
    import shutil

    shutil.copytree(ref_dir / "cache", tmp_path / "cache")
    shard = tmp_path / "cache" / "block0" / "train" / "shard-00001.pt"
    original = shard.read_bytes()
    if damage == "flip":
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(original[: len(original) // 2])
    proc = run_driver(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = load_result(tmp_path)
    assert result["skipped"] == [True, True, True]
    assert result["rebuilt"][0] == ["train"]
    assert shard.read_bytes() == original                 # rebuilt bit for bit from the saved weights
    assert_same_learners(result, reference)


@pytest.mark.parametrize("damage", ["empty", "other weights"])
def test_weights_that_do_not_match_their_record_are_retrained_not_reused(uninterrupted, tmp_path, damage):
    """A power cut can leave learners.pt empty; a later run with other settings, killed between its weights
    and its record, leaves other weights beside an old record. Neither is taken for the block's weights."""
    ref_dir, reference = uninterrupted
    import shutil

    shutil.copytree(ref_dir / "cache", tmp_path / "cache")
    weights = tmp_path / "cache" / "block0" / "learners.pt"
    if damage == "empty":
        weights.write_bytes(b"")
    else:
        _, other = build_learners({**SPEC, "seed": 1}, AUX)
        torch.save([other[i].state_dict() for i in (0, 1)], weights)
    proc = run_driver(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not match its record" in proc.stderr
    result = load_result(tmp_path)
    # block 0 trained again (same seed: the same weights, so the same cache); blocks 1-2 then reused
    assert result["skipped"] == [False, True, True]
    assert_same_learners(result, reference)


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_classic_local_learning_recomputes_inputs_and_matches_the_cached_run(trained, mnist_subset, tmp_path):
    """Without a cache each block runs the trained units before it on every batch; same inputs, same learning.
    That recomputation costs memory inside the step: the trained units' weights and their forward (no budget
    here, so that both runs train at the planned batches; at the cached run's budget the last block's step
    no longer fits its batch)."""
    _, cached_learners, blocks, cached = trained
    _, learners = build_learners(SPEC, AUX)
    result = train_blocks(learners, blocks, splits(mnist_subset), opts(), workdir=tmp_path / "cache",
                          budget_bytes=None, cache=CacheOptions(shard_samples=100), use_cache=False)
    assert not any((tmp_path / "cache" / f"block{b.index}" / "train").exists() for b in blocks)
    assert [b.batch_size for b in result.blocks] == [b.batch_size for b in cached.blocks]
    classic, with_cache = [b.peak_bytes for b in result.blocks], [b.peak_bytes for b in cached.blocks]
    assert classic[0] == with_cache[0] and all(c > k for c, k in zip(classic[1:], with_cache[1:]))
    for a, b in zip(learners, cached_learners):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)   # the cache holds exactly what the trained units compute


@pytest.mark.parametrize("split_rho", [None, 0.4])
@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_a_block_too_big_for_the_budget_is_split_not_abandoned(mnist_subset, tmp_path, split_rho):
    """Per-unit profiles ignore the other units' parameters in a block; the measured block step does not."""
    _, learners = build_learners(SPEC, AUX)
    budget = 1_150_000
    whole = [Block(index=0, units=tuple(range(len(learners))), batch_size=8)]
    result = train_blocks(learners, whole, splits(mnist_subset, 64, 32), opts(epochs=1), workdir=tmp_path / "c",
                          budget_bytes=budget, cache=CacheOptions(shard_samples=64), split_rho=split_rho)
    assert len(result.blocks) > 1
    if split_rho is not None:   # every multi-unit block kept a batch within rho of its plan
        assert all(b.batch_size >= (1 - split_rho) * b.planned_batch for b in result.blocks if len(b.units) > 1)
    assert [u for b in result.blocks for u in b.units] == list(range(len(learners)))
    assert [b.index for b in result.blocks] == list(range(len(result.blocks)))
    assert all(b.peak_bytes <= budget for b in result.blocks)


def test_until_stops_before_the_next_block(mnist_subset, tmp_path):
    """Benchmarks cap slow baselines (a time limit): once until holds no block starts; finished blocks stay."""
    _, learners = build_learners(SPEC, AUX)
    blocks = three_blocks(len(learners))
    data = splits(mnist_subset, 64, 32)
    capped = train_blocks(learners, blocks, data, opts(epochs=1), workdir=tmp_path / "c",
                          cache=CacheOptions(shard_samples=64),
                          until=lambda run: run.train_time_s > 0)
    assert not capped.complete and [tuple(b.units) for b in capped.blocks] == [blocks[0].units]
    assert all(capped.unit_val_acc[u] > 0 for u in blocks[0].units)
    assert all(capped.unit_val_acc[u] == 0 for b in blocks[1:] for u in b.units)
    _, learners = build_learners(SPEC, AUX)
    whole = train_blocks(learners, blocks, data, opts(epochs=1), workdir=tmp_path / "w",
                         cache=CacheOptions(shard_samples=64),
                         until=lambda run: run.train_time_s > 1e9)
    assert whole.complete and len(whole.blocks) == len(blocks)
    assert whole.unit_val_acc[:2] == capped.unit_val_acc[:2]   # the same first block either way


def test_a_unit_that_cannot_fit_names_itself(mnist_subset, tmp_path):
    from edgeflux.neuroflux.partition import UnitDoesNotFitError

    _, learners = build_learners(SPEC, AUX)
    with pytest.raises(UnitDoesNotFitError, match="unit 0"):
        train_blocks(learners[:1], [Block(index=0, units=(0,), batch_size=4)], splits(mnist_subset, 64, 32),
                     opts(epochs=1), workdir=tmp_path / "c", budget_bytes=10_000, cache=CacheOptions(shard_samples=64))


def test_bittrain_in_the_block_worker_trains_bit_identically_with_less_saved_memory(mnist_subset, tmp_path):
    """params.yaml neuroflux.bittrain.enabled: the same learning, measured with compressed saved activations."""
    from edgeflux.config import BitTrainParams

    runs = {}
    for enabled in (False, True):
        _, learners = build_learners(SPEC, AUX)
        blocks = [Block(index=0, units=(0, 1, 2), batch_size=32)]
        result = train_blocks(learners[:3], blocks, splits(mnist_subset, 128, 32), opts(epochs=1),
                              workdir=tmp_path / str(enabled), cache=CacheOptions(storage="bittrain", shard_samples=64),
                              context=BitTrainParams(enabled=enabled).context)
        runs[enabled] = (learners[:3], result.blocks[0])
    for a, b in zip(runs[False][0], runs[True][0]):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    # Both runs measured their block step under their own context; in local learning a unit's input
    # and output are held by the worker anyway, so BitTrain saves little here (the unit-internal saved
    # tensors) and never costs: its compression allocates nothing but the bitmaps.
    assert runs[True][1].peak_bytes <= runs[False][1].peak_bytes
    cache = ActivationCache.open(tmp_path / "True" / "block0" / "train")
    dense_bytes = cache.num_samples * math.prod(cache.sample_shape) * 4
    assert cache.storage == "bittrain" and cache.nbytes < dense_bytes   # post-ReLU outputs: bitmap + non-zeros


def test_with_bittrain_a_block_batch_peak_is_the_largest_of_several_batches(mnist_subset):
    """As in backprop's batch search: under BitTrain a block step's peak follows its batch's non-zeros (here
    the first batch is made all-zero after unit 0, so it compresses best), so the block's batch is measured
    on CONTENT_SAMPLES disjoint batches and its peak is the largest, not the first batch's alone. What the
    step saved is what BitTrain stored (its hooks are innermost: the generic count sees nothing)."""
    from edgeflux.config import BitTrainParams
    from edgeflux.data import tensors
    from edgeflux.memory import CONTENT_SAMPLES
    from edgeflux.neuroflux.cache import TensorSource
    from edgeflux.neuroflux.worker import fit_block_batch, measure_block_peak

    x, y = tensors(mnist_subset, "target_train", limit=64)
    _, learners = build_learners(SPEC, AUX)
    with torch.no_grad():
        h = copy.deepcopy(learners[0].unit).eval()(x[:])    # block 1's input: unit 0's output (a cache's content)
    h[:16] = h.min()
    block, context = learners[1:2], BitTrainParams(enabled=True).context
    batch, memory = fit_block_batch(block, opts(), TensorSource(h, y), 16, budget_bytes=None, prefix=None,
                                    context=context, device=torch.device("cpu"))
    each = [measure_block_peak(block, optimizer_factory(opts()), h[i * 16:(i + 1) * 16].clone(), y[i * 16:(i + 1) * 16].clone(),
                               context=context) for i in range(CONTENT_SAMPLES)]
    peaks = [m.peak_bytes for m in each]
    assert batch == 16 and peaks[0] < max(peaks) == memory.peak_bytes
    stored = each[1].activation_storage["units"]["unit0"]
    assert each[1].saved_bytes == stored["stored_bytes"] < stored["dense_bytes"]
    # without BitTrain the storage does not follow the content: one batch is measured, saved bytes counted
    _, dense = fit_block_batch(block, opts(), TensorSource(h, y), 16, budget_bytes=None, prefix=None,
                               context=None, device=torch.device("cpu"))
    labels = 16 * 8    # the int64 targets the loss saves: neither an activation nor an index to BitTrain
    assert dense.activation_storage is None
    assert dense.saved_bytes == stored["dense_bytes"] + stored["index_dense_bytes"] + labels


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_the_smallest_budget_the_partitioner_names_trains_every_block(tmp_path, mnist_subset):
    """The partitioner's 'smallest feasible budget' is shown to work: at that exact byte figure, partition
    passes AND train_blocks trains every unit (the line fitted at batches 16..64 underestimates batch 1,
    so a figure from the line alone passes partition and stops train_blocks at a unit that needs more)."""
    from edgeflux.neuroflux.partition import UnitDoesNotFitError, partition
    from edgeflux.neuroflux.profile import profile_units

    model, learners = build_learners(SPEC, AUX)
    data = splits(mnist_subset, n_train=64, n_eval=32)
    profiles = profile_units(learners, model.describe(), 10, optimizer_factory(opts()), batches=(16, 32, 64),
                             data=data["train"])
    models, floors = [u.model for u in profiles], [u.min_bytes for u in profiles]
    assert all(u.batch1_peak_bytes > 0 for u in profiles)
    with pytest.raises(UnitDoesNotFitError) as info:
        partition(models, 10_000, batch_limit=64, floors=floors)
    need = info.value.min_feasible_bytes
    blocks = partition(models, need, batch_limit=64, floors=floors)
    result = train_blocks(learners, blocks, data, opts(epochs=1), workdir=tmp_path / "cache", budget_bytes=need,
                          cache=CacheOptions(storage="dense", shard_samples=100))
    assert result.complete and [u for b in result.blocks for u in b.units] == list(range(len(learners)))
    assert max(b.peak_bytes for b in result.blocks) <= need
