"""The library on a CUDA device: memory measurement, BitTrain, budgets, NeuroFlux, MobileTL and ElasticTrainer.

Every test runs on "cpu" and on "cuda". The CPU variants run everywhere (they show that each assertion is
real); the CUDA variants carry the ``cuda`` mark and are skipped without a GPU. On a GPU machine
``python -m pytest -m cuda tests/test_cuda.py`` runs only those. Synthetic tensors only: a GPU machine
has neither the datasets nor the orchestration packages (MLflow, Prefect, DVC).
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgeflux.backprop import fit_model_batch, train_under_budget
from edgeflux.bittrain import BitTrainOptions, compress
from edgeflux.elastic import predict_backward, profile_tensors
from edgeflux.memory import (OUTSIDE_UNITS, BudgetTooSmallError, count_saved_tensors, measure_step,
                             measure_training_peak, training_step_fn)
from edgeflux.mobiletl import ShiftOnlyBatchNorm, SignBackward, quantize_bottom, quantized_engine
from edgeflux.models import build_model
from edgeflux.neuroflux.model import build_learners
from edgeflux.neuroflux.partition import min_budget_bytes, partition
from edgeflux.neuroflux.profile import profile_units
from edgeflux.neuroflux.worker import train_blocks
from edgeflux.train import MemoryOptions, TrainOptions, TrainRun, optimizer_factory, resolve_device
from test_bittrain import _cases as bittrain_cases
from test_memory import sgd_momentum, small_cnn

F32 = 4
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def deterministic_cudnn():
    """cuDNN may pick a different (or atomics-based) algorithm from one call to the next; two steps are
    compared bit for bit only with its deterministic algorithms and no autotuning."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def random_split(n: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def numel_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def mlp_saved_bytes(batch: int) -> int:
    """What the MLP's step saves for backward, on any device: x, the ReLU output, log_softmax's output,
    the int64 labels and nll_loss's float32 total weight (the Linears' weights are parameters)."""
    return batch * (64 + 256 + 10) * F32 + batch * 8 + F32


# ----------------------------------------------------------------------------- measuring a step

def test_measure_step_categories_match_formulas(device):
    model = mlp().to(device)
    opt = sgd_momentum(model.parameters())
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
    step = training_step_fn(model, opt, x, y)
    step()                                                  # warm-up: the momentum buffers exist
    mem = measure_step(step, model=model, optimizer=opt, inputs=(x, y), device=device)
    param_bytes = sum(p.numel() for p in model.parameters()) * F32
    assert mem.method == {"cpu": "cpu_allocator", "cuda": "cuda_allocator"}[device.type]
    assert mem.device == str(device)
    assert (mem.param_bytes, mem.grad_bytes, mem.optimizer_bytes, mem.buffer_bytes) == (param_bytes,) * 3 + (0,)
    assert mem.peak_bytes >= 3 * param_bytes + numel_bytes((x, y))
    assert mem.activation_bytes == mem.peak_bytes - 3 * param_bytes
    assert mem.saved_bytes == mlp_saved_bytes(32)
    assert mem.saved_by_unit == {OUTSIDE_UNITS: mem.saved_bytes}


