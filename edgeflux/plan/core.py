"""The plan's core: a candidate's batch under the budget (measured as its run measures it) and its speed (its
run's own step, timed), a row of the plan's table, and the choice method: auto makes (see edgeflux.plan)."""
from __future__ import annotations

import copy
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
from torch import nn

from edgeflux.backprop import fit_model_batch
from edgeflux.data import batches
from edgeflux.errors import UserError
from edgeflux.memory import BudgetTooSmallError
from edgeflux.memory.sizes import budget_at_least
from edgeflux.models import count_params
from edgeflux.options import TrainOptions
from edgeflux.train import TrainResult, TrainRun, fit_step
from edgeflux.tricks.accumulate import Accumulation
from edgeflux.tricks.options import backprop_label, backprop_options

log = logging.getLogger(__name__)

BACKPROP_CANDIDATES = ("backprop", "backprop-bittrain", "backprop-accumulate", "backprop-checkpoint",
                       "backprop-fused_step", "backprop-checkpoint-fused_step", "backprop-bittrain-fused_step")
FINETUNE_CANDIDATES = ("ft_all", "ft_all-bittrain", "ft_all-accumulate", "ft_all-checkpoint", "ft_all-fused_step",
                       "ft_all-checkpoint-fused_step", "ft_last", "ft_bn", "ft_bias", "ft_blocks", "mobiletl",
                       "mobiletl-bittrain", "elastic")
TRADES = {"bittrain": "compression time (exact)", "accumulate": "BatchNorm on micro-batches",
          "checkpoint": "recomputed forward", "fused_step": "no full gradient (no clipping)",
          "ft_last": "classifier only", "ft_bn": "BatchNorm only", "ft_bias": "biases only",
          "ft_bn_bias": "BatchNorm + biases only", "ft_blocks": "top blocks only",
          "mobiletl": "top blocks, approximate gradients, int8 bottom", "elastic": "a selected subset per interval",
          "neuroflux": "local losses, auxiliary heads"}
NOISE = 0.05   # timing few steps: candidates within 5% of the fastest are as fast (the simplest of them is chosen)
FULL = {"backprop", "ft_all"}   # the methods that train every parameter: what method: auto chooses among
FINETUNE_FULL = tuple(c for c in FINETUNE_CANDIDATES if c.split("-")[0] in FULL)


class NoFeasibleMethodError(RuntimeError, UserError):
    """No candidate fits the budget."""


@dataclass
class PlanRow:
    method: str                  # the name params take (train_bp.method, finetune.methods)
    label: str
    feasible: bool
    batch: int | None            # the (micro-)batch the run would train at
    samples_per_update: int | None
    peak_bytes: int | None       # measured, at that batch
    min_budget_bytes: int | None   # the smallest feasible budget (measured at batch 1) when infeasible
    samples_per_s: float | None  # timed: the run's own step on the training data
    epoch_s: float | None        # the training set over samples_per_s
    trainable_params: int
    trades: str
    full: bool                   # trains every parameter (a candidate of method: auto)

    def to_dict(self) -> dict:
        return asdict(self)


def _trades(spec: str) -> str:
    parts = [p for p in spec.split("-") if p in TRADES]
    return "; ".join(TRADES[p] for p in parts) or "-"


STEPS = 5    # timed groups per candidate (an odd count: the median is one of them)
WARMUP = 2   # groups before timing: the first allocates optimizer state, the second still settles caches


def time_step(model: nn.Module, train: tuple, opts: TrainOptions, batch: int, run: TrainRun, steps: int) -> float:
    """Samples per second of the step fit trains with at ``batch`` (on a copy of ``model``): the median over
    ``steps`` groups (one step; with accumulation, the micro-batches of one update) of the training data after
    WARMUP groups (the data's epochs repeated when it holds fewer). The median, not the mean: a few steps' mean is
    carried by one slow step (a warm-up straggler, a preempted core), while the run's rate over thousands of
    steps is the steady one."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    x, y = train
    step = fit_step(copy.deepcopy(model).to(run.device).train(), opts, batch, run, len(y))
    hook = run.make_before_step(step, train, batch) if run.make_before_step else None
    group = step.accumulation.every if step.accumulation is not None else 1
    result, rates, seen, elapsed = TrainResult(), [], 0, 0.0
    epochs = (batches(x, y, batch, shuffle=True, seed=opts.seed + e) for e in itertools.count())
    for i, (xb, yb) in enumerate(b for epoch in epochs for b in epoch):
        if hook is not None:
            hook(result)         # an elastic hook profiles in the warm-up groups
        start = time.perf_counter()
        step(xb.to(run.device), yb.to(run.device))
        if i >= group * WARMUP:
            elapsed, seen = elapsed + time.perf_counter() - start, seen + len(yb)
        if (i + 1) % group == 0 and seen:
            rates.append(seen / max(elapsed, 1e-9))
            seen, elapsed = 0, 0.0
        if len(rates) == steps:
            break
    return statistics.median(rates)


def plan_one(spec: str, label: str, model: nn.Module, train: tuple, opts, run: TrainRun, steps: int) -> PlanRow:
    """One candidate: its batch under opts' budget (measured) and its speed (timed)."""
    trainable = count_params(model, trainable_only=True)
    full = spec.split("-")[0] in FULL
    try:
        batch, _, memory = fit_model_batch(model, train, opts, opts, run)
    except BudgetTooSmallError as e:
        return PlanRow(spec, label, False, None, None, None, e.min_feasible_bytes, None, None, trainable,
                       _trades(spec), full)
    per_s = time_step(model, train, opts, batch, run, steps)
    group = Accumulation.for_epoch(len(train[1]), batch, run.tricks.effective_batch).effective \
        if run.tricks and run.tricks.accumulate else batch
    log.info("plan %s: batch %d, %.1f samples/s", spec, batch, per_s)
    return PlanRow(spec, label, True, batch, group, memory.peak_bytes, None, per_s, len(train[1]) / per_s,
                   trainable, _trades(spec), full)


