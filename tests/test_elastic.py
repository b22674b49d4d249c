"""ElasticTrainer: the selector against brute force, the tensor time model against measured backward times,
the importance against its definition, and the elastic run (no gradient below the deepest selected tensor,
the classifier always in, one-line errors for an impossible objective)."""
import copy
import itertools
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgeflux.bittrain import BitTrainOptions
from edgeflux.config import ParamsError, load_params
from edgeflux.elastic import (ElasticBudgetError, ElasticController, ElasticOptions, classifier_names,
                              execution_order,
                              profile_tensors, random_selections, rounded_costs, select_tensors,
                              selection_cost, tensor_importance, validate_time_model)
from edgeflux.finetune import FinetuneOptions, finetune, prepare
from edgeflux.models import build_model
from edgeflux.step import TrainStep
from edgeflux.train import TrainResult, optimizer_factory

REPO = Path(__file__).resolve().parents[1]


def _brute_force(w, y, gains, cap) -> float:
    best = 0.0
    for mask in itertools.product([False, True], repeat=len(w)):
        if selection_cost(w, y, mask) <= cap:
            best = max(best, sum(g for g, m in zip(gains, mask) if m))
    return best


def test_selector_is_the_exact_optimum_of_brute_force_and_never_over_budget():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 9)
        t_dw = [rng.choice([0.0, rng.random()]) for _ in range(n)]
        t_dy = [rng.random() * rng.choice([0, 1, 2]) for _ in range(n)]
        gains = [rng.uniform(-0.3, 1.0) for _ in range(n)]
        budget, resolution = rng.uniform(0.05, 3.0), rng.choice([1, 3, 10, 50, 1000])
        mask = select_tensors(t_dw, t_dy, gains, budget, resolution)
        w, y = rounded_costs(t_dw, t_dy, budget, resolution)
        assert selection_cost(w, y, mask) <= resolution               # rounded up: the budget holds exactly
        assert selection_cost(t_dw, t_dy, mask) <= budget + 1e-12
        got = sum(g for g, m in zip(gains, mask) if m)
        assert got == pytest.approx(_brute_force(w, y, gains, resolution), abs=1e-9)


def test_selector_cost_counts_the_error_gradient_down_to_the_deepest_tensor():
    # tensor 0 is the most important, but reaching it costs the t_dy of tensors 1 and 2 (multiples of 1/8 of a
    # budget of 1: the rounding to 1000 steps is exact)
    t_dw, t_dy = [0.125, 0.125, 0.125], [0.0, 0.25, 0.25]
    assert selection_cost(t_dw, t_dy, [True, False, True]) == 0.75
    assert select_tensors(t_dw, t_dy, [10, 1, 1], budget=1.0) == [True, True, True]                  # 0.875
    assert select_tensors([0.25] * 3, t_dy, [10, -1, 1], budget=1.0) == [True, False, True]          # 1.0 exactly
    assert select_tensors(t_dw, [0.0, 0.375, 0.5], [10, 1, 1], budget=1.0) == [True, False, False]  # 10 beats 2
    assert select_tensors(t_dw, [0.0, 0.5, 0.5], [10, 1, 1], budget=1.0) == [False, True, True]     # 0 out of reach
    assert select_tensors(t_dw, t_dy, [-1, -1, -1], budget=5) == [False, False, False]
    with pytest.raises(ValueError, match="budget must be a positive time"):
        select_tensors(t_dw, t_dy, [1, 1, 1], budget=0)
    with pytest.raises(ValueError, match="differ in length"):
        select_tensors(t_dw, t_dy, [1, 1], budget=1)


def _model():
    return build_model("resnet18", num_classes=10, in_channels=1, width=0.25, image_size=32, seed=0).train()


