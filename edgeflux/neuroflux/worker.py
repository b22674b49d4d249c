"""NeuroFlux's controller and worker: block-wise local learning over cached activations.

    result = train_blocks(learners, blocks, data, opts, budget_bytes=..., workdir=Path("cache/neuroflux"))

Algorithm 2 of the paper, block by block: only the current block's units (and their auxiliary
heads) are trained; every unit is updated from its own local loss on the output of the unit
before it (detached: no gradient crosses a unit boundary). When a block is done, its output
activations for the train, validation and test sets are written to an activation cache
(``edgeflux.neuroflux.cache``) and become the next block's input, re-chunked to the next
block's own batch size by a background prefetcher: no forward pass through a trained block
ever runs again.

The budget is a promise, so it is measured, not trusted: before a block trains, one whole
block step (every unit's forward, local loss, backward and update, in sequence) is measured at
the partitioner's batch size (``edgeflux.memory``: the exact live-tensor peak on CPU, the
allocator peak on CUDA). If the profile's linear models were optimistic, the batch is lowered
to the largest one whose measured block step fits.

Resume: each block's trained weights and a record of what produced them sit next to its caches
in ``workdir/block<k>/``. A rerun skips a block whose signature (its config and the hash of its
input cache) matches and whose caches are complete and pass their checksums; a cache that fails
is rebuilt from the block's saved weights. An interrupted block restarts from its last epoch
checkpoint; the order of batches depends only on (seed, block, epoch), so the resumed result
equals an uninterrupted run.

Classic local learning (the paper's baseline) runs on the same worker with ``use_cache=False``:
every block then recomputes its input by a forward pass through the trained units before it.
"""
from __future__ import annotations

import hashlib
import io
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from edgeflux.artifacts import CorruptFileError, atomic_write, read_json, write_json
from edgeflux.checkpoint import run_signature, tensor_digest
from edgeflux.memory import BudgetTooSmallError, StoredBound, format_bytes, stored_bounds
from edgeflux.step import StepContext, no_context
from edgeflux.train import Schedule, TrainOptions, TrainResult, TrainRun, optimizer_factory, train_loop
from edgeflux.neuroflux.results import BlockResult, NeuroFluxRun

from .aux import LocalLearner
from .block import BlockStep, LocalBlock, Prefix, evaluate_exits, fit_block_batch, measure_block_peak, out_shape
from .cache import ActivationCache, Batches, CacheCorruptError, CacheOptions, CacheWriter, TensorSource, cache_hash
from .options import AUGMENT_REFUSED
from .partition import Block, UnitDoesNotFitError

log = logging.getLogger(__name__)

__all__ = ["BlockResult", "CacheOptions", "NeuroFluxRun", "evaluate_exits", "fit_block_batch", "measure_block_peak",
           "train_blocks"]

SPLITS = ("train", "val", "test")


# ----------------------------------------------------------------------------- the controller

class _BlockTooBig(Exception):
    """A block fits the budget only far below its planned batch: train it as two smaller blocks."""


class _BlockFiles:
    def __init__(self, workdir: Path, index: int) -> None:
        self.dir = workdir / f"block{index}"
        self.record = self.dir / "block.json"
        self.weights = self.dir / "learners.pt"

    def cache(self, split: str) -> Path:
        return self.dir / split


@dataclass(frozen=True)
class _Settings:
    """What every block of one train_blocks call trains with (see train_blocks)."""
    opts: TrainOptions
    budget_bytes: int | None
    cache: CacheOptions
    use_cache: bool
    split_rho: float | None
    device: torch.device
    context: StepContext
    checkpoint_dir: Path
    on_epoch_end: Callable[[int, int], None] | None
    desc: str


@dataclass
class _BlockWork:
    """One block as the controller hands it on: its plan, its units' learners, the trained units before it
    (without the cache its input is recomputed through them), its files and the signature of its result."""
    block: Block
    learners: list[LocalLearner]
    prefix: Prefix | None
    files: _BlockFiles
    signature: str


