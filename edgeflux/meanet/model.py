"""MEANet's edge network: a main block, an adaptive block and an extension block (paper, Section III.A, Fig. 4).

    spec = MEANetSpec(variant="B", split_after="block4.1", fusion="sum", n_hard=5)
    net = build_meanet(pretrained, spec)     # pretrained: a zoo UnitModel (the cloud-trained CNN)
    y2 = net(x)                              # the extension exit: logits over the n_hard hard classes
    y1, features = net.main_exit(x)          # the main exit (all classes) and F at the fusion point
    y2 = net.extension_exit(x, features)     # adaptive(x) fused with F, through the extension block

Model A splits a CNN at a unit boundary: units before it plus a new exit are the main block, the units
after it (with the original classifier, resized to the hard classes) are the extension block. Model B
keeps the whole CNN as the main block and adds new residual blocks of the zoo's own kind (torchvision's
BasicBlock or InvertedResidual) with an exit as the extension block, fed from the activation after
``split_after``. Either way the main block is a ``UnitModel``: ``forward_until(x, k)`` gives F and
``head(k)`` the main exit, the same plumbing NeuroFlux's exits use.

The adaptive block is a light mirror of the main block from the raw input to the fusion point: one
3x3 conv + BatchNorm per spatial stage of the main block, with that stage's output channels and
stride, so its output has F's shape. ``fusion="sum"`` adds the two; ``"concat"`` stacks them and the
extension block starts with a 1x1 conv from 2C to C channels (its first layer then "has more input
channels", as the paper puts it).

Training on the edge (Algorithm 1, step 6) fixes the main block: ``freeze`` takes its gradients away
and keeps it in eval mode while the rest trains, and F is computed under ``torch.no_grad`` so nothing
of the main block is saved for backward.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.mobilenetv2 import InvertedResidual
from torchvision.models.resnet import BasicBlock

from edgeflux.artifacts import load_checked, model_fix, save_checked
from edgeflux.errors import UserError
from edgeflux.models import UnitModel, build_model, count_params, eval_mode
from edgeflux.models.units import freeze

VARIANTS = ("A", "B")
FUSIONS = ("sum", "concat")
MODELS = ("resnet18", "mobilenet_v2")   # the zoo models whose residual blocks an extension block can reuse
BLOCK_KINDS = ("residual", "inverted_residual")


class MEANetConfigError(ValueError, UserError):
    """A MEANet setting the model cannot take (a split that is not a unit boundary, a bad n_hard)."""


@dataclass(frozen=True)
class MEANetSpec:
    """How the edge network is built from a zoo CNN: saved in model files, so plain values only."""

    variant: Literal["A", "B"] = "B"
    split_after: str | None = None     # the unit whose output is F; None: the default for the variant
    fusion: Literal["sum", "concat"] = "sum"
    n_hard: int = 5
    extension_blocks: int = 2          # model B: new residual blocks in the extension block
    num_classes: int = 10

    def to_dict(self) -> dict:
        return asdict(self)


def default_split(model: UnitModel, variant: str) -> str:
    """B: after the last residual unit (F is the deepest feature map before the head's 1x1 conv or pooling).
    A: after the last residual unit of the second-coarsest resolution, so the extension block keeps a stage."""
    info = model.describe()
    blocks = [u for u in info if u.kind in BLOCK_KINDS]
    if not blocks:
        raise MEANetConfigError(f"{model.name} has no residual units; MEANet supports {', '.join(MODELS)}")
    if variant == "B":
        return blocks[-1].name
    coarsest = min(u.out_shape[-1] for u in blocks)
    return [u for u in blocks if u.out_shape[-1] > coarsest][-1].name


def split_index(model: UnitModel, spec: MEANetSpec) -> int:
    """The unit boundary k of the fusion point (F = model.forward_until(x, k)); a one-line error when the
    name is not a unit, or the boundary leaves no feature map (k = 0, or at/after the classifier)."""
    name = spec.split_after or default_split(model, spec.variant)
    if name not in model.unit_names:
        raise MEANetConfigError(f"meanet.split_after = {name!r} is not a unit boundary of {model.name}; "
                                f"use one of: {', '.join(model.unit_names[:-1])}")
    k = model.unit_index(name) + 1
    last = len(model.units) - 1
    if model.unit_kinds[-1] != "classifier" or k >= last + (spec.variant == "B"):
        allowed = model.unit_names[:last - (spec.variant == "A")]
        raise MEANetConfigError(f"meanet.split_after = {name!r} leaves no {'extension' if spec.variant == 'A' else 'feature map'}"
                                f" in {model.name} (variant {spec.variant}); use a unit before it: {', '.join(allowed)}")
    return k


def check_n_hard(n_hard: int, num_classes: int) -> None:
    if not isinstance(n_hard, int) or not 1 <= n_hard < num_classes:
        raise MEANetConfigError(f"meanet.n_hard = {n_hard!r}: needs 1 <= n_hard < {num_classes} (the class count); "
                                f"null takes half ({num_classes // 2})")


def _conv_bn(c_in: int, c_out: int, stride: int, kernel: int = 3, relu: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers, *([nn.ReLU(inplace=True)] if relu else []))


def adaptive_block(model: UnitModel, k: int) -> nn.Sequential:
    """One conv per spatial stage of units[0:k], with the stage's output channels and stride (Fig. 4)."""
    info = model.describe()[:k]
    stages: list[tuple[int, int]] = []                     # (output channels, output size) per stage
    for u in info:
        if stages and stages[-1][1] == u.out_shape[-1]:
            stages[-1] = (u.out_shape[0], u.out_shape[-1])
        else:
            stages.append((u.out_shape[0], u.out_shape[-1]))
    layers, c_in, size = [], model.in_channels, model.image_size
    for i, (c_out, out_size) in enumerate(stages):
        # a 3x3 conv, padding 1, stride s gives ceil(size / s): 7 -> 4 at stride 2, as the main block's own
        layers.append(_conv_bn(c_in, c_out, max(1, round(size / out_size)), relu=i < len(stages) - 1))
        c_in, size = c_out, out_size
    return nn.Sequential(*layers)


def _new_blocks(model: UnitModel, channels: int, count: int) -> list[nn.Module]:
    if model.name == "resnet18":
        return [BasicBlock(channels, channels) for _ in range(count)]
    if model.name == "mobilenet_v2":
        return [InvertedResidual(channels, channels, 1, expand_ratio=6) for _ in range(count)]
    raise MEANetConfigError(f"MEANet model B builds extension blocks for {', '.join(MODELS)}, not {model.name}")


def _exit(channels: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(channels, classes))


def _resize_last_linear(module: nn.Module, classes: int) -> None:
    """Replace the last nn.Linear in `module` by a new one with `classes` outputs (same inputs)."""
    parent, name, linear = None, None, None
    for mod in module.modules():
        for child_name, child in mod.named_children():
            if isinstance(child, nn.Linear):
                parent, name, linear = mod, child_name, child
    if linear is None:
        raise MEANetConfigError("the extension block has no Linear classifier to resize")
    setattr(parent, name, nn.Linear(linear.in_features, classes))


def main_block(model: UnitModel, spec: MEANetSpec) -> tuple[UnitModel, int]:
    """(the main block, k): B the model itself; A units[0:k] and a new exit over all classes."""
    k = split_index(model, spec)
    if spec.variant == "B":
        return model, k
    channels = model.describe()[k - 1].out_shape[0]
    units = [(n, kind, u) for n, kind, u in zip(model.unit_names[:k], model.unit_kinds[:k], model.units[:k])]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(getattr(model, "build_args", {}).get("seed") or 0)   # the same exit in every process
        exit_ = _exit(channels, model.num_classes)
    main = UnitModel(f"{model.name}-A@{model.unit_names[k - 1]}", [*units, ("exit", "classifier", exit_)],
                     num_classes=model.num_classes, in_channels=model.in_channels, image_size=model.image_size,
                     width=model.width)
    return main, k


def extension_block(model: UnitModel, k: int, spec: MEANetSpec) -> nn.Sequential:
    """A: a copy of units[k:] (the original classifier resized to n_hard); B: new residual blocks and an exit."""
    channels = model.describe()[k - 1].out_shape[0]
    head: list[nn.Module] = [_conv_bn(2 * channels, channels, 1, kernel=1)] if spec.fusion == "concat" else []
    if spec.variant == "A":
        tail = copy.deepcopy(nn.Sequential(*model.units[k:]))
        _resize_last_linear(tail, spec.n_hard)
        return nn.Sequential(*head, *tail)
    if spec.extension_blocks < 1:
        raise MEANetConfigError(f"meanet.extension_blocks = {spec.extension_blocks}: model B needs at least 1")
    return nn.Sequential(*head, *_new_blocks(model, channels, spec.extension_blocks), _exit(channels, spec.n_hard))


class MEANet(nn.Module):
    """main (a UnitModel with its exit), adaptive and extension blocks; forward gives the extension exit."""

    def __init__(self, main: UnitModel, split: int, adaptive: nn.Module, extension: nn.Module, spec: MEANetSpec,
                 build_args: dict) -> None:
        super().__init__()
        self.main, self.adaptive, self.extension = main, adaptive, extension
        self.split, self.spec, self.build_args = split, spec, build_args

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """F: the main block's activation at the fusion point."""
        return self.main.forward_until(x, self.split)

    def main_exit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ŷ1 over all classes, F): one pass through the main block."""
        features = self.features(x)
        return self.main.head(self.split)(features), features

    def extension_exit(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """ŷ2 over the hard classes, from the raw input (adaptive block) and F (sum or concatenation)."""
        f2 = self.adaptive(x)
        fused = features + f2 if self.spec.fusion == "sum" else torch.cat([features, f2], dim=1)
        return self.extension(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The extension exit, with F computed without gradients when the main block is fixed."""
        fixed = not any(p.requires_grad for p in self.main.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not fixed):
            features = self.features(x)
        return self.extension_exit(x, features)


