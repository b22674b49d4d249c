"""MobileTL and the fine-tuning harness: gradients against a reference, saved bytes against the formula,
frozen statistics, the int8 bottom, the methods' trainable sets, FLOP counts and one-line errors."""
import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.ops import Conv2dNormActivation

from edgeflux.bittrain import BitTrainOptions, pack_mask, unpack_mask
from edgeflux.finetune import METHODS, FinetuneOptions, count_flops, finetune, prepare
from edgeflux.memory import count_saved_tensors
from edgeflux.mobiletl import (
    BlocksError,
    ShiftOnlyBatchNorm,
    SignBackward,
    quantize_bottom,
    top_start,
    transform_block,
)
from edgeflux.models import build_model, count_params
from edgeflux.models.units import train_mode

REPO = Path(__file__).resolve().parents[1]


def mbv2_irb(c: int = 16, expand: int = 6, stride: int = 1) -> nn.Module:
    return mobilenetv2.InvertedResidual(c, c, stride=stride, expand_ratio=expand)


def mbv3_irb(c: int = 16, expand: int = 6) -> nn.Module:
    cfg = mobilenetv3.InvertedResidualConfig(c, 5, c * expand, c, True, "HS", 1, 1, 1.0)
    return mobilenetv3.InvertedResidual(cfg, nn.BatchNorm2d)


def _randomise_bn(block: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BN statistics and affine values, so a frozen scale or a wrong statistic shows."""
    g = torch.Generator().manual_seed(seed)
    for m in block.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.2)
    return block


class _ReferenceFrozenBN(nn.BatchNorm2d):
    """The paper's Eq. 1 with gamma, mu, sigma constant, written with plain autograd ops (which save what they need)."""

    def forward(self, x):
        a = (self.weight * torch.rsqrt(self.running_var + self.eps)).detach().view(1, -1, 1, 1)
        affine = x * a + self.bias.view(1, -1, 1, 1)        # dy/dx = a, dy/dbeta = 1: what autograd differentiates
        # the value as torch's eval-mode batch_norm rounds it (affine - affine.detach() is exactly 0), so that both
        # sides see the same activations and masks
        value = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return value.detach() + (affine - affine.detach())


class _ReferenceSign(nn.Module):
    """Forward act(x); backward grad * 1[x >= 0], from an explicitly saved float mask."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        mask = (x >= 0).to(x.dtype).detach()
        return self.fn(x).detach() + (x - x.detach()) * mask


def _reference_transform(block: nn.Module) -> nn.Module:
    """The same approximation as transform_block, written with plain autograd ops: torchvision's conv-norm-activation
    layers are (conv, BN, activation); the expansion's and the depthwise's BN become frozen-scale, their activations
    sign-backward; the projection's BN (the block's last layer) stays."""
    block = copy.deepcopy(block)
    fns = {nn.ReLU6: F.relu6, nn.Hardswish: F.hardswish}
    layers = list((block.conv if hasattr(block, "conv") else block.block).children())
    for layer in layers[:-1]:
        if isinstance(layer, Conv2dNormActivation):
            bn = layer[1]
            ref = _ReferenceFrozenBN(bn.num_features, eps=bn.eps)
            ref.load_state_dict(bn.state_dict())
            ref.weight.requires_grad_(False)
            layer[1], layer[2] = ref, _ReferenceSign(fns[type(layer[2])])
    return block


@pytest.mark.parametrize("make", [mbv2_irb, mbv3_irb], ids=["mbv2", "mbv3"])
def test_transformed_block_gradients_equal_the_reference(make):
    torch.manual_seed(0)
    block = _randomise_bn(make())
    ours, ref = copy.deepcopy(block), _reference_transform(block)
    transform_block(ours)
    assert sum(isinstance(m, ShiftOnlyBatchNorm) for m in ours.modules()) == 2
    assert sum(isinstance(m, SignBackward) for m in ours.modules()) == 2    # SE's own ReLU/Hardsigmoid are kept
    x = torch.randn(4, 16, 8, 8, requires_grad=True)
    grads = []
    for net in (ours, ref):
        net.train()
        x.grad = None
        out = net(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({"input": x.grad.clone(), **{n: p.grad for n, p in net.named_parameters() if p.requires_grad}})
    ours_g, ref_g = grads
    assert ours_g.keys() == ref_g.keys()
    assert any("weight" in k for k in ours_g) and any(k.endswith("bias") for k in ours_g)
    for name in ours_g:
        # the same products in the same order, except the shift's sum over (N, H, W), which autograd's broadcast
        # reduction and ours may add in another order: float32 rounding, ~1e-7 relative
        assert torch.allclose(ours_g[name], ref_g[name], rtol=1e-5, atol=1e-6), name
    # a scale that trained, or a mask that was 1[x > 0]-only-for-ReLU6, would not match: the frozen scales got none
    frozen = [n for n, p in ours.named_parameters() if not p.requires_grad]
    assert len(frozen) == 2 and all(n.endswith("weight") for n in frozen)


def test_sign_backward_is_not_the_exact_gradient():
    """The reference test above is only meaningful if the approximation differs from autograd's exact rule."""
    x = torch.tensor([-4.0, -1.0, 0.5, 2.0, 7.0], requires_grad=True)
    SignBackward("hardswish")(x).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    exact = torch.autograd.grad(F.hardswish(x).sum(), x)[0]
    assert not torch.equal(exact, x.grad)


