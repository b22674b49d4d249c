"""NeuroFlux (neuroflux.txt): adaptive local learning under a memory budget.

    learners = local_learners(model, mode="adaptive", seed=0)            # aux.py: AAN-LL
    profiles = profile_units(learners, model.describe(), 10, opt_factory)  # profile.py: the Profiler
    blocks = partition([p.model for p in profiles], budget, batch_limit)  # partition.py: Algorithm 1
    run = train_blocks(learners, blocks, splits, opts, workdir=...)      # worker.py: Algorithm 2 + caches
    k = select_exit(run.unit_val_acc, [exit_params(learners, i) for i in range(len(learners))])  # exit.py
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "options": ["AUX_MODES", "STORAGES", "CacheOptions"],
    "aux": ["AuxNet", "LocalLearner", "aux_filters", "exit_params", "local_learners"],
    "partition": ["UNBOUNDED", "Block", "UnitDoesNotFitError", "group", "load_blocks", "max_batch_for",
                  "min_budget_bytes", "partition", "save_blocks", "unit_batch_sizes"],
    "profile": ["PoorFitError", "UnitProfile", "fit_unit", "load_profile", "profile_units", "profiling_seconds",
                "save_profile"],
    "cache": ["ActivationCache", "Batches", "CacheCorruptError", "CacheNotFoundError", "CacheStaleError",
              "CacheWriter", "TensorSource", "cache_hash", "is_complete"],
    "exit": ["ExitModel", "select_exit", "throughput"],
})
