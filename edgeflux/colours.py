"""One colour per method, the same in every figure: the report's (Pareto, accuracy vs time) and the
benchmarks'. A method is known by its label (edgeflux.finetune.finetune_label, edgeflux.tricks'
backprop_label, the stages' rows, the benchmarks' names).

A label in METHOD_COLOURS has its own colour. A composition ("MobileTL + BitTrain", "ElasticTrainer on
MobileTL", "backprop + BitTrain + checkpointing") takes a shade of the colour of the method it starts
with, lighter or darker by what it adds: related methods look related, and still differ. Any other label
gets a colour of PALETTE picked by a checksum of the label, so it too is the same in every figure and run.
"""
from __future__ import annotations

import re
import zlib

METHOD_COLOURS = {
    # from scratch
    "backprop": "#ff7f0e", "plain backprop": "#ff7f0e",
    "accumulation": "#bcbd22", "backprop + accumulation": "#bcbd22",
    "checkpointing": "#d62728", "backprop + checkpointing": "#d62728",
    "step in backward": "#9467bd", "backprop + step in backward": "#9467bd",
    "checkpointing + step in backward": "#8c564b", "backprop + checkpointing + step in backward": "#8c564b",
    "method: auto": "#7f7f7f", "method: auto, plan stored": "#c7c7c7",
    "NeuroFlux": "#1f77b4", "NeuroFlux, full model": "#1f77b4", "NeuroFlux, exit": "#6baed6",
    "classic LL": "#2ca02c",
    # fine-tuning
    "MobileTL": "#17becf", "FT-All": "#e377c2", "ElasticTrainer": "#393b79", "FT-Last": "#98df8a",
    "FT-BN": "#ff9896", "FT-BN+Bias": "#dbdb8d", "FT-Bias (TinyTL-B)": "#c5b0d5", "FT-Bias": "#c5b0d5",
    "FT-Blocks": "#c49c94",
    # MEANet
    "MEANet, edge only": "#637939", "MEANet, edge + cloud": "#b5a01a", "cloud only": "#525252",
}
PALETTE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")
# what a composition adds, as (mix towards white or black, how far): by a checksum of the added text
SHADES = (("black", 0.35), ("white", 0.4), ("black", 0.55), ("white", 0.6))


def _base(label: str) -> str:
    """The label without what only describes its run: '(auto)', '(29% sent)', the exit's unit name."""
    label = re.sub(r"\s*\((auto|\d+% sent)\)$", "", label)
    return re.sub(r"^NeuroFlux, exit \S+", "NeuroFlux, exit", label)


def _mix(colour: str, towards: str, amount: float) -> str:
    target = 255 if towards == "white" else 0
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (target - c) * amount):02x}" for c in rgb)


def known_method(label: str) -> str | None:
    """The METHOD_COLOURS entry ``label`` is, or is a composition of ("MobileTL + BitTrain": "MobileTL"), or None."""
    base = _base(label)
    if base in METHOD_COLOURS:
        return base
    return max((k for k in METHOD_COLOURS if base.startswith((k + " + ", k + " on "))), key=len, default=None)


def method_colour(label: str) -> str:
    """The colour of the method labelled ``label`` (see the module docstring)."""
    base, known = _base(label), known_method(label)
    if known == base:
        return METHOD_COLOURS[base]
    if known is not None:
        towards, amount = SHADES[zlib.crc32(base[len(known):].encode()) % len(SHADES)]
        return _mix(METHOD_COLOURS[known], towards, amount)
    return PALETTE[zlib.crc32(base.encode()) % len(PALETTE)]
