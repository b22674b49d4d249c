"""Measuring the memory of one training step: one API for CPU and CUDA.

    mem = measure_step(training_step_fn(model, opt, x, y), model=model, optimizer=opt, inputs=(x, y))
    mem.peak_bytes, mem.activation_bytes, mem.saved_by_unit, mem.rss_peak_bytes
    choice = choose_batch(measure, data, budget_bytes=..., max_batch=256)   # the batch a trainer uses

What is measured, and how (one module per job):

* ``step``: the peak of one step, from the allocator that serves it, so that scratch a kernel
  allocates inside one op counts too. CUDA: the caching allocator's own counter,
  ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``. CPU: the CPU
  allocator's events over the plain step (``allocator``). Tensors that exist before the step
  (parameters, buffers, optimizer state, the batch) count from the start.
  ``measure_training_step`` measures the step a trainer runs (built by the same factory) on a copy.
* ``blocks``: the CUDA caching allocator set to split its blocks to the request (expandable segments)
  before a step is measured and before the training loop runs, so that the figure does not depend on
  what the process allocated before (``split_blocks_exactly``).
* ``tracker``: the exact peak of live tensor bytes in any code (a ``TorchDispatchMode``), e.g. what a
  bitmap holds; not the training step's figure (it misses scratch, and a dispatch mode changes the step).
* ``saved``: bytes saved for backward, counted in ``torch.autograd.graph.saved_tensors_hooks``,
  deduplicated by storage (a ReLU output that the next conv also saves counts once), parameters and
  buffers excluded (their memory exists anyway), attributed to the unit whose forward is running.
* ``process``: process peak RSS (a 1 ms sampling thread) and USS after the step (psutil): a
  cross-check of the process as a whole (interpreter, libraries, allocator caches), never the figure.
* ``budget``: the batch size under a budget (``choose_batch``, ``max_batch_under_budget``) and the
  error that names the smallest feasible budget (``BudgetTooSmallError``).
* ``bound``: what a step whose stored activations depend on their content (BitTrain) may store, so
  that every batch, not only the measured ones, stays under the budget (``StoredBound``).
* ``sizes``: bytes for people (``format_bytes``) and budgets rounded up (``budget_at_least``).
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "edgeflux.step": ["StepContext", "TrainStep", "no_context", "training_step_fn"],
    "budget": ["CONTENT_SAMPLES", "BatchChoice", "BatchFit", "BudgetTooSmallError", "choose_batch", "fit_linear",
               "largest_over_batches", "max_batch_under_budget"],
    "blocks": ["split_blocks_exactly"],
    "bound": ["StoredBound", "StoredOverBudget", "stored_bounds"],
    "options": ["MemoryOptions"],
    "process": ["retain_freed_heap"],
    "saved": ["OUTSIDE_UNITS", "SavedTensorCounter", "SavedTensorModifiedError", "UnitsArg", "UnitTracker",
              "check_saved_version", "count_saved_tensors", "resolve_units", "saved_bytes_by_node"],
    "sizes": ["MiB", "budget_at_least", "format_bytes"],
    "step": ["StepMemory", "live_tensor_peak", "measure_step", "measure_training_peak", "measure_training_step"],
    "tracker": ["LiveTensorTracker", "track_live_tensors"],
})
