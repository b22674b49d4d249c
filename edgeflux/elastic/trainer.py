"""Elastic training (the paper's Figure 5): profile the tensors' times, evaluate their importance every
``interval`` epochs, select the tensors that fit the backward budget, train only those.

    opts = ElasticOptions(rho=0.5, interval=3)
    controller = ElasticController(opts, classifier=["units.13.1.weight", "units.13.1.bias"])
    fit(model, train, val, topts, batch, TrainRun(make_before_step=controller.attach))    # via edgeflux.finetune

The speedup objective ``rho`` asks a training step to take rho * T_full: the backward budget is
rho * T_full - T_forward (Eq. 3; T_full and T_forward measured), spent on weight gradients and optimizer
updates of the selected tensors and on passing the error gradient down to the deepest of them. The
classifier always trains. At every re-selection the unselected tensors stop requiring gradients, so autograd
builds no graph below the deepest selected tensor and computes no gradient for the others; the optimizer
holds every tensor and skips those without a gradient.

Each selection (epoch, mask, predicted backward time, importances) and the time spent profiling, evaluating
importance and selecting are kept in the training result's ``extra["elastic"]``, so they are checkpointed
with the run and a resumed run trains the tensors the interrupted one had selected.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from edgeflux.elastic.importance import scaled, tensor_importance
from edgeflux.elastic.profile import TensorTiming, execution_order, predict_backward, predict_step, profile_tensors
from edgeflux.elastic.select import selection_cost, select_tensors
from edgeflux.errors import UserError
from edgeflux.elastic.options import ElasticOptions
from edgeflux.step import Step
from edgeflux.train import TrainResult

log = logging.getLogger(__name__)

__all__ = ["ElasticBudgetError", "ElasticController", "ElasticOptions", "classifier_names", "elastic_metrics"]


def classifier_names(model: torch.nn.Module) -> list[str]:
    """Names of the trainable tensors of a UnitModel's last unit (the classifier, which always trains)."""
    head = {id(p) for p in model.units[-1].parameters() if p.requires_grad}
    return [name for name, p in model.named_parameters() if id(p) in head]


class ElasticBudgetError(ValueError, UserError):
    """The speedup objective leaves no time for the backward pass the classifier needs."""