def test_saved_bytes_equal_the_formula():
    """MBV2 IRB (expansion 6, stride 1): the expand conv keeps its input (4n bytes), the depthwise and projection
    convs theirs (24n each), the last BN its input (4n) and batch mean/invstd (8C); each activation a 1-bit
    mask (6n/8 bytes); the shift-only BNs nothing."""
    torch.manual_seed(0)
    n_batch, c, hw = 4, 16, 8
    block = _randomise_bn(mbv2_irb(c))
    transform_block(block)
    block.train()
    x = torch.randn(n_batch, c, hw, hw, requires_grad=True)
    params = [*block.parameters(), *block.buffers()]
    with count_saved_tensors(params=params) as saved:
        out = block(x)
    n = x.numel()
    expected = 4 * n + 24 * n + 24 * n + 4 * n + 8 * c + 2 * math.ceil(6 * n / 8)
    assert saved.total_bytes == expected
    with count_saved_tensors(params=params) as vanilla:
        _randomise_bn(mbv2_irb(c)).train()(x)
    assert saved.total_bytes < 0.6 * vanilla.total_bytes
    out.sum().backward()


def test_shift_only_bn_saves_nothing_and_sign_backward_one_bit():
    bn = _randomise_bn(nn.Sequential(nn.BatchNorm2d(8)))[0]
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    for layer, expected in ((ShiftOnlyBatchNorm.from_batchnorm(bn), 0), (SignBackward("relu6"), math.ceil(x.numel() / 8))):
        with count_saved_tensors(params=[*layer.parameters(), *layer.buffers()]) as saved:
            layer(x)
        assert saved.total_bytes == expected


def test_pack_mask_round_trips_any_length():
    for n in (1, 7, 8, 9, 1000):
        m = torch.rand(n) > 0.5
        bits = pack_mask(m)
        assert bits.dtype == torch.uint8 and bits.numel() == math.ceil(n / 8)
        assert torch.equal(unpack_mask(bits, (n,)), m)


def _small_model(name="mobilenet_v3_small", width=0.25):
    return build_model(name, num_classes=10, in_channels=1, width=width, seed=0)


