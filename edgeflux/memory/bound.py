"""What a step whose saved activations are stored by their content (BitTrain) may store under a budget.

Torch-free and import-free: the step (edgeflux.step) and the hooks (edgeflux.bittrain.hooks) both name it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .step import StepMemory


class StoredOverBudget(RuntimeError):
    """Raised inside a forward whose stored activations outgrow their StoredBound: the step that catches
    it (edgeflux.step.TrainStep, NeuroFlux's BlockStep per unit) trains the batch in halves instead. Not a
    user error: it never escapes a step unless one sample alone outgrows the bound."""


@dataclass(frozen=True)
class StoredBound:
    """How many bytes a step whose stored activations depend on their content (BitTrain) may store.

    A batch size's peak is measured on a few batches, but another batch of the same size is sparser or
    denser: its bitmaps are smaller or larger, and so is its peak. Everything else the step allocates has
    the sizes of the measured step (the same shapes), so at any moment its memory is the measured step's
    plus the difference in stored bytes so far. Hence the rule: after the k-th stored activation, the
    stored total may be at most ``envelope[k]`` (the most any measured batch had stored by then) plus
    ``headroom`` (budget - measured peak). Backward frees the saved tensors last-in first-out, so what is
    left then is such a prefix too, and the rule holds there as well. The hooks refuse a store that would
    break it before allocating it (StoredOverBudget)."""

    envelope: tuple[int, ...]
    headroom: int

    def room(self, k: int, stored: int) -> int:
        """Bytes the k-th stored activation may add to ``stored`` (may be negative)."""
        return self.envelope[min(k, len(self.envelope) - 1)] + self.headroom - stored


def stored_bounds(memory: StepMemory, budget_bytes: int | None) -> tuple[StoredBound, ...] | None:
    """The bounds for steps measured as ``memory`` under ``budget_bytes``, one per context the step enters
    (a TrainStep: one; NeuroFlux's block step: one per unit, each unit's memory on top of the same fixed
    part, so the same headroom); None where no bound applies (no budget, or storage that does not depend on
    content)."""
    if budget_bytes is None or not memory.stored_envelope:
        return None
    headroom = max(0, budget_bytes - memory.peak_bytes)
    return tuple(StoredBound(tuple(envelope), headroom) for envelope in memory.stored_envelope)