def _batch(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_the_time_model_is_profiled_per_tensor_and_validated_against_measured_selections():
    """The mechanics, not this machine's speed: how well predictions match measured times is the benchmark's
    figure (bench/results/elastic.md), since any time measured here moves with what else the machine runs."""
    model, (x, y) = _model(), _batch()
    before = copy.deepcopy(model.state_dict())
    timing = profile_tensors(model, x, y, repeats=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())      # profiling only looks
    assert all(p.requires_grad for p in model.parameters())
    n = len(timing.names)
    assert n == len(list(model.parameters())) and timing.names[0] == "units.0.0.weight"
    assert len(timing.t_dw) == len(timing.t_dy) == n and min(timing.t_dw) >= 0 and timing.t_backward > 0
    # a BatchNorm's backward goes to its shift (the paper's Section 5.2): its scale passes nothing
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    for k, name in enumerate(timing.names):
        module, kind = name.rsplit(".", 1)
        if module in norms:
            assert (timing.t_dy[k] > 0) == (kind == "bias"), name
    assert all(timing.t_dy[k] > 0 for k, name in enumerate(timing.names) if "conv" in name)
    # each selection: the prediction is the model's cost of that mask (head + chosen t_dw + t_dy above the deepest
    # chosen tensor), the measurement a positive time, the error their relative difference
    masks = random_selections(n, 4, seed=1, always=[n - 2, n - 1])
    rows = validate_time_model(model, timing, masks, x, y, repeats=1, warmup=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for mask, row in zip(masks, rows, strict=True):
        deepest = mask.index(True)
        cost = timing.t_head + sum(timing.t_dw[k] for k in range(n) if mask[k]) + sum(timing.t_dy[deepest + 1:])
        assert row["predicted_s"] == pytest.approx(cost, rel=1e-12) and row["measured_s"] > 0
        assert row["error"] == pytest.approx((row["predicted_s"] - row["measured_s"]) / row["measured_s"])
        assert (row["selected"], row["deepest"]) == (sum(mask), deepest)


def test_unselected_tensors_get_no_gradient_and_nothing_runs_below_the_deepest():
    model, (x, y) = _model(), _batch()
    step = TrainStep.factory(optimizer_factory(FinetuneOptions(optimizer="adam", lr=1e-3)))(model)
    controller = ElasticController(ElasticOptions(rho=0.4), classifier_names(model))
    controller.attach(step, (x, y), 32)
    names = controller.names
    deepest = names.index("units.7.conv1.weight")
    mask = [k >= deepest and k % 2 == 0 for k in range(len(names))]
    mask[-2:] = [True, True]
    controller._apply(mask)
    seen = {}
    hooks = [model.units[i].register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out.requires_grad))
             for i in range(len(model.units))]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(x, y)
    for h in hooks:
        h.remove()
    by_name = dict(model.named_parameters())
    for name, keep in zip(names, mask):
        assert (by_name[name].grad is not None) == keep, name
        assert torch.equal(by_name[name].detach(), weights[name]) != keep, name    # only the selected move
    # units below the deepest selected tensor's unit build no graph: autograd never reaches them
    assert [i for i, g in seen.items() if not g] == list(range(7))


def test_importance_is_the_first_order_loss_reduction_of_one_update():
    model, (x, y) = _model(), _batch(16)
    opts = FinetuneOptions(optimizer="sgd", lr=0.01, momentum=0.0, weight_decay=0.0)
    step = TrainStep.factory(optimizer_factory(opts))(model)
    names = execution_order(model, lambda: model(x))
    before = copy.deepcopy(model.state_dict())
    got = tensor_importance(step, names, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())      # weights and statistics back
    # by hand: SGD's update is -lr * g; I = -sum(g * update) = lr * |g|^2
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    g = torch.autograd.grad(F.cross_entropy(ref(x), y), [params[n] for n in names])
    want = [float(0.01 * (a * a).sum()) for a in g]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-12)
    assert sum(got) > 0                                      # one SGD step lowers the loss to first order
    # per weight: each over its tensor's element count
    per_weight = tensor_importance(step, names, x, y, per_weight=True)
    assert per_weight == pytest.approx([w / params[n].numel() for w, n in zip(want, names)], rel=1e-4, abs=1e-12)


def test_importance_under_adam_is_lr_times_the_l1_norm_for_a_fresh_tensor():
    """Adam's first step moves every weight by lr (bias-corrected m / sqrt(v) = sign(g)): the importance is
    lr * |g|_1, a sum over weights; per weight it is lr * mean |g|."""
    model, (x, y) = _model(), _batch(16)
    opts = FinetuneOptions(optimizer="adam", lr=1e-3, weight_decay=0.0)
    step = TrainStep.factory(optimizer_factory(opts))(model)
    names = execution_order(model, lambda: model(x))
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    g = torch.autograd.grad(F.cross_entropy(ref(x), y), [params[n] for n in names])
    raw = tensor_importance(step, names, x, y)
    assert raw == pytest.approx([1e-3 * float(a.abs().sum()) for a in g], rel=1e-3, abs=1e-9)
    per_weight = tensor_importance(step, names, x, y, per_weight=True)
    assert per_weight == pytest.approx([1e-3 * float(a.abs().mean()) for a in g], rel=1e-3, abs=1e-12)

