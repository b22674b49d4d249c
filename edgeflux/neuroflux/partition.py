"""The Partitioner: NeuroFlux Algorithm 1, contiguous blocks of units with their batch sizes.

    sizes = unit_batch_sizes(models, budget, batch_limit)      # lines 2-5
    blocks = partition(models, budget, batch_limit, rho=0.4)   # lines 1-17

`models` holds one linear memory model per unit from the Profiler, (a, b) in bytes:
peak = a * batch + b. Each unit gets the largest batch whose predicted peak fits the budget,
capped at the batch limit. Then units are grouped: a block starts at unit i and takes unit i+1
while |b[i+1] - b[i]| <= rho * b[i], comparing each unit with the one before it; the block's
batch size is the smallest of its units'.
"""
from __future__ import annotations

import logging
import math
import numbers
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from edgeflux.artifacts import read_json, write_json
from edgeflux.memory import BudgetTooSmallError, budget_at_least, format_bytes

log = logging.getLogger(__name__)

UNBOUNDED = sys.maxsize   # max_batch_for's answer when memory does not grow with the batch


@dataclass(frozen=True)
class Block:
    """Contiguous units trained together at one batch size."""

    index: int
    units: tuple[int, ...]
    batch_size: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["units"] = list(self.units)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Block:
        return cls(index=int(d["index"]), units=tuple(int(u) for u in d["units"]), batch_size=int(d["batch_size"]))


def max_batch_for(a: float, b: float, budget_bytes: float) -> int:
    """The largest integer batch t with a*t + b <= budget_bytes; 0 when batch 1 does not fit.

    Exact: the comparison is done in rational arithmetic on the given floats, so a peak that
    lands exactly on the budget fits and one byte more does not. A slope a <= 0 (memory that
    does not grow with the batch; real peaks always grow, so only a flat fit gives this) is
    unbounded when batch 1 fits: UNBOUNDED, which the caller caps at its batch limit.
    """
    for name, v in (("a", a), ("b", b), ("budget_bytes", budget_bytes)):
        if not (isinstance(v, numbers.Real) and math.isfinite(v)):
            raise ValueError(f"max_batch_for needs finite numbers, got {name}={v!r}")
    fa, fb, fm = _exact(a), _exact(b), _exact(budget_bytes)
    if fa <= 0:
        return UNBOUNDED if fa + fb <= fm else 0
    t = math.floor((fm - fb) / fa)
    return 0 if t < 1 else min(t, UNBOUNDED)


def _exact(v: numbers.Real) -> Fraction:
    """v as an exact fraction (numpy scalars too: Fraction takes only Python's int and float)."""
    return Fraction(int(v)) if isinstance(v, numbers.Integral) else Fraction(float(v))


def unit_floors(models: Sequence[tuple[float, float]], floors: Sequence[int] | None = None) -> list[int]:
    """Each unit's least budget: its measured batch-1 peak where the profiler measured one (the line
    extrapolates badly down to batch 1), else the line's ceil(a + b)."""
    lines = [math.ceil(_exact(a) + _exact(b)) for a, b in models]
    return [int(f) if f else line for line, f in zip(lines, floors or [0] * len(models), strict=True)]


def min_budget_bytes(models: Sequence[tuple[float, float]], floors: Sequence[int] | None = None) -> int:
    """The smallest whole-byte budget under which every unit fits batch 1: the largest unit floor."""
    return max(unit_floors(models, floors))


