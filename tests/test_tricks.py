"""The memory tricks (edgeflux.tricks): each one's gradients and updates equal plain autograd's, and the
measured step shows the memory it saves."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgeflux.backprop import train_under_budget
from edgeflux.config import MemoryOptions
from edgeflux.finetune import FinetuneOptions, finetune_label, method_options, parse_method, prepare
from edgeflux.memory import measure_training_step
from edgeflux.models import build_model
from edgeflux.step import TrainStep, Tricks
from edgeflux.train import TrainOptions, TrainRun, make_optimizer, optimizer_factory
from edgeflux.tricks import (Accumulation, LeanBatchNorm2d, LeanConv2d, TrickOptions, checkpointed,
                             lean_layers, plain_layers, segment_bounds, step_in_backward)


def saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def grads_of(module, x, out_fn):
    """Output and gradients in float64, where equal computations agree to rounding (1e-12), not to fp32's."""
    module, x = module.double(), x.double().requires_grad_(True)
    out = out_fn(module, x)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("conf", [dict(stride=1, padding=1), dict(stride=2, padding=1, dilation=1),
                                  dict(stride=1, padding=2, dilation=2), dict(stride=1, padding=1, groups=8),
                                  dict(stride=2, padding=0, bias=False)])
def test_lean_conv_saves_no_input_and_its_gradients_equal_autograds(conf):
    torch.manual_seed(0)
    plain = nn.Conv2d(8, 16 if conf.get("groups") is None else 8, 3, **conf)
    plain.weight.requires_grad_(False)
    lean = copy.deepcopy(plain)
    lean_layers(lean)
    assert type(lean) is LeanConv2d
    x = torch.randn(4, 8, 15, 15)
    ref = grads_of(plain, x, lambda m, x: m(x))
    got = grads_of(lean, x, lambda m, x: m(x))
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[0], ref[0], **close)
    torch.testing.assert_close(got[1], ref[1], **close)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], **close)
    inp = x.double().requires_grad_(True)
    assert (4, 8, 15, 15) in saved_shapes(lambda: plain(inp))[1]        # what torch keeps
    assert (4, 8, 15, 15) not in saved_shapes(lambda: lean(inp))[1]     # and the lean layer does not
    lean.weight.requires_grad_(True)                                     # unfrozen at run time: torch's own
    assert (4, 8, 15, 15) in saved_shapes(lambda: lean(inp))[1]


def test_lean_eval_batchnorm_saves_no_input_and_matches():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(6)
    plain.running_mean.uniform_(-1, 1), plain.running_var.uniform_(0.5, 2), plain.weight.data.uniform_(0.5, 2)
    plain.eval().weight.requires_grad_(False)
    lean = copy.deepcopy(plain)
    lean_layers(lean)
    assert type(lean) is LeanBatchNorm2d
    x = torch.randn(3, 6, 7, 7)
    ref, got = grads_of(plain, x, lambda m, x: m(x)), grads_of(lean, x, lambda m, x: m(x))
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2]["bias"], ref[2]["bias"], rtol=1e-10, atol=1e-12)
    inp = x.double().requires_grad_(True)
    assert all(s != (3, 6, 7, 7) for s in saved_shapes(lambda: lean(inp))[1])
    lean.train()                       # training mode: torch's own (batch statistics need the input)
    assert (3, 6, 7, 7) in saved_shapes(lambda: lean(inp))[1]
    assert type(plain_layers(lean)) is nn.BatchNorm2d


@pytest.mark.parametrize("make", [lambda: nn.ReLU(), lambda: nn.ReLU(inplace=True), lambda: nn.ReLU6(),
                                  lambda: nn.ReLU6(inplace=True)])
