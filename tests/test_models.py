"""Tests for edgeflux.models: unit structure, shapes, parameter counts, torchvision weight mapping."""

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.models._utils import _make_divisible

from edgeflux.models import (
    MODEL_NAMES,
    UNIT_KINDS,
    UnitModel,
    WeightsFileNotFoundError,
    build_model,
    count_params,
    load_torchvision_weights,
)
from edgeflux.models.mobilenet import build_mobilenet

EXPECTED_UNITS = {  # (number of units, count per kind)
    "vgg11": (9, {"conv": 8, "classifier": 1}),
    "vgg16": (14, {"conv": 13, "classifier": 1}),
    "vgg19": (17, {"conv": 16, "classifier": 1}),
    "resnet18": (10, {"conv": 1, "residual": 8, "classifier": 1}),
    "mobilenet_v2": (20, {"conv": 2, "inverted_residual": 17, "classifier": 1}),
    "mobilenet_v3_small": (14, {"conv": 2, "inverted_residual": 11, "classifier": 1}),
    "mobilenet_v3_large": (18, {"conv": 2, "inverted_residual": 15, "classifier": 1}),
}
# torchvision's VGG configurations "A", "D", "E", written out here (not imported) as the reference
CFGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("in_channels", [1, 3])
def test_builds_and_maps_batch_to_logits(name, in_channels):
    model = build_model(name, num_classes=7, in_channels=in_channels, width=0.25)
    assert isinstance(model, UnitModel)
    assert (model.name, model.num_classes, model.in_channels, model.width) == (name, 7, in_channels, 0.25)
    n_units, kinds = EXPECTED_UNITS[name]
    assert len(model.units) == len(model.unit_names) == len(model.unit_kinds) == n_units
    assert {k: model.unit_kinds.count(k) for k in set(model.unit_kinds)} == kinds
    assert model.unit_kinds[-1] == "classifier" and set(model.unit_kinds) <= set(UNIT_KINDS)
    x = torch.randn(2, in_channels, 32, 32)
    assert model(x).shape == (2, 7)
    # one backward works through every unit
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_units_compose_to_the_model(name):
    model = build_model(name, num_classes=10, in_channels=3, width=0.25).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        y = x
        for unit in model.units:
            y = unit(y)
        assert torch.equal(y, ref)
        n = len(model.units)
        for stop in sorted({0, 1, 2, n // 2, n - 2, n - 1, n}):
            mid = model.forward_until(x, stop)
            assert torch.equal(model.head(stop)(mid), ref)
    assert torch.equal(model.forward_until(x, 0), x)
    # head shares modules, it does not copy them
    assert model.head(1)[0] is model.units[1]
    with pytest.raises(IndexError):
        model.forward_until(x, len(model.units) + 1)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("image_size", [32, 64])
def test_describe_matches_actual_unit_outputs(name, image_size):
    model = build_model(name, num_classes=10, in_channels=1, width=0.25, image_size=image_size)
    model.train()
    model.units[0].eval()  # a deliberate mix of modes must survive describe()
    modes = [m.training for m in model.modules()]
    bn_stats = [b.running_mean.clone() for b in model.modules() if isinstance(b, nn.BatchNorm2d)]

    infos = model.describe()

    assert [m.training for m in model.modules()] == modes
    bn_after = [b.running_mean for b in model.modules() if isinstance(b, nn.BatchNorm2d)]
    assert all(torch.equal(a, b) for a, b in zip(bn_stats, bn_after))  # ran in eval mode
    assert [i.name for i in infos] == model.unit_names and [i.kind for i in infos] == model.unit_kinds
    assert [i.index for i in infos] == list(range(len(infos)))
    y = torch.randn(3, 1, image_size, image_size)
    model.eval()
    with torch.no_grad():
        for info, unit in zip(infos, model.units):
            assert info.in_shape == tuple(y.shape[1:])
            y = unit(y)
            assert info.out_shape == tuple(y.shape[1:])
            assert info.params == sum(p.numel() for p in unit.parameters())
            if y.ndim == 4:
                assert info.out_channels == y.shape[1]
                assert info.downsamples == (info.out_shape[1] < info.in_shape[1])
            else:
                assert info.out_channels is None and not info.downsamples
    assert infos[-1].out_shape == (10,)
    assert sum(i.params for i in infos) == count_params(model)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large"])
def test_mobilenets_end_at_2x2_for_32x32(name):
    infos = build_model(name, in_channels=1, width=0.25).describe()
    assert infos[0].out_shape[1:] == (32, 32)  # stem at stride 1
    assert infos[-2].out_shape[1:] == (2, 2)  # last 1x1 conv, before the classifier
    # four halvings 32 -> 16 -> 8 -> 4 -> 2, all inside inverted-residual units
    assert [i.kind for i in infos if i.downsamples] == ["inverted_residual"] * 4
    if name == "mobilenet_v2":
        # the last stage (320 channels, one block) runs at 2x2
        assert infos[17].in_shape[1:] == (2, 2) and infos[17].name == "irb17"


def test_mobilenet_relaxed_first_downsample_ends_at_4x4():
    model = build_mobilenet("mobilenet_v2", 10, 1, 0.25, 32, relax_first_downsample=True)
    infos = model.describe()
    assert infos[-2].out_shape[1:] == (4, 4)
    assert infos[2].name == "irb2" and not infos[2].downsamples


def test_resnet18_param_count_matches_reference():
    # CIFAR ResNet-18 (3x3 stem, no max pool), 10 classes: the well-known 11,173,962
    assert count_params(build_model("resnet18", num_classes=10, in_channels=3)) == 11_173_962
    # a 1-channel stem has 64 * 2 * 9 fewer weights
    assert count_params(build_model("resnet18", num_classes=10, in_channels=1)) == 11_173_962 - 64 * 2 * 9


@pytest.mark.parametrize("batch_norm", [True, False])
def test_vgg16_param_count_matches_cfg(batch_norm):
    expected, c_in = 0, 3
    for v in CFGS["vgg16"]:
        if v == "M":
            continue
        expected += c_in * v * 9 + v  # conv weight + bias
        expected += 2 * v if batch_norm else 0  # BN gamma, beta
        c_in = v
    expected += 512 * 10 + 10  # final spatial 1x1 at 32x32
    model = build_model("vgg16", num_classes=10, in_channels=3, batch_norm=batch_norm)
    assert count_params(model) == expected
    if batch_norm:
        assert expected == 14_728_266  # the usual CIFAR VGG16-BN figure


def test_mobilenet_v2_params_equal_torchvision_minus_our_changes():
    tv = torchvision.models.mobilenet_v2(weights=None)  # 3 input channels, 1000 classes
    ours = build_model("mobilenet_v2", num_classes=10, in_channels=1)
    stem_diff = 32 * (3 - 1) * 3 * 3
    classifier_diff = (1280 + 1) * (1000 - 10)
    assert count_params(tv) == 3_504_872
    assert count_params(ours) == count_params(tv) - stem_diff - classifier_diff
    # the units are torchvision modules
    irbs = [u for u, k in zip(ours.units, ours.unit_kinds) if k == "inverted_residual"]
    assert all(isinstance(u, mobilenetv2.InvertedResidual) for u in irbs)
    assert len(irbs) == 17


def test_mobilenet_v3_units_are_torchvision_blocks_with_same_params():
    for name, builder in [
        ("mobilenet_v3_small", torchvision.models.mobilenet_v3_small),
        ("mobilenet_v3_large", torchvision.models.mobilenet_v3_large),
    ]:
        tv = builder(weights=None, width_mult=0.5, num_classes=10)
        ours = build_model(name, num_classes=10, in_channels=3, width=0.5)
        assert count_params(ours) == count_params(tv)
        irbs = [u for u, k in zip(ours.units, ours.unit_kinds) if k == "inverted_residual"]
        assert all(isinstance(u, mobilenetv3.InvertedResidual) for u in irbs)
        assert [u.out_channels for u in irbs] == [m.out_channels for m in tv.features[1:-1]]


def test_vgg_without_batch_norm_has_none():
    model = build_model("vgg11", width=0.25, batch_norm=False)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    assert any(isinstance(m, nn.BatchNorm2d) for m in build_model("vgg11", width=0.25).modules())
    with pytest.raises(ValueError, match="only available for VGG"):
        build_model("resnet18", batch_norm=False)


@pytest.mark.parametrize("width", [0.25, 0.6, 1.25])
def test_width_scales_channels(width):
    for name in ("vgg11",):
        convs = [m for m in build_model(name, width=width).modules() if isinstance(m, nn.Conv2d)]
        assert [c.out_channels for c in convs] == [max(8, int(round(v * width))) for v in CFGS[name] if v != "M"]
    infos = build_model("resnet18", width=width).describe()
    stage_out = [i.out_channels for i in infos if i.kind == "residual"][::2]
    assert stage_out == [max(8, int(round(c * width))) for c in (64, 128, 256, 512)]
    mb = build_model("mobilenet_v2", width=width).describe()
    assert mb[0].out_channels == _make_divisible(32 * width, 8)
    assert mb[17].out_channels == _make_divisible(320 * width, 8)
    assert mb[18].out_channels == _make_divisible(1280 * max(1.0, width), 8)


def test_other_image_sizes():
    vgg = build_model("vgg11", width=0.25, image_size=64)
    assert vgg.units[-1][1].in_features == 128 * 2 * 2  # final spatial 64 / 32 = 2
    assert vgg(torch.randn(2, 1, 64, 64)).shape == (2, 10)
    assert build_model("resnet18", width=0.25, image_size=28)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="too small"):
        build_model("vgg16", image_size=16)


def test_bad_arguments():
    with pytest.raises(ValueError) as err:
        build_model("alexnet")
    assert all(n in str(err.value) for n in MODEL_NAMES)
    for w in (0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="width"):
            build_model("vgg11", width=w)


def test_load_torchvision_mobilenet_v2_weights(tmp_path):
    tv = torchvision.models.mobilenet_v2(weights=None, num_classes=1000)
    path = tmp_path / "mobilenet_v2.pth"
    torch.save(tv.state_dict(), path)
    ours = build_model("mobilenet_v2", num_classes=10, in_channels=3)
    before = {k: v.clone() for k, v in ours.state_dict().items()}

    summary = load_torchvision_weights(ours, path)

    cls = ours.unit_names.index("classifier")
    linear = f"units.{cls}.2.1"  # avgpool, flatten, torchvision's classifier (Dropout, Linear)
    assert summary["skipped"] == [
        (f"{linear}.weight", "shape mismatch: source classifier.1.weight (1000, 1280) vs model (10, 1280)"),
        (f"{linear}.bias", "shape mismatch: source classifier.1.bias (1000,) vs model (10,)"),
    ]
    assert summary["missing"] == [] and summary["unused"] == []
    src = tv.state_dict()
    ours_sd = ours.state_dict()
    assert len(summary["loaded"]) == len(src) - 2 == len(ours_sd) - 2
    # structural correspondence: our i-th tensor is torchvision's i-th tensor
    for (key, value), src_value in zip(ours_sd.items(), src.values()):
        if key in summary["loaded"]:
            assert torch.equal(value, src_value), key
        else:
            assert torch.equal(value, before[key]), key
    # and the copy went into the live parameters, so the features compute what torchvision's do
    x = torch.randn(2, 3, 32, 32)
    ours.eval(), tv.eval()
    tv.features[0][0].stride = (1, 1)  # our only change to the feature extractor
    with torch.no_grad():
        assert torch.equal(ours.forward_until(x, cls), tv.features(x))


def test_build_model_with_pretrained_path_and_skips_stem_for_gray_input(tmp_path):
    tv = torchvision.models.mobilenet_v3_small(weights=None)
    path = tmp_path / "mnv3s.pth"
    torch.save(tv.state_dict(), path)
    ours = build_model("mobilenet_v3_small", num_classes=10, in_channels=1, pretrained_path=path)
    stem_key = "units.0.0.weight"
    skipped = [k for k, _ in load_torchvision_weights(ours, path)["skipped"]]
    assert skipped[0] == stem_key and len(skipped) == 3  # stem conv + last Linear weight/bias
    assert torch.equal(ours.units[1].block[0][0].weight, tv.features[1].block[0][0].weight)


def test_resnet18_imagenet_weights_map_onto_cifar_resnet(tmp_path):
    tv = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(tv.state_dict(), path)
    ours = build_model("resnet18", num_classes=10, in_channels=3)
    summary = load_torchvision_weights(ours, path)
    assert [k for k, _ in summary["skipped"]] == ["units.0.0.weight", "units.9.2.weight", "units.9.2.bias"]
    assert "(64, 3, 7, 7)" in summary["skipped"][0][1]
    assert summary["missing"] == [] and summary["unused"] == []
    assert torch.equal(ours.units[4].conv1.weight, tv.layer2[1].conv1.weight)
    assert torch.equal(ours.units[3].downsample[1].running_var, tv.layer2[0].downsample[1].running_var)


def test_missing_weights_file(tmp_path):
    model = build_model("mobilenet_v2", width=0.25)
    with pytest.raises(FileNotFoundError, match="place the .pth file") as err:
        load_torchvision_weights(model, tmp_path / "nope.pth")
    assert isinstance(err.value, WeightsFileNotFoundError)
    assert str(tmp_path / "nope.pth") in str(err.value)
    with pytest.raises(FileNotFoundError):
        build_model("vgg11", pretrained_path=tmp_path / "nope.pth")


def test_seed_gives_the_same_weights_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_model("resnet18", width=0.125, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = build_model("resnet18", width=0.125, seed=7)
    c = build_model("resnet18", width=0.125, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
