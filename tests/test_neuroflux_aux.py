"""edgeflux.neuroflux.aux and .profile: AAN-LL filter counts, local learners, measured per-unit memory lines."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeflux import memory
from edgeflux.memory import measure_training_peak
from edgeflux.models import build_model, count_params
from edgeflux.neuroflux.aux import AuxNet, aux_filters, exit_params, local_learners
from edgeflux.neuroflux.profile import (PoorFitError, fit_unit, load_profile, profile_units, profiling_seconds,
                                        save_profile)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ----------------------------------------------------------------------------- filter counts

def test_vgg16_adaptive_filters_follow_the_paper():
    infos = build_model("vgg16", 10, 1, width=1.0, image_size=32, seed=0).describe()
    filters = aux_filters(infos, "adaptive")
    assert filters == [32, 32] + [256] * 11 + [None]   # 64 // 2 up to the first max-pool, 512 // 2 after


def test_adaptive_filters_scale_with_width():
    infos = build_model("vgg16", 10, 1, width=0.25, image_size=32, seed=0).describe()
    assert aux_filters(infos) == [8, 8] + [64] * 11 + [None]   # channels 16..128


def test_classic_filters():
    infos = build_model("vgg16", 10, 1, width=0.25, image_size=32, seed=0).describe()
    assert aux_filters(infos, "classic") == [256] * 13 + [None]
    assert aux_filters(infos, "classic", classic_filters=64) == [64] * 13 + [None]
    with pytest.raises(ValueError, match="mode"):
        aux_filters(infos, "fancy")


def test_resnet18_initial_units_are_those_at_input_resolution():
    infos = build_model("resnet18", 10, 1, width=0.25, image_size=32, seed=0).describe()
    # stem, block1.0, block1.1 and block2.0 (whose strided conv is the first downsampling) read 32x32 inputs
    assert aux_filters(infos) == [8, 8, 8, 8] + [64] * 5 + [None]


def test_auxnet_layout():
    aux = AuxNet((16, 8, 8), filters=32, num_classes=10, pool=2)
    kinds = [type(m).__name__ for m in aux.net]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "AdaptiveAvgPool2d", "Flatten", "Linear"]
    assert aux.net[0].kernel_size == (3, 3) and aux.net[0].padding == (1, 1)
    assert aux.net[-1].in_features == 32 * 2 * 2
    assert aux(torch.randn(3, 16, 8, 8)).shape == (3, 10)
    assert isinstance(AuxNet((24,), 5, 10).net, torch.nn.Linear)
    one = AuxNet((16, 1, 1), filters=8, num_classes=10)   # 1x1 map: trains at batch 1
    one.train()
    assert one(torch.randn(1, 16, 1, 1)).shape == (1, 10)


def test_auxnet_on_a_1x1_map_is_its_3x3_convs_centre_tap():
    """On a 1x1 map a padded 3x3 conv is its centre tap: the 1x1 conv computes the same logits and input
    gradients from the same seed, with 1/9 of the conv's weights."""
    torch.manual_seed(0)
    one = AuxNet((16, 1, 1), filters=8, num_classes=10)
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(16, 8, kernel_size=3, padding=1, bias=True)   # what AuxNet built before
    linear = torch.nn.Linear(8, 10)
    assert one.net[0].kernel_size == (1, 1) and one.net[0].padding == (0, 0)
    assert torch.equal(one.net[-1].weight, linear.weight)   # the later layers' draws are unchanged
    x = torch.randn(4, 16, 1, 1, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = one(x)
    expected = linear(torch.relu(ref(x_ref)).flatten(1))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(one.net[0].weight.grad, ref.weight.grad[:, :, 1:2, 1:2])
    assert ref.weight.grad[:, :, 0].abs().sum() == 0   # the other taps never learn anything
    assert count_params(one.net[0]) == 16 * 8 + 8


def test_vgg16s_last_conv_unit_at_32px_gets_the_1x1_aux_conv():
    """VGG-16 at 32 px: conv13 (after the fifth max-pool) outputs a 1x1 map, so its auxiliary conv is 1x1; the
    units before it (2x2 maps and larger) keep the paper's 3x3."""
    learners = local_learners(build_model("vgg16", 10, 1, width=0.25, image_size=32, seed=0), seed=0)
    kernels = {lr.name: lr.aux.net[0].kernel_size for lr in learners[:-1]}
    assert kernels["conv13"] == (1, 1) and kernels["conv12"] == (3, 3)
    assert count_params(learners[-2].aux) == 128 * 64 + 64 + 64 * 10 + 10


# ----------------------------------------------------------------------------- learners

@pytest.mark.parametrize("name", ["vgg16", "resnet18", "mobilenet_v2"])
def test_every_learner_gives_logits(name):
    model = build_model(name, 10, 1, width=0.25, image_size=32, seed=0)
    learners = local_learners(model, seed=0)
    assert len(learners) == len(model.units)
    assert learners[-1].aux is None and all(lr.aux is not None for lr in learners[:-1])
    x = torch.randn(2, 1, 32, 32)
    for learner in learners:
        learner.eval()   # MobileNetV2's classifier has dropout: repeated calls must agree
    with torch.no_grad():
        ref = model(x)
        for learner in learners:
            out, logits = learner.forward_with_output(x)
            assert logits.shape == (2, 10)
            assert torch.equal(learner(x), logits)
            x = out
    assert torch.equal(x, ref)   # chaining the units' outputs is the model's forward


def test_learners_share_the_model_parameters():
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    learners = local_learners(model, seed=0)
    for learner, unit in zip(learners, model.units):
        assert learner.unit is unit
        assert all(p is q for p, q in zip(learner.unit.parameters(), unit.parameters()))


def test_seeded_construction_is_reproducible_and_leaves_the_global_rng_alone():
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = local_learners(model, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    second = local_learners(model, seed=7)
    other = local_learners(model, seed=8)
    for a, b in zip(first[:-1], second[:-1]):
        for (na, pa), (_, pb) in zip(a.aux.named_parameters(), b.aux.named_parameters()):
            assert torch.equal(pa, pb), na
    assert any(not torch.equal(pa, pc) for a, c in zip(first[:-1], other[:-1])
               for pa, pc in zip(a.aux.parameters(), c.aux.parameters()))


def test_local_step_on_unit_0_touches_only_unit_0_and_its_aux():
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    learners = local_learners(model, seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    aux0_before = [p.detach().clone() for p in learners[0].aux.parameters()]
    params = list(learners[0].parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    out, logits = learners[0].forward_with_output(x)
    F.cross_entropy(logits, y).backward()
    opt.step()
    for learner in learners[1:]:
        assert all(p.grad is None for p in learner.parameters())
    assert all(p.grad is not None for p in params)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(name.startswith("units.0.") for name in changed)
    assert all(not torch.equal(p, q) for p, q in zip(learners[0].aux.parameters(), aux0_before))


def test_exit_params():
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    learners = local_learners(model, seed=0)
    assert exit_params(learners, len(learners) - 1) == count_params(model)
    k = 2
    expected = sum(count_params(u) for u in model.units[:k + 1]) + count_params(learners[k].aux)
    assert exit_params(learners, k) == expected
    with pytest.raises(IndexError):
        exit_params(learners, len(learners))


# ----------------------------------------------------------------------------- profiler

def test_profile_narrow_vgg(tmp_path):
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    learners = local_learners(model, seed=0)
    infos = model.describe()
    # small batches of a narrow model sit where a fixed phase of the step still sets the peak (the peak
    # is a max of lines); from batch 16 the activation line dominates (conv6 with the convolutions'
    # scratch: at batch 8 still the fixed phase)
    batches = (16, 32, 64)
    profiles = profile_units(learners, infos, 10, sgd, batches=batches)
    assert [p.index for p in profiles] == list(range(len(learners)))
    for p, learner in zip(profiles, learners):
        assert p.batches == list(batches) and len(p.peak_bytes) == 3
        assert p.r2 >= 0.99 and p.slope_bytes_per_sample > 0
        assert p.params == count_params(learner)
    # the recorded peak is what measure_training_peak measures for that learner
    for i in (0, len(learners) - 1):
        mem = measure_training_peak(learners[i], sgd, infos[i].in_shape, 10, batches[1])
        assert profiles[i].peak_bytes[1] == mem.peak_bytes
    assert profiling_seconds(profiles) == pytest.approx(sum(p.seconds for p in profiles))
    # an early unit has a much steeper line than the classifier
    assert profiles[0].slope_bytes_per_sample > 10 * profiles[-1].slope_bytes_per_sample

    path = tmp_path / "profile.json"
    save_profile(path, profiles, {"model": "vgg11"})
    loaded, meta = load_profile(path)
    assert loaded == profiles and meta["model"] == "vgg11" and "profiling_seconds" in meta


def test_profile_keeps_process_memory_out_of_its_time(monkeypatch):
    # The profiler keeps only each measurement's peak: reading USS and sampling RSS beside every
    # step was a third of its time, which counts as NeuroFlux's overhead.
    def forbidden(*args, **kwargs):
        raise AssertionError("the profiler read process memory")

    monkeypatch.setattr(memory.step, "uss_bytes", forbidden)
    monkeypatch.setattr(memory.step, "RssSampler", forbidden)
    model = build_model("vgg11", 10, 1, width=0.125, image_size=32, seed=0)
    profiles = profile_units(local_learners(model, seed=0)[:2], model.describe()[:2], 10, sgd, batches=(8, 16))
    assert len(profiles) == 2 and all(p.peak_bytes[1] > p.peak_bytes[0] > 0 for p in profiles)


def test_fit_unit_and_poor_fit():
    a, b, r2 = fit_unit(0, "conv1", [1, 2, 4, 8], [1100, 1200, 1400, 1800])
    assert (a, b, r2) == (100.0, 1000.0, 1.0)
    with pytest.raises(PoorFitError) as info:
        fit_unit(3, "conv4", [1, 2, 4, 8, 16], [1, 4, 16, 64, 4096])   # far from a line
    err = info.value
    assert err.r2 < 0.98 and err.measurements[-1] == (16, 4096)
    assert "unit 3 (conv4)" in str(err) and "min_r2" in str(err) and "batch sizes" in str(err)
    fit_unit(3, "conv4", [1, 2, 4, 8, 16], [1, 4, 16, 64, 4096], min_r2=0.5)   # a lower bar accepts it
    with pytest.raises(ValueError, match="two distinct"):
        fit_unit(0, "conv1", [4, 4], [10, 10])
