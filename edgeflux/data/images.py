"""Image tensors in bulk: decoding files, resizing, RGB to gray, and converting a dataset into a tensor of one
size and channel count. prepare() converts whole datasets with these; the loaders and the incoming samples
decode and convert with the same functions, so an image gets the same pixels whichever way it arrives.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# ITU-R BT.601 luma weights (the ones PIL's convert("L") uses).
LUMA_601 = (0.299, 0.587, 0.114)
# Bulk image conversion works in chunks of about this many bytes of float32 per step: small
# enough to stay in cache (measured faster than whole-dataset steps) and to bound memory.
CHUNK_BYTES = 8 << 20


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


def decode_files(paths: list[str]) -> torch.Tensor:
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
        images = [im if tuple(im.shape[-2:]) == (h, w) else resize(im[None], (h, w))[0] for im in images]
    return torch.stack(images)
