"""ElasticTrainer: faster on-device fine-tuning by run-time tensor selection under a wall-clock objective
(Huang, Yang and Gao, MobiSys 2023).

    timing = profile_tensors(model, x, y, optimizer=opt)        # t_dw, t_dy per tensor, T_forward, T_full
    importance = tensor_importance(step, timing.names, xp, yp)  # first-order loss reduction of an update
    mask = select_tensors(timing.update_cost(), timing.t_dy, importance, budget)   # exact DP

The method ``elastic`` of edgeflux.finetune runs them in the training loop (``ElasticController``).
Modules: profile (the tensor timing profiler and the time model), validate (the time model against measured
backward times), importance, select (the DP), trainer.
"""
from __future__ import annotations

from .importance import tensor_importance
from .profile import TensorTiming, execution_order, measure_backward, predict_backward, predict_step, profile_tensors
from .select import rounded_costs, select_tensors, selection_cost
from .trainer import ElasticBudgetError, ElasticController, ElasticOptions, classifier_names, elastic_metrics
from .validate import random_selections, validate_time_model

__all__ = ["ElasticBudgetError", "ElasticController", "ElasticOptions", "TensorTiming", "classifier_names",
           "elastic_metrics",
           "execution_order", "measure_backward", "predict_backward", "predict_step", "profile_tensors",
           "random_selections",
           "rounded_costs", "select_tensors", "selection_cost", "tensor_importance", "validate_time_model"]
