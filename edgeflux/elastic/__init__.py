"""ElasticTrainer: faster on-device fine-tuning by run-time tensor selection under a wall-clock objective
(Huang, Yang and Gao, MobiSys 2023).

    timing = profile_tensors(model, x, y, optimizer=opt)        # t_dw, t_dy per tensor, T_forward, T_full
    importance = tensor_importance(step, timing.names, xp, yp)  # first-order loss reduction of an update
    mask = select_tensors(timing.update_cost(), timing.t_dy, importance, budget)   # exact DP

The method ``elastic`` of edgeflux.finetune runs them in the training loop (``ElasticController``).
Modules: profile (the tensor timing profiler and the time model), validate (the time model against measured
backward times), importance, select (the DP), trainer.
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "importance": ["tensor_importance"],
    "options": ["ElasticOptions"],
    "profile": ["TensorTiming", "execution_order", "measure_backward", "predict_backward", "predict_step",
                "profile_tensors"],
    "select": ["rounded_costs", "select_tensors", "selection_cost"],
    "trainer": ["ElasticBudgetError", "ElasticController", "classifier_names", "elastic_metrics"],
    "validate": ["random_selections", "validate_time_model"],
})
