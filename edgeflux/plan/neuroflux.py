"""NeuroFlux as a candidate of the plan: its profile and partition (Algorithm 1), each block measured and timed."""
from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
from torch import nn

from edgeflux.memory import CONTENT_SAMPLES, BudgetTooSmallError, choose_batch
from edgeflux.models import count_params
from edgeflux.neuroflux.block import BlockStep, LocalBlock, forward_block, measure_block_peak
from edgeflux.neuroflux.model import aux_args, build_learners
from edgeflux.neuroflux.partition import partition
from edgeflux.neuroflux.profile import profile_units
from edgeflux.train import optimizer_factory

from .core import ROUNDS, STEPS, TRADES, WARMUP, PlanRow

log = logging.getLogger(__name__)


def plan_neuroflux(spec: dict, train: tuple, opts, steps: int = STEPS, device: str | torch.device = "cpu") -> PlanRow:
    """NeuroFlux on the model ``spec`` (build_model arguments) with opts' settings (the neuroflux section): the
    profile and partition its stages run (Algorithm 1), then each block's step measured at its batch and timed
    on its input (the units before it, run forward once) over steps x ROUNDS steps, as many as the other
    candidates' rounds time at least; an epoch is every block's pass over the training set."""
    model, learners = build_learners(spec, aux_args(opts))
    trainable = count_params(nn.ModuleList(learners))
    profiles = profile_units(learners, model.describe(), spec["num_classes"], optimizer_factory(opts),
                             batches=opts.profile_batches, device=device, data=train, context=opts.bittrain.context,
                             min_r2=opts.min_r2)
    try:
        blocks = partition([(u.slope_bytes_per_sample, u.intercept_bytes) for u in profiles], opts.budget,
                           opts.max_batch, rho=opts.rho, names=[u.name for u in profiles],
                           floors=[u.min_bytes for u in profiles])
    except BudgetTooSmallError as e:
        return PlanRow("neuroflux", "NeuroFlux", False, None, None, None, e.min_feasible_bytes, None, None,
                       trainable, TRADES["neuroflux"], False)
    x, y = train
    steps *= ROUNDS
    n = min(len(y), max(b.batch_size for b in blocks) * max(steps + WARMUP, CONTENT_SAMPLES))
    inputs, y, peak, epoch_s, batches_used = x[:n].to(device), y[:n].to(device), 0, 0.0, []
    make_optimizer = optimizer_factory(opts)
    for block in blocks:
        group = [learners[i] for i in block.units]
        try:    # the planned batch, or the largest whose measured block step fits (as train_blocks does)
            choice = choose_batch(lambda xb, yb, group=group: measure_block_peak(group, make_optimizer, xb.clone(),
                                                                                 yb.clone(),
                                                                    context=opts.bittrain.context, device=device,
                                                                    process_stats=False),
                                  (inputs, y), budget_bytes=opts.budget, max_batch=block.batch_size,
                                  preferred=block.batch_size)
        except BudgetTooSmallError as e:
            return PlanRow("neuroflux", "NeuroFlux", False, None, None, None, e.min_feasible_bytes, None, None,
                           trainable, TRADES["neuroflux"], False)
        b = choice.batch_size
        peak, batches_used = max(peak, choice.memory.peak_bytes), batches_used + [b]
        step = BlockStep.factory(make_optimizer, opts.bittrain.context)(copy.deepcopy(LocalBlock(group)))
        epoch_s += median_step_s(step, inputs, y, b, steps) / b * len(train[1])
        inputs = forward_block(group, inputs)[0]   # the next block's input, as the activation cache holds it
    batch = "/".join(map(str, batches_used))
    per_s = len(train[1]) / epoch_s
    log.info("plan neuroflux: %d blocks at batches %s, %.1f samples/s", len(blocks), batch, per_s)
    return PlanRow("neuroflux", f"NeuroFlux ({len(blocks)} block{'s' * (len(blocks) > 1)}, batch {batch})", True,
                   min(batches_used), None, peak, None, per_s, epoch_s, trainable, TRADES["neuroflux"], False)


def median_step_s(step, x, y, batch: int, steps: int) -> float:
    """A block step's median seconds over ``steps`` batches of (x, y) after WARMUP ones, cycling through the
    batches x holds when they are fewer. Not in rounds with the other candidates: NeuroFlux is not one method
    auto chooses among, and its blocks' inputs are the previous blocks' outputs, computed once."""
    count = max(1, len(y) // batch)
    seconds = []
    for i in range(WARMUP + steps):
        k = i % count
        xb, yb = x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]
        start = time.perf_counter()
        step(xb, yb)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
