"""The shared backprop loop: it learns, and an interrupted run resumes to the same weights."""
import pytest
import torch

from edgeflux.config import TrainOptions
from edgeflux.data import tensors
from edgeflux.models import build_model
from edgeflux.train import TrainRun, evaluate, fit

OPTS = TrainOptions(epochs=2, batch_size=64, lr=0.05, evals_per_epoch=2, seed=3, device="cpu")


def small_model(data):
    return build_model("vgg11", num_classes=len(data.classes), in_channels=1, width=0.125)


def test_fit_learns_real_digits(mnist_subset):
    train, val = tensors(mnist_subset, "train", limit=1500), tensors(mnist_subset, "val")
    model = small_model(mnist_subset)
    before = evaluate(model, *val)
    result = fit(model, train, val, OPTS, batch_size=64)
    assert result.steps == 2 * 24 and result.epochs_done == 2
    assert [round(r["epoch"], 2) for r in result.history] == [0.5, 1.0, 1.5, 2.0]
    times = [r["time_s"] for r in result.history]
    assert times == sorted(times) and times[-1] <= result.train_time_s < times[-1] + 1.0
    assert result.history[-1]["val_acc"] > max(0.6, before + 0.3)


class Interrupt(Exception):
    pass


def test_interrupted_run_resumes_to_identical_weights(mnist_subset, tmp_path):
    train, val = tensors(mnist_subset, "train", limit=600), tensors(mnist_subset, "val", limit=200)
    reference = small_model(mnist_subset)
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    fit(reference, train, val, OPTS, batch_size=64)

    ckpt = tmp_path / "ckpt.pt"
    interrupted = small_model(mnist_subset)
    interrupted.load_state_dict(initial)

    def stop_after_first_epoch(epoch, result):
        if epoch == 0:
            raise Interrupt

    with pytest.raises(Interrupt):
        fit(interrupted, train, val, OPTS, 64, TrainRun(checkpoint=ckpt, on_epoch_end=stop_after_first_epoch))
    assert ckpt.exists()
    resumed = small_model(mnist_subset)  # a fresh process would start from fresh weights
    result = fit(resumed, train, val, OPTS, 64, TrainRun(checkpoint=ckpt))
    assert result.resumed_from_epoch == 1 and result.epochs_done == 2
    assert not ckpt.exists()
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_of_other_config_is_not_resumed(mnist_subset, tmp_path):
    train, val = tensors(mnist_subset, "train", limit=200), tensors(mnist_subset, "val", limit=100)
    ckpt = tmp_path / "ckpt.pt"
    one_epoch = OPTS.model_copy(update={"epochs": 1})
    with pytest.raises(Interrupt):
        fit(small_model(mnist_subset), train, val, OPTS, 64,
            TrainRun(checkpoint=ckpt, on_epoch_end=lambda e, r: (_ for _ in ()).throw(Interrupt())))
    result = fit(small_model(mnist_subset), train, val, one_epoch.model_copy(update={"lr": 0.01}), 64,
                 TrainRun(checkpoint=ckpt))
    assert result.resumed_from_epoch == 0
    ckpt.write_bytes(b"truncated")
    assert fit(small_model(mnist_subset), train, val, one_epoch, 64, TrainRun(checkpoint=ckpt)).resumed_from_epoch == 0


@pytest.mark.parametrize("change", ["labels", "order", "bittrain"])
def test_checkpoint_of_other_data_or_activation_storage_is_not_resumed(mnist_subset, tmp_path, change):
    """Same options and batch, but the split was prepared anew (a label, the sample order) or activations
    are stored otherwise: the old checkpoint is not resumed; the same run is."""
    from edgeflux.config import BitTrainParams

    train, val = tensors(mnist_subset, "train", limit=128), tensors(mnist_subset, "val", limit=64)
    ckpt = tmp_path / "ckpt.pt"
    plain = BitTrainParams(enabled=False).context

    def resumed_from(data, context) -> int:   # one epoch, then stop (the checkpoint of epoch 1 stays)
        seen = []

        def stop(epoch, result):
            seen.append(result.resumed_from_epoch)
            raise Interrupt

        with pytest.raises(Interrupt):
            fit(small_model(mnist_subset), data, val, OPTS, 64,
                TrainRun(checkpoint=ckpt, context=context, on_epoch_end=stop))
        return seen[0]

    assert resumed_from(train, plain) == 0
    kept = ckpt.read_bytes()
    x, y = train
    context = plain
    if change == "labels":
        y = y.clone()
        y[0] = (y[0] + 1) % 10
    elif change == "order":
        x, y = x[:].flip(0), y.flip(0)
    else:
        context = BitTrainParams(enabled=True).context
    assert resumed_from((x, y), context) == 0
    ckpt.write_bytes(kept)
    assert resumed_from(train, plain) == 1


def _spy_calls(monkeypatch, step_class) -> list:
    """Record the model of every call of step_class (the one step every trainer and measurement runs)."""
    calls, original = [], step_class.__call__

    def spy(self, x, y):
        calls.append(self.model)
        return original(self, x, y)
    monkeypatch.setattr(step_class, "__call__", spy)
    return calls


