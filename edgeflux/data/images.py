"""Image tensors in bulk: decoding files, resizing, RGB to gray, and converting a dataset into a tensor of one
size and channel count. prepare() converts whole datasets with these; the loaders and the incoming samples
decode and convert with the same functions, so an image gets the same pixels whichever way it arrives.

An imagefolder dataset's files (and the incoming samples added to one) are decoded one at a time and brought to the
final square size at once (fit_image: shorter side, then centre crop), so a folder of large photos never sits in
memory at full size.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# ITU-R BT.601 luma weights (the ones PIL's convert("L") uses).
LUMA_601 = (0.299, 0.587, 0.114)
# Bulk image conversion works in chunks of about this many bytes of float32 per step: small
# enough to stay in cache (measured faster than whole-dataset steps) and to bound memory.
CHUNK_BYTES = 8 << 20
# How fit_image brings a decoded file to size (the manifest's "resize" of an imagefolder dataset).
RESIZE_CROP = "shorter-side+center-crop"


def convert_into(src: torch.Tensor, dst: torch.Tensor) -> str:
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
    chunk = max(1, CHUNK_BYTES // (4 * pixels))
    for start in range(0, len(src), chunk):
        x = src[start : start + chunk]
        if x.shape[1] == 3 and out_c == 1:
            x = to_gray(x)  # before resizing: a third of the work
        if method == "pad":
            x = F.pad(x, (2, 2, 2, 2))
        elif method == "bilinear":
            x = resize(x, (size, size))
        dst[start : start + len(x)] = x  # broadcasts 1 -> 3 channels by repeating
    return method


def resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased resize of uint8 NCHW images, rounded back to uint8."""
    y = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
    return y.round_().clamp_(0, 255).to(torch.uint8)


def to_gray(x: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3, H, W] RGB -> uint8 [N, 1, H, W] ITU-R 601 luma, rounded."""
    weights = torch.tensor(LUMA_601, dtype=torch.float32).view(1, 3, 1, 1)
    return (x.float() * weights).sum(1, keepdim=True).round_().clamp_(0, 255).to(torch.uint8)


def fit_image(image, size: int, channels: int = 3) -> torch.Tensor:
    """A PIL image as uint8 [channels, size, size]: the shorter side resized to `size` (antialiased), then the centre
    cropped to a square (torchvision's Resize(size) + CenterCrop(size)), so no image is stretched."""
    from torchvision.transforms.v2 import functional as TF

    x = TF.pil_to_tensor(TF.center_crop(TF.resize(image.convert("RGB"), size), size))
    return to_gray(x[None])[0] if channels == 1 else x


def decode_into(paths: list[str], out: torch.Tensor) -> tuple[list[int], list[tuple[str, str]]]:
    """Decode `paths` one at a time, each brought to out's size and channels by fit_image, into out[0], out[1], ...

    Only one full-size image is alive at a time, so decoding needs out's bytes plus one photo. A file PIL cannot
    read (not an image, truncated, damaged) is skipped and the next image takes its row. Returns the indices into
    `paths` of the images written, in order, and (path, reason) of every file skipped.
    """
    from PIL import UnidentifiedImageError
    from rich.progress import track
    from torchvision.datasets.folder import default_loader

    kept, skipped = [], []
    size, channels = out.shape[-1], out.shape[1]
    for i, path in enumerate(track(paths, description="decoding images", transient=True,
                                   disable=not sys.stderr.isatty())):
        try:
            image = default_loader(path)   # ImageFolder's own loader: PIL, RGB
        except OSError as e:   # PIL's errors for a file that is not an image or whose data is damaged
            skipped.append((path, "not an image PIL reads" if isinstance(e, UnidentifiedImageError) else str(e)))
            continue
        out[len(kept)] = fit_image(image, size, channels)
        kept.append(i)
    return kept, skipped

