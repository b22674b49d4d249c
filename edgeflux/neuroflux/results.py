"""What NeuroFlux's block worker returns: one BlockResult per trained (or reused) block, and the run of them
(edgeflux.neuroflux.worker.train_blocks), with the figures the train_blocks stage writes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    cpu_s: float = 0.0          # the process's CPU time over the spans of the three times above
    skipped: bool = False       # reused from an earlier run
    resumed_from_epoch: int = 0
    rebuilt_caches: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)   # this block's accuracy-vs-time rows
    split_batches: int = 0      # unit batches trained in halves to stay under the budget (BitTrain's StoredBound)
    activation_bytes: int = 0   # of peak_bytes, the activations alive at the peak (StepMemory.activation_bytes)


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
    def train_cpu_s(self) -> float:
        """The process's CPU time over the same spans as train_time_s."""
        return sum(b.cpu_s for b in self.blocks)

    @property
    def peak_bytes(self) -> int:
        return max((b.peak_bytes for b in self.blocks), default=0)

    def to_dict(self) -> dict:
        return {"blocks": [asdict(b) for b in self.blocks], "history": self.history,
                "unit_val_acc": self.unit_val_acc, "unit_test_acc": self.unit_test_acc, "complete": self.complete,
                "train_time_s": self.train_time_s, "train_cpu_s": self.train_cpu_s, "peak_bytes": self.peak_bytes}
