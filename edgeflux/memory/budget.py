"""The batch size a trainer uses under a memory budget: the largest whose measured step fits."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from edgeflux.errors import UserError

from .sizes import budget_at_least, format_bytes
from .step import StepMemory

log = logging.getLogger(__name__)


CONTENT_SAMPLES = 3   # batches measured per batch size when activation storage depends on the values


def largest_over_batches(measure: Callable[[int], StepMemory], available: int,
                         samples: int = CONTENT_SAMPLES) -> StepMemory:
    """measure(0), or, where the step stores activations by their content (``activation_storage`` is
    set: BitTrain's bitmap holds the batch's non-zeros), the largest peak of measure(i) over the first
    min(samples, available) disjoint batches i, with the largest stored bytes of any of them after each
    stored activation (``stored_envelope``, what StoredBound holds later batches to)."""
    step = measure(0)
    if step.activation_storage is not None:
        for i in range(1, min(samples, available)):
            other = measure(i)
            envelope = _upper_envelope(step.stored_envelope, other.stored_envelope)
            step = max(step, other, key=lambda s: s.peak_bytes)
            step.stored_envelope = envelope
    return step


def _upper_envelope(a: list[list[int]] | None, b: list[list[int]] | None) -> list[list[int]] | None:
    # not the same sequence of saves: no envelope to trust
    if a is None or b is None or [len(t) for t in a] != [len(t) for t in b]:
        return None
    return [[max(u, v) for u, v in zip(ta, tb)] for ta, tb in zip(a, b)]


class BudgetTooSmallError(RuntimeError, UserError):
    """Even batch size 1 does not fit the memory budget."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int) -> None:
        self.budget_bytes, self.min_feasible_bytes = int(budget_bytes), int(min_feasible_bytes)
        need = f"{format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes)"
        super().__init__(
            f"the memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the measured peak "
            f"of one training step at batch size 1, {need}: the smallest feasible budget is {need} (measured); "
            f"raise the budget to at least {budget_at_least(min_feasible_bytes)} or choose a smaller/narrower model")


@dataclass
class BatchFit:
    """The largest batch whose measured peak fits the budget, and the measurements behind it."""
    batch_size: int
    peak_bytes: int                      # measured at batch_size
    budget_bytes: int
    measurements: list[tuple[int, int]]  # (batch, measured peak), every point measured, by batch
    slope_bytes_per_sample: float        # estimate: least-squares line bytes = slope*batch + intercept
    intercept_bytes: float               # estimate
    r2: float                            # of that line over the measurements
    min_feasible_bytes: int              # measured peak at batch 1


