"""The Profiler (NeuroFlux Section 5.2): measured memory of each unit's local step, and its line.

    profiles = profile_units(learners, infos, num_classes, optimizer_factory(opts), batches=(1, 2, 4, 8, 16))
    [(p.slope_bytes_per_sample, p.intercept_bytes) for p in profiles]   # the Partitioner's models

For every unit, one local-learning training step (unit + auxiliary net, forward, loss, backward,
optimizer step) is *measured* at each batch size with edgeflux.memory.measure_training_peak
(exact live-tensor peak on CPU, allocator peak on CUDA), and a least-squares line
peak = a * batch + b is fitted. The paper observes that this is linear; a poor fit (R² below
`min_r2`) is an error rather than a silently wrong partition.

The line is fitted where blocks train (batches 16..128 by default) and extrapolates badly to batch 1,
where fixed scratch dominates (`profile/memory.json`: `batch1_peak_bytes` against slope + intercept). So each unit's
step at batch 1 is measured too, as the block step train_blocks runs for a one-unit block
(``measure_block_peak``): the least budget a unit needs is that figure, never the extrapolation.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from edgeflux.artifacts import read_json, write_json
from edgeflux.errors import UserError
from edgeflux.memory import StepContext, fit_linear, format_bytes, measure_training_peak
from edgeflux.models.units import UnitInfo, count_params
from edgeflux.train import progress_bar

from .aux import LocalLearner
from .block import measure_block_peak

log = logging.getLogger(__name__)


@dataclass
class UnitProfile:
    """One unit's measured training-step peaks and the line fitted through them."""

    index: int
    name: str
    batches: list[int]
    peak_bytes: list[int]              # measured, one per batch
    slope_bytes_per_sample: float      # a, fitted
    intercept_bytes: float             # b, fitted
    r2: float
    batch1_peak_bytes: int = 0         # measured: the one-unit block step at batch 1 (0: not measured)
    params: int = 0                    # unit + auxiliary net
    seconds: float = 0.0               # time spent measuring this unit

    @property
    def model(self) -> tuple[float, float]:
        """(a, b): what the Partitioner takes."""
        return self.slope_bytes_per_sample, self.intercept_bytes

    @property
    def min_bytes(self) -> int:
        """The least budget this unit trains under: its measured batch-1 step (the line's a + b if unmeasured)."""
        return self.batch1_peak_bytes or math.ceil(self.slope_bytes_per_sample + self.intercept_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> UnitProfile:
        return cls(**d)


class PoorFitError(RuntimeError, UserError):
    """A unit's measured peaks are not close enough to a line in the batch size."""

    def __init__(self, index: int, name: str, r2: float, batches: Sequence[int], peaks: Sequence[int],
                 min_r2: float) -> None:
        self.index, self.name, self.r2, self.min_r2 = index, name, r2, min_r2
        self.measurements = list(zip(batches, peaks))
        super().__init__(
            f"unit {index} ({name}): the measured training-step peaks are not linear in the batch size "
            f"(R² {r2:.4f} < min_r2 {min_r2}); measurements (batch, peak bytes): {self.measurements}. "
            f"Profile more batch sizes, and larger ones (e.g. 16, 32, 64, 128), so that fixed costs weigh less, "
            f"or lower min_r2 if the partition may rest on a rougher line.")


def fit_unit(index: int, name: str, batches: Sequence[int], peaks: Sequence[int],
             min_r2: float = 0.98) -> tuple[float, float, float]:
    """Fit peaks = a * batch + b; returns (a, b, r2), PoorFitError when r2 < min_r2."""
    if len(set(batches)) < 2:
        raise ValueError(f"unit {index} ({name}): a line needs at least two distinct batch sizes, got {list(batches)}")
    a, b, r2 = fit_linear(list(batches), list(peaks))
    if r2 < min_r2:
        raise PoorFitError(index, name, r2, batches, peaks, min_r2)
    return a, b, r2


def profile_units(learners: Sequence[LocalLearner], infos: Sequence[UnitInfo], num_classes: int,
                  optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                  batches: Sequence[int] = (1, 2, 4, 8, 16), device: str | torch.device = "cpu",
                  data: tuple[Tensor, Tensor] | None = None, context: StepContext | None = None,
                  min_r2: float = 0.98) -> list[UnitProfile]:
    """Measure each learner's training-step peak at every batch size and fit a line per unit.

    Each measurement is measure_training_peak on a copy of the learner (the learners are
    untouched) with input shape infos[i].in_shape. Unit 0 trains on `data` (real images, the
    first max(batches) samples) when given: activation sparsity, which compressed storage
    (`context`, e.g. BitTrain) depends on, is that of the data; later units get random inputs.
    Total profiling time: profiling_seconds(profiles).
    """
    batches = sorted({int(b) for b in batches})
    if len(batches) < 2 or batches[0] < 1:
        raise ValueError(f"profile at least two distinct batch sizes >= 1, got {batches}")
    if len(learners) != len(infos):
        raise ValueError(f"{len(learners)} learners but {len(infos)} unit descriptions")
    if data is not None and len(data[0]) < batches[-1]:
        raise ValueError(f"profiling data has {len(data[0])} samples; batch {batches[-1]} needs at least that many")
    profiles = []
    with progress_bar() as progress:
        task = progress.add_task("profiling units", total=len(learners) * len(batches), status="")
        for learner, info in zip(learners, infos):
            start = time.perf_counter()
            peaks = []
            for batch in batches:
                progress.update(task, status=f"{info.name} batch {batch}")
                # only the peak is kept: the process cross-check (USS, RSS sampler) was a third of the
                # profiling time, which is NeuroFlux's overhead (the paper: < 1.5% of training)
                mem = measure_training_peak(learner, optimizer_factory, info.in_shape, num_classes, batch,
                                            device=device, data=data if info.index == 0 else None, context=context,
                                            process_stats=False)
                peaks.append(int(mem.peak_bytes))
                progress.advance(task)
            a, b, r2 = fit_unit(info.index, info.name, batches, peaks, min_r2)
            batch1 = _batch1_block_peak(learner, optimizer_factory, info, num_classes, device,
                                        data if info.index == 0 else None, context)
            p = UnitProfile(index=info.index, name=info.name, batches=list(batches), peak_bytes=peaks,
                            slope_bytes_per_sample=a, intercept_bytes=b, r2=r2, batch1_peak_bytes=batch1,
                            params=count_params(learner), seconds=time.perf_counter() - start)
            log.info("unit %d (%s): peak = %s/sample * batch + %s (R² %.5f; %s at batch %d), %.2fs", p.index,
                     p.name, format_bytes(a), format_bytes(b), r2, format_bytes(peaks[-1]), batches[-1], p.seconds)
            profiles.append(p)
    log.info("profiled %d units at batches %s in %.1fs", len(profiles), batches, profiling_seconds(profiles))
    return profiles


def _batch1_block_peak(learner: LocalLearner, optimizer_factory, info: UnitInfo, num_classes: int, device,
                       data: tuple[Tensor, Tensor] | None, context: StepContext | None) -> int:
    """The measured peak of the step train_blocks runs for this unit alone at batch 1."""
    if data is not None:
        x, y = data[0][:1].clone(), data[1][:1].clone()
    else:
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(1, *info.in_shape, generator=gen), torch.randint(0, num_classes, (1,), generator=gen)
    return int(measure_block_peak([learner], optimizer_factory, x, y, context=context, device=device,
                                  process_stats=False).peak_bytes)


def profiling_seconds(profiles: Sequence[UnitProfile]) -> float:
    """Total time spent measuring: the profiler's overhead, to set against the training time."""
    return float(sum(p.seconds for p in profiles))


def save_profile(path: str | Path, profiles: Sequence[UnitProfile], meta: dict | None = None) -> None:
    """Write the profiles and `meta` (model, device, budget, ...) as JSON, atomically."""
    meta = dict(meta or {})
    meta.setdefault("profiling_seconds", profiling_seconds(profiles))
    write_json(path, {"units": [p.to_dict() for p in profiles], "meta": meta}, checksum=True)


def load_profile(path: str | Path) -> tuple[list[UnitProfile], dict]:
    """Read what save_profile wrote: (profiles, meta)."""
    data = read_json(path, "run the profile stage first (`dvc repro profile`)", checksum=True)
    return [UnitProfile.from_dict(d) for d in data["units"]], data.get("meta", {})
