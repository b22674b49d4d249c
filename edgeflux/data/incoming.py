"""New labelled samples for on-device retraining: `data/incoming/<class id>/<image files>`.

The device's fine-tuning stages train on their target training split plus these samples. Each image is
decoded by the imagefolder loader and converted to the prepared data's size and channels by the very
function prepare() converts a dataset with, so a sample gives the pixels it would have inside the dataset.
The normalisation statistics stay those of the prepared data: the pretrained model learnt with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeflux.data.feed import Images
from edgeflux.data.images import RESIZE_CROP, convert_into, fit_image
from edgeflux.data.inbox import READD as _READD
from edgeflux.data.inbox import IncomingDataError, refuse_links
from edgeflux.data.store import PreparedData

log = logging.getLogger(__name__)

__all__ = ["MAX_INCOMING_PIXELS", "Incoming", "IncomingDataError", "add_incoming", "find_incoming", "load_incoming"]

# The most pixels one incoming image may have (a 48-megapixel phone photo: 138 MiB decoded as RGB). Its size
# is read from the header before anything is decoded, so a decompression bomb costs nothing.
MAX_INCOMING_PIXELS = 48_000_000


@dataclass
class Incoming:
    """Incoming samples at the prepared data's size and channels."""

    images: torch.Tensor = field(repr=False)  # uint8 [N, C, S, S]
    labels: torch.Tensor = field(repr=False)  # int64 [N]
    files: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def find_incoming(root: str | Path, n_classes: int) -> list[tuple[Path, int]]:
    """(image file, class id) of every sample under `root`, in sorted order; [] if `root` is missing.

    Checks the layout without decoding anything: a folder that is not a class id, or an image outside
    any class folder, is an IncomingDataError. Other files (a README) and hidden entries are skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    refuse_links(root)
    samples = []
    for entry in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        if entry.is_dir():
            label = _class_id(entry, n_classes)
            samples += [(f, label) for f in sorted(entry.rglob("*")) if _is_image(f, entry)]
        elif _is_image(entry, root):  # a sample whose class nobody said: refuse rather than guess or drop it
            raise IncomingDataError(f"{entry} is outside any class folder: move it into "
                                    f"{root}/<class id>/ (0..{n_classes - 1}), {_READD}")
    return samples


def load_incoming(root: str | Path, data: PreparedData) -> Incoming:
    """The samples under `root`, converted as prepare() converted `data`; empty if there are none."""
    from torchvision.transforms.functional import pil_to_tensor

    samples = find_incoming(root, len(data.classes))
    images = torch.empty((len(samples), *data.images.shape[1:]), dtype=torch.uint8)
    cropped = data.manifest.get("resize") == RESIZE_CROP   # an imagefolder dataset: its files were fitted so
    for i, (path, _) in enumerate(samples):
        image = _decode(path)
        if cropped:
            images[i] = fit_image(image, images.shape[-1], images.shape[1])
        else:
            convert_into(pil_to_tensor(image)[None], images[i : i + 1])
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if samples:
        log.info("%s: %d new samples, per class %s", root, len(samples), dict(sorted(Counter(labels.tolist()).items())))
    return Incoming(images, labels, [str(path) for path, _ in samples])


def add_incoming(split: tuple[Images, torch.Tensor], incoming: Incoming) -> tuple[Images, torch.Tensor]:
    """`split` (images and labels as tensors() gives them) with the incoming samples after it.

    Works on the split a stage trains on, after its max_train_samples limit, so every incoming sample
    trains however the split was cut, and only the split's rows are copied, not the whole dataset.
    """
    if not len(incoming):
        return split
    images, labels = split
    if incoming.images.shape[1:] != images.shape[1:]:  # a caller's bug: loaded for other prepared data
        raise ValueError(f"incoming images {tuple(incoming.images.shape[1:])} do not fit {tuple(images.shape[1:])}")
    pixels = torch.cat([images.pixels, incoming.images])
    mean, std = images.mean.flatten().tolist(), images.std.flatten().tolist()
    return Images(pixels, mean, std), torch.cat([labels, incoming.labels])


def _class_id(folder: Path, n_classes: int) -> int:
    name = folder.name
    if not (name.isascii() and name.isdigit() and int(name) < n_classes):
        raise IncomingDataError(f"{folder}: a class folder is named by its class id, 0..{n_classes - 1} "
                                f"(data/prepared/manifest.json lists the classes); rename it, {_READD}")
    return int(name)


def _is_image(path: Path, under: Path) -> bool:
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension  # slow to import

    hidden = any(part.startswith(".") for part in path.relative_to(under).parts)
    return path.is_file() and not hidden and has_file_allowed_extension(path.name, IMG_EXTENSIONS)


def _decode(path: Path):
    """One image file as a PIL RGB image; IncomingDataError naming the file if it does not decode or is
    larger than MAX_INCOMING_PIXELS."""
    from torchvision.datasets.folder import default_loader

    _check_pixels(path)
    try:
        return default_loader(str(path))
    except (OSError, SyntaxError, ValueError) as e:  # PIL: UnidentifiedImageError, truncated, broken PNG chunks
        from PIL import UnidentifiedImageError

        reason = "no image format PIL reads" if isinstance(e, UnidentifiedImageError) else str(e)
        raise IncomingDataError(f"{path} is not a readable image ({reason}); replace or delete it, {_READD}") from None


def _check_pixels(path: Path) -> None:
    from PIL import Image

    try:
        with Image.open(path) as image:   # reads the header only
            width, height = image.size
    except Image.DecompressionBombError as e:   # PIL's own limit, which is above ours
        raise IncomingDataError(f"{path} is over the {MAX_INCOMING_PIXELS / 1e6:g}-megapixel limit for one "
                                f"incoming image ({e}); downscale it, {_READD}") from None
    except (OSError, SyntaxError, ValueError):   # not an image PIL reads: decoding names the reason
        return
    if width * height > MAX_INCOMING_PIXELS:
        raise IncomingDataError(f"{path} is {width}x{height} pixels, over the {MAX_INCOMING_PIXELS / 1e6:g}-megapixel "
                                f"limit for one incoming image; downscale it, {_READD}")
