"""What a memory budget buys: every candidate method's measured step under the budget, and its speed.

    rows = plan_training(model, train, opts)          # from scratch: backprop, BitTrain, the memory tricks
    rows.append(plan_neuroflux(spec, train, nf_opts))  # NeuroFlux on the same model
    rows = plan_finetune(pretrained, train, opts)     # every fine-tuning method, FT-All with the tricks
    best = fastest(rows)                              # what method: auto trains with

core.py: a candidate measured and timed, a row, the choice; finetune.py and neuroflux.py: their candidates (each
stage imports only the part it runs); cache.py: the rows kept for the next run with the same model, data shape,
options and machine (method: auto reuses them; `edgeflux plan` measures afresh and stores).

For each candidate the batch is chosen as its run chooses it (``edgeflux.backprop.fit_model_batch``: the largest
whose measured step fits, or BudgetTooSmallError with the smallest feasible budget), then the step its run trains
with (``edgeflux.train.fit_step``, on a copy) is timed on the training data: a window of a few batches (at least 64
samples) after a warm-up one, in three rounds that take the candidates in turn (each round starting one further
along), so that the machine's own drift falls on all of them alike; samples per second at the median round, and
from it the seconds an epoch of the training set takes (training only). A candidate auto could choose that the
first two rounds both find far slower than the fastest (below 70%) is not timed a third time: it cannot become the
choice, and its row keeps those two rounds. What a candidate trades away is said beside
it: recomputation, BatchNorm on micro-batches, the parameters it leaves frozen (an accuracy risk no few-step plan
can measure).

``method: auto`` (train_bp, finetune) trains with the fastest feasible candidate among those that train every
parameter: the same model and loss, only how memory is spent differs. It trains from the batch the plan
measured (TrainRun.batch_hint: confirmed in three measured steps instead of a second search). Samples/s is not time to an accuracy:
each candidate's batch sets its learning rate (lr_scaling) and accumulation makes fewer, larger updates, which
a few timed steps cannot weigh; bench/budget.py measures what each reaches, and when (docs/tricks.md). Choosing
*what* to train (FT-Bias's biases, MobileTL's top blocks) trades accuracy, which the table shows and the user
decides.
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "core": ["BACKPROP_CANDIDATES", "FINETUNE_CANDIDATES", "FINETUNE_FULL", "NoFeasibleMethodError", "PlanRow",
             "STEPS", "auto_method", "fastest", "plan_rows", "plan_training", "size_one", "time_step"],
    "cache": ["PlanCache", "plan_key"],
    "finetune": ["plan_finetune"],
    "neuroflux": ["plan_neuroflux"],
})
