"""The fine-tuning methods' names, their labels in the report, and the options every method takes
(params.yaml's ``finetune`` section). Torch-free: params are checked without torch; edgeflux/finetune/methods.py
implements each name and checks that the two lists agree.

A method's name may carry modifiers (``parse_method``): ``-bittrain`` turns BitTrain on for that run, a memory
trick's name (``-accumulate``, ``-checkpoint``, ``-fused_step``) turns it on (edgeflux.tricks, with the section's
``tricks`` settings), and ``elastic-<base>`` selects among ``<base>``'s tensors (ElasticTrainer on a MobileTL
model: ``elastic-mobiletl``).
"""
from __future__ import annotations

from typing import NamedTuple

from pydantic import Field

from edgeflux.elastic.options import ElasticOptions
from edgeflux.memory.options import MemoryOptions
from edgeflux.options import TrainOptions
from edgeflux.tricks.options import TRICK_LABELS, TRICK_NAMES, TrickOptions

# name -> its row's label in the report (the names params.yaml's finetune.methods takes)
METHOD_LABELS = {"ft_all": "FT-All", "ft_last": "FT-Last", "ft_bn": "FT-BN", "ft_bn_bias": "FT-BN+Bias",
                 "ft_bias": "FT-Bias (TinyTL-B)", "ft_blocks": "FT-Blocks", "mobiletl": "MobileTL",
                 "elastic": "ElasticTrainer"}
METHOD_NAMES = tuple(METHOD_LABELS)
MODIFIERS = ("bittrain", *TRICK_NAMES)
METHOD_HELP = (f"one of {' | '.join(METHOD_NAMES)}, optionally followed by -bittrain (BitTrain on) and any of "
               f"{', '.join('-' + t for t in TRICK_NAMES)} (memory tricks on), and elastic by -<base> (the method "
               "whose tensors it selects among, e.g. elastic-mobiletl)")


class ParsedMethod(NamedTuple):
    method: str
    base: str | None            # elastic: the method whose tensors it selects among
    bittrain: bool
    tricks: tuple[str, ...] = ()   # memory tricks the name turns on, in TRICK_NAMES order


def parse_method(spec: str) -> ParsedMethod:
    """The parts of a method name such as 'mobiletl-bittrain', 'elastic-mobiletl' or 'ft_all-checkpoint';
    ValueError naming the allowed forms otherwise."""
    method, *mods = spec.split("-")
    base = [m for m in mods if m in METHOD_LABELS and m != "elastic"]
    unknown = [m for m in mods if m not in MODIFIERS and m not in base]
    if method not in METHOD_LABELS or unknown or len(set(mods)) < len(mods) or len(base) > (method == "elastic"):
        raise ValueError(f"finetune method {spec!r} is unknown: {METHOD_HELP}")
    return ParsedMethod(method, base[0] if base else None, "bittrain" in mods,
                        tuple(t for t in TRICK_NAMES if t in mods))


def finetune_label(spec: str, bittrain: bool = False) -> str:
    """'elastic-mobiletl' -> 'ElasticTrainer on MobileTL'; '-bittrain' (or bittrain on for every method) adds
    '+ BitTrain', a trick its label ('ft_all-checkpoint' -> 'FT-All + checkpointing')."""
    method, base, on, tricks = parse_method(spec)
    label = METHOD_LABELS[method] + (f" on {METHOD_LABELS[base]}" if base else "")
    return label + (" + BitTrain" if on or bittrain else "") + "".join(f" + {TRICK_LABELS[t]}" for t in tricks)


class FinetuneOptions(TrainOptions, MemoryOptions):
    """The options every fine-tuning method takes (params.yaml's ``finetune`` section, `model` and
    `methods` aside)."""

    blocks: int = Field(3, ge=1)             # block-wise methods: the top `blocks` blocks train
    quantize_bottom: bool = True             # mobiletl: the frozen bottom runs in int8
    calibration_batches: int = Field(8, ge=1)   # target batches (of 32) that calibrate the int8 bottom
    elastic: ElasticOptions = ElasticOptions()   # elastic: the time objective and how often to re-select
    tricks: TrickOptions = TrickOptions()        # memory tricks for every method (or per method: -checkpoint, ...)
    # frozen convolutions and eval-mode BatchNorm save no input for backward, ReLU/ReLU6 a 1-bit mask
    # (edgeflux.tricks.lean: the same gradients); false: torch's own layers (to measure the difference)
    lean_layers: bool = True
