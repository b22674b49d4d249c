"""The memory options every budgeted trainer takes (params.yaml: the device section, which budgeted stages
inherit), so that techniques compose: a budget, a batch limit and BitTrain for any trainer. Torch-free."""
from __future__ import annotations

from pydantic import Field

from edgeflux.bittrain.options import BitTrainOptions
from edgeflux.options import Bytes, Options


class MemoryOptions(Options):
    """The memory options every budgeted trainer takes (composable across techniques)."""

    budget: Bytes | None = None
    max_batch: int = Field(256, ge=1)
    bittrain: BitTrainOptions = BitTrainOptions()
