"""Adaptive auxiliary networks (AAN-LL, NeuroFlux Section 3) and the local learners they make.

    learners = local_learners(model, mode="adaptive", seed=0)   # one per unit, sharing the units
    out, logits = learners[i].forward_with_output(x)            # the worker passes out.detach() on

Local learning trains every unit against a loss of its own: unit i's output goes through a small
auxiliary classifier A_i and the cross-entropy of its prediction updates unit i and A_i only.
The last unit is the model's own classifier, so it needs no auxiliary network.

AAN-LL sizes the auxiliary convolutions by depth. Units before the first downsampling (their
output still has the input's spatial resolution) produce the largest activations, so their
auxiliary conv gets half the *smallest* channel count of the model (VGG: 64 -> 32); later units
get half the *largest* (VGG: 512 -> 256), enough filters to learn well where the maps are small.
Classic LL uses 256 filters everywhere (Belilovsky et al.), which costs more memory than
backprop on the first layers.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from edgeflux.models.units import UnitInfo, UnitModel, count_params
from edgeflux.neuroflux.options import AUX_MODES

log = logging.getLogger(__name__)



def _is_map(shape: Sequence[int]) -> bool:
    return len(shape) == 3


def aux_filters(infos: list[UnitInfo], mode: str = "adaptive", classic_filters: int = 256) -> list[int | None]:
    """Filters of each unit's auxiliary conv; None for the last unit (it is the classifier).

    adaptive: units whose input is at the model's input resolution (before the first
    downsampling) get max(1, min_channels // 2), later units max(1, max_channels // 2), min and
    max taken over the units that output feature maps (so width multipliers scale them too).
    classic: `classic_filters` for every unit but the last.
    """
    if mode not in AUX_MODES:
        raise ValueError(f"unknown auxiliary network mode {mode!r}; choose one of {AUX_MODES}")
    if not infos:
        raise ValueError("aux_filters needs the description of at least one unit (model.describe())")
    if mode == "classic":
        if not (isinstance(classic_filters, int) and classic_filters >= 1):
            raise ValueError(f"classic_filters must be a positive int (the paper's classic LL uses 256), "
                             f"got {classic_filters!r}")
        return [classic_filters] * (len(infos) - 1) + [None]

    channels = [info.out_channels for info in infos if info.out_channels is not None]
    if not channels:   # no feature maps at all (an MLP): the auxiliary nets are single Linears
        return [1] * (len(infos) - 1) + [None]
    small, large = max(1, min(channels) // 2), max(1, max(channels) // 2)
    input_hw = tuple(infos[0].in_shape[1:])
    # A unit includes its own downsampling (the paper's eq. 1: x_{n+1} = alpha P_n theta_n x_n), so
    # the "layers before the first downsampling operation" are those whose input is still at the
    # model's input resolution: VGG's conv1 and conv2 (which ends in the first max-pool), ResNet's
    # stem and first stage. That keeps the first unit's aux small in every model of the zoo.
    filters: list[int | None] = []
    for info in infos[:-1]:
        initial = _is_map(info.in_shape) and tuple(info.in_shape[1:]) == input_hw
        filters.append(small if initial else large)
    return filters + [None]


class AuxNet(nn.Module):
    """An auxiliary classifier A_n for one unit's output.

    Feature map (C, H, W): conv3x3 (`filters`) -> BatchNorm2d -> ReLU -> AdaptiveAvgPool2d -> flatten
    -> Linear. That is the paper's eq. 2, A_n = gamma_n F_n beta_n (conv, downsampling, linear);
    BatchNorm and ReLU after the conv are those of Belilovsky et al.'s auxiliary networks, which
    classic LL (and NeuroFlux) builds on. The conv has no bias because BatchNorm follows it
    (except on a 1x1 map, which has no BatchNorm: see below).
    The pool output is `pool` x `pool`, clamped to the map's own size: pooling a 1x1 map up to
    2x2 would only copy values and quadruple the Linear's weights. For the same reason the conv on a
    1x1 map is the 1x1 conv its 3x3 one reduces to (see _centre_tap).

    Vector (C,) (a unit that already flattened its output): a single Linear(C, num_classes).
    """

    def __init__(self, in_shape: Sequence[int], filters: int, num_classes: int, pool: int = 2) -> None:
        super().__init__()
        in_shape = tuple(in_shape)
        if not (isinstance(num_classes, int) and num_classes >= 1):
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        self.in_shape = in_shape
        if _is_map(in_shape):
            if not (isinstance(filters, int) and filters >= 1):
                raise ValueError(f"filters must be a positive int, got {filters!r}")
            if not (isinstance(pool, int) and pool >= 1):
                raise ValueError(f"pool must be a positive int, got {pool!r}")
            c, h, w = in_shape
            ph, pw = min(pool, h), min(pool, w)
            # BatchNorm on a 1x1 map normalises each channel over the batch alone: undefined at
            # batch 1 (PyTorch raises), which the profiler and tight budgets do use. Such a map
            # gets a conv with a bias and no BatchNorm.
            norm = h * w > 1
            conv = nn.Conv2d(c, filters, kernel_size=3, padding=1, bias=not norm)
            self.net = nn.Sequential(
                conv if norm else _centre_tap(conv),
                nn.BatchNorm2d(filters) if norm else nn.Identity(),
                nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((ph, pw)), nn.Flatten(1),
                nn.Linear(filters * ph * pw, num_classes))
        elif len(in_shape) == 1:
            self.net = nn.Linear(in_shape[0], num_classes)
        else:
            raise ValueError(f"AuxNet takes a (C, H, W) feature map or a (C,) vector per sample, got shape {in_shape}")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _centre_tap(conv: nn.Conv2d) -> nn.Conv2d:
    """The 1x1 conv a padded 3x3 ``conv`` is on a 1x1 map: its other eight taps only ever meet the zero padding,
    so they change neither the output nor any gradient, yet their weights, gradients and optimizer state cost
    8/9 of the conv's memory (VGG's last conv unit at 32 px, after the fifth max-pool, outputs a 1x1 map).
    The 3x3 weights are drawn first and their centre kept, so the auxiliary net computes what the 3x3 one would
    from the same seed, and the random draws of every later layer are unchanged."""
    one = nn.utils.skip_init(nn.Conv2d, conv.in_channels, conv.out_channels, kernel_size=1,
                             bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        one.weight.copy_(conv.weight[:, :, 1:2, 1:2])
        if conv.bias is not None:
            one.bias.copy_(conv.bias)
    return one


class LocalLearner(nn.Module):
    """One unit and its auxiliary network (None for the last unit): what local learning trains.

    forward(x) gives the local logits, so a learner is a model for edgeflux.memory's
    training_step_fn / measure_training_peak; forward_with_output(x) also gives the unit's output.
    """

    def __init__(self, unit: nn.Module, aux: AuxNet | None, index: int = 0, name: str = "") -> None:
        super().__init__()
        self.unit = unit
        self.aux = aux
        self.index = index
        self.name = name

    def forward_with_output(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(unit output, local logits); for the last unit both are the unit's output."""
        out = self.unit(x)
        return out, (out if self.aux is None else self.aux(out))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_output(x)[1]

    def extra_repr(self) -> str:
        return f"index={self.index}, name={self.name!r}"


