"""Resumable runs: what defines a run (its signature), the RNG state, and checkpoints written atomically.

A checkpoint is resumed only by the run it belongs to: ``load_checkpoint`` returns None for a file
of another run (another signature) and for an unreadable or corrupt one (its content checksum,
``artifacts.save_checked``, does not match), and the run starts over.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from edgeflux.artifacts import CorruptFileError, hash_tensor, load_checked, save_checked
from edgeflux.data import Images

log = logging.getLogger(__name__)


def run_signature(**parts) -> str:
    """A short hash of what defines a run; a checkpoint of a different run is never resumed."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tensor_digest(*tensors: torch.Tensor | Images) -> str:
    """sha256 over the tensors' dtypes, shapes and bytes: any changed value, label or sample order shows.

    (Hashes the memory in place, ~1 GB/s; a contiguous CPU tensor is not copied. Images are
    hashed as what defines their values: the uint8 pixels and the normalisation.)
    """
    h = hashlib.sha256()
    for t in tensors:
        for part in (t.pixels, t.mean, t.std) if isinstance(t, Images) else (t,):
            hash_tensor(h, part)
    return h.hexdigest()


def rng_state() -> dict:
    """The global RNG states a resumed run must continue from: CPU, and every CUDA device's when CUDA
    is in use (dropout on a GPU draws from the CUDA generator)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def set_rng_state(state: dict | torch.Tensor) -> None:
    """Restore what rng_state() returned (a bare tensor: a checkpoint that kept the CPU state only)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict) -> None:
    save_checked(path, state)  # atomic: a kill mid-write leaves the previous checkpoint


def load_checkpoint(path: Path, signature: str) -> dict | None:
    if not path.exists():
        return None
    try:
        state = load_checked(path, "training from scratch", weights_only=True)
    except CorruptFileError as exc:  # truncated, bit-flipped or foreign: start over rather than resume it
        log.warning("ignoring checkpoint: %s", exc)
        return None
    if state.get("signature") != signature:
        log.info("checkpoint %s belongs to another configuration; training from scratch", path)
        return None
    return state