def test_lean_activations_save_one_bit_and_their_gradients_are_exact(make):
    """Values on the kinks (0, 6) included: the mask passes gradient exactly where torch's backward does."""
    x = torch.cat([torch.randn(2, 4, 9, 9) * 5, torch.zeros(1, 4, 9, 9), torch.full((1, 4, 9, 9), 6.0)])
    plain, lean = make(), make()
    lean_layers(lean)
    assert type(lean).__name__.startswith("Lean")

    def run(module):   # behind a multiplication: an in-place activation needs a non-leaf input
        inp = x.double().requires_grad_(True)
        out, shapes = saved_shapes(lambda: module(inp * 1.0))
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out))
        return out.detach(), inp.grad, shapes
    (a, ga, _), (b, gb, shapes) = run(plain), run(lean)
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert shapes == [((x.numel() + 7) // 8,)]      # one bit per element, packed


def _step_on(model, opts, x, y, tricks=None, steps=1):
    step = TrainStep.factory(optimizer_factory(opts), tricks=tricks)(model)
    for _ in range(steps):
        step(x, y)
    return step


def _data(n=32, channels=1, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fused_step_updates_equal_the_plain_steps_and_hold_no_gradients(optimizer):
    opts = TrainOptions(optimizer=optimizer, lr=0.01, weight_decay=5e-4)
    # no BatchNorm: a conv bias before it has a zero gradient up to rounding, which Adam's normalisation blows
    # up to +-lr whichever way the rounding went (any two implementations disagree there)
    model = build_model("vgg11", width=0.25, batch_norm=False, seed=0)
    x, y = _data()
    plain, fused = copy.deepcopy(model), copy.deepcopy(model)
    _step_on(plain, opts, x, y, steps=3)
    step = _step_on(fused, opts, x, y, Tricks(TrickOptions(fused_step=True)), steps=3)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, msg=name)
    assert all(p.grad is None for p in fused.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in fused.parameters())   # hooks live only in a step
    assert len(step.optimizer.state) == len(list(model.parameters()))
    make = TrainStep.factory(optimizer_factory(opts))
    before = measure_training_step(model, make, (x, y), (x, y), process_stats=False)
    after = measure_training_step(model, TrainStep.factory(optimizer_factory(opts),
                                                           tricks=Tricks(TrickOptions(fused_step=True))),
                                  (x, y), (x, y), process_stats=False)
    largest = max(p.numel() * 4 for p in model.parameters())
    assert before.grad_bytes > 2 * largest            # the plain step holds many gradients at its peak
    assert after.grad_bytes <= largest and after.peak_bytes < before.peak_bytes   # at most one at a time


def test_checkpointing_gradients_equal_autograds_and_batchnorm_updates_once():
    model = build_model("resnet18", width=0.25, seed=0)
    x, y = _data(16)
    plain, ckpt = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    F.cross_entropy(plain(x), y).backward()
    forward = checkpointed(ckpt, segments=3)
    assert len(forward.bounds) == 3
    F.cross_entropy(forward(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(plain.named_buffers(), ckpt.buffers()):   # running stats, num_batches_tracked
        torch.testing.assert_close(b, a, msg=name)
    opts = TrainOptions(optimizer="sgd")
    full = measure_training_step(model, TrainStep.factory(optimizer_factory(opts)), (x, y), (x, y),
                                 process_stats=False)
    less = measure_training_step(model, TrainStep.factory(optimizer_factory(opts),
                                                          tricks=Tricks(TrickOptions(checkpoint=True))),
                                 (x, y), (x, y), process_stats=False)
    assert less.activation_bytes < 0.8 * full.activation_bytes


def test_segments_are_contiguous_balanced_and_as_many_as_asked():
    assert segment_bounds([10] * 16, None) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert segment_bounds([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert segment_bounds([1, 1, 1, 100], 2) == [(0, 3), (3, 4)]     # back-heavy: still two segments
    assert segment_bounds([5], None) == [(0, 1)]
    assert segment_bounds([1] * 5, 9) == [(i, i + 1) for i in range(5)]


def test_accumulated_micro_batches_equal_one_batch():
    """Without BatchNorm (which normalises each micro-batch by its own statistics), two micro-batches of 12
    and one of 8 accumulated are one step on the batch of 32."""
    opts = TrainOptions(optimizer="sgd", lr=0.05)
    model = build_model("vgg11", width=0.25, batch_norm=False, seed=0)
    x, y = _data(32)
    plain = copy.deepcopy(model)
    _step_on(plain, opts, x, y)
    acc = copy.deepcopy(model)
    step = TrainStep.factory(optimizer_factory(opts), tricks=Tricks(
        TrickOptions(accumulate=True, effective_batch=36), Accumulation.for_epoch(32, 12, 36)))(acc)
    losses = [step(x[i:i + 12], y[i:i + 12]) for i in range(0, 32, 12)]
    for (name, a), b in zip(plain.named_parameters(), acc.parameters()):
        torch.testing.assert_close(b, a, msg=name)
    torch.testing.assert_close(sum(loss * n for loss, n in zip(losses, (12, 12, 8))) / 32,
                               F.cross_entropy(model(x), y).item())


def test_accumulation_groups_never_straddle_an_epoch():
    a = Accumulation.for_epoch(samples=10, micro=3, effective=6)
    first_epoch = [a.next() for _ in range(4)]
    assert first_epoch == [(True, False, 0.5), (False, True, 0.5), (True, False, 0.75), (False, True, 0.25)]
    assert [a.next() for _ in range(4)] == first_epoch
    assert Accumulation.for_epoch(10, 8, 4).every == 1


def test_accumulation_under_a_budget_measures_the_closing_micro_batch(mnist_subset):
    from edgeflux.data import tensors

    train = tensors(mnist_subset, "target_train", limit=256)
    model = build_model("vgg11", width=0.25, seed=0)
    opts = TrainOptions(epochs=1, evals_per_epoch=1, lr=0.05)
    tricks = TrickOptions(accumulate=True, effective_batch=64)
    result = train_under_budget(model, train, train, train, opts, TrainRun(tricks=tricks),
                                memory=MemoryOptions(budget="9MB", max_batch=256))
    assert 1 < result.batch_size < 64        # the budget leaves micro-batches below the effective batch
    assert result.step_memory.grad_bytes == sum(p.numel() * 4 for p in model.parameters())  # held throughout
    # and SGD's momentum, made by the first group's step, is alive through every later micro-batch
    assert result.step_memory.optimizer_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert result.step_memory.peak_bytes <= 9_000_000
    assert result.train.steps == -(-256 // result.batch_size)


def test_finetune_names_turn_tricks_on_and_lean_layers_help_ft_bias():
    assert parse_method("ft_all-checkpoint-bittrain") == ("ft_all", None, True, ("checkpoint",))
    assert finetune_label("ft_bias-fused_step") == "FT-Bias (TinyTL-B) + step in backward"
    _, opts = method_options("ft_all-accumulate-checkpoint", FinetuneOptions())
    assert opts.tricks.on() == ("accumulate", "checkpoint")
    with pytest.raises(ValueError, match="exclude each other"):
        method_options("ft_all-accumulate-fused_step", FinetuneOptions())
    model = build_model("mobilenet_v2", width=0.5, seed=0)
    x, y = _data(32)
    nets = {}
    for lean in (False, True):
        nets[lean] = prepare("ft_bias", copy.deepcopy(model), FinetuneOptions(lean_layers=lean), []).model
    grads = {}
    for lean, net in nets.items():   # in float64: equal to autograd's but for rounding, whatever the depth
        wide = copy.deepcopy(net).double().train()
        torch.manual_seed(0)    # the classifier's dropout
        F.cross_entropy(wide(x.double()), y).backward()
        grads[lean] = [p.grad for p in wide.parameters() if p.requires_grad]
    assert len(grads[True]) == 54 and all(g is not None for g in grads[True])
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    opts = TrainOptions(optimizer="adam", lr=1e-3)
    peaks = {lean: measure_training_step(net, TrainStep.factory(optimizer_factory(opts)), (x, y), (x, y),
                                         process_stats=False).peak_bytes for lean, net in nets.items()}
    assert peaks[True] < 0.75 * peaks[False]


def test_step_in_backward_leaves_no_hook_behind_an_error():
    model = nn.Linear(4, 2)
    optimizer = make_optimizer(model.parameters(), TrainOptions())
    with pytest.raises(RuntimeError), step_in_backward(optimizer):
        raise RuntimeError("boom")
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
