"""One shard file's content per storage: what the writer serialises and the reader deserialises.

A shard is a ``torch.save`` of plain tensors and ints only (``x`` or the BitTrain bitmap fields, and
``y`` int64), so reading uses ``torch.load(weights_only=True)`` and never unpickles a class.
"""
from __future__ import annotations

import io

import torch
from torch import Tensor

from edgeflux.bittrain import BitmapTensor, compress

__all__ = ["compact", "decode_payload", "dtype_from_name", "dtype_name", "encode_payload", "fits_float16"]


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fits_float16(x: Tensor) -> bool:
    """Every finite value of x stays finite in float16 (|x| < 65520 rounds to at most 65504)."""
    return not bool((x.isfinite() & (x.abs() >= 65520)).any())


def compact(t: Tensor) -> Tensor:
    """t if it is contiguous and owns exactly its storage, else a compact copy: torch.save writes a
    view's whole storage, so a shard sliced from the writer's buffer would carry the entire buffer."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def encode_payload(x: Tensor, y: Tensor, storage: str, threshold: float, value_dtype: torch.dtype | None,
                   full_precision: bool) -> bytes:
    """The shard file's bytes for x (in the compute dtype) and y (int64).

    ``full_precision``: x has values beyond float16's range, so float16 storage keeps the compute
    dtype and bittrain keeps its values in it.
    """
    if storage == "dense" or (storage == "float16" and full_precision):
        payload = {"x": compact(x)}
    elif storage == "float16":
        payload = {"x": compact(x.to(torch.float16))}
    else:
        packed = compress(x.contiguous(), threshold=threshold, store_dtype=None if full_precision else value_dtype)
        payload = {"bitmap": compact(packed.bitmap), "values": compact(packed.values),
                   "shape": list(packed.shape), "stride": list(packed.stride)}
    payload["y"] = compact(y)
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def decode_payload(data: bytes, storage: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """What encode_payload wrote, as (x in the compute dtype ``dtype``, y); the caller checks shapes."""
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if storage == "bittrain":
        x = BitmapTensor(bitmap=payload["bitmap"], values=payload["values"], shape=torch.Size(payload["shape"]),
                         stride=tuple(payload["stride"]), dtype=dtype).decompress()
    else:
        x = payload["x"].to(dtype)
    return x, payload["y"]