def _sources(data: dict[str, tuple[Tensor, Tensor]], cache: CacheOptions) -> dict[str, TensorSource]:
    return {split: TensorSource(x, y, shard_samples=cache.samples_per_shard(x.shape[1:], x.dtype))
            for split, (x, y) in ((s, data[s]) for s in SPLITS)}


def _input_hash(sources: dict, raw_digests: dict[str, str]) -> str:
    """Identity of a block's input: the caches' checksums, or (block 0) the raw tensors' digests."""
    return run_signature(**{split: cache_hash(src.manifest) if isinstance(src, ActivationCache) else raw_digests[split]
                            for split, src in sources.items()})


def train_blocks(learners: Sequence[LocalLearner], blocks: Sequence[Block],
                 data: dict[str, tuple[Tensor, Tensor]], opts: TrainOptions, *, workdir: Path,
                 budget_bytes: int | None = None, device: torch.device | str = "cpu",
                 cache: CacheOptions | None = None, use_cache: bool = True,
                 context: StepContext | None = None, signature: dict | None = None,
                 checkpoint_dir: Path | None = None, on_epoch_end=None, desc: str = "neuroflux",
                 split_rho: float | None = None, until: Callable[[NeuroFluxRun], bool] | None = None) -> NeuroFluxRun:
    """Train ``learners`` block by block (Algorithm 2) and return what each block cost and scored.

    data: {"train"|"val"|"test": (x, y)} — the raw split tensors (block 0's input).
    signature: what else defines the run (model spec, aux mode, ...) for skip/resume decisions.
    checkpoint_dir: where epoch checkpoints of the block in training go (default workdir/../checkpoints).
    on_epoch_end(block_index, epoch): called after each epoch checkpoint (tests interrupt runs here).
    split_rho: a block of several units whose measured step fits only at a batch below
    (1 - split_rho) x its planned batch is split in two (None: only when batch 1 does not fit).
    until(run): no new block starts once it holds for the run so far (a benchmark's time limit or target
    accuracy); the run then has fewer blocks than planned and ``complete`` is False.
    """
    if opts.augment.enabled:
        raise ValueError(AUGMENT_REFUSED)
    cache = cache or CacheOptions()
    workdir = Path(workdir)
    settings = _Settings(opts, budget_bytes, cache, use_cache, split_rho, torch.device(device), context or no_context,
                         Path(checkpoint_dir) if checkpoint_dir else workdir.parent / "checkpoints", on_epoch_end, desc)
    raw_digests = {split: tensor_digest(*data[split]) for split in SPLITS}
    sources: dict = dict(_sources(data, cache))
    run = NeuroFluxRun([], [], [0.0] * len(learners), [0.0] * len(learners))
    pending = deque(blocks)
    while pending:
        if until is not None and until(run):
            log.warning("%s: stopped (until) after %d blocks and %.0fs of training; %d units left untrained", desc,
                        len(run.blocks), run.train_time_s, sum(len(b.units) for b in pending))
            break
        planned = pending.popleft()
        block = Block(index=len(run.blocks), units=tuple(planned.units), batch_size=planned.batch_size)
        work = _BlockWork(block, [learners[i] for i in block.units],
                          None if use_cache else Prefix([learners[i] for i in range(block.units[0])]),
                          _BlockFiles(workdir, block.index),
                          run_signature(run=signature or {}, units=list(block.units), planned=block.batch_size,
                                        opts={k: getattr(opts, k) for k in TrainOptions.model_fields},
                                        budget=budget_bytes, cache=cache.model_dump(),
                                        use_cache=use_cache, input=_input_hash(sources, raw_digests)))
        result = _reuse_block(work, sources, settings) if use_cache else _reuse_weights(work)
        if result is None:
            try:
                result = _train_block(work, sources, settings, so_far=run)
            except (BudgetTooSmallError, _BlockTooBig) as exc:
                pending.extendleft(reversed(_split(block, exc)))
                continue
        else:
            log.info("block %d (units %s): reusing the trained block and its caches from %s", block.index,
                     list(block.units), work.files.dir)
        _park(work.learners, work.prefix)
        _record(run, block, result)
        if use_cache:
            sources = {split: ActivationCache.open(work.files.cache(split)) for split in SPLITS}
    run.complete = not pending
    return run


