"""The CUDA caching allocator set to split its blocks to the request, so that the figure a budget is held
against does not depend on what the process allocated before.

``torch.cuda.max_memory_allocated`` counts the blocks the caching allocator hands out, not the bytes asked
for. By default it splits a cached block of its large pool (requests over 1 MiB) only when more than 1 MiB
would be left over: a request served from a block up to 1 MiB larger takes the whole block, and the figure
counts it. Which cached block serves a request depends on the process's earlier allocations, so the same
training step can count up to 1 MiB more per live tensor at one moment of a run than at another: a step
measured under the budget could train over it (``bench/results/cuda_budget_probe_cuda.md``). With expandable
segments the allocator splits every block to the request rounded up to 512 bytes, wherever the block comes
from, so the figure is the step's own: the measured step and every step that trains on a batch of its size
count the same bytes.

``split_blocks_exactly()`` turns that on for the process (once; the measurement and the training loop call
it before they use a CUDA device), keeping the allocator's other settings, unless its settings
(``PYTORCH_ALLOC_CONF``) already choose ``expandable_segments`` (respected, with a warning when it is off) or
another allocator backend is in use.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch

log = logging.getLogger(__name__)

SETTING = "expandable_segments"
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")   # torch reads both (the second: older name)
_state: bool | None = None   # the outcome, once decided for the process


def live_settings() -> str:
    """The allocator's settings as they are now: the last string set, else its environment variable."""
    if (getter := getattr(torch._C, "_accelerator_getAllocatorSettings", None)) is not None:
        return getter()
    return next((os.environ[var] for var in ENV_VARS if os.environ.get(var)), "")


def configured() -> bool | None:
    """The choice of expandable segments the allocator's settings make, or None if they make none."""
    for item in live_settings().split(","):
        key, _, value = item.partition(":")
        if key.strip() == SETTING:
            return value.strip().lower() == "true"
    return None


def split_blocks_exactly() -> bool:
    """Make the CUDA caching allocator split every block to the request (expandable segments), once per process.
    Returns whether it does: False without CUDA, with another allocator backend, where the allocator's settings
    turn expandable segments off, or where torch refuses the setting (each but the first with a warning)."""
    global _state
    if _state is None:
        _state = _switch_on()
    return _state


def _switch_on() -> bool:
    if not torch.cuda.is_available():
        return False
    why = ("a memory budget's figure can then be exceeded by up to 1 MiB per tensor alive at the peak "
           "(the allocator's block sizes depend on its history)")
    if (backend := torch.cuda.memory.get_allocator_backend()) != "native":
        log.warning("CUDA allocator backend %r: blocks are not split by edgeflux's setting; %s", backend, why)
        return False
    if (chosen := configured()) is not None:
        if not chosen:
            log.warning("%s is off in the CUDA allocator's settings; %s", SETTING, why)
        return chosen
    # a string set replaces every setting: the others are kept by setting them again
    settings = ",".join([*(item for item in live_settings().split(",") if item.strip()), f"{SETTING}:True"])
    try:
        if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
            torch._C._accelerator_setAllocatorSettings(settings)
        else:   # older torch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.cuda.memory._set_allocator_settings(settings)
    except (RuntimeError, AttributeError) as exc:
        log.warning("could not turn on %s in the CUDA allocator (%s); %s", SETTING, exc, why)
        return False
    log.debug("CUDA allocator: %s on (blocks split to the request)", SETTING)
    return True
