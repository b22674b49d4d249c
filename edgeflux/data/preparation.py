"""Preparing a raw dataset for every model: one image size and channel count, deterministic splits.

prepare() converts all images in bulk (pad, antialiased resize, RGB <-> gray) into one uint8 tensor
(images a loader already brought to that size, as imagefolder's, are used without a copy), carves
class-stratified splits from a seed (train/val/test and the source_*/target_* splits of transfer
learning) and computes the normalisation statistics on the train split only, so no evaluation image
leaks into them, or takes ImageNet's, which models trained from ImageNet weights expect. The manifest
records every setting and a hash of every source file, so the output names exactly what it was made from.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from edgeflux.data.images import CHUNK_BYTES, LUMA_601, convert_into
from edgeflux.data.raw import RawDataset
from edgeflux.data.splits import DataParamsError, make_splits
from edgeflux.data.store import _FORMAT_VERSION, PreparedData

log = logging.getLogger(__name__)

# torchvision's ImageNet statistics (its pretrained weights' ImageClassification transforms), on the [0, 1] scale.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def prepare(
    raw: RawDataset,
    image_size: int = 32,
    channels: int | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    split_by: str = "data",
    source_fraction: float = 0.5,
    source_classes: list[int] | None = None,
    normalize: str = "dataset",
) -> PreparedData:
    """Resize/pad to `image_size`, convert to `channels` (None: native) and split deterministically.

    Splits, all stratified by class and shuffled by `seed`: "train"/"val" from the original
    training set (val is `val_fraction` of it, per class within one image of exact; a dataset's own
    val set, raw.given_val, instead when it has one), "test" is the original test set (same images,
    shuffled order so that a prefix is a fair sample).
    Transfer-learning splits source_*/target_* for train, val and test:
      split_by="data":    train and val split per class by `source_fraction`; test shared.
      split_by="classes": by membership of the label in `source_classes` (default: first half).
      split_by="none":    source_* and target_* are the full splits.
    normalize: "dataset" (mean/std of the train split) or "imagenet" (IMAGENET_MEAN/STD).
    """
    _check_raw(raw)
    n_classes = len(raw.classes)
    native_c = raw.train_images.shape[1]
    out_c, source_classes = _check_params(native_c, n_classes, image_size, channels, val_fraction, split_by,
                                          source_fraction, source_classes, normalize)
    images, resize = _output_images(raw, out_c, image_size)
    labels = torch.cat([raw.train_labels, raw.test_labels]).to(torch.int64)
    splits = make_splits(raw.train_labels, labels, val_fraction, seed, split_by, source_fraction, source_classes,
                         raw.given_val)
    mean, std = _channel_stats(images, splits["train"]) if normalize == "dataset" else imagenet_stats(out_c)
    manifest = {
        "format": _FORMAT_VERSION,
        "dataset": raw.name,
        "classes": list(raw.classes),
        "sources": [{"path": s, "sha256": sha256_path(Path(s))} for s in raw.sources],
        "seed": seed,
        "image_size": image_size,
        "channels": out_c,
        "native_channels": native_c,
        "native_size": list(raw.train_images.shape[2:]),
        "resize": raw.notes.get("resize", resize) if resize == "none" else resize,   # the loader's, if it resized
        "val_fraction": None if raw.given_val else val_fraction,
        "split_by": split_by,
        "source_fraction": source_fraction if split_by == "data" else None,
        "source_classes": source_classes,
        "normalize": normalize,
        "mean": mean,
        "std": std,
        "counts": _counts(splits, labels, n_classes),
        **({"loader": raw.notes} if raw.notes else {}),
    }
    log.info(
        "%s: %d train / %d val / %d test images, %dx%dx%d (%s), split_by=%s",
        raw.name, len(splits["train"]), len(splits["val"]), len(splits["test"]), out_c, image_size, image_size,
        manifest["resize"], split_by,
    )
    return PreparedData(raw.name, list(raw.classes), images, labels, splits, mean, std, manifest)


def imagenet_stats(channels: int) -> tuple[list[float], list[float]]:
    """IMAGENET_MEAN/STD for `channels`; for gray images the luma-weighted (LUMA_601) mean of the three, since a
    gray pixel is that weighting of R, G and B (the std so weighted is an approximation: channels correlate)."""
    if channels == 3:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return ([sum(w * m for w, m in zip(LUMA_601, IMAGENET_MEAN))],
            [sum(w * s for w, s in zip(LUMA_601, IMAGENET_STD))])


def _output_images(raw: RawDataset, out_c: int, size: int) -> tuple[torch.Tensor, str]:
    """All images, train first, at `size` and `out_c` channels, and how they were resized.

    Raw images already at that size and channel count in one buffer, train then test (imagefolder decodes into
    one), are used as they are: a converted copy would double the peak memory of preparing a folder of photos.
    """
    train, test = raw.train_images, raw.test_images
    if train.shape[1:] == (out_c, size, size) and (joined := _adjacent(train, test)) is not None:
        return joined, "none"
    images = torch.empty((len(train) + len(test), out_c, size, size), dtype=torch.uint8)
    resize = convert_into(train, images[: len(train)])
    convert_into(test, images[len(train) :])
    return images, resize


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a and b as one tensor without a copy when b follows a in the same storage (both contiguous), else None."""
    if not (a.is_contiguous() and b.is_contiguous()):
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.numel():
        return None
    return a.as_strided((len(a) + len(b), *a.shape[1:]), a.stride(), a.storage_offset())


