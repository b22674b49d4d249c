"""The prepare stage's output on disk, and reading it back in the stages that train on it.

out_dir/data.pt holds the tensors (uint8 images, labels, split indices) and out_dir/manifest.json the
settings and per-split counts, human-readable and diffable by DVC. Files are written by rename so an
interrupted stage never leaves half a file, and everything read back is checked (data.pt's content
checksum, then what it must contain: shapes, split indices, labels in range), so a stale or damaged
output fails with the command that recreates it instead of an error deep inside training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeflux.artifacts import CorruptFileError, load_checked, read_json, save_checked, write_json
from edgeflux.errors import UserError

_FORMAT_VERSION = 1
_PREPARE_FIX = "run `dvc repro prepare` (add -f to force it) to (re)create it"


class PreparedDataError(RuntimeError, UserError):
    """The output of the prepare stage is missing or unreadable."""


@dataclass
class PreparedData:
    """Images at their final size, labels, split indices and normalisation statistics."""

    name: str
    classes: list[str]
    images: torch.Tensor = field(repr=False)  # uint8 [N_train + N_test, C, S, S], train first
    labels: torch.Tensor = field(repr=False)  # int64 [N_train + N_test]
    splits: dict[str, torch.Tensor] = field(repr=False)  # int64 indices into images
    mean: list[float]  # per channel, on the [0, 1] scale, from the "train" split only
    std: list[float]
    manifest: dict


def save_prepared(data: PreparedData, out_dir: Path) -> None:
    """Write out_dir/data.pt (tensors and fields) and out_dir/manifest.json (indent 2, sorted keys)."""
    out_dir = Path(out_dir)
    payload = {
        "format": _FORMAT_VERSION,
        "name": data.name,
        "classes": list(data.classes),
        "images": data.images,
        "labels": data.labels,
        "splits": dict(data.splits),
        "mean": list(data.mean),
        "std": list(data.std),
    }
    problem = _payload_problem(payload)
    if problem:   # a bug upstream: never write a file that every later stage would refuse
        raise ValueError(f"refusing to save invalid prepared data: {problem}")
    save_checked(out_dir / "data.pt", payload)
    write_json(out_dir / "manifest.json", data.manifest)


def load_prepared(out_dir: Path) -> PreparedData:
    """Read what save_prepared wrote; PreparedDataError (naming the prepare stage) if missing/corrupt."""
    out_dir = Path(out_dir)
    data_path, manifest_path = out_dir / "data.pt", out_dir / "manifest.json"
    for path in (data_path, manifest_path):
        if not path.is_file():
            raise PreparedDataError(f"{path} not found: the prepare stage makes it; {_PREPARE_FIX}")
    try:
        # mmap: the images stay file-backed page cache, which the kernel can drop under memory
        # pressure and share between stages, rather than anonymous memory that only swap can free;
        # a stage copies out the rows of its splits (tensors()) and does not touch the rest.
        payload = load_checked(data_path, _PREPARE_FIX, weights_only=True, mmap=True)
        manifest = read_json(manifest_path, _PREPARE_FIX)
    except CorruptFileError as e:
        raise PreparedDataError(str(e)) from None
    problem = _payload_problem(payload)
    if problem:
        raise PreparedDataError(f"{data_path} is not valid prepared data: {problem}; {_PREPARE_FIX}")
    return PreparedData(
        name=payload["name"],
        classes=list(payload["classes"]),
        images=payload["images"],
        labels=payload["labels"],
        splits=dict(payload["splits"]),
        mean=list(payload["mean"]),
        std=list(payload["std"]),
        manifest=manifest,
    )


def _payload_problem(p) -> str | None:
    keys = {"format", "name", "classes", "images", "labels", "splits", "mean", "std"}
    if not isinstance(p, dict) or not keys <= p.keys():
        return f"expected a dict with keys {sorted(keys)}"
    if p["format"] != _FORMAT_VERSION:
        return f"format {p['format']} (this edgeflux reads format {_FORMAT_VERSION})"
    images, labels = p["images"], p["labels"]
    if (images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64
            or labels.shape != (len(images),)):
        return f"images {tuple(images.shape)} {images.dtype} and labels {tuple(labels.shape)} do not fit"
    if len(p["mean"]) != images.shape[1] or len(p["std"]) != images.shape[1]:
        return "mean/std do not match the channel count"
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(p["classes"])):
        return (f"labels range over {int(labels.min())}..{int(labels.max())}, outside the "
                f"{len(p['classes'])} classes 0..{len(p['classes']) - 1}")
    for name, idx in p["splits"].items():
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(images)):
            return f"split {name!r} indexes outside the {len(images)} images"
    return None
