"""The memory tricks a PyTorch user tries before a paper (params.yaml: ``tricks`` in train_bp and finetune).
Torch-free: params are checked without torch; edgeflux.step applies them.

* ``accumulate``: micro-batches whose gradients add up to ``effective_batch`` samples before one optimizer step;
  the micro-batch is the largest whose measured step fits the budget. BatchNorm normalises each micro-batch.
* ``checkpoint``: the model's units grouped into ``segments`` (null: about the square root of their count,
  balanced by output size); every segment but the last keeps only its input and recomputes the rest in
  backward (torch.utils.checkpoint), BatchNorm's running statistics updated once.
* ``fused_step``: the optimizer updates each parameter as soon as its gradient is complete, during backward,
  and frees that gradient: no full set of gradients is ever held (PyTorch's "optimizer step in backward").
"""
from __future__ import annotations

from pydantic import Field, model_validator

from edgeflux.options import Options

TRICK_NAMES = ("accumulate", "checkpoint", "fused_step")
BACKPROP, AUTO = "backprop", "auto"
TRICK_LABELS = {"accumulate": "accumulation", "checkpoint": "checkpointing", "fused_step": "step in backward"}


class TrickOptions(Options):
    accumulate: bool = False
    effective_batch: int = Field(128, ge=1)      # accumulate: samples per optimizer step
    checkpoint: bool = False
    segments: int | None = Field(None, ge=1)     # checkpoint: how many segments (null: ~sqrt(units))
    fused_step: bool = False

    @model_validator(mode="after")
    def _compatible(self) -> TrickOptions:
        if self.accumulate and self.fused_step:
            raise ValueError("tricks.accumulate and tricks.fused_step exclude each other: a step in backward "
                             "applies each micro-batch's gradient at once, so nothing accumulates; turn one off")
        return self

    def on(self) -> tuple[str, ...]:
        """The tricks turned on, in TRICK_NAMES order."""
        return tuple(name for name in TRICK_NAMES if getattr(self, name))

    def with_on(self, names) -> TrickOptions:
        """These options with the named tricks turned on as well."""
        return TrickOptions.model_validate({**self.model_dump(), **{name: True for name in names}})


def parse_backprop(spec: str) -> tuple[bool, tuple[str, ...]]:
    """(BitTrain on, tricks on) of a from-scratch method name such as 'backprop-checkpoint-fused_step' (train_bp's
    ``method``); ValueError naming the allowed forms otherwise."""
    base, *mods = spec.split("-")
    if base != BACKPROP or len(set(mods)) < len(mods) or any(m not in ("bittrain", *TRICK_NAMES) for m in mods):
        raise ValueError(f"train_bp method {spec!r} is unknown: {AUTO}, or {BACKPROP} optionally followed by "
                         f"-bittrain and any of {', '.join('-' + t for t in TRICK_NAMES)}")
    return "bittrain" in mods, tuple(t for t in TRICK_NAMES if t in mods)


def backprop_label(spec: str) -> str:
    """'backprop-bittrain-checkpoint' -> 'backprop + BitTrain + checkpointing'."""
    bittrain, tricks = parse_backprop(spec)
    return BACKPROP + (" + BitTrain" if bittrain else "") + "".join(f" + {TRICK_LABELS[t]}" for t in tricks)


def backprop_options(spec: str, opts):
    """``opts`` (a section with ``tricks`` and ``bittrain``) as a from-scratch method name runs it: its
    modifiers turned on."""
    bittrain, tricks = parse_backprop(spec)
    update = {"tricks": opts.tricks.with_on(tricks)}
    if bittrain:
        update["bittrain"] = opts.bittrain.model_copy(update={"enabled": True})
    return opts.model_copy(update=update)