def test_measure_training_peak_on_the_device_saves_what_cpu_saves(device):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    on_cpu = measure_training_peak(model, sgd_momentum, (64,), 10, batch=4, process_stats=False)
    mem = measure_training_peak(model, sgd_momentum, (64,), 10, batch=4, device=device, process_stats=False)
    param_bytes = sum(p.numel() for p in model.parameters()) * F32
    assert mem.device == str(device)
    assert (mem.param_bytes, mem.optimizer_bytes) == (param_bytes, param_bytes)
    assert mem.peak_bytes >= mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes + 4 * 64 * F32 + 4 * 8   # + the batch
    assert mem.saved_bytes == on_cpu.saved_bytes == mlp_saved_bytes(4)
    assert mem.saved_by_unit == on_cpu.saved_by_unit
    # measured on a copy: the model stays where it was, as it was
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ----------------------------------------------------------------------------- BitTrain

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns in logical order (so -0.0 != 0.0 and NaN == NaN)."""
    return t.reshape(-1).contiguous().view(INT_OF[t.element_size()])


# the cases whose round trip the CPU tests check, less those only the CPU kernel path has to handle
ROUND_TRIP = ("relu_4d", "scalar_neg_zero", "empty", "all_zero", "all_nonzero", "odd_length", "specials",
              "channels_last", "transposed", "strided_slice", "several_chunks")


def round_trip_cases() -> dict[str, torch.Tensor]:
    return {name: t for name, t in bittrain_cases().items() if name in ROUND_TRIP}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_bitmap_round_trip_is_bit_exact(device, dtype):
    for name, t in round_trip_cases().items():
        t = t.to(device, dtype)
        packed = compress(t)
        out = packed.decompress()
        assert packed.device.type == out.device.type == device.type, name
        assert out.dtype == dtype and out.shape == t.shape, name
        assert torch.equal(bits(out), bits(t)), name
        nnz = int((bits(t) != 0).sum())
        assert packed.nnz == nnz and packed.nbytes == math.ceil(t.numel() / 8) + nnz * t.element_size(), name


def _grads_of_one_step(model: nn.Module, x, y, context=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with context if context is not None else nullcontext():
        F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_bittrain_gradients_are_bit_identical_and_stored_smaller(device, deterministic_cudnn):
    dense_model = small_cnn().to(device)
    twin = small_cnn().to(device)
    x, y = (t.to(device) for t in random_split(8, (1, 16, 16), seed=1))
    dense = _grads_of_one_step(dense_model, x, y)
    again = _grads_of_one_step(dense_model, x, y)
    assert all(torch.equal(a, b) for a, b in zip(dense, again))       # the dense step itself is reproducible
    ctx = BitTrainOptions(enabled=True).context(twin)
    compressed = _grads_of_one_step(twin, x, y, ctx)
    for (name, _), a, b in zip(twin.named_parameters(), dense, compressed):
        assert torch.equal(a, b), name
    total = ctx.summary()["total"]
    assert total["compressed"] > 0 and 0 < total["stored_bytes"] < total["dense_bytes"]
    assert total["narrowed"] == 1 and total["index_stored_bytes"] * 4 == total["index_dense_bytes"]   # max-pool


# ----------------------------------------------------------------------------- a budget

def _peak_at(model, data, batch: int, opts: TrainOptions, device) -> int:
    """The measured peak of the step backprop trains with, at `batch`, on the first `batch` samples."""
    sample = data[0][:batch], data[1][:batch]
    return fit_model_batch(model, sample, opts.model_copy(update={"batch_size": batch}), MemoryOptions(),
                           TrainRun(device))[2].peak_bytes


def test_backprop_trains_at_a_batch_whose_measured_peak_fits_the_budget(device):
    model = small_cnn()
    train, val, test = (random_split(n, (1, 16, 16), seed) for n, seed in ((64, 0), (16, 1), (16, 2)))
    opts = TrainOptions(epochs=1, batch_size=1, lr=0.05, evals_per_epoch=1, seed=0)
    p1, p16 = _peak_at(model, train, 1, opts, device), _peak_at(model, train, 16, opts, device)
    budget = (p1 + p16) // 2
    run = train_under_budget(model, train, val, test, opts, TrainRun(device),
                             MemoryOptions(budget=f"{budget}B", max_batch=64))
    assert run.step_memory.device == str(device)
    assert run.step_memory.peak_bytes == run.batch_fit.peak_bytes <= budget
    measured = dict(run.batch_fit.measurements)
    assert measured[run.batch_size] <= budget < measured[run.batch_size + 1]   # the next batch was measured over it
    assert run.train.steps == math.ceil(64 / run.batch_size)
    assert all(p.device.type == device.type for p in model.parameters())
    with pytest.raises(BudgetTooSmallError, match="smallest feasible budget") as err:
        fit_model_batch(model, train, opts, MemoryOptions(budget=f"{p1 // 2}B"), TrainRun(device))
    assert err.value.min_feasible_bytes > p1 // 2


# ----------------------------------------------------------------------------- NeuroFlux

NF_SPEC = dict(name="vgg11", num_classes=10, in_channels=1, width=0.125, image_size=32, batch_norm=True, seed=0)
NF_AUX = dict(mode="adaptive", classic_filters=256, pool=2, seed=0)


def test_neuroflux_blocks_train_within_the_budget(device, tmp_path):
    data = {split: random_split(n, (1, 32, 32), seed) for split, n, seed in (("train", 128, 0), ("val", 32, 1),
                                                                              ("test", 32, 2))}
    opts = TrainOptions(epochs=1, lr=0.05, evals_per_epoch=1, seed=0)
    model, learners = build_learners(NF_SPEC, NF_AUX)
    # lines through small batches, extrapolated to the blocks' batches: the worker must measure, not trust them
    profiles = profile_units(learners, model.describe(), 10, optimizer_factory(opts), batches=(2, 4), device=device,
                             min_r2=0.0)
    models, floors = [p.model for p in profiles], [p.min_bytes for p in profiles]
    budget = int(1.5 * min_budget_bytes(models, floors))
    blocks = partition(models, budget, batch_limit=64, floors=floors)
    run = train_blocks(learners, blocks, data, opts, workdir=tmp_path / "cache", budget_bytes=budget, device=device)
    assert run.complete
    assert [u for b in run.blocks for u in b.units] == list(range(len(learners)))
    for b in run.blocks:
        assert b.peak_bytes <= budget and b.budget_bytes == budget, b
        assert 1 <= b.batch_size <= b.planned_batch, b
    # a finished block leaves the device (only the block in training occupies it), without gradients
    assert all(p.device.type == "cpu" and p.grad is None for learner in learners for p in learner.parameters())


# ----------------------------------------------------------------------------- MobileTL

def test_sign_backward_passes_the_gradient_where_the_input_is_not_negative(device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 8, 5, 5, generator=g) * 4).to(device)
    x[0, 0, 0] = torch.tensor([0.0, -0.0, 6.0, -3.0, 3.0])            # the edges of ReLU6 and Hard-Swish
    upstream = torch.randn(x.shape, generator=g).to(device)
    for kind, fn in (("relu6", F.relu6), ("hardswish", F.hardswish), ("relu", F.relu)):
        xg = x.clone().requires_grad_()
        layer = SignBackward(kind)
        with count_saved_tensors() as saved:
            out = layer(xg)
        (out * upstream).sum().backward()
        assert torch.equal(out, fn(x)), kind
        assert torch.equal(xg.grad, torch.where(x >= 0, upstream, torch.zeros_like(upstream))), kind
        assert saved.total_bytes == math.ceil(x.numel() / 8), kind                 # a 1-bit mask


def test_shift_only_batchnorm_gradients_and_frozen_statistics(device):
    g = torch.Generator().manual_seed(0)
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        for t, values in ((bn.running_mean, torch.randn(8, generator=g) * 0.3), (bn.running_var, torch.rand(8, generator=g) + 0.5),
                          (bn.weight, torch.rand(8, generator=g) + 0.5), (bn.bias, torch.randn(8, generator=g) * 0.2)):
            t.copy_(values)
    layer = ShiftOnlyBatchNorm.from_batchnorm(bn.to(device)).train()
    frozen = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(4, 8, 5, 5, generator=g).to(device).requires_grad_()
    upstream = torch.randn(x.shape, generator=g).to(device)
    with count_saved_tensors(params=[*layer.parameters(), *layer.buffers()]) as saved:
        out = layer(x)
    (out * upstream).sum().backward()
    assert saved.total_bytes == 0
    assert torch.equal(out, F.batch_norm(x.detach(), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps))
    scale = bn.weight.detach() * torch.rsqrt(bn.running_var + bn.eps)      # dy/dx = gamma / sigma, a constant
    assert torch.equal(x.grad, upstream * scale.view(1, -1, 1, 1))
    assert torch.equal(layer.bias.grad, upstream.sum(dim=[0, 2, 3]))
    assert layer.weight.grad is None
    assert all(torch.equal(v, frozen[k]) for k, v in layer.state_dict().items())


def test_frozen_bottom_is_int8_on_cpu_and_float_on_cuda(device):
    """Quantized kernels run on CPU only: on CUDA the bottom stays in float on the device, with a warning."""
    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, width=0.25, image_size=32, seed=0).eval().to(device)
    units = list(zip(model.unit_names[:3], model.units[:3]))
    x = torch.randn(16, 1, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    if device.type == "cuda":
        with pytest.warns(UserWarning, match="quantized kernels run on CPU only"):
            bottom = quantize_bottom(units, [x], device)
        assert not bottom.int8 and bottom.float_units == [name for name, _ in units]
    else:
        if quantized_engine() is None:
            pytest.skip("this torch build has no quantized engine")
        bottom = quantize_bottom(units, [x[:8], x[8:]], device)
        assert bottom.int8 and bottom.float_units == []
    with torch.no_grad():
        ref = model.forward_until(x, 3)
    got = bottom(x)
    assert got.device.type == device.type and not got.requires_grad and bottom.held_tensors()
    if bottom.int8:
        assert ((got - ref).norm() / ref.norm()).item() < 0.1     # 8-bit activations through three units
    else:
        assert torch.equal(got, ref)


# ----------------------------------------------------------------------------- ElasticTrainer

def test_elastic_profile_times_every_trainable_tensor(device):
    model = small_cnn(width=16).to(device).train()
    x, y = (t.to(device) for t in random_split(64, (1, 32, 32), seed=0))
    opt = sgd_momentum(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    timing = profile_tensors(model, x, y, optimizer=opt, repeats=1, warmup=1)
    names = [name for name, _ in model.named_parameters()]
    assert timing.names == names and timing.batch_size == 64
    for times in (timing.t_dw, timing.t_dy, timing.t_opt):
        assert len(times) == len(names) and all(math.isfinite(t) and t >= 0 for t in times)
    assert all(t > 0 for t in timing.update_cost())                  # the update of every tensor costs time
    norm_scales = [names.index(f"{n}.weight") for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert [timing.t_dy[k] for k in norm_scales] == [0.0, 0.0]       # a BatchNorm's backward goes to its shift
    everything, classifier = [True] * len(names), [False] * (len(names) - 2) + [True, True]
    assert predict_backward(timing, everything) > predict_backward(timing, classifier) > 0
    assert predict_backward(timing, everything) >= timing.t_backward * (1 - 1e-9)   # scaled up to the measured one
    # profiling only looks: weights, statistics, trainable flags and gradients as they were
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- the device itself

def test_resolve_device_gives_the_device_asked_for(device):
    assert resolve_device(device.type) == device
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert torch.ones(2, device=resolve_device(device.type)).sum().item() == 2.0