def fit_linear(batches: Sequence[float], values: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares line values = a*batches + b; returns (a, b, r2). One point: (0, value, 1)."""
    n = len(batches)
    if n == 0 or n != len(values):
        raise ValueError(f"fit_linear needs equally many batches and values (got {n} and {len(values)})")
    mx, my = sum(batches) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in batches)
    if sxx == 0:
        return 0.0, float(my), 1.0
    a = sum((x - mx) * (y - my) for x, y in zip(batches, values)) / sxx
    b = my - a * mx
    ss_res = sum((y - (a * x + b)) ** 2 for x, y in zip(batches, values))
    ss_tot = sum((y - my) ** 2 for y in values)
    return float(a), float(b), 1.0 if ss_tot == 0 else float(1 - ss_res / ss_tot)


def max_batch_under_budget(measure: Callable[[int], int], budget_bytes: int, max_batch: int,
                           hint: int | None = None) -> BatchFit:
    """The largest batch <= max_batch whose measured peak, measure(batch), is <= budget_bytes.

    hint: a batch another search found (the plan's, for method: auto): after batch 1, the hint and hint + 1 are
    measured first and bracket the search; when the hint fits and hint + 1 does not (or the hint is max_batch)
    that is the answer, in three measurements.

    Measures batch 1 (BudgetTooSmallError if it is over budget) and batch 8, extrapolates the
    line through the two largest measurements to the budget until a measurement lands over
    it, then interpolates inside the bracket (Illinois regula falsi). Every guess lies strictly
    between the largest batch measured under budget and the smallest measured over it, so the
    bracket shrinks each time. A linear peak takes 4 measurements, a clearly curved one ~10.
    The answer is a measured fact: the returned batch was measured under budget and batch+1
    was measured over it (or the batch is max_batch). The fitted line in the result is an
    estimate over all measurements, reported beside them.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    measured: dict[int, int] = {}

    def m(batch: int) -> int:
        if batch not in measured:
            measured[batch] = int(measure(batch))
            log.debug("batch %d: measured peak %s", batch, format_bytes(measured[batch]))
        return measured[batch]

    if m(1) > budget_bytes:
        raise BudgetTooSmallError(budget_bytes, measured[1])
    lo, hi = 1, max_batch + 1   # lo: largest batch measured under budget; hi: smallest over (max_batch+1: none)
    for batch in (hint, hint + 1) if hint is not None else ():   # the bracket around a batch found before
        if lo < batch < hi:
            if m(batch) > budget_bytes:
                hi = batch
                break
            lo = batch
    probe = min(max_batch, 8)
    if lo < probe < hi:
        if m(probe) <= budget_bytes:
            lo = probe
        else:
            hi = probe
    # Illinois-style regula falsi on the integers: when the same end of the bracket moves twice
    # in a row (the peak is not linear here), the other end's excess over the budget is halved
    # so the next guess lands nearer to it instead of crawling.
    weight = {"lo": 1.0, "hi": 1.0}
    last_moved = None
    while hi - lo > 1:
        if hi <= max_batch:     # bracketed: interpolate between its ends
            f_lo = (measured[lo] - budget_bytes) * weight["lo"]
            f_hi = (measured[hi] - budget_bytes) * weight["hi"]
            guess = lo + math.floor((hi - lo) * -f_lo / (f_hi - f_lo))
        else:                   # not yet: extrapolate from the two largest batches measured
            (b1, p1), (b2, p2) = sorted(measured.items())[-2:]
            slope = (p2 - p1) / (b2 - b1)
            guess = b1 + math.floor((budget_bytes - p1) / slope) if slope > 0 else hi - 1
        guess = min(max(guess, lo + 1), hi - 1)
        moved = "lo" if m(guess) <= budget_bytes else "hi"
        if moved == "lo":
            lo = guess
        else:
            hi = guess
        weight[moved] = 1.0
        if moved == last_moved:
            weight["hi" if moved == "lo" else "lo"] /= 2
        last_moved = moved

    a, b, r2 = fit_linear(list(measured), list(measured.values()))
    return BatchFit(batch_size=lo, peak_bytes=measured[lo], budget_bytes=int(budget_bytes),
                    measurements=sorted(measured.items()), slope_bytes_per_sample=a, intercept_bytes=b,
                    r2=r2, min_feasible_bytes=measured[1])



@dataclass
class BatchChoice:
    """The batch a trainer trains with and the measured step behind it."""
    batch_size: int
    fit: BatchFit | None     # the search under the budget; None when no search ran (no budget, or `preferred` fit)
    memory: StepMemory       # the measured step at batch_size


def choose_batch(measure: Callable[[Tensor, Tensor], StepMemory], data: tuple[Tensor, Tensor], *,
                 budget_bytes: int | None, max_batch: int, preferred: int | None = None,
                 samples: int = CONTENT_SAMPLES, hint: int | None = None) -> BatchChoice:
    """The batch size every trainer trains with: measured, never guessed.

    measure(x, y): the measured training step on that batch (the step the trainer runs: see
    edgeflux.memory.measure_training_step). data: samples to measure on, real data (activation sparsity,
    which compressed storage depends on, is the data's); the i-th batch of size b is data[i*b:(i+1)*b].
    No budget: ``preferred``, measured for the record. A budget: ``preferred`` when its measured peak fits
    (NeuroFlux's planned block batch), else the largest batch <= max_batch (and <= preferred) whose measured
    peak fits (max_batch_under_budget: BudgetTooSmallError, naming the smallest feasible budget, when batch 1
    does not; ``hint``: where that search looks first). Where the step stores activations by their content
    (BitTrain), a batch size's peak is the largest over the first `samples` disjoint batches
    (largest_over_batches).
    """
    n = len(data[1])
    max_batch = min(max_batch, n)
    preferred = min(preferred, n) if preferred is not None else None
    measured: dict[int, StepMemory] = {}

    def peak(batch: int) -> int:
        if batch not in measured:
            def at(i: int) -> StepMemory:
                return measure(data[0][i * batch:(i + 1) * batch], data[1][i * batch:(i + 1) * batch])
            measured[batch] = largest_over_batches(at, available=n // batch, samples=samples)
            log.info("measured peak at batch %d: %s", batch, format_bytes(measured[batch].peak_bytes))
        return measured[batch].peak_bytes

    if budget_bytes is None or (preferred is not None and peak(preferred) <= budget_bytes):
        batch = preferred if preferred is not None else max_batch
        peak(batch)
        return BatchChoice(batch, None, measured[batch])
    fitted = max_batch_under_budget(peak, budget_bytes, preferred or max_batch, hint)
    log.info("budget %s: batch %d fits (measured peak %s; batch 1 needs %s)", format_bytes(budget_bytes),
             fitted.batch_size, format_bytes(fitted.peak_bytes), format_bytes(fitted.min_feasible_bytes))
    return BatchChoice(fitted.batch_size, fitted, measured[fitted.batch_size])