def _split(block: Block, exc: Exception) -> list[Block]:
    """The two halves to train instead of a block whose measured step does not fit.

    Algorithm 1 sizes blocks from per-unit profiles, but a block holds the parameters and optimizer state
    of all its units. When the measured block step does not fit at batch 1, or only at a batch more than
    rho below the plan (the partitioner's own tolerance), the block is trained as two halves, as
    Algorithm 1 would have grouped it had its per-unit models included the block's resident state. A
    single unit that does not fit at batch 1 is a budget the user must raise.
    """
    if isinstance(exc, BudgetTooSmallError) and len(block.units) == 1:
        raise UnitDoesNotFitError(exc.budget_bytes, exc.min_feasible_bytes, block.units[0],
                                  unit_bytes=exc.min_feasible_bytes, measured=True) from None
    half = len(block.units) // 2
    log.warning("block %d (units %s): %s; splitting it into units %s and %s", block.index,
                list(block.units), exc, list(block.units[:half]), list(block.units[half:]))
    return [Block(index=-1, units=block.units[:half], batch_size=block.batch_size),
            Block(index=-1, units=block.units[half:], batch_size=block.batch_size)]


def _record(run: NeuroFluxRun, block: Block, result: BlockResult) -> None:
    """Add a finished block to the run: its exits' accuracies, its curve, and a point for the best exit so far."""
    run.blocks.append(result)
    for i, unit in enumerate(block.units):
        run.unit_val_acc[unit], run.unit_test_acc[unit] = result.unit_val_acc[i], result.unit_test_acc[i]
    run.history.extend(result.history)
    best = max(range(len(run.unit_val_acc)), key=run.unit_val_acc.__getitem__)
    run.history.append({"step": sum(b.steps for b in run.blocks), "block": block.index, "epoch": float(result.epochs),
                        "time_s": run.train_time_s, "cpu_s": run.train_cpu_s,
                        "train_loss": result.history[-1]["train_loss"] if result.history else 0.0,
                        "val_acc": run.unit_val_acc[best], "test_acc": run.unit_test_acc[best]})


def _to_device(block_learners: Sequence[LocalLearner], prefix: nn.Module | None, device: torch.device) -> None:
    """The block in training (and the frozen units before it, without the cache) on the device."""
    for module in (*block_learners, prefix):
        if module is not None:
            module.to(device)


def _park(block_learners: Sequence[LocalLearner], prefix: nn.Module | None) -> None:
    """Back to host memory once the block is done (paper Section 3.1: only the block in training
    occupies device memory), without gradients: a CUDA peak measured for the next block then
    counts that block alone, and the host holds no gradient buffers of finished units."""
    for module in (*block_learners, prefix):
        if module is not None:
            module.zero_grad(set_to_none=True)
            module.to("cpu")


def _reuse_weights(work: _BlockWork) -> BlockResult | None:
    """The finished block's result, its weights loaded into its learners; None when it must be trained.

    The record names the sha256 of the weights it describes: weights rewritten by a later run (with
    other settings, killed before its own record), truncated or corrupt, are never taken for these.
    """
    files = work.files
    if not files.record.exists() or not files.weights.exists():
        return None
    record = _read_record(files.record)
    if record is None or record.get("signature") != work.signature:
        return None
    data = files.weights.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.get("weights_sha256"):
        log.warning("block %d: %s does not match its record %s (rewritten, truncated or corrupt); training the "
                    "block again", record["result"]["index"], files.weights, files.record)
        return None
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for learner, sd in zip(work.learners, state, strict=True):
        learner.load_state_dict(sd)
    return BlockResult(**{**record["result"], "skipped": True})


def _read_record(path: Path) -> dict | None:
    try:
        return read_json(path, "the block is trained again", checksum=True)
    except CorruptFileError as exc:   # edited or damaged: its result cannot be trusted
        log.warning("%s", exc)
        return None
    except OSError:   # absent: the block is not finished
        return None


