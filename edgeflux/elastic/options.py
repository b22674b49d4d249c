"""ElasticTrainer's options (params.yaml: finetune.elastic). Torch-free: params are checked without torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeflux.options import Options


class ElasticOptions(Options):
    """ElasticTrainer's options (params.yaml: finetune.elastic)."""

    rho: float = Field(0.5, gt=0, le=1)          # a step should take rho x the full step's time
    # when rho leaves no time for the classifier on the machine as measured (a loaded machine measures a slow
    # forward): "classifier" trains it alone that epoch, with a warning and the selection marked not met;
    # "error" stops with the smallest workable rho
    when_infeasible: Literal["classifier", "error"] = "classifier"
    # re-evaluate importance and re-select every `interval` epochs: the paper's Figure 7 finds importances still
    # 80% alike after 3 epochs, at under 1% of the training cost
    interval: int = Field(3, ge=1)
    profile_interval: int = Field(0, ge=0)       # re-profile every this many epochs (0: once, at the start)
    probe_samples: int = Field(32, ge=1)         # the probe batch of the importance evaluation
    # importance of a tensor: "update", the first-order loss change of its update summed over its weights (the
    # paper's Eq. 6); "per_weight", that over its element count, so that size alone does not rank under Adam
    # (edgeflux.elastic.importance; bench.elastic measures both)
    importance: Literal["update", "per_weight"] = "update"
    resolution: int = Field(1000, ge=10)         # the selector's time steps over the budget
    # profiling: timed rounds (runs A to D and the full step, after one warm-up step). A round costs about six
    # training steps; bench.elastic measures the time model's error at the default
    repeats: int = Field(1, ge=1)
    # the fine-tuning method whose trainable tensors elastic selects among (edgeflux.finetune)
    base: Literal["ft_all", "ft_blocks", "ft_bn", "ft_bn_bias", "ft_bias", "mobiletl"] = "ft_all"
