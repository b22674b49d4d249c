"""Backprop under a budget: the chosen batch's measured peak fits, the next one does not."""
import pytest
import torch

from edgeflux.backprop import fit_model_batch, train_under_budget
from edgeflux.config import MemoryOptions, TrainOptions
from edgeflux.data import tensors
from edgeflux.memory import BudgetTooSmallError, measure_training_peak
from edgeflux.models import build_model
from edgeflux.train import TrainRun, optimizer_factory

OPTS = TrainOptions(epochs=1, batch_size=32, lr=0.05, evals_per_epoch=1, device="cpu")
SHAPE = (1, 32, 32)
DATA = (torch.randn(256, *SHAPE, generator=torch.Generator().manual_seed(0)), torch.randint(0, 10, (256,)))


def model():
    torch.manual_seed(0)
    return build_model("vgg11", num_classes=10, in_channels=1, width=0.125)


def peak_at(m, batch, data=DATA):
    return measure_training_peak(m, optimizer_factory(OPTS), SHAPE, 10, batch, data=data).peak_bytes


def test_largest_batch_that_fits_is_chosen():
    m = model()
    budget = peak_at(m, 20) + 1  # a budget between batch 20 and 21 by measurement
    batch, fitted, memory = fit_model_batch(m, DATA, OPTS, MemoryOptions(budget=f"{budget}B", max_batch=256))
    assert batch == 20
    assert memory.peak_bytes == fitted.peak_bytes <= budget
    assert peak_at(m, batch + 1) > budget
    assert fitted.r2 > 0.99  # memory is linear in batch size (the NeuroFlux observation)


def test_batch_is_capped_by_max_batch():
    m = model()
    batch, fitted, _ = fit_model_batch(m, DATA, OPTS, MemoryOptions(budget="1GB", max_batch=16))
    assert batch == 16 and fitted.peak_bytes <= 10**9


def test_budget_below_batch_one_says_the_smallest_feasible_budget():
    m = model()
    need = peak_at(m, 1)
    with pytest.raises(BudgetTooSmallError) as err:
        fit_model_batch(m, DATA, OPTS, MemoryOptions(budget=f"{need - 1}B"))
    assert str(need) in str(err.value).replace(",", "") or f"{need:,}" in str(err.value)


def test_train_under_budget_reports_measured_figures(mnist_subset):
    m = model()
    budget = peak_at(m, 48) + 1
    run = train_under_budget(m, tensors(mnist_subset, "train", limit=960), tensors(mnist_subset, "val", limit=200),
                             tensors(mnist_subset, "test", limit=200), OPTS, memory=MemoryOptions(budget=f"{budget}B"))
    metrics = run.metrics()
    assert metrics["batch_size"] == 48 and metrics["peak_mem_bytes"] <= metrics["budget_bytes"] == budget
    assert metrics["steps"] == 20 and 0.1 < metrics["test_acc"] <= 1.0
    assert metrics["params"] == sum(p.numel() for p in m.parameters())


def test_evaluation_at_the_training_batch_stays_under_the_training_peak(mnist_subset):
    from edgeflux.memory import track_live_tensors
    from edgeflux.train import evaluate

    m = model()
    step_peak = peak_at(m, 32)
    # the state a model is in mid-training: gradients and momentum buffers alive
    opt = optimizer_factory(OPTS)(m.parameters())
    x, y = tensors(mnist_subset, "val", limit=96)   # Images: each evaluation batch is read from uint8
    torch.nn.functional.cross_entropy(m(x[:32]), y[:32]).backward()
    opt.step()
    state = list(m.parameters()) + [p.grad for p in m.parameters()] + [
        t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    with track_live_tensors(seed=state + [x.pixels, y]) as tracker:
        evaluate(m, x, y, batch_size=32)
    assert 0 < tracker.peak_bytes < step_peak


def test_bittrain_from_params_trains_bit_identically_and_fits_a_larger_batch(mnist_subset):
    from edgeflux.config import BitTrainParams
    from edgeflux.train import fit

    bittrain = BitTrainParams(enabled=True)
    train, val = tensors(mnist_subset, "train", limit=256), tensors(mnist_subset, "val", limit=64)

    def vgg_nobn():
        return build_model("vgg11", num_classes=10, in_channels=1, width=0.125, batch_norm=False, seed=0)

    plain, compressed = vgg_nobn(), vgg_nobn()
    fit(plain, train, val, OPTS, batch_size=32)
    fit(compressed, train, val, OPTS, 32, TrainRun(context=bittrain.context))
    for (name, a), b in zip(plain.state_dict().items(), compressed.state_dict().values()):
        assert torch.equal(a, b), name

    m = vgg_nobn()
    dense_peak = measure_training_peak(m, optimizer_factory(OPTS), SHAPE, 10, 32, data=train).peak_bytes
    budget = MemoryOptions(budget=f"{dense_peak}B", max_batch=256)
    dense_batch, _, _ = fit_model_batch(m, train, OPTS, budget)
    bit_batch, fitted, memory = fit_model_batch(m, train, OPTS, budget, TrainRun(context=bittrain.context))
    assert dense_batch == 32 < bit_batch and memory.peak_bytes <= dense_peak
    total = memory.activation_storage["total"]
    assert memory.saved_bytes == total["stored_bytes"] < total["dense_bytes"] and total["compressed"] > 0


def test_with_bittrain_the_batch_peak_is_the_largest_of_several_batches(mnist_subset):
    """A bitmap's size follows its batch's non-zeros, so batches of one size peak differently (here the
    second batch is blank images, which after BatchNorm compress worst). The chosen batch's peak is the
    largest of CONTENT_SAMPLES disjoint batches, each measured, not the first batch's alone."""
    from edgeflux.config import BitTrainParams
    from edgeflux.memory import CONTENT_SAMPLES

    x, y = tensors(mnist_subset, "train", limit=64)
    x = x[:]   # a float32 tensor of the images, to edit
    x[16:32] = x.min()                     # the second batch of 16: blank images
    m = build_model("vgg11", num_classes=10, in_channels=1, width=0.125, seed=0)
    context = BitTrainParams(enabled=True).context
    _, _, memory = fit_model_batch(m, (x, y), OPTS, MemoryOptions(budget="1GB", max_batch=16),
                                   TrainRun(context=context))
    each = [measure_training_peak(m, optimizer_factory(OPTS), SHAPE, 10, 16, context=context,
                                  data=(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16])).peak_bytes
            for i in range(CONTENT_SAMPLES)]
    assert each[0] < each[1] == max(each) == memory.peak_bytes
