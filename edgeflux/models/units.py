"""A model as an ordered list of units: the granularity every edgeflux technique works at.

NeuroFlux trains unit by unit, MobileTL rewrites the top inverted-residual units,
ElasticTrainer orders tensors unit by unit, MEANet splits at a unit boundary. So every model in
the zoo is a `UnitModel`: `units[i]` is a plain nn.Module and the model is their composition.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

UNIT_KINDS = ("conv", "residual", "inverted_residual", "classifier")


@dataclass
class UnitInfo:
    """Static description of one unit, with shapes per sample (no batch dimension)."""

    index: int
    name: str  # "conv3", "block2.1", "irb5", "classifier"
    kind: str  # one of UNIT_KINDS
    in_shape: tuple[int, ...]  # (C, H, W)
    out_shape: tuple[int, ...]  # (C, H, W) or (num_classes,)
    out_channels: int | None  # None when the output is not a feature map
    downsamples: bool  # spatial size smaller at output than at input
    params: int


def count_params(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements in `module` (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Put `module` in eval mode, then restore every submodule's own train/eval flag.

    Restoring per submodule (not `module.train(was_training)`) keeps deliberate mixes intact,
    e.g. frozen BatchNorm layers kept in eval inside a model that trains.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


class UnitModel(nn.Module):
    """A CNN as an ordered nn.ModuleList of units; forward runs them in order."""

    def __init__(
        self,
        name: str,
        units: Sequence[tuple[str, str, nn.Module]],
        *,
        num_classes: int,
        in_channels: int,
        image_size: int,
        width: float,
    ) -> None:
        """`units` is a sequence of (unit name, unit kind, module) in forward order."""
        super().__init__()
        if not units:
            raise ValueError(f"{name}: a UnitModel needs at least one unit")
        names = [n for n, _, _ in units]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: unit names must be unique, got {names}")
        for unit_name, kind, _ in units:
            if kind not in UNIT_KINDS:
                raise ValueError(f"{name}: unit {unit_name!r} has kind {kind!r}; use one of {UNIT_KINDS}")
        self.units = nn.ModuleList(m for _, _, m in units)
        self.unit_names: list[str] = names
        self.unit_kinds: list[str] = [k for _, k, _ in units]
        self.name = name
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.image_size = image_size
        self.width = width
        self.__dict__["running_unit"] = None   # plain attribute (not nn.Module's __setattr__): set per unit

    @property
    def running_unit(self) -> str | None:
        """The unit whose forward is running now (None between forwards): edgeflux.memory.UnitTracker
        reads it to attribute saved tensors without module hooks."""
        return self.__dict__.get("running_unit")   # (.get: a model unpickled from an older edgeflux)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, len(self.units))

    def forward_until(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        """Run units[0:stop] and return the activation at that boundary (x itself for stop=0)."""
        self._check_boundary(stop)
        return self._run(x, stop)

    def _run(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        state = self.__dict__
        try:
            for name, unit in zip(self.unit_names[:stop], self.units):
                state["running_unit"] = name
                x = unit(x)
        finally:
            state["running_unit"] = None
        return x

    def head(self, start: int) -> nn.Sequential:
        """units[start:] as an nn.Sequential sharing the modules (not copies) with this model."""
        self._check_boundary(start)
        return nn.Sequential(*self.units[start:])

    def unit_index(self, name: str) -> int:
        """Index of the unit called `name`."""
        try:
            return self.unit_names.index(name)
        except ValueError:
            raise KeyError(f"{self.name} has no unit {name!r}; units are {self.unit_names}") from None

    def describe(self) -> list[UnitInfo]:
        """Per-unit shapes and parameter counts, found by one forward of a zero sample.

        Runs in eval mode (BatchNorm must not update its running stats) under no_grad, and
        restores each submodule's train/eval mode afterwards.
        """
        ref = next(self.parameters())
        x = torch.zeros(1, self.in_channels, self.image_size, self.image_size, device=ref.device, dtype=ref.dtype)
        infos = []
        with eval_mode(self), torch.no_grad():
            for i, (unit, name, kind) in enumerate(zip(self.units, self.unit_names, self.unit_kinds)):
                y = unit(x)
                in_shape, out_shape = tuple(x.shape[1:]), tuple(y.shape[1:])
                spatial = len(in_shape) == 3 and len(out_shape) == 3
                infos.append(
                    UnitInfo(
                        index=i,
                        name=name,
                        kind=kind,
                        in_shape=in_shape,
                        out_shape=out_shape,
                        out_channels=out_shape[0] if len(out_shape) == 3 else None,
                        downsamples=spatial and (out_shape[1] < in_shape[1] or out_shape[2] < in_shape[2]),
                        params=count_params(unit),
                    )
                )
                x = y
        return infos

    def _check_boundary(self, i: int) -> None:
        if not 0 <= i <= len(self.units):
            raise IndexError(f"unit boundary {i} is outside 0..{len(self.units)} for {self.name}")

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, units={len(self.units)}, num_classes={self.num_classes}, "
            f"in_channels={self.in_channels}, image_size={self.image_size}, width={self.width}"
        )


def keep_eval(module: nn.Module) -> nn.Module:
    """Mark `module` to stay in eval mode while the model around it trains (train_mode honours the
    mark): BatchNorm whose statistics a fine-tuning method froze keeps normalising with them."""
    module.__dict__["edgeflux_keep_eval"] = True
    return module.eval()


def freeze(module: nn.Module) -> nn.Module:
    """No gradients for `module`'s parameters, and eval mode while the model trains (keep_eval)."""
    module.requires_grad_(False)
    return keep_eval(module)


def train_mode(model: nn.Module) -> nn.Module:
    """model.train(), except the submodules marked keep_eval (and what they contain), which stay in eval.

    What a trainer calls instead of model.train(): that would un-freeze BatchNorm a method froze.
    """
    model.train()
    for m in model.modules():
        if m.__dict__.get("edgeflux_keep_eval"):
            m.eval()
    return model
