"""NeuroFlux (neuroflux.txt): adaptive local learning under a memory budget.

    learners = local_learners(model, mode="adaptive", seed=0)            # aux.py: AAN-LL
    profiles = profile_units(learners, model.describe(), 10, opt_factory)  # profile.py: the Profiler
    blocks = partition([p.model for p in profiles], budget, batch_limit)  # partition.py: Algorithm 1
    run = train_blocks(learners, blocks, splits, opts, workdir=...)      # worker.py: Algorithm 2 + caches
    k = select_exit(run.unit_val_acc, [exit_params(learners, i) for i in range(len(learners))])  # exit.py
"""
from .aux import AUX_MODES, AuxNet, LocalLearner, aux_filters, exit_params, local_learners
from .partition import (UNBOUNDED, Block, UnitDoesNotFitError, group, load_blocks, max_batch_for, min_budget_bytes,
                        partition, save_blocks, unit_batch_sizes)
from .profile import PoorFitError, UnitProfile, fit_unit, load_profile, profile_units, profiling_seconds, save_profile

from .cache import (ActivationCache, Batches, CacheCorruptError, CacheNotFoundError, CacheStaleError, CacheWriter,
                    TensorSource, cache_hash, is_complete)
from .exit import ExitModel, select_exit, throughput

__all__ = [
    "AUX_MODES", "AuxNet", "LocalLearner", "aux_filters", "exit_params", "local_learners",
    "UNBOUNDED", "Block", "UnitDoesNotFitError", "group", "load_blocks", "max_batch_for", "min_budget_bytes",
    "partition", "save_blocks", "unit_batch_sizes",
    "ActivationCache", "Batches", "CacheCorruptError", "CacheNotFoundError", "CacheStaleError", "CacheWriter",
    "TensorSource", "cache_hash", "is_complete", "ExitModel", "select_exit", "throughput",
    "PoorFitError", "UnitProfile", "fit_unit", "load_profile", "profile_units", "profiling_seconds", "save_profile",
]