@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_profiles_warm_up_step_is_the_importance_of_its_batch_and_the_first_selection_uses_it(optimizer):
    """Profiling on the epoch's probe makes the probe's own evaluation redundant: the warm-up step's gains equal
    tensor_importance on that batch (the model and the optimizer's state as they were), and the controller's
    first selection carries them, per weight when asked."""
    model, (x, y) = _model(), _batch(64)
    opts = FinetuneOptions(optimizer=optimizer, lr=0.01, momentum=0.9, weight_decay=5e-4)
    step = TrainStep.factory(optimizer_factory(opts))(model)
    names = execution_order(model, lambda: model(x))
    timing = profile_tensors(model, x[:32], y[:32], optimizer=step.optimizer, repeats=1)
    assert timing.names == names
    assert timing.gains == pytest.approx(tensor_importance(step, names, x[:32], y[:32]), rel=1e-4, abs=1e-12)
    assert profile_tensors(model, x[:32], y[:32], optimizer=step.optimizer, repeats=1, warmup=0).gains is None
    for how in ("update", "per_weight"):
        model.requires_grad_(True)                      # every tensor a candidate again
        controller = ElasticController(ElasticOptions(importance=how, repeats=1), classifier_names(model))
        controller.attach(step, (x, y), 32)
        result = TrainResult()
        controller(result)
        first = result.extra["elastic"]["selections"][0]["importance"]
        probe = controller._probe(0, torch.device("cpu"))
        want = tensor_importance(step, names, *probe, per_weight=how == "per_weight")
        assert first == pytest.approx(want, rel=1e-4, abs=1e-15)
        assert result.extra["elastic"]["overhead_s"]["importance"] < result.extra["elastic"]["overhead_s"]["profile"]



def test_a_rho_too_small_trains_the_classifier_alone_or_is_one_line_naming_the_smallest_workable_value(tmp_path):
    model, (x, y) = _model(), _batch()
    step = TrainStep.factory(optimizer_factory(FinetuneOptions(optimizer="adam")))(model)
    controller = ElasticController(ElasticOptions(rho=0.05), classifier_names(model), key="finetune.elastic.rho")
    controller.attach(step, (x, y), 32)
    controller.timing = profile_tensors(model, x, y, optimizer=step.optimizer)
    importance = [1.0] * (len(controller.names) - 2) + [-1.0, -1.0]     # the classifier trains all the same
    # by default the classifier alone, with a warning: a default rho must not fail a stage on a loaded machine
    assert controller.select(importance) == [False] * (len(controller.names) - 2) + [True, True]
    controller.opts = ElasticOptions(rho=0.05, when_infeasible="error")
    with pytest.raises(ElasticBudgetError, match=r"^finetune.elastic.rho = 0.05 asks for training steps of .* "
                                                 r"the smallest workable finetune.elastic.rho is (0\.\d+)$") as err:
        controller.select(importance)
    assert "\n" not in str(err.value)
    smallest = float(str(err.value).rsplit(" ", 1)[1])
    controller.opts = ElasticOptions(rho=smallest)
    mask = controller.select(importance)
    assert mask[-2:] == [True, True]
    for bad in ("0", "1.5"):          # outside (0, 1]: refused when the params are read
        raw = (REPO / "params.yaml").read_text()
        assert "    rho: 0.5 " in raw
        (tmp_path / "params.yaml").write_text(raw.replace("    rho: 0.5 ", f"    rho: {bad} "))
        with pytest.raises(ParamsError, match=r"finetune.elastic.rho"):
            load_params(tmp_path / "params.yaml")


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_elastic_finetune_composes_with_mobiletl_and_bittrain(mnist_subset):
    from edgeflux.data import tensors
    data = [tensors(mnist_subset, s, limit=512) for s in ("target_train", "target_val", "target_test")]
    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, width=0.25, image_size=32, seed=0)
    opts = FinetuneOptions(blocks=2, epochs=2, budget="24MB", max_batch=64, evals_per_epoch=1, optimizer="adam",
                           lr=1e-3, bittrain=BitTrainOptions(enabled=True),
                           elastic=ElasticOptions(rho=0.7, base="mobiletl", repeats=1, interval=1))
    reference = prepare("mobiletl", copy.deepcopy(model), opts, [data[0][0][:32]]).model
    top = {n for n, p in reference.named_parameters() if p.requires_grad}
    run = finetune(model, "elastic", opts, *data)
    m = run.metrics()
    assert m["peak_mem_bytes"] <= opts.budget
    assert m["saved_stored_bytes"] < m["saved_dense_bytes"]                  # BitTrain on what is still saved
    assert m["elastic_selections"] == 2 and 0 < m["elastic_selected_frac"] <= 1
    assert m["elastic_overhead_s"] == pytest.approx(m["elastic_profile_s"] + m["elastic_importance_s"]
                                                    + m["elastic_select_s"])
    state = run.run.train.extra["elastic"]
    # only the mobiletl top's tensors are candidates (the int8 bottom has none), the classifier always in
    assert set(state["names"]) == top
    assert all(s["mask"][-2:] == [True, True] for s in state["selections"])
    assert len(run.selections) == 2 and len(run.tensors) >= len(state["names"])
    assert all(len(mask) == len(run.tensors) for mask in run.selections)