def planned(spec: str, cache, measure: Callable[[], PlanRow], samples: int) -> PlanRow:
    """``spec``'s row as stored in ``cache`` (edgeflux.plan.cache.PlanCache; None: none), its epoch time for
    ``samples`` training samples, else measure()d and stored there."""
    row = cache.get(spec) if cache is not None else None
    if row is not None:
        return replace(row, epoch_s=samples / row.samples_per_s if row.samples_per_s else None)
    row = measure()
    if cache is not None:
        cache.put(row)
    return row


def plan_training(model: nn.Module, train: tuple, opts, candidates=None, steps: int = STEPS,
                  device: str | torch.device = "cpu", cache=None) -> list[PlanRow]:
    """Every from-scratch candidate (default: BACKPROP_CANDIDATES) for ``model`` under opts' budget; a row
    ``cache`` (PlanCache) holds is taken from it."""
    def measure(spec: str) -> PlanRow:
        o = backprop_options(spec, opts)
        run = TrainRun(device, context=o.bittrain.context, tricks=o.tricks)
        return plan_one(spec, backprop_label(spec), model, train, o, run, steps)
    return [planned(spec, cache, partial(measure, spec), len(train[1])) for spec in candidates or BACKPROP_CANDIDATES]


def fastest(rows: list[PlanRow]) -> PlanRow:
    """The feasible candidate that trains every parameter fastest (what method: auto runs). A few timed steps
    cannot tell apart candidates within NOISE of the fastest samples/s; of those, the one with the fewest modifiers
    (each trades something: recomputation, BatchNorm on micro-batches, no full gradient), then the faster. Not
    the larger update: at equal samples/s the time to a target accuracy did not follow the update's size
    (bench/results/budget.md: accumulation to the reference batch beside plain backprop at the micro-batch
    that fits)."""
    feasible = [r for r in rows if r.feasible and r.full and math.isfinite(r.samples_per_s or float("nan"))]
    if not feasible:
        smallest = min((r.min_budget_bytes for r in rows if r.full and r.min_budget_bytes), default=None)
        scratch = any(r.method.startswith("backprop") for r in rows)
        other = ("or train block by block with NeuroFlux (the neuroflux stage), which holds one block at a time"
                 if scratch else "or fine-tune less: finetune.methods mobiletl or ft_bias (`edgeflux plan` lists them)")
        raise NoFeasibleMethodError("no method that trains every parameter fits the budget" + (
            f"; the smallest budget any fits is {budget_at_least(smallest)}: raise device.budget to it, {other}"
            if smallest else f"; {other}"))
    top = max(r.samples_per_s for r in feasible)
    near = [r for r in feasible if r.samples_per_s >= (1 - NOISE) * top]
    return min(near, key=lambda r: (r.method.count("-"), -r.samples_per_s))


def auto_method(rows: list[PlanRow], budget_bytes: int, run, cache=None) -> PlanRow:
    """What ``method: auto`` trains with: the fastest feasible row (its method, and its batch, which the run takes
    as TrainRun.batch_hint rather than searching again); the whole plan is logged to the stage's MLflow run
    (``run``: edgeflux.tracking's) as plan.json, with the stored plan (``cache``: PlanCache) it came from."""
    chosen = fastest(rows)
    stored = {"stored": str(cache.path), "reused": sorted(cache.reused)} if cache is not None else {}
    run.log_dict({"budget_bytes": budget_bytes, "auto": chosen.method, **stored, "rows": [r.to_dict() for r in rows]},
                 "plan.json")
    return chosen