def _train_steps(model, x, y, steps=3):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    train_mode(model)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_frozen_statistics_do_not_move_and_the_last_bn_does():
    model = _small_model()
    x, y = torch.randn(16, 1, 32, 32), torch.randint(0, 10, (16,))
    prepared = prepare("mobiletl", model, FinetuneOptions(blocks=2, quantize_bottom=False), [x])
    frozen = [m for m in model.modules() if isinstance(m, ShiftOnlyBatchNorm)]
    last = [u.block[-1][1] for u in model.units[top_start(model, 2):-2]]
    before = {id(m): {k: v.clone() for k, v in m.state_dict().items()} for m in frozen + last}
    _train_steps(prepared.model, x, y)
    assert len(frozen) == 4 and len(last) == 2
    for m in frozen:
        old = before[id(m)]
        for key in ("running_mean", "running_var", "weight", "num_batches_tracked"):
            assert torch.equal(m.state_dict()[key], old[key]), key
        assert not torch.equal(m.bias, old["bias"])
    for m in frozen:
        assert m.weight.grad is None
    for m in last:    # (an untrained model's scale gradients are ~1e-8: too small to move a weight of 1.0 visibly)
        assert not torch.equal(m.running_mean, before[id(m)]["running_mean"])
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0


def test_int8_bottom_is_close_to_float(mnist_subset):
    from edgeflux.data import tensors
    x, _ = tensors(mnist_subset, "target_train")
    model = _small_model("mobilenet_v2")
    train_mode(model)
    with torch.no_grad():            # BatchNorm statistics of real data: a network whose activations are in range
        for i in range(0, 512, 64):
            model(x[i:i + 64])
    model.eval()
    start = top_start(model, 3)
    bottom = quantize_bottom(list(zip(model.unit_names[:start], model.units[:start])),
                             [x[i:i + 32] for i in range(0, 256, 32)])
    assert bottom.int8 and bottom.float_units == []
    probe = x[1000:1256]
    with torch.no_grad():
        ref, got = model.forward_until(probe, start), bottom(probe)
    # 8-bit activations through ~10 layers: measured 1.0% here; 5% leaves room for another engine's rounding
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    assert not any(p.requires_grad for p in bottom.parameters())
    assert bottom.state_dict() == {} and bottom.held_tensors()


class _Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:          # data-dependent control flow: FX cannot trace it
            return x * 2
        return x


def test_an_unquantizable_unit_falls_back_to_float_with_one_warning():
    conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
    units = [("conv", conv), ("odd", _Untraceable())]
    x = [torch.randn(8, 1, 8, 8) for _ in range(2)]
    with pytest.warns(UserWarning, match="units odd of the frozen bottom could not be quantized") as record:
        bottom = quantize_bottom(units, x)
    assert len([w for w in record if "could not be quantized" in str(w.message)]) == 1
    assert bottom.int8 and bottom.float_units == ["odd"]
    with torch.no_grad():
        got, ref = bottom(x[0]), units[1][1](conv(x[0]))
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


def test_each_method_trains_what_it_says():
    x = torch.randn(8, 1, 32, 32)
    trains = {}
    for method in METHODS:
        model = _small_model()
        prepared = prepare(method, model, FinetuneOptions(blocks=2), [x])
        trains[method] = {n for n, p in prepared.model.named_parameters() if p.requires_grad}
        total = count_params(model)
        assert 0 < count_params(prepared.model, trainable_only=True) <= total
    assert all(n.startswith("units.13.") for n in trains["ft_last"])       # the classifier
    assert all(n.endswith(("bias", "weight")) for n in trains["ft_bn"] - trains["ft_last"])
    assert all(n.endswith("bias") for n in trains["ft_bias"] - trains["ft_last"])
    assert trains["ft_all"] > trains["ft_bn"] > trains["ft_last"] and trains["ft_all"] > trains["ft_bias"] > trains["ft_last"]
    assert any(".fc1.bias" in n for n in trains["ft_bias"])       # squeeze-excitation's conv biases are biases too
    # mobiletl trains ft_blocks' tensors but the intermediate BN scales (4: two per block); its bottom is one
    # int8 unit (units.0), so its unit i is the model's unit start + i - 1
    start = top_start(_small_model(), 2)

    def original(name):
        _, i, rest = name.split(".", 2)
        return f"units.{start + int(i) - 1}.{rest}"
    mobiletl = {original(n) for n in trains["mobiletl"]}
    assert mobiletl < trains["ft_blocks"] and len(trains["ft_blocks"] - mobiletl) == 4
    assert all(n.endswith(".1.weight") for n in trains["ft_blocks"] - mobiletl)