def local_learners(model: UnitModel, mode: str = "adaptive", classic_filters: int = 256, pool: int = 2,
                   seed: int | None = None) -> list[LocalLearner]:
    """One LocalLearner per unit of `model`, sharing the unit modules (not copies).

    seed: initialise the auxiliary networks from this seed, leaving torch's global RNG as it was;
    None draws from the global RNG. The auxiliary nets are put on the units' device and dtype.
    """
    infos = model.describe()
    filters = aux_filters(infos, mode, classic_filters)
    learners = []
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        for info, unit, f in zip(infos, model.units, filters):
            aux = None
            if f is not None:
                aux = AuxNet(info.out_shape, f, model.num_classes, pool)
                ref = next(unit.parameters(), None)
                if ref is not None:
                    aux = aux.to(device=ref.device, dtype=ref.dtype)
            learners.append(LocalLearner(unit, aux, info.index, info.name))
    log.info("%s: %s auxiliary networks, filters %s, %d auxiliary params", model.name, mode, filters,
             sum(count_params(lr.aux) for lr in learners if lr.aux is not None))
    return learners


def exit_params(learners: Sequence[LocalLearner], exit_index: int) -> int:
    """Parameters of the early-exit model at `exit_index`: units[0..exit_index] + that unit's aux."""
    if not 0 <= exit_index < len(learners):
        raise IndexError(f"exit {exit_index} is outside 0..{len(learners) - 1}")
    modules = [lr.unit for lr in learners[:exit_index + 1]]
    if learners[exit_index].aux is not None:
        modules.append(learners[exit_index].aux)
    return count_params(nn.ModuleList(modules))   # ModuleList.parameters() counts shared tensors once