def test_the_budget_measures_the_step_that_trains(monkeypatch, mnist_subset):
    """Backprop's batch search measures TrainStep on copies of the model and fit trains the model with
    TrainStep: every training step and every measured step is that one step. A trainer that ran a step of
    its own (a copy beside the measured one, free to drift from it) would leave the model's count at zero."""
    from edgeflux.backprop import train_under_budget
    from edgeflux.config import MemoryOptions
    from edgeflux.step import TrainStep

    calls = _spy_calls(monkeypatch, TrainStep)
    model = small_model(mnist_subset)
    train, val = tensors(mnist_subset, "train", limit=256), tensors(mnist_subset, "val", limit=64)
    run = train_under_budget(model, train, val, val, OPTS.model_copy(update={"epochs": 1}),
                             memory=MemoryOptions(budget="1GB", max_batch=64))
    on_model = sum(m is model for m in calls)
    assert run.train.steps == 4 and on_model == run.train.steps
    # a warm-up and a measured step per batch size the search measured, each on a copy
    assert len(calls) - on_model == 2 * len(run.batch_fit.measurements) >= 4


def test_neuroflux_blocks_measure_the_step_that_trains(monkeypatch, mnist_subset, tmp_path):
    """The same for NeuroFlux: the block's measured step and its training steps are BlockStep calls."""
    from edgeflux.config import NeuroFluxParams
    from edgeflux.neuroflux.block import BlockStep
    from edgeflux.neuroflux.model import build_learners
    from edgeflux.neuroflux.partition import Block
    from edgeflux.neuroflux.worker import CacheOptions, train_blocks

    calls = _spy_calls(monkeypatch, BlockStep)
    spec = dict(name="vgg11", num_classes=10, in_channels=1, width=0.125, image_size=32, batch_norm=True, seed=0)
    _, learners = build_learners(spec, dict(mode="adaptive", classic_filters=256, pool=2, seed=0))
    data = {"train": tensors(mnist_subset, "target_train", limit=128),
            "val": tensors(mnist_subset, "target_val", limit=32), "test": tensors(mnist_subset, "target_test", limit=32)}
    run = train_blocks(learners[:2], [Block(index=0, units=(0, 1), batch_size=32)], data,
                       NeuroFluxParams(epochs=1, evals_per_epoch=1), workdir=tmp_path, budget_bytes=10**9,
                       cache=CacheOptions(shard_samples=64))
    on_learners = sum(m.learners[0] is learners[0] for m in calls)
    assert run.blocks[0].steps == 4 and on_learners == 4
    assert len(calls) - on_learners == 2      # the planned batch fits: one warm-up and one measured step


def _loop_on(model, train, epochs=1, batch=64, before_step=None):
    """train_loop over a TrainStep on `model`, its batches seeded by epoch, one evaluation per epoch."""
    import math

    from edgeflux.data import batches
    from edgeflux.step import TrainStep
    from edgeflux.train import Schedule, optimizer_factory, train_loop

    step = TrainStep.factory(optimizer_factory(OPTS))(model)
    return train_loop(step, lambda epoch: batches(*train, batch, shuffle=True, seed=epoch),
                      Schedule(epochs, math.ceil(len(train[1]) / batch), evals_per_epoch=1, seed=0),
                      lambda: {"val_acc": evaluate(model, *train)}, before_step=before_step)


def test_a_frozen_batchnorm_stays_frozen_through_training_and_evaluation(mnist_subset):
    """A method that freezes BatchNorm (statistics and affine) keeps it so: the loop trains in train_mode,
    not model.train(), and evaluation restores every submodule's own mode."""
    from edgeflux.models.units import freeze

    model = small_model(mnist_subset)
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    freeze(bn)
    stats = [t.clone() for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
    modes = []
    result = _loop_on(model, tensors(mnist_subset, "train", limit=256),
                      before_step=lambda _: modes.append((bn.training, model.training)))
    assert result.steps == 4 and modes == [(False, True)] * 4
    assert all(torch.equal(a, b) for a, b in zip(stats, (bn.running_mean, bn.running_var, bn.weight, bn.bias)))
    assert not bn.training and model.training


def test_before_step_can_change_what_trains_at_run_time(mnist_subset):
    """The per-step hook a run-time selection method uses: after the first step only the classifier
    trains; the optimizer holds every parameter and skips those without a gradient."""
    model = small_model(mnist_subset)
    head = model.units[-1]
    body = [p for u in model.units[:-1] for p in u.parameters()]

    def select(result):
        if result.steps == 1:
            for p in body:
                p.requires_grad_(False)

    snapshot = {}
    result = _loop_on(model, tensors(mnist_subset, "train", limit=256),
                      before_step=lambda r: (select(r), snapshot.setdefault(r.steps, [p.clone() for p in body])))
    after = [p.detach() for p in body]
    assert result.steps == 4
    assert not all(torch.equal(a, b) for a, b in zip(snapshot[0], snapshot[1]))    # step 1 trained the body
    assert all(torch.equal(a, b) for a, b in zip(snapshot[1], after))              # later steps did not
    assert all(p.requires_grad for p in head.parameters())


def test_until_ends_the_run_at_the_evaluation_that_meets_it(mnist_subset):
    """A benchmark's target: training stops after the first evaluation whose row satisfies ``until``, mid-epoch,
    with the same curve up to there as the run that goes on."""
    train, val = tensors(mnist_subset, "train", limit=512), tensors(mnist_subset, "val", limit=256)
    torch.manual_seed(0)
    whole = fit(small_model(mnist_subset), train, val, OPTS, batch_size=64)
    torch.manual_seed(0)
    stopped = fit(small_model(mnist_subset), train, val, OPTS, batch_size=64,
                  run=TrainRun(until=lambda row: row["epoch"] >= 1.5))
    assert stopped.stopped and not whole.stopped
    assert stopped.steps == 12 and stopped.epochs_done == 1 and len(stopped.history) == 3
    assert [r["val_acc"] for r in stopped.history] == [r["val_acc"] for r in whole.history[:3]]
