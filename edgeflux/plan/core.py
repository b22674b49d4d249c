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
from typing import NamedTuple

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
    rounds: int | None = None    # the timing rounds samples_per_s is the median of (fewer: out of the running)

    def to_dict(self) -> dict:
        return asdict(self)


def _trades(spec: str) -> str:
    parts = [p for p in spec.split("-") if p in TRADES]
    return "; ".join(TRADES[p] for p in parts) or "-"


ROUNDS = 3   # every candidate is timed once per round, in turn: the machine's slow seconds fall on all of them
STEPS = 3    # timed steps per candidate and round (more while they hold fewer than WINDOW_SAMPLES samples)
WINDOW_SAMPLES = 64   # a window of a few small batches lasts milliseconds: shorter than the machine's own jitter
# groups before timing: the first on a fresh copy allocates the optimizer's state; the steps after it are within
# the machine's jitter of the later ones (bench/results/plan_precision.md, the warm-up table)
WARMUP = 1
# after two rounds, a candidate auto could choose that both found below this share of the fastest such candidate's
# samples/s is timed no more (its row keeps those rounds): not after one, since a round's share strays from the
# median's by up to 0.32 (bench/results/plan_precision.md, first_round_gap) and can hold a stall (a preempted
# core); a candidate within NOISE of the fastest would have to stray that far twice
CONTENDS = 0.7
DECIDES = 2   # the rounds after which the slow are out


def time_step(model: nn.Module, train: tuple, opts: TrainOptions, batch: int, run: TrainRun, steps: int) -> float:
    """Samples per second of the step fit trains with at ``batch`` (on a copy of ``model``) over one window of
    the training data after WARMUP groups (a group: one step; with accumulation, the micro-batches of one
    update): whole groups, until it holds ``steps`` steps and WINDOW_SAMPLES samples (the data's epochs repeated
    when it holds fewer). The window's samples over its seconds, as a run's epoch counts them."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    x, y = train
    step = fit_step(copy.deepcopy(model).to(run.device).train(), opts, batch, run, len(y))
    hook = run.make_before_step(step, train, batch) if run.make_before_step else None
    group = step.accumulation.every if step.accumulation is not None else 1
    per_epoch = math.ceil(len(y) / batch)
    result, groups, timed, seen, elapsed = TrainResult(), 0, 0, 0, 0.0
    epochs = (batches(x, y, batch, shuffle=True, seed=opts.seed + e) for e in itertools.count())
    for i, (xb, yb) in enumerate(b for epoch in epochs for b in epoch):
        if hook is not None:
            hook(result)         # an elastic hook profiles in the warm-up groups
        start = time.perf_counter()
        step(xb.to(run.device), yb.to(run.device))
        if groups >= WARMUP:
            elapsed, seen, timed = elapsed + time.perf_counter() - start, seen + len(yb), timed + 1
        k = i % per_epoch
        if (k + 1) % group == 0 or k + 1 == per_epoch:   # a group closes (as Accumulation: never across epochs)
            groups += 1
            if timed >= steps and seen >= WINDOW_SAMPLES:
                break
    return seen / max(elapsed, 1e-9)


class Candidate(NamedTuple):
    """What a candidate trains: its label, model (prepared as its run prepares it), options and run."""
    label: str
    model: nn.Module
    opts: TrainOptions
    run: TrainRun


def size_one(spec: str, c: Candidate, train: tuple) -> PlanRow:
    """One candidate's row but its speed: its batch under its options' budget (measured as its run measures it)."""
    trainable = count_params(c.model, trainable_only=True)
    full = spec.split("-")[0] in FULL
    try:
        batch, _, memory = fit_model_batch(c.model, train, c.opts, c.opts, c.run)
    except BudgetTooSmallError as e:
        return PlanRow(spec, c.label, False, None, None, None, e.min_feasible_bytes, None, None, trainable,
                       _trades(spec), full)
    group = Accumulation.for_epoch(len(train[1]), batch, c.run.tricks.effective_batch).effective \
        if c.run.tricks and c.run.tricks.accumulate else batch
    return PlanRow(spec, c.label, True, batch, group, memory.peak_bytes, None, None, None, trainable,
                   _trades(spec), full)


def plan_rows(specs, make: Callable[[str], Candidate], train: tuple, steps: int, cache=None) -> list[PlanRow]:
    """The row of every candidate in ``specs`` (make(spec): what it trains): one ``cache`` (PlanCache; None:
    none) holds is taken from it, its epoch time scaled to the training data; every other is sized, then timed
    in ROUNDS rounds that take the candidates in turn, each round starting one further along (one candidate's
    copy alive at a time), at its median round, and stored in ``cache`` (an infeasible one as soon as sized).
    In turn, not one after the other: the machine's speed drifts by more than the candidates differ within
    seconds, and a ranking must not follow the drift. After DECIDES rounds only the candidates still in the
    running (contenders) are timed again."""
    samples = len(train[1])
    rows = {s: cache.get(s) if cache is not None else None for s in specs}
    rows = {s: replace(r, epoch_s=samples / r.samples_per_s if r.samples_per_s else None) if r else None
            for s, r in rows.items()}
    measured = {s: size_one(s, make(s), train) for s, r in rows.items() if r is None}
    for row in measured.values():
        if cache is not None and not row.feasible:
            cache.put(row)
    order = [s for s, r in measured.items() if r.feasible]
    rates = {s: [] for s in order}
    for turn in range(ROUNDS if order else 0):
        if turn == DECIDES:
            order = contenders(order, rates, measured)
        for s in order[turn % len(order):] + order[:turn % len(order)]:
            c = make(s)
            rates[s].append(time_step(c.model, train, c.opts, measured[s].batch, c.run, steps))
            del c   # before the next candidate's copy is made
    for s, timed in rates.items():
        per_s = statistics.median(timed)
        row = measured[s] = replace(measured[s], samples_per_s=per_s, epoch_s=samples / per_s, rounds=len(timed))
        log.info("plan %s: batch %d, %.1f samples/s (rounds: %s)", s, row.batch, per_s,
                 ", ".join(f"{r:.1f}" for r in timed))
        if cache is not None:
            cache.put(row)
    return [rows[s] or measured[s] for s in specs]


def contenders(order: list[str], rates: dict[str, list[float]], rows: dict[str, PlanRow]) -> list[str]:
    """The candidates of ``order`` worth timing again: every one auto could not choose (its row is for the user to
    weigh), and of those it could, each at CONTENDS of the fastest such candidate in at least one round so far."""
    full = [s for s in order if rows[s].full]
    tops = [max(rates[s][k] for s in full) for k in range(min(len(rates[s]) for s in full))] if full else []
    return [s for s in order if not rows[s].full or any(r >= CONTENDS * t for r, t in zip(rates[s], tops))]


def plan_training(model: nn.Module, train: tuple, opts, candidates=None, steps: int = STEPS,
                  device: str | torch.device = "cpu", cache=None) -> list[PlanRow]:
    """Every from-scratch candidate (default: BACKPROP_CANDIDATES) for ``model`` under opts' budget; a row
    ``cache`` (PlanCache) holds is taken from it."""
    def make(spec: str) -> Candidate:
        o = backprop_options(spec, opts)
        return Candidate(backprop_label(spec), model, o, TrainRun(device, context=o.bittrain.context, tricks=o.tricks))
    return plan_rows(candidates or BACKPROP_CANDIDATES, make, train, steps, cache)


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