class ElasticController:
    """The ``before_step`` hook of an elastic run (module docstring)."""

    def __init__(self, opts: ElasticOptions, classifier: Sequence[str], key: str = "elastic.rho"):
        self.opts, self.classifier, self.key = opts, list(classifier), key
        self.timing: TensorTiming | None = None
        self.epoch_seen: int | None = None

    def attach(self, step: Step, train: tuple, batch_size: int) -> Callable[[TrainResult], None]:
        """The hook for the training loop, given the step that trains and its data and batch."""
        self.step, self.train, self.batch_size = step, train, batch_size
        x = train[0][:batch_size]
        self.names = execution_order(step.model, lambda: step.model(x.to(self._device())))
        missing = [c for c in self.classifier if c not in self.names]
        if missing:
            raise ValueError(f"the classifier tensors {missing} do not train in this model")
        return self

    def _device(self) -> torch.device:
        return next(p.device for p in self.step.model.parameters())

    def __call__(self, result: TrainResult) -> None:
        if result.epochs_done == self.epoch_seen:
            return
        self.epoch_seen = epoch = result.epochs_done
        state = result.extra.setdefault("elastic", {
            "names": self.names, "selections": [], "overhead_s": {"profile": 0.0, "importance": 0.0, "select": 0.0}})
        if epoch % self.opts.interval == 0 or not state["selections"]:
            self._reselect(epoch, state)
        self._apply(state["selections"][-1]["mask"])

    def _reselect(self, epoch: int, state: dict) -> None:
        device, overhead = self._device(), state["overhead_s"]
        if self.timing is None and "timing" in state:        # resumed: the time model the run selected with
            self.timing = TensorTiming(**state["timing"])
        self._apply([True] * len(self.names))                # profile and probe every candidate
        # profiling and the probe draw no random numbers from the run (dropout, ...): a resumed run trains the same
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            tick = time.perf_counter()
            probe, importance = self._probe(epoch, device), None
            if self.timing is None or (self.opts.profile_interval and epoch % self.opts.profile_interval == 0):
                importance = self._profile(probe, device, state)
                overhead["profile"] += time.perf_counter() - tick
                tick = time.perf_counter()
            if importance is None:
                importance = tensor_importance(self.step, self.names, *probe, per_weight=self.opts.importance == "per_weight")
            overhead["importance"] += time.perf_counter() - tick
        tick = time.perf_counter()
        mask = self.select(importance)
        overhead["select"] += time.perf_counter() - tick
        step = predict_step(self.timing, mask)
        state["selections"].append({"epoch": epoch, "mask": mask, "importance": importance,
                                    "predicted_backward_s": predict_backward(self.timing, mask),
                                    "predicted_step_s": step,
                                    "objective_met": step <= self.opts.rho * self.timing.t_full * 1.01})
        log.info("elastic: epoch %d trains %d of %d tensors (deepest %d); predicted step %.1f ms of a full %.1f ms",
                 epoch, sum(mask), len(mask), mask.index(True), step * 1e3, self.timing.t_full * 1e3)

    def _profile(self, probe: tuple, device: torch.device, state: dict) -> list[float] | None:
        """Profiles the time model at the training batch; returns the tensors' importances on the probe when the
        probe is a training batch (the profile's warm-up step is then the probe's evaluation), else None."""
        reuse = len(probe[1]) == self.batch_size
        x, y = probe if reuse else (t[:self.batch_size].to(device) for t in self.train)
        self.timing = profile_tensors(self.step.model, x, y, optimizer=self.step.optimizer, context=self.step.context,
                                      repeats=self.opts.repeats, loss_fn=getattr(self.step, "loss_fn", F.cross_entropy),
                                      names=self.names)
        state["timing"] = self.timing.to_dict()
        if not reuse or self.timing.gains is None:
            return None
        gains = dict(zip(self.timing.names, self.timing.gains))
        by_name = dict(self.step.model.named_parameters())
        return scaled([gains[n] for n in self.names], [by_name[n] for n in self.names], self.opts.importance == "per_weight")

    def _probe(self, epoch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.train
        g = torch.Generator().manual_seed(1_000_003 * epoch + 17)
        pick = torch.randperm(len(y), generator=g)[:self.opts.probe_samples].sort().values
        return x[pick].to(device), y[pick].to(device)

    def budget(self) -> float:
        """The backward budget, rho * T_full - T_forward, less what is paid whenever anything trains."""
        t = self.timing
        return self.opts.rho * t.t_full - t.t_forward - t.t_head

    def select(self, importance: Sequence[float]) -> list[bool]:
        """The selection for ``importance`` under the budget; the classifier always in (it gets an importance
        above the sum of all others, so the optimum includes it whenever it fits)."""
        t, n = self.timing, len(self.names)
        forced = [self.names.index(c) for c in self.classifier]
        cost = t.update_cost()
        budget = self.budget()
        top = sum(max(0.0, i) for i in importance) + 1.0
        gains = [top if k in forced else importance[k] for k in range(n)]
        mask = select_tensors(cost, t.t_dy, gains, budget, self.opts.resolution) if budget > 0 else [False] * n
        if all(mask[k] for k in forced):
            return mask
        classifier = [k in forced for k in range(n)]
        need = t.t_forward + t.t_head + selection_cost(cost, t.t_dy, classifier)
        smallest = math.ceil(1000 * need * 1.01 / t.t_full) / 1000     # 1% for the selector's rounding
        fix = (f"the smallest workable {self.key} is {smallest:.3f}" if smallest <= 1 else
               f"no {self.key} fits: train another method, or a model whose classifier is cheaper")
        problem = (f"{self.key} = {self.opts.rho:g} asks for training steps of {self.opts.rho * t.t_full * 1e3:.1f} "
                   f"ms, but the forward pass takes {t.t_forward * 1e3:.1f} ms and training only the classifier "
                   f"{need * 1e3:.1f} ms (a full step: {t.t_full * 1e3:.1f} ms, measured)")
        if self.opts.when_infeasible == "error":
            raise ElasticBudgetError(f"{problem}; {fix}")
        log.warning("elastic: %s: training the classifier alone, the objective not met (%s; a loaded machine "
                    "measures a slow forward pass; %s.when_infeasible: error stops instead)", problem, fix,
                    self.key.rsplit(".", 1)[0])
        return classifier

    def _apply(self, mask: Sequence[bool]) -> None:
        by_name = dict(self.step.model.named_parameters())
        for name, keep in zip(self.names, mask):
            by_name[name].requires_grad_(bool(keep))


def elastic_metrics(state: dict, train_time_s: float) -> dict:
    """Flat metrics of an elastic run's ``extra["elastic"]``: the overhead of profiling, importance and
    selection (seconds and as a fraction of the training time, which includes it), how many tensors the
    selections trained, and the time model's predicted step against the measured full step."""
    overhead = state["overhead_s"]
    total = sum(overhead.values())
    masks = [s["mask"] for s in state["selections"]]
    timing = state.get("timing") or {}
    out = {"elastic_selections": len(masks), "elastic_overhead_s": total,
           "elastic_overhead_frac": total / train_time_s if train_time_s > 0 else 0.0,
           **{f"elastic_{k}_s": v for k, v in overhead.items()},
           "elastic_tensors": len(masks[-1]) if masks else 0,
           "elastic_selected_frac": sum(sum(m) / len(m) for m in masks) / len(masks) if masks else 0.0,
           # selections whose predicted step meets rho (one that could not trains the classifier alone)
           "elastic_objective_met_frac": (sum(s.get("objective_met", True) for s in state["selections"]) / len(masks)
                                          if masks else 0.0)}
    if timing and masks:
        predicted = sum(s["predicted_step_s"] for s in state["selections"]) / len(masks)
        out.update(elastic_t_full_s=timing["t_full"], elastic_t_forward_s=timing["t_forward"],
                   elastic_predicted_speedup=timing["t_full"] / predicted)
    return out