def _reuse_block(work: _BlockWork, sources: dict, settings: _Settings) -> BlockResult | None:
    """The finished block from an earlier run, its caches verified (and rebuilt from its weights if corrupt)."""
    result = _reuse_weights(work)
    if result is None:
        return None
    for split in SPLITS:
        try:
            ActivationCache.open(work.files.cache(split), producer=work.signature).verify()
        except (CacheCorruptError, FileNotFoundError, ValueError) as exc:
            log.warning("block %d: %s cache unusable (%s); rebuilding it from the block's saved weights",
                        result.index, split, exc)
            _to_device(work.learners, work.prefix, settings.device)
            shape = out_shape(work.learners, sources[split], work.prefix)
            with _cache_writer(work, split, shape, settings.cache) as writer:
                evaluate_exits(work.learners, sources[split], result.batch_size, settings.device, work.prefix, writer)
            result.rebuilt_caches.append(split)
    return result


def _train_block(work: _BlockWork, sources: dict, settings: _Settings, so_far: NeuroFluxRun) -> BlockResult:
    """Measure the block's batch, train it and cache its outputs. so_far: the blocks before it (where its
    curve starts, and the best exit it has to beat)."""
    block, opts, budget_bytes = work.block, settings.opts, settings.budget_bytes
    tick, cpu_tick = time.perf_counter(), time.process_time()
    batch, memory = fit_block_batch(work.learners, opts, sources["train"], block.batch_size, budget_bytes, work.prefix,
                                    settings.context, settings.device)
    measure_time, measure_cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    split_rho = settings.split_rho
    if split_rho is not None and len(block.units) > 1 and batch < (1 - split_rho) * block.batch_size:
        raise _BlockTooBig(f"its measured step fits batch {batch} only, more than rho={split_rho:g} below the "
                           f"planned {block.batch_size}")
    log.info("block %d (units %s): batch %d (planned %d), measured block-step peak %s%s", block.index,
             list(block.units), batch, block.batch_size, format_bytes(memory.peak_bytes),
             f" <= budget {format_bytes(budget_bytes)}" if budget_bytes else "")
    _to_device(work.learners, work.prefix, settings.device)   # measured on copies: the originals are not there yet
    # every batch under the budget, not only the measured ones (BitTrain: edgeflux.memory.StoredBound)
    train = _block_loop(work, sources, batch, settings, so_far, (sum(b.steps for b in so_far.blocks),
                        so_far.train_time_s + measure_time, so_far.train_cpu_s + measure_cpu),
                        stored_bounds(memory, budget_bytes))

    # The block is trained: cache its outputs (use_cache) and score every unit's exit on the way.
    tick, cpu_tick = time.perf_counter(), time.process_time()
    accs = _cache_outputs(work, sources, batch, settings)
    cache_time, cache_cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    result = BlockResult(
        index=block.index, units=list(block.units), planned_batch=block.batch_size, batch_size=batch,
        peak_bytes=memory.peak_bytes, activation_bytes=memory.activation_bytes, budget_bytes=budget_bytes,
        epochs=opts.epochs, steps=train.steps,
        train_time_s=train.train_time_s, cache_time_s=cache_time, measure_time_s=measure_time,
        cpu_s=measure_cpu + train.train_cpu_s + cache_cpu,
        unit_val_acc=accs["val"], unit_test_acc=accs["test"],
        cache_bytes=sum(ActivationCache.open(work.files.cache(s)).nbytes for s in SPLITS) if settings.use_cache else 0,
        resumed_from_epoch=train.resumed_from_epoch, history=train.history, split_batches=train.split_batches)
    _save_block(work, result)
    checkpoint = _checkpoint(settings, block)
    if checkpoint.exists():
        checkpoint.unlink()
    log.info("block %d done: %d steps, %.1fs training, %.1fs caching; exits val %s", block.index, result.steps,
             result.train_time_s, cache_time, " ".join(f"{a:.3f}" for a in result.unit_val_acc))
    return result


def _checkpoint(settings: _Settings, block: Block) -> Path:
    return settings.checkpoint_dir / f"block{block.index}.pt"


