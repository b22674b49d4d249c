"""The fine-tuning methods and their harness (edgeflux.finetune): what each method trains, and one run of it."""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from edgeflux.backprop import BudgetedRun, train_under_budget
from edgeflux.checkpoint import run_signature
from edgeflux.data import Images
from edgeflux.elastic import ElasticController, classifier_names, elastic_metrics
from edgeflux.elastic.plot import per_epoch
from edgeflux.mobiletl import quantize_bottom, replace_module, shift_only, top_start, transform_block
from edgeflux.models import UnitModel, count_params
from edgeflux.models.units import freeze, train_mode
from edgeflux.train import TrainRun
from edgeflux.tricks.lean import lean_layers

from .options import METHOD_NAMES, FinetuneOptions, parse_method

log = logging.getLogger(__name__)

__all__ = ["METHODS", "FinetuneRun", "Prepared", "calibration_batches", "count_flops", "finetune", "method_options",
           "prepare"]


@dataclass
class Prepared:
    """What a method hands the harness: the module that trains (sharing its trainable modules with the
    float model it was given), what it did, and, for a method that changes what trains while training, the
    training loop's hook (``edgeflux.train.TrainRun.make_before_step``)."""
    model: nn.Module
    info: dict = field(default_factory=dict)
    make_before_step: Callable | None = None


def _trainable(modules) -> None:
    for m in modules:
        m.requires_grad_(True)


