"""Feeding prepared data to training loops: a split's images and labels, and mini-batches over them.

Images stay uint8 on the host and are normalised a batch at a time as they are read, so a stage holds
a quarter of the bytes a float32 copy of its split would need; batch orders are seeded so runs repeat.
Training batches may be augmented (random-resized crop, horizontal flip: `augment_pixels`) on their uint8
pixels before normalisation, from the batches' own seeded generator; evaluation reads images directly and
never is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import torch

from edgeflux.data.store import PreparedData

if TYPE_CHECKING:
    from edgeflux.options import AugmentOptions

# torchvision RandomResizedCrop's default range of the crop's aspect ratio (width / height)
CROP_RATIO = (3 / 4, 4 / 3)


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
        return self.normalize(self.pixels[index])

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels (some of these images, e.g. augmented) as the normalised float32 that indexing reads."""
        return pixels.float().div_(255).sub_(self.mean).div_(self.std)

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
    torch's global RNG (torch.manual_seed applies). With `augment` enabled, every batch is augmented
    (augment_pixels) by draws from the same generator: the same seed, the same augmented batches.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool,
                 seed: int | None = None, drop_last: bool = False, augment: AugmentOptions | None = None):
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.augment = augment if augment is not None and augment.enabled else None

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, bs = len(self.x), self.batch_size
        order = torch.randperm(n, generator=self._gen) if self.shuffle else None
        for start in range(0, len(self) * bs, bs):
            idx = slice(start, start + bs) if order is None else order[start : start + bs]  # a slice: a view
            yield self._read(idx), self.y[idx]

    def _read(self, idx) -> torch.Tensor:
        if self.augment is None:
            return self.x[idx]
        if isinstance(self.x, Images):   # augmented as uint8, the pixels the dataset holds, then normalised
            return self.x.normalize(augment_pixels(self.x.pixels[idx], self.augment, self._gen))
        return augment_pixels(self.x[idx], self.augment, self._gen)


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool,
            seed: int | None = None, drop_last: bool = False, augment: AugmentOptions | None = None) -> Batches:
    """Iterate (x, y) in batches of `batch_size`; shuffled (and augmented) by a generator seeded with `seed`."""
    return Batches(x, y, batch_size, shuffle, seed, drop_last, augment)


def augment_pixels(x: torch.Tensor, opts: AugmentOptions, gen: torch.Generator | None = None) -> torch.Tensor:
    """A new batch [N, C, H, W] of random-resized crops of `x` back to H x W, each flipped horizontally with
    probability 1/2 when opts.flip; `x` is untouched.

    As torchvision's RandomResizedCrop: the crop's area is a uniform share in opts.scale of the image's, its aspect
    ratio log-uniform in CROP_RATIO, resized bilinearly with antialiasing; a crop that would not fit is clamped to
    the image (torchvision retries 10 times, then falls back to a centre crop). Parameters are drawn for the whole
    batch from `gen` (None: torch's global RNG), so a seed repeats the augmentation.
    """
    from torchvision.transforms.v2 import functional as TF

    n, _, h, w = x.shape
    area = torch.empty(n).uniform_(*opts.scale, generator=gen) * (h * w)
    ratio = torch.empty(n).uniform_(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]), generator=gen).exp_()
    crop_w = (area * ratio).sqrt_().round_().clamp_(1, w).long()
    crop_h = (area / ratio).sqrt_().round_().clamp_(1, h).long()
    top = (torch.rand(n, generator=gen) * (h - crop_h + 1)).long()
    left = (torch.rand(n, generator=gen) * (w - crop_w + 1)).long()
    flip = (torch.rand(n, generator=gen) < 0.5).tolist() if opts.flip else [False] * n
    out = torch.empty_like(x)
    for i, box in enumerate(zip(top.tolist(), left.tolist(), crop_h.tolist(), crop_w.tolist())):
        crop = TF.resized_crop(x[i], *box, [h, w], antialias=True)
        out[i] = TF.horizontal_flip(crop) if flip[i] else crop
    return out
