"""Files the stages hand to each other: trained models and JSON metrics, written atomically.

A model file holds its zoo spec next to the weights, so ``load_model`` rebuilds it without the
params that made it (a device downloading a pre-trained backbone needs only the file).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgeflux.models import build_model


def atomic_write(path: str | Path, write) -> None:
    """write(tmp_path), then rename over path: a kill mid-write leaves the old file (or none), never half a file.

    The temporary file is fsync'd before the rename and the directory after it: without that, a power
    cut on a device (an SD card, ext4's delayed allocation) can leave the new name pointing at an empty
    file, and a record or manifest that vouches for bytes that never reached the disk.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:   # some file systems (and Windows) cannot open or sync a directory: the rename still holds
        if not path.is_dir():
            raise


def write_json(path: str | Path, data: Any) -> None:
    atomic_write(Path(path), lambda p: p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


class CorruptFileError(ValueError):
    """A file a stage reads is not valid JSON (truncated, edited by hand)."""


def read_json(path: str | Path, missing: str) -> Any:
    """The JSON in `path`; FileNotFoundError saying `missing` (what makes the file) when it is absent,
    CorruptFileError saying the same when it is not valid JSON."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptFileError(f"{path} is not valid JSON ({exc}); remake it: {missing}") from None


def save_model(path: str | Path, model: nn.Module, spec: dict, meta: dict | None = None) -> None:
    """``spec``: build_model keyword arguments (name, num_classes, in_channels, width, ...)."""
    state = {"spec": spec, "state_dict": model.state_dict(), "meta": meta or {}}
    atomic_write(Path(path), lambda p: torch.save(state, p))


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild a model saved by ``save_model``; returns (model, meta)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file; run the stage that writes it (see dvc.yaml: `dvc repro`)")
    state = torch.load(path, map_location=map_location, weights_only=False)
    model = build_model(**state["spec"])
    model.load_state_dict(state["state_dict"])
    return model, state["meta"]