def test_frozen_base_tensors_are_not_candidates():
    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, width=0.25, image_size=32, seed=0)
    prepared = prepare("elastic", model, FinetuneOptions(blocks=1, elastic=ElasticOptions(base="ft_blocks")),
                       [torch.randn(8, 1, 32, 32)])
    x, y = _batch(8)
    step = TrainStep.factory(optimizer_factory(FinetuneOptions()))(prepared.model)
    controller = prepared.make_before_step(step, (x, y), 8)
    trainable = [n for n, p in prepared.model.named_parameters() if p.requires_grad]
    assert sorted(controller.names) == sorted(trainable) and len(trainable) < len(list(model.parameters()))


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_a_resumed_run_keeps_the_selection_and_a_reprofile_keeps_every_candidate(mnist_subset, tmp_path, monkeypatch):
    """interval 2 over 3 epochs: epoch 0 selects, epoch 1 keeps it, epoch 2 re-profiles (profile_interval 2) with
    epoch 0's mask still applied and re-selects. The run is stopped after epoch 0 and resumed from its checkpoint."""
    import edgeflux.train as train
    from edgeflux.data import tensors
    data = [tensors(mnist_subset, s, limit=256) for s in ("target_train", "target_val", "target_test")]
    opts = FinetuneOptions(epochs=3, batch_size=32, evals_per_epoch=1, optimizer="adam", lr=1e-3,
                           elastic=ElasticOptions(rho=0.6, interval=2, profile_interval=2, repeats=1))
    real = train._run_epoch

    def stop_at_epoch_1(loop, batches, epoch, *rest):
        if epoch == 1:
            raise KeyboardInterrupt
        return real(loop, batches, epoch, *rest)
    monkeypatch.setattr(train, "_run_epoch", stop_at_epoch_1)
    checkpoint = tmp_path / "elastic.pt"
    with pytest.raises(KeyboardInterrupt):
        finetune(_model(), "elastic", opts, *data, checkpoint=checkpoint)
    first = torch.load(checkpoint, weights_only=False)["result"]["extra"]["elastic"]
    monkeypatch.setattr(train, "_run_epoch", real)
    model = _model()
    run = finetune(model, "elastic", opts, *data, checkpoint=checkpoint)
    state = run.run.train.extra["elastic"]
    assert run.run.train.resumed_from_epoch == 1
    assert [s["epoch"] for s in state["selections"]] == [0, 2]
    assert state["selections"][0]["mask"] == first["selections"][0]["mask"]
    assert state["overhead_s"]["profile"] > first["overhead_s"]["profile"]        # epoch 2 profiled again
    assert state["timing"]["names"] == state["names"]                           # every candidate, not the mask
    assert all(p.requires_grad for p in model.parameters())      # the method's trainable set back after training