def _counts(splits: dict[str, torch.Tensor], labels: torch.Tensor, n_classes: int) -> dict[str, dict]:
    """Each split's size, in total and per class."""
    return {name: {"total": len(idx), "per_class": torch.bincount(labels[idx], minlength=n_classes).tolist()}
            for name, idx in splits.items()}


def _check_params(
    native_c: int,
    n_classes: int,
    image_size: int,
    channels: int | None,
    val_fraction: float,
    split_by: str,
    source_fraction: float,
    source_classes: list[int] | None,
    normalize: str = "dataset",
) -> tuple[int, list[int] | None]:
    """prepare()'s settings checked against the dataset: (output channels, sorted source classes).

    Every problem is a DataParamsError naming the data.* setting, raised before any image is converted.
    """
    if not isinstance(image_size, int) or image_size < 1:
        raise DataParamsError(f"data.image_size must be a positive int, got {image_size!r}")
    if channels not in (None, 1, 3):
        raise DataParamsError(f"data.channels must be 1, 3 or None (keep the native {native_c}), got {channels!r}")
    out_c = native_c if channels is None else channels
    if out_c != native_c and native_c not in (1, 3):
        raise DataParamsError(f"data.channels: cannot convert {native_c}-channel images to {out_c} channels (only 1 <-> 3)")
    if normalize not in ("dataset", "imagenet"):
        raise DataParamsError(f"data.normalize must be 'dataset' or 'imagenet', got {normalize!r}")
    if not 0 < val_fraction < 1:
        raise DataParamsError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
    if split_by not in ("data", "classes", "none"):
        raise DataParamsError(f"data.split_by must be 'data', 'classes' or 'none', got {split_by!r}")
    if split_by == "data" and not 0 < source_fraction < 1:
        raise DataParamsError(f"data.source_fraction must be in (0, 1) with split_by='data', got {source_fraction!r}")
    if source_classes is not None and split_by != "classes":
        raise DataParamsError(f"data.source_classes only applies with split_by='classes' (split_by is {split_by!r})")
    if split_by == "classes":
        if source_classes is None:
            source_classes = list(range(n_classes // 2))
        source_classes = [int(c) for c in source_classes]
        bad = [c for c in source_classes if not 0 <= c < n_classes]
        if bad:
            raise DataParamsError(f"data.source_classes {bad} out of range: class ids are 0..{n_classes - 1}")
        if len(set(source_classes)) != len(source_classes):
            raise DataParamsError(f"data.source_classes has duplicates: {source_classes}")
        if not 0 < len(source_classes) < n_classes:
            raise DataParamsError(
                f"data.source_classes must name at least one and at most {n_classes - 1} of the "
                f"{n_classes} classes, so both source and target have classes"
            )
        source_classes = sorted(source_classes)
    return out_c, source_classes


def _check_raw(raw: RawDataset) -> None:
    for part in ("train", "test"):
        x, y = getattr(raw, f"{part}_images"), getattr(raw, f"{part}_labels")
        if x.dtype != torch.uint8 or x.dim() != 4:
            raise ValueError(f"{raw.name}: {part}_images must be uint8 [N, C, H, W], got {x.dtype} {tuple(x.shape)}")
        if y.dim() != 1 or len(y) != len(x):
            raise ValueError(f"{raw.name}: {part}_labels must be [N] with N={len(x)}, got {tuple(y.shape)}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= len(raw.classes)):
            raise ValueError(f"{raw.name}: {part}_labels outside 0..{len(raw.classes) - 1}")
    if raw.train_images.shape[1:] != raw.test_images.shape[1:]:
        raise ValueError(
            f"{raw.name}: train images {tuple(raw.train_images.shape[1:])} and test images "
            f"{tuple(raw.test_images.shape[1:])} differ in shape"
        )


def _channel_stats(images: torch.Tensor, idx: torch.Tensor) -> tuple[list[float], list[float]]:
    """Exact per-channel mean/std (population) on the [0, 1] scale, via 256-bin histograms."""
    n_c = images.shape[1]
    hist = torch.zeros(n_c, 256, dtype=torch.float64)
    # CHUNK_BYTES of uint8 images a step: with the channel's copy and bincount's scratch a step holds several times
    # that, which must stay small beside the dataset (preparing holds the dataset once: see _output_images)
    chunk = max(1, CHUNK_BYTES // images[0].numel())
    for start in range(0, len(idx), chunk):
        x = images[idx[start : start + chunk]]
        for c in range(n_c):
            hist[c] += torch.bincount(x[:, c].reshape(-1), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255
    n = hist.sum(1)
    mean = (hist * values).sum(1) / n
    var = ((hist * values**2).sum(1) / n - mean**2).clamp_min(0)
    std = var.sqrt()
    std[std == 0] = 1.0  # a constant channel: leave it unscaled rather than divide by zero
    return mean.tolist(), std.tolist()


def sha256_path(path: Path) -> str | None:
    """sha256 of a file; of a folder, over its files' relative paths and contents; None if absent."""
    if path.is_file():
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
            h.update(bytes.fromhex(sha256_path(f)))
        return h.hexdigest()
    return None