def _block_loop(work: _BlockWork, sources: dict, batch: int, settings: _Settings, so_far: NeuroFluxRun,
                offset: tuple[int, float, float], bounds: tuple[StoredBound, ...] | None = None) -> TrainResult:
    """The block's epochs through the one training loop. Batches are ordered by (seed, block, epoch) and the
    global RNG (dropout, if a model has any) is seeded per block and restored on resume, so a resumed block
    equals an uninterrupted one. The checkpoint is kept until the block's caches and record are written.
    offset: where the block's curve starts (the blocks before it, and measuring this one)."""
    block, learners, prefix, opts, device = work.block, work.learners, work.prefix, settings.opts, settings.device
    step = BlockStep.factory(optimizer_factory(opts.model_copy(update={"lr": opts.lr_for(batch)})), settings.context,
                             bounds)(LocalBlock(learners, prefix))
    unit_val, unit_test = so_far.unit_val_acc, so_far.unit_test_acc

    def evaluate() -> dict:
        accs = evaluate_exits(learners, sources["val"], batch, device, prefix)
        test_accs = evaluate_exits(learners, sources["test"], batch, device, prefix)
        log.info("%s block %d: exit val_acc %s", settings.desc, block.index, " ".join(f"{a:.3f}" for a in accs))
        # The model at this moment is the best exit so far (earlier blocks' exits included); test accuracy
        # is recorded for time-to-target curves, never used to choose anything.
        best = max(range(len(accs)), key=accs.__getitem__)
        earlier = max(range(len(unit_val)), key=unit_val.__getitem__)
        return {"block": block.index, "val_acc": max(accs[best], unit_val[earlier]),
                "test_acc": test_accs[best] if accs[best] >= unit_val[earlier] else unit_test[earlier]}

    on_epoch_end = settings.on_epoch_end
    run = TrainRun(device=device, checkpoint=_checkpoint(settings, block),
                   signature=run_signature(block=work.signature, batch=batch),
                   desc=f"{settings.desc} block {block.index} (batch {batch})", keep_checkpoint=True, offset=offset,
                   on_epoch_end=(lambda epoch, _: on_epoch_end(block.index, epoch)) if on_epoch_end else None)
    seed = opts.seed * 100_003 + block.index * 1009
    result = train_loop(step, lambda epoch: Batches(sources["train"], batch, shuffle=True, seed=seed, epoch=epoch),
                        Schedule(opts.epochs, math.ceil(sources["train"].num_samples / batch), opts.evals_per_epoch,
                                 seed=opts.seed * 100_003 + block.index), evaluate, run)
    result.split_batches = step.split_batches
    return result


def _cache_writer(work: _BlockWork, split: str, shape: tuple[int, ...], cache: CacheOptions) -> CacheWriter:
    """The writer of the block's output cache of `split` (per-sample `shape`)."""
    return CacheWriter(work.files.cache(split), work.signature, shape, storage=cache.storage,
                       threshold=cache.threshold, shard_samples=cache.samples_per_shard(shape))


def _cache_outputs(work: _BlockWork, sources: dict, batch: int, settings: _Settings) -> dict[str, list[float]]:
    """Every unit's exit accuracy per split; with use_cache, the block's outputs written to its caches on the way."""
    accs = {}
    work.files.dir.mkdir(parents=True, exist_ok=True)
    shape = out_shape(work.learners, sources["train"], work.prefix)
    for split in SPLITS:
        if settings.use_cache:
            with _cache_writer(work, split, shape, settings.cache) as writer:
                accs[split] = evaluate_exits(work.learners, sources[split], batch, settings.device, work.prefix, writer)
        elif split != "train":
            accs[split] = evaluate_exits(work.learners, sources[split], batch, settings.device, work.prefix)
    return accs


def _save_block(work: _BlockWork, result: BlockResult) -> None:
    """Weights first, record last (naming the weights' sha256): a record always describes the weights beside it."""
    buf = io.BytesIO()
    torch.save([learner.state_dict() for learner in work.learners], buf)
    weights = buf.getvalue()
    atomic_write(work.files.weights, lambda p: p.write_bytes(weights))
    write_json(work.files.record, {"signature": work.signature, "weights_sha256": hashlib.sha256(weights).hexdigest(),
                                   "result": asdict(result)}, checksum=True)