def test_blocks_too_large_or_a_non_irb_model_is_a_clear_error():
    with pytest.raises(BlocksError, match=r"finetune.blocks = 12: mobilenet_v3_small has 11 inverted-residual "
                                          r"blocks; allowed: 1..11"):
        prepare("mobiletl", _small_model(), FinetuneOptions(blocks=12), [])
    with pytest.raises(BlocksError, match="method mobiletl needs a model built of inverted-residual blocks; "
                                          "resnet18 has none"):
        prepare("mobiletl", build_model("resnet18", width=0.25), FinetuneOptions(blocks=1), [])
    prepare("ft_blocks", build_model("resnet18", width=0.25), FinetuneOptions(blocks=1), [])   # any model


def test_counted_flops_backward_is_twice_the_forward_for_ft_all():
    """Each conv's input and weight gradients cost a forward each (torch's own formula counts a depthwise conv's
    weight gradient C times over); FT-Last's backward is the classifier's only."""
    model = _small_model()
    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    fwd, bwd = count_flops(model, model, x, y)
    first_conv = model.units[0][0]
    # the stem's input needs no gradient: its input-gradient conv is not run
    stem = 2 * x.shape[0] * first_conv.weight.numel() * 32 * 32
    assert bwd == 2 * fwd - stem
    last = copy.deepcopy(model)
    prepared = prepare("ft_last", last, FinetuneOptions(), [])
    assert count_flops(last, prepared.model, x, y)[1] < fwd / 10


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_finetune_composes_with_bittrain_and_fits_the_budget(mnist_subset):
    from edgeflux.data import tensors
    data = [tensors(mnist_subset, s, limit=256) for s in ("target_train", "target_val", "target_test")]
    opts = FinetuneOptions(blocks=2, epochs=1, budget="24MB", max_batch=64, evals_per_epoch=1,
                           bittrain=BitTrainOptions(enabled=True))
    run = finetune(_small_model(), "mobiletl", opts, *data)
    m = run.metrics()
    assert m["peak_mem_bytes"] <= opts.budget and m["batch_size"] >= 1
    assert m["saved_stored_bytes"] < m["saved_dense_bytes"]      # BitTrain compressed what MobileTL still saves
    assert m["train_params"] < m["params"] and m["flops_per_sample"] > 0
    assert run.info["bottom_int8"] is True
    assert isinstance(run.run.train.history[-1]["val_acc"], float)


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_the_stage_refuses_bad_blocks_in_one_line(tmp_path):
    params = (REPO / "params.yaml").read_text().replace("  blocks: 3 ", "  blocks: 99 ")
    assert "blocks: 99" in params
    (tmp_path / "params.yaml").write_text(params)
    (tmp_path / "models/pretrained").mkdir(parents=True)
    from edgeflux.artifacts import save_model
    model = build_model("mobilenet_v2", num_classes=10, in_channels=1, width=0.5, seed=0)
    save_model(tmp_path / "models/pretrained/mobilenet_v2-w0.5.pt", model,
               dict(name="mobilenet_v2", num_classes=10, in_channels=1, width=0.5, image_size=32, batch_norm=True,
                    seed=0))
    from edgeflux.data import load_raw, save_prepared
    from edgeflux.data import prepare as prepare_data
    save_prepared(prepare_data(load_raw("mnist-subset"), image_size=32, val_fraction=0.1, seed=0, split_by="data"),
                  tmp_path / "data/prepared")
    out = subprocess.run([sys.executable, "-m", "stages.finetune", "--method", "mobiletl"], cwd=tmp_path, check=False,
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                              "MLFLOW_DISABLE_TELEMETRY": "true",
                                                              "HOME": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "finetune.blocks = 99: mobilenet_v2 has 17 inverted-residual blocks; allowed: 1..17" in out.stderr