class UnitDoesNotFitError(BudgetTooSmallError):
    """A unit's training step at batch size 1 is predicted to exceed the memory budget."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, unit_index: int, unit_name: str | None = None,
                 unit_bytes: int | None = None, others: Sequence[int] = (), measured: bool = False) -> None:
        """measured: the need is this unit's measured step (the worker), not the profiled models of every
        unit (the partitioner): min_feasible_bytes then covers this unit only."""
        super().__init__(budget_bytes, min_feasible_bytes)
        self.unit_index, self.unit_name, self.unit_bytes = unit_index, unit_name, unit_bytes
        unit = f"unit {unit_index}" + (f" ({unit_name})" if unit_name else "")
        needs = f" needs {format_bytes(unit_bytes)} ({unit_bytes} bytes)" if unit_bytes is not None else " does not fit"
        more = f"; units {list(others)} do not fit either" if others else ""
        need = f"{format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes)"
        basis = "measured" if measured else "profiled"
        fits = (f"It fits batch 1 from {need} (measured; a later unit may need more)" if measured
                else f"Every unit's profiled batch-1 step fits from {need}")
        self.args = (
            f"{unit}{needs} for one local-learning step at batch size 1 ({basis}), above the memory budget "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes){more}. {fits}: raise the budget to at least "
            f"{budget_at_least(min_feasible_bytes)}, or choose a smaller/narrower model (or the adaptive auxiliary "
            f"networks).",)


def _check_args(models: Sequence[tuple[float, float]], budget_bytes: float, batch_limit: int,
                names: Sequence[str] | None, floors: Sequence[int] | None = None) -> None:
    if not models:
        raise ValueError("partition needs one (a, b) memory model per unit; got none (run the profiler first)")
    if not (isinstance(budget_bytes, numbers.Real) and math.isfinite(budget_bytes) and budget_bytes > 0):
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    if isinstance(batch_limit, bool) or not (isinstance(batch_limit, numbers.Integral) and batch_limit >= 1):
        raise ValueError(f"batch_limit must be an int >= 1 (the paper caps batches at 32..512), got {batch_limit!r}")
    for what, given in (("names", names), ("floors", floors)):
        if given is not None and len(given) != len(models):
            raise ValueError(f"{what} has {len(given)} entries for {len(models)} units")


def unit_batch_sizes(models: Sequence[tuple[float, float]], budget_bytes: float, batch_limit: int,
                     names: Sequence[str] | None = None, floors: Sequence[int] | None = None) -> list[int]:
    """Algorithm 1 lines 2-5: b_l = min(max batch under the budget, batch_limit) for every unit.

    floors: each unit's measured batch-1 peak (UnitProfile.min_bytes). A unit fits batch 1 exactly when
    its floor does: the measurement overrides the line both ways (the line may predict 0 where batch 1
    measured within the budget, or 1 where it measured over it).
    Raises UnitDoesNotFitError (a BudgetTooSmallError) naming the first unit whose batch 1 does
    not fit, with the smallest budget at which every unit fits.
    """
    _check_args(models, budget_bytes, batch_limit, names, floors)
    least = unit_floors(models, floors)
    sizes = [0 if need > budget_bytes else max(1, min(max_batch_for(a, b, budget_bytes), batch_limit))
             for (a, b), need in zip(models, least)]
    bad = [i for i, s in enumerate(sizes) if s < 1]
    if bad:
        i = bad[0]
        raise UnitDoesNotFitError(int(budget_bytes), max(least), i, names[i] if names else None,
                                  unit_bytes=least[i], others=bad[1:])
    return [int(size) for size in sizes]


def group(sizes: Sequence[int], rho: float = 0.4) -> list[Block]:
    """Algorithm 1 lines 6-17 on per-unit batch sizes: contiguous blocks, batch = min over the block.

    rho is read as the decimal the user wrote (0.4 is exactly 40%: 4 against 10 is inside it),
    not as its binary approximation, so boundary cases do not depend on float rounding.
    """
    if not (isinstance(rho, numbers.Real) and not isinstance(rho, bool) and math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho (the grouping threshold) must be a number >= 0, e.g. 0.4 for 40%, got {rho!r}")
    r = Fraction(str(rho))
    blocks: list[Block] = []
    i, n = 0, len(sizes)
    while i < n:                                                  # line 6 (the while loop advances i past a block)
        units, batch = [i], sizes[i]                              # lines 7-9
        while i + 1 < n and abs(sizes[i + 1] - sizes[i]) <= r * sizes[i]:   # line 10: compare with the unit before
            batch = min(batch, sizes[i + 1])                      # line 11
            units.append(i + 1)                                   # line 12
            i += 1                                                # line 13
        blocks.append(Block(index=len(blocks), units=tuple(units), batch_size=batch))   # line 15
        i += 1
    return blocks


def partition(models: Sequence[tuple[float, float]], budget_bytes: float, batch_limit: int, rho: float = 0.4,
              names: Sequence[str] | None = None, floors: Sequence[int] | None = None) -> list[Block]:
    """NeuroFlux Algorithm 1: blocks of contiguous units and their batch sizes under `budget_bytes`.

    models: (a, b) per unit, predicted peak bytes = a * batch + b (the Profiler's fits).
    batch_limit: the cap B on any batch size. rho: the grouping threshold (0.4 in the paper).
    names: unit names, for error messages. floors: measured batch-1 peaks (see unit_batch_sizes).
    """
    sizes = unit_batch_sizes(models, budget_bytes, batch_limit, names, floors)
    blocks = group(sizes, rho)
    log.info("partitioned %d units under %s (batch limit %d, rho %g): per-unit batches %s -> %d blocks %s",
             len(models), format_bytes(budget_bytes), batch_limit, rho, sizes, len(blocks),
             [(list(bl.units), bl.batch_size) for bl in blocks])
    return blocks


def save_blocks(path: str | Path, blocks: Sequence[Block], meta: dict | None = None) -> None:
    """Write the blocks and `meta` (budget, limit, rho, per-unit batches, ...) as JSON, atomically."""
    write_json(path, {"blocks": [b.to_dict() for b in blocks], "meta": meta or {}}, checksum=True)


def load_blocks(path: str | Path) -> tuple[list[Block], dict]:
    """Read what save_blocks wrote: (blocks, meta)."""
    data = read_json(path, "run the partition stage first (`dvc repro partition`)", checksum=True)
    return [Block.from_dict(d) for d in data["blocks"]], data.get("meta", {})
