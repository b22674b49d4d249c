"""The fine-tuning candidates of the plan: each method prepared as edgeflux.finetune prepares it."""
from __future__ import annotations

import copy

import torch
from torch import nn

from edgeflux.finetune.methods import calibration_batches, method_options, prepare
from edgeflux.finetune.options import FinetuneOptions, finetune_label
from edgeflux.train import TrainRun

from .core import FINETUNE_CANDIDATES, STEPS, Candidate, PlanRow, plan_rows


def plan_finetune(model: nn.Module, train: tuple, opts: FinetuneOptions, candidates=None,
                  steps: int = STEPS, device: str | torch.device = "cpu", cache=None) -> list[PlanRow]:
    """Every fine-tuning candidate (default: FINETUNE_CANDIDATES) for a pretrained ``model`` under opts' budget,
    each prepared as edgeflux.finetune.finetune prepares it (lean layers included); a row ``cache`` (PlanCache)
    holds is taken from it, unprepared. Each timing round prepares its copy again: one candidate's copy is alive at
    a time."""
    def make(spec: str) -> Candidate:
        method, o = method_options(spec, opts)
        prepared = prepare(method, copy.deepcopy(model), o, calibration_batches(train[0], o.calibration_batches),
                           device)
        run = TrainRun(device, context=o.bittrain.context, tricks=o.tricks, make_before_step=prepared.make_before_step)
        return Candidate(finetune_label(spec), prepared.model, o, run)
    return plan_rows(candidates or FINETUNE_CANDIDATES, make, train, steps, cache)


