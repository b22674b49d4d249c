"""The imagefolder dataset: a user's own photos, one folder per class, decoded into one uint8 tensor at the final size.

Two layouts; class names are the folder names, sorted (torchvision ImageFolder's class order):

    <root>/<class>/<image files>           the test split is carved from it, test_fraction of every class, drawn
                                           with a fixed seed (TEST_SEED): every data.seed tests on the same images
    <root>/train/<class>/<image files>     with <root>/test/<class>/<image files>; and with <root>/val/<class>/...
                                           too, val/ is the val split (else prepare() carves val from train/)

Each file is decoded as RGB and brought to image_size x image_size at once (edgeflux.data.images.fit_image: the
shorter side resized, antialiased, then centre-cropped) into one preallocated tensor, train then val then test, so
loading holds one full-size photo at a time and prepare() uses the tensor as it is. A file that does not decode (not
an image, truncated) is skipped; one warning at the end names every skipped file and why. A problem with the layout
is one line naming the folder and the fix.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edgeflux.data.images import RESIZE_CROP, decode_into
from edgeflux.data.raw import DatasetFormatError, DatasetNotFoundError, RawDataset
from edgeflux.data.splits import DataParamsError, stratified_pick

log = logging.getLogger(__name__)

# The flat layout's test split is drawn with this seed, not data.seed, so that "the test set" of a folder is the same
# images whatever the experiment's seed (as mnist-subset's: edgeflux.data.load.MNIST_SUBSET_SEED).
TEST_SEED = 0
SPLITS = ("train", "val", "test")
LAYOUTS = "<root>/<class>/<images>, or <root>/train/<class>/<images> and <root>/test/<class>/<images> (val/ optional)"


def load_imagefolder(root: str | Path | None, image_size: int = 32, channels: int = 3,
                     test_fraction: float = 0.2) -> RawDataset:
    """The images under `root` (see the module docstring) as uint8 [N, channels, image_size, image_size]."""
    parts = _split_folders(_root(root))
    classes = _classes(parts)
    samples = {part: _samples(folder, classes) for part, folder in parts.items()}
    if "all" in samples:
        samples["train"], samples["test"] = _carve_test(samples.pop("all"), test_fraction, root)
    order = [part for part in SPLITS if part in samples]
    paths = [path for part in order for path, _ in samples[part]]
    images = torch.empty((len(paths), channels, image_size, image_size), dtype=torch.uint8)
    kept, skipped = decode_into(paths, images)
    _warn_skipped(skipped)
    kept_t = torch.tensor(kept, dtype=torch.int64)
    labels = torch.tensor([label for part in order for _, label in samples[part]], dtype=torch.int64)[kept_t]
    images = images[: len(kept)]   # skipped files leave their rows unused at the end: no copy to trim them
    ends = torch.tensor([len(samples[part]) for part in order]).cumsum(0)
    n_kept = dict(zip(order, torch.bincount(torch.bucketize(kept_t, ends, right=True), minlength=len(order)).tolist()))
    for part, n in n_kept.items():
        if n == 0:
            raise DatasetFormatError(f"imagefolder: no file of the {part} split decodes as an image (see the warning "
                                     f"above): replace them with readable images")
    n_train = len(kept) - n_kept["test"]
    return RawDataset(
        name="imagefolder", classes=classes,
        train_images=images[:n_train], train_labels=labels[:n_train],
        test_images=images[n_train:], test_labels=labels[n_train:],
        sources=[str(folder) for folder in parts.values()], given_val=n_kept.get("val", 0),
        notes={"layout": "classes" if "all" in parts else "splits", "val": "val/" if "val" in parts else "carved",
               "test_fraction": test_fraction if "all" in parts else None, "resize": RESIZE_CROP,
               "decoded": "RGB" if channels == 3 else "RGB, then ITU-R 601 luma",
               "skipped": [{"path": path, "reason": reason} for path, reason in skipped]},
    )


def _root(root: str | Path | None) -> Path:
    if root is None:
        raise DatasetNotFoundError(f"dataset 'imagefolder' needs data.root: set it in params.yaml to your folder of "
                                   f"images, laid out as {LAYOUTS}")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DatasetNotFoundError(f"data.root {path} is not a folder: point data.root to your folder of images, laid "
                                   f"out as {LAYOUTS}")
    return path


def _split_folders(root: Path) -> dict[str, Path]:
    """{"all": root} (class folders directly under root) or {"train", ["val",] "test": folder}."""
    present = [part for part in SPLITS if (root / part).is_dir()]
    if not present:
        return {"all": root}
    missing = [part for part in ("train", "test") if part not in present]
    if missing:
        raise DatasetFormatError(f"{root} has {' and '.join(p + '/' for p in present)} but no "
                                 f"{' or '.join(p + '/' for p in missing)}: add {root}/{missing[0]}/<class>/<images>, "
                                 f"or put the class folders directly in {root} to have the test split carved")
    return {part: root / part for part in present}


def _classes(parts: dict[str, Path]) -> list[str]:
    """The class names (sorted folder names), the same in every split's folder."""
    from torchvision.datasets.folder import find_classes

    found = {}
    for part, folder in parts.items():
        try:
            found[part] = find_classes(folder)[0]
        except FileNotFoundError:
            raise DatasetNotFoundError(f"{folder} has no class folders: put each class's images in "
                                       f"{folder}/<class name>/ ({LAYOUTS})") from None
    first, reference = next(iter(found.items()))
    for part, names in found.items():
        if names != reference:
            only_ref, only_here = sorted(set(reference) - set(names)), sorted(set(names) - set(reference))
            raise DatasetFormatError(f"{first}/ and {part}/ have different class folders (only in {first}/: "
                                     f"{only_ref or 'none'}; only in {part}/: {only_here or 'none'}): give every "
                                     f"split the same class folders")
    return reference


def _samples(folder: Path, classes: list[str]) -> list[tuple[str, int]]:
    """(image file, class index) under folder/<class>/, sorted (torchvision's make_dataset); every class has some."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    samples = make_dataset(str(folder), {c: i for i, c in enumerate(classes)}, extensions=IMG_EXTENSIONS,
                           allow_empty=True)
    counts = torch.bincount(torch.tensor([label for _, label in samples], dtype=torch.int64), minlength=len(classes))
    empty = [str(folder / classes[i]) for i in torch.nonzero(counts == 0).flatten().tolist()]
    if empty:
        raise DatasetNotFoundError(f"no image files ({' '.join(IMG_EXTENSIONS)}) in {', '.join(empty)}: add images "
                                   f"or remove the folder")
    return samples


def _carve_test(samples: list[tuple[str, int]], fraction: float, root) -> tuple[list, list]:
    """(train, test): `fraction` of every class to test, drawn with TEST_SEED; folder order kept inside each."""
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    test, train = stratified_pick(torch.arange(len(samples)), labels, fraction, torch.Generator().manual_seed(TEST_SEED))
    if len(test) == 0:
        raise DataParamsError(f"data.test_fraction={fraction} of the {len(samples)} images in {root} is no image: "
                              f"raise data.test_fraction or add images")
    return [samples[i] for i in train.sort().values.tolist()], [samples[i] for i in test.sort().values.tolist()]


def _warn_skipped(skipped: list[tuple[str, str]]) -> None:
    """One warning naming every file skipped and why (not one per file: a folder may hold many)."""
    if skipped:
        log.warning("imagefolder: skipped %d file(s) that do not decode as images:\n%s", len(skipped),
                    "\n".join(f"  {path}: {reason}" for path, reason in skipped))
