"""arch: torchvision: torchvision's architectures unchanged as UnitModels, and their weights loaded strictly."""
import logging

import pytest
import torch
from pydantic import ValidationError
from torchvision import models as tvm

from edgeflux.models import ModelSpec, build_model
from edgeflux.models.spec import TORCHVISION_NAMES
from edgeflux.models.torchvision_arch import WeightsError

SIZE = 64


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.parametrize("name", TORCHVISION_NAMES)
def test_the_units_compute_what_torchvision_computes(name):
    """Built from the same seed, the unit model and torchvision's own model give the same logits: nothing
    of the architecture (stem, strides, pooling, classifier) was changed or left out by the cut into units."""
    torch.manual_seed(3)
    theirs = getattr(tvm, name)(weights=None, num_classes=7)
    ours = build_model(name, num_classes=7, in_channels=3, image_size=SIZE, seed=3, arch="torchvision")
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert ours.unit_kinds[0] == "conv" and ours.unit_kinds[-1] == "classifier" and len(ours.units) > 5
    x = torch.randn(2, 3, SIZE, SIZE)
    torch.testing.assert_close(logits(ours, x), logits(theirs, x), rtol=0, atol=1e-5)
    infos = ours.describe()
    assert infos[-1].out_shape == (7,) and [i.in_shape for i in infos[1:]] == [i.out_shape for i in infos[:-1]]


def test_gray_images_are_repeated_to_the_rgb_stem_and_the_log_says_so(caplog):
    torch.manual_seed(0)
    theirs = tvm.resnet18(weights=None, num_classes=4)
    with caplog.at_level(logging.INFO, logger="edgeflux.models.torchvision_arch"):
        ours = build_model("resnet18", num_classes=4, in_channels=1, image_size=SIZE, seed=0, arch="torchvision")
    assert "1-channel images are repeated" in caplog.text
    gray = torch.rand(2, 1, SIZE, SIZE)
    torch.testing.assert_close(logits(ours, gray), logits(theirs, gray.repeat(1, 3, 1, 1)), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def imagenet_resnet18(tmp_path_factory):
    """A torchvision ResNet-18 state_dict as a user saves it (1000 ImageNet classes; random weights here)."""
    torch.manual_seed(1)
    state = tvm.resnet18(weights=None).state_dict()
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save(state, path)
    return path, state


def test_every_tensor_of_the_file_is_loaded_and_only_the_classifier_is_re_made(imagenet_resnet18, caplog):
    path, state = imagenet_resnet18
    with caplog.at_level(logging.INFO, logger="edgeflux.models.torchvision_arch"):
        ours = build_model("resnet18", num_classes=10, in_channels=3, image_size=SIZE, pretrained_path=path,
                           arch="torchvision")
    assert "re-made for the data's classes: fc.bias, fc.weight" in caplog.text
    # our tensors, in forward order, are the file's tensors (but fc's) in torchvision's order
    ours_values = list(ours.state_dict().values())
    theirs = [v for k, v in state.items() if not k.startswith("fc.")]
    assert len(ours_values) == len(theirs) + 2
    for mine, file_tensor in zip(ours_values[:-2], theirs):
        assert torch.equal(mine, file_tensor)
    assert ours.units[-1][-1].weight.shape == (10, 512)

    # with the file's own 1000 classes nothing is re-made: the logits are the file's model's
    full = build_model("resnet18", num_classes=1000, in_channels=3, image_size=SIZE, pretrained_path=path,
                       arch="torchvision")
    reference = tvm.resnet18(weights=None)
    reference.load_state_dict(state)
    x = torch.randn(2, 3, SIZE, SIZE)
    torch.testing.assert_close(logits(full, x), logits(reference, x), rtol=0, atol=1e-5)


def bad_files(tmp_path, state):
    """(file, what the one-line error must say) for each way a weights file can be wrong."""
    files = {}
    other = tmp_path / "mobilenet_v2.pth"
    torch.save(tvm.mobilenet_v2(weights=None).state_dict(), other)
    files[other] = "is not a resnet18 state_dict"
    short = tmp_path / "missing_tensor.pth"
    torch.save({k: v for k, v in state.items() if k != "layer3.0.bn1.running_var"}, short)
    files[short] = "1 of its tensors missing (e.g. layer3.0.bn1.running_var)"
    wider = tmp_path / "other_shape.pth"
    torch.save({**state, "layer1.0.conv1.weight": torch.zeros(64, 64, 5, 5)}, wider)
    files[wider] = "1 shapes differ (e.g. layer1.0.conv1.weight"
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes((tmp_path / "missing_tensor.pth").read_bytes()[:4096])
    files[truncated] = "cannot be read as a state_dict"
    text = tmp_path / "notes.pth"
    text.write_text("not weights\n")
    files[text] = "cannot be read as a state_dict"
    whole = tmp_path / "whole_model.pth"
    torch.save(tvm.resnet18(weights=None), whole)   # the module pickled, not its state_dict
    files[whole] = "cannot be read as a state_dict"
    nested = tmp_path / "checkpoint.pth"
    torch.save({"state_dict": state, "epoch": 3}, nested)
    files[nested] = "does not hold a state_dict"
    files[tmp_path / "absent.pth"] = "never downloads weights"
    return files


def test_a_wrong_weights_file_is_one_line_naming_the_problem_and_how_to_make_the_right_one(imagenet_resnet18, tmp_path):
    _, state = imagenet_resnet18
    for path, says in bad_files(tmp_path, state).items():
        with pytest.raises(WeightsError) as err:
            build_model("resnet18", num_classes=10, in_channels=3, image_size=SIZE, pretrained_path=path,
                        arch="torchvision")
        message = str(err.value)
        assert says in message and "\n" not in message, (path.name, message)
        assert "torch.save(torchvision.models.resnet18(weights='DEFAULT').state_dict()" in message, message


def test_the_spec_says_which_names_and_options_each_arch_takes():
    spec = ModelSpec(arch="torchvision", name="efficientnet_b0", weights="effnet.pth")
    assert spec.key == "tv-efficientnet_b0" and spec.weights_path() == "effnet.pth"
    assert spec.build_args(10, 3, 128, 0)["arch"] == "torchvision"
    zoo = ModelSpec(name="vgg11", width=0.25)
    assert list(zoo.build_args(10, 1, 32, 0)) == ["name", "num_classes", "in_channels", "width", "image_size",
                                                  "batch_norm", "seed"]   # what saved zoo models hold
    for bad, says in ((dict(arch="torchvision", name="vgg11"), "not a torchvision model"),
                      (dict(name="efficientnet_b0"), "not a zoo model"),
                      (dict(arch="torchvision", name="resnet18", width=0.5), "give its weights with `weights: PATH`"),
                      (dict(name="resnet18", weights="r.pth"), "use pretrained_path")):
        with pytest.raises(ValidationError, match=says):
            ModelSpec(**bad)


def test_mobiletl_quantizes_the_gray_stem_of_a_torchvision_mobilenet():
    """The channel repeat traces (torch.fx) with the stem: MobileTL's frozen bottom is int8 from its first unit."""
    from edgeflux.mobiletl.quantize import quantize_bottom

    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, image_size=SIZE, seed=0, arch="torchvision")
    bottom = quantize_bottom(list(zip(model.unit_names[:4], model.units[:4])), [torch.rand(8, 1, SIZE, SIZE)])
    assert bottom.int8 and bottom.float_units == []
