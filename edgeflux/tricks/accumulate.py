"""Gradient accumulation: which micro-batch opens an optimizer step, which closes it, and each one's weight.

The training loop feeds micro-batches (only one is on the device at a time); an epoch of ``samples`` samples
is ``per_epoch`` micro-batches of ``micro``, grouped ``every`` at a time (the epoch's last group may be
shorter). Each micro-batch's mean loss is weighted by its share of its group's samples, so a group's gradient
is the mean loss's over the group, as one batch of that size would give (BatchNorm aside: it normalises each
micro-batch by its own statistics). Groups never straddle epochs, so a checkpoint after an epoch holds no
half-accumulated gradient and a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Accumulation:
    micro: int           # samples per micro-batch
    every: int           # micro-batches per optimizer step
    samples: int         # samples per epoch
    calls: int = 0       # micro-batches seen

    @classmethod
    def for_epoch(cls, samples: int, micro: int, effective: int) -> Accumulation:
        """Micro-batches of ``micro`` adding up to ``effective`` samples per step (at least one micro-batch)."""
        return cls(micro, max(1, effective // micro), samples)

    @classmethod
    def measuring(cls, micro: int, effective: int) -> Accumulation:
        """For the measured step: groups of two, the measured micro-batch closing one (its optimizer step
        included), the costliest position; edgeflux.memory.step.warm_up runs a group before it, so that the
        optimizer's state is alive as in training. One micro-batch a step when the group is one."""
        return cls(micro, min(2, max(1, effective // micro)), samples=2**62)

    @property
    def effective(self) -> int:
        return self.micro * self.every

    def next(self) -> tuple[bool, bool, float]:
        """(opens a group, closes it, weight of its mean loss) for the next micro-batch."""
        per_epoch = math.ceil(self.samples / self.micro)
        i = self.calls % per_epoch
        self.calls += 1
        first = i - i % self.every
        stop = min(first + self.every, per_epoch)
        group = min(stop * self.micro, self.samples) - first * self.micro
        size = min((i + 1) * self.micro, self.samples) - i * self.micro
        return i == first, i + 1 == stop, size / group
