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

import copy
import hashlib
import io
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.artifacts import atomic_write, read_json, write_json
from edgeflux.config import NeuroFluxParams, TrainOptions
from edgeflux.memory import (CONTENT_SAMPLES, BudgetTooSmallError, StepContext, StepMemory, format_bytes,
                             largest_over_batches, max_batch_under_budget, measure_step, no_context)
from edgeflux.train import (load_checkpoint, make_optimizer, progress_bar, rng_state, run_signature, save_checkpoint,
                            set_rng_state, tensor_digest)

from .aux import LocalLearner
from .cache import ActivationCache, Batches, CacheCorruptError, CacheWriter, TensorSource, cache_hash
from .partition import Block, UnitDoesNotFitError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


@dataclass
class CacheOptions:
    """How block outputs are stored on disk (see edgeflux.neuroflux.cache)."""
    storage: str = "dense"      # dense | float16 | bittrain
    threshold: float = 0.0      # bittrain pruning threshold (0: exact)
    shard_size: int = 4 * 2**20          # bytes of a shard in the compute dtype (params: neuroflux.cache.shard_size)
    shard_samples: int | None = None     # samples per shard instead (tests, benchmarks): overrides shard_size

    def samples_per_shard(self, sample_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        if self.shard_samples is not None:
            return self.shard_samples
        return max(1, self.shard_size // (math.prod(sample_shape) * dtype.itemsize))


@dataclass
class BlockResult:
    index: int
    units: list[int]
    planned_batch: int          # the partitioner's batch (from the profile's linear models)
    batch_size: int             # the batch trained with: measured block step <= budget
    peak_bytes: int             # measured peak of one block step at batch_size
    budget_bytes: int | None
    epochs: int
    steps: int
    train_time_s: float         # training only; caching and measuring are separate
    cache_time_s: float         # writing this block's output caches (and evaluating its exits on them)
    measure_time_s: float
    unit_val_acc: list[float]   # each unit's exit on the validation split (eval mode)
    unit_test_acc: list[float]
    cache_bytes: int = 0        # on disk, all splits
    skipped: bool = False       # reused from an earlier run
    resumed_from_epoch: int = 0
    rebuilt_caches: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)   # this block's accuracy-vs-time rows


@dataclass
class NeuroFluxRun:
    blocks: list[BlockResult]
    history: list[dict]         # rows: step, block, epoch, time_s, train_loss, val_acc, test_acc (best exit so far)
    unit_val_acc: list[float]
    unit_test_acc: list[float]
    complete: bool = True       # False: train_blocks stopped at its time limit with units left untrained

    @property
    def train_time_s(self) -> float:
        """Wall-clock cost of training: block training + writing caches + measuring."""
        return sum(b.train_time_s + b.cache_time_s + b.measure_time_s for b in self.blocks)

    @property
    def peak_bytes(self) -> int:
        return max(b.peak_bytes for b in self.blocks)

    def to_dict(self) -> dict:
        return {"blocks": [asdict(b) for b in self.blocks], "history": self.history,
                "unit_val_acc": self.unit_val_acc, "unit_test_acc": self.unit_test_acc, "complete": self.complete,
                "train_time_s": self.train_time_s, "peak_bytes": self.peak_bytes}


# ----------------------------------------------------------------------------- one block step

def _block_step(learners: Sequence[LocalLearner], optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                prefix: nn.Module | None, context: StepContext, entered: list | None = None) -> float:
    """Algorithm 2, lines 2-8, for one batch: each unit learns from its own local loss, in order.

    One optimizer holds the block's parameters; after zero_grad(set_to_none) only the current
    unit has gradients, and SGD/Adam skip parameters without one, so each step() updates exactly
    the unit that was just backpropagated (the same as one optimizer per unit).
    entered: if given, each unit's entered context is appended (to read its accounting).
    """
    if prefix is not None:          # classic local learning: recompute the input through trained units
        with torch.no_grad():
            x = prefix(x)
    loss_sum = 0.0
    for learner in learners:
        optimizer.zero_grad(set_to_none=True)
        with context(learner) as unit_context:
            out, logits = learner.forward_with_output(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
        if entered is not None:
            entered.append(unit_context)
        optimizer.step()
        loss_sum += loss.item()
        x = out.detach()
    return loss_sum / len(learners)


def measure_block_peak(learners: Sequence[LocalLearner], opts: TrainOptions, x: Tensor, y: Tensor,
                       prefix: nn.Module | None = None, context: StepContext | None = None,
                       device: torch.device | str = "cpu") -> StepMemory:
    """Measured memory of one steady-state block step on copies (a warm-up step creates optimizer state)."""
    device = torch.device(device)
    block = copy.deepcopy(nn.ModuleList(learners)).to(device).train()
    frozen = copy.deepcopy(prefix).to(device).eval() if prefix is not None else None
    optimizer = make_optimizer(block.parameters(), opts)
    context = context or no_context
    x, y = x.to(device), y.to(device)
    _block_step(block, optimizer, x.clone(), y, frozen, context)
    model = nn.ModuleList([block, frozen]) if frozen is not None else block
    entered: list = []
    memory = measure_step(lambda: _block_step(block, optimizer, x, y, frozen, context, entered), model=model,
                          optimizer=optimizer, inputs=(x, y), units=[(f"unit{i}", m) for i, m in enumerate(block)],
                          device=device)
    if all(hasattr(c, "summary") for c in entered):   # (BitTrain: see StepMemory.set_stored)
        stored = {f"unit{i}": c.summary()["total"] for i, c in enumerate(entered)}
        memory.set_stored({"units": stored}, {name: unit["stored_bytes"] for name, unit in stored.items()})
    return memory


def fit_block_batch(learners: Sequence[LocalLearner], opts: TrainOptions, source, planned: int,
                    budget_bytes: int | None, prefix: nn.Module | None, context: StepContext | None,
                    device: torch.device) -> tuple[int, StepMemory]:
    """The planned batch if its measured block step fits the budget, else the largest that does.

    Measured on the first batch of the planned size; where the step stores activations by their
    content (BitTrain), the peak of a batch size is the largest over the first CONTENT_SAMPLES batches.
    """
    batches = iter(Batches(source, planned, shuffle=False))
    samples = [batch for _, batch in zip(range(CONTENT_SAMPLES), batches)]
    getattr(batches, "close", lambda: None)()   # stop the prefetcher: these batches are all we need
    measured: dict[int, StepMemory] = {}

    def measure(batch: int, i: int) -> StepMemory:
        # clone: a batch may be a view into a whole shard or dataset; the step holds only the batch
        x, y = samples[i]
        return measure_block_peak(learners, opts, x[:batch].clone(), y[:batch].clone(), prefix, context, device)

    def peak(batch: int) -> int:
        full = [i for i, (x, _) in enumerate(samples) if len(x) >= batch]   # a last short batch may be smaller
        measured[batch] = largest_over_batches(lambda i: measure(batch, full[i]), available=len(full))
        return measured[batch].peak_bytes

    planned = min(planned, len(samples[0][0]))
    if budget_bytes is None or peak(planned) <= budget_bytes:
        if planned not in measured:
            peak(planned)
        return planned, measured[planned]
    fitted = max_batch_under_budget(peak, budget_bytes, planned)
    log.warning("block step at the planned batch %d measured %s > budget %s: training at batch %d (%s)",
                planned, format_bytes(measured[planned].peak_bytes), format_bytes(budget_bytes),
                fitted.batch_size, format_bytes(fitted.peak_bytes))
    return fitted.batch_size, measured[fitted.batch_size]


# ----------------------------------------------------------------------------- evaluation and caching

@torch.no_grad()
def _forward_block(learners: Sequence[LocalLearner], x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output of the block's last unit and every unit's exit logits."""
    logits = []
    for learner in learners:
        x, z = learner.forward_with_output(x)
        logits.append(z)
    return x, logits


@torch.no_grad()
def evaluate_exits(learners: Sequence[LocalLearner], source, batch_size: int, device: torch.device,
                   prefix: nn.Module | None = None, writer: CacheWriter | None = None) -> list[float]:
    """Accuracy of each unit's exit over a split; optionally writes the block's output to a cache."""
    modes = [(m, m.training) for learner in learners for m in learner.modules()]
    for learner in learners:
        learner.eval()
    correct = [0] * len(learners)
    total = 0
    try:
        for xb, yb in Batches(source, batch_size, shuffle=False):
            xb = xb.to(device)
            if prefix is not None:
                xb = prefix(xb)
            out, logits = _forward_block(learners, xb)
            for i, z in enumerate(logits):
                correct[i] += (z.argmax(1).cpu() == yb).sum().item()
            total += len(yb)
            if writer is not None:
                writer.append(out, yb)
    finally:
        for m, training in modes:
            m.training = training
    return [c / max(1, total) for c in correct]


class _Prefix(nn.Module):
    """The trained units before a block, frozen in eval mode: classic local learning's input path."""

    def __init__(self, learners: Sequence[LocalLearner]) -> None:
        super().__init__()
        self.units = nn.ModuleList(learner.unit for learner in learners)
        self.train(False)   # BatchNorm on running statistics, and never updating them

    def forward(self, x: Tensor) -> Tensor:
        for unit in self.units:
            x = unit(x)
        return x

    def train(self, mode: bool = True) -> _Prefix:   # always inference: these units are trained already
        return super().train(False)


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
                 split_rho: float | None = None, time_limit_s: float | None = None) -> NeuroFluxRun:
    """Train ``learners`` block by block (Algorithm 2) and return what each block cost and scored.

    data: {"train"|"val"|"test": (x, y)} — the raw split tensors (block 0's input).
    signature: what else defines the run (model spec, aux mode, ...) for skip/resume decisions.
    checkpoint_dir: where epoch checkpoints of the block in training go (default workdir/../checkpoints).
    on_epoch_end(block_index, epoch): called after each epoch checkpoint (tests interrupt runs here).
    split_rho: a block of several units whose measured step fits only at a batch below
    (1 - split_rho) x its planned batch is split in two (None: only when batch 1 does not fit).
    time_limit_s: no new block starts once this much training time is spent (benchmarks cap slow
    baselines this way); the run then has fewer blocks than planned and ``complete`` is False.
    """
    device = torch.device(device)
    cache = cache or CacheOptions()
    context = context or no_context
    workdir = Path(workdir)
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else workdir.parent / "checkpoints"
    raw = _sources(data, cache)
    raw_digests = {split: tensor_digest(*data[split]) for split in SPLITS}
    sources: dict = dict(raw)
    results: list[BlockResult] = []
    history: list[dict] = []
    unit_val = [0.0] * len(learners)
    unit_test = [0.0] * len(learners)
    elapsed = 0.0
    step_count = 0
    pending = deque(blocks)
    while pending:
        if time_limit_s is not None and elapsed >= time_limit_s:
            log.warning("%s: time limit %.0fs reached after %d blocks; %d units left untrained", desc, time_limit_s,
                        len(results), sum(len(b.units) for b in pending))
            break
        planned = pending.popleft()
        block = Block(index=len(results), units=tuple(planned.units), batch_size=planned.batch_size)
        files = _BlockFiles(workdir, block.index)
        block_learners = [learners[i] for i in block.units]
        prefix = None if use_cache else _Prefix([learners[i] for i in range(block.units[0])])
        input_hash = _input_hash(sources, raw_digests)
        block_sig = run_signature(run=signature or {}, units=list(block.units), planned=block.batch_size,
                                  opts={k: getattr(opts, k) for k in TrainOptions.model_fields},
                                  lr_scaling=[opts.lr_scaling, opts.lr_reference_batch]
                                  if isinstance(opts, NeuroFluxParams) else None, budget=budget_bytes, cache=asdict(cache),
                                  use_cache=use_cache, input=input_hash)
        result = _reuse_block(files, block_sig, block_learners, sources, prefix, device, cache) if use_cache \
            else _reuse_weights(files, block_sig, block_learners)
        if result is None:
            try:
                result = _train_block(block, block_learners, sources, opts, budget_bytes, prefix, context, device,
                                      files, block_sig, checkpoint_dir / f"block{block.index}.pt", cache, use_cache,
                                      elapsed, step_count, unit_val, unit_test, on_epoch_end, desc, split_rho)
            except (BudgetTooSmallError, _BlockTooBig) as exc:
                # Algorithm 1 sizes blocks from per-unit profiles, but a block holds the parameters and
                # optimizer state of all its units. When the measured block step does not fit at batch 1,
                # or only at a batch more than rho below the plan (the partitioner's own tolerance), the
                # block is trained as two halves, as Algorithm 1 would have grouped it had its per-unit
                # models included the block's resident state. A single unit that does not fit at batch 1
                # is a budget the user must raise.
                if isinstance(exc, BudgetTooSmallError) and len(block.units) == 1:
                    raise UnitDoesNotFitError(exc.budget_bytes, exc.min_feasible_bytes, block.units[0],
                                              unit_bytes=exc.min_feasible_bytes, measured=True) from None
                half = len(block.units) // 2
                log.warning("block %d (units %s): %s; splitting it into units %s and %s", block.index,
                            list(block.units), exc, list(block.units[:half]), list(block.units[half:]))
                pending.appendleft(Block(index=-1, units=block.units[half:], batch_size=block.batch_size))
                pending.appendleft(Block(index=-1, units=block.units[:half], batch_size=block.batch_size))
                continue
        else:
            log.info("block %d (units %s): reusing the trained block and its caches from %s", block.index,
                     list(block.units), files.dir)
        _park(block_learners, prefix)
        results.append(result)
        for i, unit in enumerate(block.units):
            unit_val[unit], unit_test[unit] = result.unit_val_acc[i], result.unit_test_acc[i]
        history.extend(result.history)
        elapsed += result.train_time_s + result.cache_time_s + result.measure_time_s
        step_count += result.steps
        best = max(range(len(unit_val)), key=unit_val.__getitem__)
        history.append({"step": step_count, "block": block.index, "epoch": float(result.epochs), "time_s": elapsed,
                        "train_loss": result.history[-1]["train_loss"] if result.history else 0.0,
                        "val_acc": unit_val[best], "test_acc": unit_test[best]})
        if use_cache:
            sources = {split: ActivationCache.open(files.cache(split)) for split in SPLITS}
    return NeuroFluxRun(results, history, unit_val, unit_test, complete=not pending)


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


def _reuse_weights(files: _BlockFiles, block_sig: str, block_learners: Sequence[LocalLearner]) -> BlockResult | None:
    """The finished block's result, its weights loaded into block_learners; None when it must be trained.

    The record names the sha256 of the weights it describes: weights rewritten by a later run (with
    other settings, killed before its own record), truncated or corrupt, are never taken for these.
    """
    if not files.record.exists() or not files.weights.exists():
        return None
    record = _read_record(files.record)
    if record is None or record.get("signature") != block_sig:
        return None
    data = files.weights.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.get("weights_sha256"):
        log.warning("block %d: %s does not match its record %s (rewritten, truncated or corrupt); training the "
                    "block again", record["result"]["index"], files.weights, files.record)
        return None
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for learner, sd in zip(block_learners, state, strict=True):
        learner.load_state_dict(sd)
    return BlockResult(**{**record["result"], "skipped": True})


def _read_record(path: Path) -> dict | None:
    try:
        return read_json(path, "no record of a finished block")
    except (OSError, ValueError):   # absent or half-written: the block is not finished
        return None


def _reuse_block(files: _BlockFiles, block_sig: str, block_learners: Sequence[LocalLearner], sources: dict,
                 prefix: nn.Module | None, device: torch.device, cache: CacheOptions) -> BlockResult | None:
    """The finished block from an earlier run, its caches verified (and rebuilt from its weights if corrupt)."""
    result = _reuse_weights(files, block_sig, block_learners)
    if result is None:
        return None
    for split in SPLITS:
        try:
            ActivationCache.open(files.cache(split), producer=block_sig).verify()
        except (CacheCorruptError, FileNotFoundError, ValueError) as exc:
            log.warning("block %d: %s cache unusable (%s); rebuilding it from the block's saved weights",
                        result.index, split, exc)
            _to_device(block_learners, prefix, device)
            shape = _out_shape(block_learners, sources[split], prefix)
            with CacheWriter(files.cache(split), block_sig, shape, storage=cache.storage, threshold=cache.threshold,
                             shard_samples=cache.samples_per_shard(shape)) as writer:
                evaluate_exits(block_learners, sources[split], result.batch_size, device, prefix, writer)
            result.rebuilt_caches.append(split)
    return result


@torch.no_grad()
def _out_shape(block_learners: Sequence[LocalLearner], source, prefix: nn.Module | None = None) -> tuple[int, ...]:
    ref = next(block_learners[0].parameters())
    x = torch.zeros(1, *source.sample_shape, device=ref.device, dtype=ref.dtype)
    if prefix is not None:
        x = prefix(x)
    modes = [(m, m.training) for learner in block_learners for m in learner.modules()]
    for learner in block_learners:
        learner.eval()
    out, _ = _forward_block(block_learners, x)
    for m, training in modes:
        m.training = training
    return tuple(out.shape[1:])


def _train_block(block: Block, block_learners: Sequence[LocalLearner], sources: dict, opts: TrainOptions,
                 budget_bytes: int | None, prefix: nn.Module | None, context: StepContext, device: torch.device,
                 files: _BlockFiles, block_sig: str, checkpoint: Path, cache: CacheOptions, use_cache: bool,
                 elapsed_before: float, steps_before: int, unit_val: list[float],
                 unit_test: list[float], on_epoch_end, desc: str, split_rho: float | None) -> BlockResult:
    tick = time.perf_counter()
    batch, memory = fit_block_batch(block_learners, opts, sources["train"], block.batch_size, budget_bytes, prefix,
                                    context, device)
    measure_time = time.perf_counter() - tick
    if split_rho is not None and len(block.units) > 1 and batch < (1 - split_rho) * block.batch_size:
        raise _BlockTooBig(f"its measured step fits batch {batch} only, more than rho={split_rho:g} below the "
                           f"planned {block.batch_size}")
    log.info("block %d (units %s): batch %d (planned %d), measured block-step peak %s%s", block.index,
             list(block.units), batch, block.batch_size, format_bytes(memory.peak_bytes),
             f" <= budget {format_bytes(budget_bytes)}" if budget_bytes else "")
    _to_device(block_learners, prefix, device)   # (measured on copies: the originals were not on the device)

    module = nn.ModuleList(block_learners).train()
    lr = opts.block_lr(batch) if isinstance(opts, NeuroFluxParams) else opts.lr
    optimizer = make_optimizer(module.parameters(), opts.model_copy(update={"lr": lr}))
    n_train = sources["train"].num_samples
    steps_per_epoch = math.ceil(n_train / batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps_per_epoch * opts.epochs)
    eval_points = {round(steps_per_epoch * k / opts.evals_per_epoch) for k in range(1, opts.evals_per_epoch + 1)}
    state = {"epochs_done": 0, "steps": 0, "train_time_s": 0.0, "history": []}
    ckpt_sig = run_signature(block=block_sig, batch=batch)
    if (saved := load_checkpoint(checkpoint, ckpt_sig)) is not None:
        module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["state"]
        set_rng_state(saved["rng"])
        log.info("block %d: resuming from %s after epoch %d/%d", block.index, checkpoint, state["epochs_done"],
                 opts.epochs)
    else:
        # Batches are ordered by (seed, block, epoch); the global RNG (dropout, if a model has any)
        # is seeded per block and restored on resume, so a resumed block equals an uninterrupted one.
        torch.manual_seed(opts.seed * 100_003 + block.index)
    resumed_from = state["epochs_done"]
    eval_batch = batch

    with progress_bar() as progress:
        task = progress.add_task(f"{desc} block {block.index} (batch {batch})", total=steps_per_epoch * opts.epochs,
                                 completed=resumed_from * steps_per_epoch, status="")
        for epoch in range(resumed_from, opts.epochs):
            seed = opts.seed * 100_003 + block.index * 1009
            loss_sum, loss_n = 0.0, 0
            tick = time.perf_counter()
            for i, (xb, yb) in enumerate(Batches(sources["train"], batch, shuffle=True, seed=seed, epoch=epoch), 1):
                loss = _block_step(block_learners, optimizer, xb.to(device), yb.to(device), prefix, context)
                scheduler.step()
                state["steps"] += 1
                loss_sum, loss_n = loss_sum + loss, loss_n + 1
                if i in eval_points:
                    state["train_time_s"] += time.perf_counter() - tick
                    accs = evaluate_exits(block_learners, sources["val"], eval_batch, device, prefix)
                    test_accs = evaluate_exits(block_learners, sources["test"], eval_batch, device, prefix)
                    # The model at this moment is the best exit so far (earlier blocks' exits included);
                    # test accuracy is recorded for time-to-target curves, never used to choose anything.
                    best = max(range(len(accs)), key=accs.__getitem__)
                    earlier = max(range(len(unit_val)), key=unit_val.__getitem__)
                    row = {"step": steps_before + state["steps"], "block": block.index,
                           "epoch": epoch + i / steps_per_epoch,
                           "time_s": elapsed_before + measure_time + state["train_time_s"],
                           "train_loss": loss_sum / loss_n,
                           "val_acc": max(accs[best], unit_val[earlier]),
                           "test_acc": test_accs[best] if accs[best] >= unit_val[earlier] else unit_test[earlier]}
                    state["history"].append(row)
                    progress.update(task, status=f"loss {row['train_loss']:.3f} val {max(accs):.3f}")
                    log.info("%s block %d: epoch %.2f loss %.4f exit val_acc %s", desc, block.index, row["epoch"],
                             row["train_loss"], " ".join(f"{a:.3f}" for a in accs))
                    loss_sum, loss_n = 0.0, 0
                    tick = time.perf_counter()
                progress.advance(task)
            state["train_time_s"] += time.perf_counter() - tick
            state["epochs_done"] = epoch + 1
            save_checkpoint(checkpoint, {"signature": ckpt_sig, "model": module.state_dict(),
                                          "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                          "state": state, "rng": rng_state()})
            if on_epoch_end is not None:
                on_epoch_end(block.index, epoch)

    # The block is trained: cache its outputs (use_cache) and score every unit's exit on the way.
    tick = time.perf_counter()
    accs = {}
    files.dir.mkdir(parents=True, exist_ok=True)
    out_shape = _out_shape(block_learners, sources["train"], prefix)
    for split in SPLITS:
        if use_cache:
            with CacheWriter(files.cache(split), block_sig, out_shape, storage=cache.storage,
                             threshold=cache.threshold, shard_samples=cache.samples_per_shard(out_shape)) as writer:
                accs[split] = evaluate_exits(block_learners, sources[split], eval_batch, device, prefix, writer)
        elif split != "train":
            accs[split] = evaluate_exits(block_learners, sources[split], eval_batch, device, prefix)
    cache_time = time.perf_counter() - tick
    result = BlockResult(
        index=block.index, units=list(block.units), planned_batch=block.batch_size, batch_size=batch,
        peak_bytes=memory.peak_bytes, budget_bytes=budget_bytes, epochs=opts.epochs, steps=state["steps"],
        train_time_s=state["train_time_s"], cache_time_s=cache_time, measure_time_s=measure_time,
        unit_val_acc=accs["val"], unit_test_acc=accs["test"],
        cache_bytes=sum(ActivationCache.open(files.cache(s)).nbytes for s in SPLITS) if use_cache else 0,
        resumed_from_epoch=resumed_from, history=state["history"])
    # Weights first, record last (naming the weights' sha256): a record always describes the weights beside it.
    buf = io.BytesIO()
    torch.save([learner.state_dict() for learner in block_learners], buf)
    weights = buf.getvalue()
    atomic_write(files.weights, lambda p: p.write_bytes(weights))
    write_json(files.record, {"signature": block_sig, "weights_sha256": hashlib.sha256(weights).hexdigest(),
                              "result": asdict(result)})
    if checkpoint.exists():
        checkpoint.unlink()
    log.info("block %d done: %d steps, %.1fs training, %.1fs caching; exits val %s", block.index, result.steps,
             result.train_time_s, cache_time, " ".join(f"{a:.3f}" for a in result.unit_val_acc))
    return result