def build_meanet(model: UnitModel, spec: MEANetSpec, build_args: dict | None = None,
                 main: UnitModel | None = None) -> MEANet:
    """The MEANet of `model` (its weights are used, not copied, for the main block; model A's extension is a copy
    of its tail). build_args: how `model` was built (build_model's arguments), for saving; main: model A's main
    block when it was built (and trained) already, by main_block."""
    check_n_hard(spec.n_hard, model.num_classes)
    if spec.variant not in VARIANTS or spec.fusion not in FUSIONS:
        raise MEANetConfigError(f"variant must be one of {VARIANTS} and fusion one of {FUSIONS}, "
                                f"got {spec.variant!r}, {spec.fusion!r}")
    if model.name not in MODELS:
        raise MEANetConfigError(f"MEANet supports {', '.join(MODELS)}, not {model.name}")
    spec = MEANetSpec(**{**spec.to_dict(), "num_classes": model.num_classes})
    build_args = dict(build_args or getattr(model, "build_args", {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(build_args.get("seed") or 0)   # the new blocks start the same in every process
        if main is None:
            main, k = main_block(model, spec)
        else:
            k = split_index(model, spec)
        adaptive, extension = adaptive_block(model, k), extension_block(model, k, spec)
    net = MEANet(main, k, adaptive, extension, spec, build_args)
    _check_shapes(net, model)
    return net


def _check_shapes(net: MEANet, model: UnitModel) -> None:
    """The adaptive block must give F's shape (a dry forward of one zero image, in eval mode)."""
    x = torch.zeros(1, model.in_channels, model.image_size, model.image_size,
                    device=next(model.parameters()).device)
    with eval_mode(net), torch.no_grad():
        f, f2 = net.features(x), net.adaptive(x)
    if f.shape != f2.shape:
        raise MEANetConfigError(f"{model.name} at {model.image_size}x{model.image_size}: the adaptive block gives "
                                f"{tuple(f2.shape[1:])}, F is {tuple(f.shape[1:])}; choose another meanet.split_after")


def save_meanet(path, net: MEANet, meta: dict | None = None) -> None:
    """The network, its spec and the zoo arguments of its CNN, checksummed (edgeflux.artifacts)."""
    save_checked(path, {"spec": net.spec.to_dict(), "build_args": net.build_args, "state_dict": net.state_dict(),
                        "meta": meta or {}})


def load_meanet(path, stage: str = "meanet_edge") -> tuple[MEANet, dict]:
    """(the MEANet saved at path, its meta); a damaged file is an error naming the fix."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no MEANet model; run `dvc repro {stage}`")
    state = load_checked(path, model_fix(path, stage), weights_only=True)
    net = build_meanet(build_model(**state["build_args"]), MEANetSpec(**state["spec"]), state["build_args"])
    net.load_state_dict(state["state_dict"])
    return net, state["meta"]


def fix_main(net: MEANet) -> MEANet:
    """Algorithm 1, step 6: the main block gets no gradients and stays in eval mode (no statistics updates)."""
    freeze(net.main)
    return net


class TwoExits(nn.Module):
    """A CNN with an extra exit after unit k, trained jointly at the cloud (BranchyNet's weighted sum of exit losses).

    As torchvision's GoogLeNet does with its auxiliary logits: in training mode forward returns
    (exit logits, final logits) for ``exits_loss``; in eval mode the early exit's logits, so evaluation
    reports the main block's accuracy.
    """

    def __init__(self, model: UnitModel, main: UnitModel, k: int) -> None:
        super().__init__()
        self.model, self.exit, self.k = model, main.units[-1], k

    def forward(self, x: torch.Tensor):
        features = self.model.forward_until(x, self.k)
        early = self.exit(features)
        return (early, self.model.head(self.k)(features)) if self.training else early


def exits_loss(outputs, y: torch.Tensor) -> torch.Tensor:
    """The sum of cross-entropy at every exit (joint optimisation, equal weights)."""
    return sum(nn.functional.cross_entropy(o, y) for o in outputs)


@torch.no_grad()
def block_costs(net: MEANet, sample: torch.Tensor) -> dict:
    """Table VI: parameters and multiply-adds per instance (torch.utils.flop_counter, 2 FLOPs a multiply-add) of
    the fixed main block and of the trained adaptive and extension blocks."""
    x = sample[:1]
    with eval_mode(net):
        with FlopCounterMode(display=False) as fixed:
            _, features = net.main_exit(x)
        with FlopCounterMode(display=False) as trained:
            net.extension_exit(x, features)
    return {"fixed_params": count_params(net.main), "trained_params": count_params(net.adaptive) + count_params(net.extension),
            "fixed_macs": fixed.get_total_flops() // 2, "trained_macs": trained.get_total_flops() // 2}