def ft_all(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    return Prepared(model)


def ft_last(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    for unit in model.units[:-1]:
        freeze(unit)
    return Prepared(model, {"trains": [model.unit_names[-1]]})


def ft_bn(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    model.requires_grad_(False)
    _trainable(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    _trainable([model.units[-1]])
    return Prepared(model)


def ft_bn_bias(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    prepared = ft_bn(model, opts, calibration, device)
    _trainable(m.bias for m in model.modules() if isinstance(getattr(m, "bias", None), nn.Parameter))
    return prepared


def ft_bias(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    model.requires_grad_(False)
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    for name in norms:
        replace_module(model, name, shift_only)
    _trainable(m.bias for m in model.modules() if isinstance(getattr(m, "bias", None), nn.Parameter))
    _trainable([model.units[-1]])
    return Prepared(model, {"shift_only_norms": len(norms)})


def ft_blocks(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    start = top_start(model, opts.blocks)
    for unit in model.units[:start]:
        freeze(unit)
    return Prepared(model, {"trains": model.unit_names[start:]})


def mobiletl(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    start = top_start(model, opts.blocks, irb_only=True)
    changed = {name: transform_block(unit) for name, unit, kind in
               zip(model.unit_names[start:], model.units[start:], model.unit_kinds[start:]) if kind == "inverted_residual"}
    info = {"trains": model.unit_names[start:], "transformed": changed}
    for unit in model.units[:start]:
        freeze(unit)          # (with quantize_bottom the float copies are not run, but they do not train either)
    if not opts.quantize_bottom:
        return Prepared(model, info)
    bottom = quantize_bottom(list(zip(model.unit_names[:start], model.units[:start])), calibration, device)
    info.update(bottom_int8=bottom.int8, bottom_float_units=bottom.float_units)
    top = list(zip(model.unit_names[start:], model.unit_kinds[start:], model.units[start:]))
    net = UnitModel(model.name, [("bottom", "conv", bottom), *top], num_classes=model.num_classes,
                    in_channels=model.in_channels, image_size=model.image_size, width=model.width)
    return Prepared(net, info)


def elastic(model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor], device: torch.device) -> Prepared:
    prepared = METHODS[opts.elastic.base](model, opts, calibration, device)
    net = prepared.model
    controller = ElasticController(opts.elastic, classifier_names(net), key="finetune.elastic.rho")
    return Prepared(net, {**prepared.info, "base": opts.elastic.base}, controller.attach)


METHODS: dict[str, Callable[[UnitModel, FinetuneOptions, list[Tensor], torch.device], Prepared]] = {
    "ft_all": ft_all, "ft_last": ft_last, "ft_bn": ft_bn, "ft_bn_bias": ft_bn_bias, "ft_bias": ft_bias,
    "ft_blocks": ft_blocks, "mobiletl": mobiletl, "elastic": elastic,
}
assert tuple(METHODS) == METHOD_NAMES, "edgeflux/finetune/options.py names the methods (and labels them)"


def method_options(spec: str, opts: FinetuneOptions) -> tuple[str, FinetuneOptions]:
    """The method a name runs and the options it runs with (a composition's modifiers applied)."""
    method, base, bittrain, tricks = parse_method(spec)
    update = {}
    if bittrain:
        update["bittrain"] = opts.bittrain.model_copy(update={"enabled": True})
    if base:
        update["elastic"] = opts.elastic.model_copy(update={"base": base})
    if tricks:
        update["tricks"] = opts.tricks.with_on(tricks)
    return method, opts.model_copy(update=update)


def prepare(method: str, model: UnitModel, opts: FinetuneOptions, calibration: list[Tensor],
            device: torch.device | str = "cpu") -> Prepared:
    """Apply ``method`` to ``model`` in place (freezing, transforms, and with opts.lean_layers the lean layers:
    elastic, which re-selects what trains, gets the lean activations only); returns the module to train."""
    if method not in METHODS:
        raise ValueError(f"finetune method {method!r} is unknown; allowed: {', '.join(METHOD_NAMES)}")
    prepared = METHODS[method](model.to(device), opts, calibration, torch.device(device))
    if opts.lean_layers:
        prepared.info["lean_layers"] = lean_layers(prepared.model, frozen=method != "elastic")
    return prepared


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                         _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    # torch's own formula leaves groups out of the weight gradient, counting a depthwise conv's C times over;
    # the input gradient and the weight gradient each take the multiply-adds of the forward conv
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def count_flops(float_model: nn.Module, trained: nn.Module, x: Tensor, y: Tensor) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step, counted (torch.utils.flop_counter: convolutions and
    matrix products, 2 per multiply-add), not timed. The forward is counted on the float model: an int8
    bottom does the same multiply-adds, in int8, which the counter does not see. Copies; the models stay."""
    with FlopCounterMode(display=False) as forward, torch.no_grad():
        copy.deepcopy(float_model).eval()(x)
    net = train_mode(copy.deepcopy(trained))
    loss = F.cross_entropy(net(x), y)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flops}) \
            as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


FLOPS_BATCH = 8   # FLOPs are counted on a batch of this size and reported per sample


@dataclass
class FinetuneRun:
    method: str
    run: BudgetedRun
    train_params: int
    total_params: int
    flops_forward: int      # per sample, counted
    flops_backward: int     # per sample, counted
    info: dict
    tensors: list[str] = field(default_factory=list)              # the model's parameter tensors
    selections: list[list[bool]] = field(default_factory=list)    # per epoch: which of them trained

    def metrics(self) -> dict:
        """The shared metric names (edgeflux.backprop.BudgetedRun.metrics), plus the fine-tuning accounting
        (and, for elastic, the selections' summary)."""
        steps = max(1, self.run.train.steps)
        out = {**self.run.metrics(), "method": self.method, "params": self.total_params,
               "train_params": self.train_params, "trainable_params": self.train_params,
               "flops_forward_per_sample": self.flops_forward,
               "flops_backward_per_sample": self.flops_backward,
               "flops_per_sample": self.flops_forward + self.flops_backward,
               "step_time_s": self.run.train.train_time_s / steps}
        if state := self.run.train.extra.get("elastic"):
            out.update(elastic_metrics(state, self.run.train.train_time_s))
        return out


def calibration_batches(x: Tensor | Images, n: int, size: int = 32) -> list[Tensor]:
    return [x[i:i + size] for i in range(0, min(len(x), n * size), size)]


def finetune(model: UnitModel, method: str, opts: FinetuneOptions, train: tuple, val: tuple, test: tuple,
             device: torch.device | str = "cpu", checkpoint: Path | None = None, start: str = "",
             track_test: bool = False, batch_hint: int | None = None) -> FinetuneRun:
    """Fine-tune ``model`` (in place: its trainable modules end with the fine-tuned weights) with ``method``
    under ``opts.budget``. start: the identity of the starting weights (e.g. the pretrained file's digest),
    for the checkpoint's signature. track_test: the history records test accuracy at each evaluation
    (benchmarks' time-to-accuracy; never used to choose anything). batch_hint: the batch a plan measured for
    this method under this budget (TrainRun.batch_hint)."""
    device = torch.device(device)
    spec, (method, opts) = method, method_options(method, opts)
    prepared = prepare(method, model, opts, calibration_batches(train[0], opts.calibration_batches), device)
    net = prepared.model
    trainable = [name for name, p in net.named_parameters() if p.requires_grad]
    run = train_under_budget(net, train, val, test, opts, TrainRun(
        device, checkpoint=checkpoint, signature=run_signature(method=spec, start=start, info=prepared.info),
        desc=f"finetune {spec}", context=opts.bittrain.context, make_before_step=prepared.make_before_step,
        track_test=track_test, tricks=opts.tricks, batch_hint=batch_hint), memory=opts)
    for name, p in net.named_parameters():       # a method that re-selected while training leaves its last set
        p.requires_grad_(name in trainable)
    n = min(FLOPS_BATCH, len(train[1]))
    fwd, bwd = count_flops(model, net, train[0][:n].to(device), train[1][:n].to(device))
    return FinetuneRun(spec, run, count_params(net, trainable_only=True), count_params(model), fwd // n, bwd // n,
                       prepared.info, *_selections(net, trainable, run.train, opts.epochs))


def _selections(net: nn.Module, trainable: list[str], result, epochs: int) -> tuple[list[str], list[list[bool]]]:
    """Every parameter tensor of ``net`` (execution order where known) and, per epoch, which trained: the
    method's trainable set, or elastic's selection in that epoch."""
    names = [n for n, _ in net.named_parameters()]
    state = result.extra.get("elastic")
    if not state:
        return names, [[n in trainable for n in names]] * epochs
    order = state["names"]
    names = order + [n for n in names if n not in order]
    return names, [list(mask) + [False] * (len(names) - len(mask)) for mask in per_epoch(state["selections"], epochs)]
