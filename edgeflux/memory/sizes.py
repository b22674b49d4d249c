"""Byte sizes for people: reports show binary units; a suggested budget is rounded up, never down."""
from __future__ import annotations

import math

MiB = 2**20


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: ``format_bytes(12_900_000) == "12.3 MiB"``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def budget_at_least(n: int) -> str:
    """A budget to paste into params.yaml that covers n bytes: format_bytes rounded *up* to its last
    digit (``budget_at_least(7_553_476) == "7.3MiB"``; format_bytes says "7.2 MiB", which is less)."""
    for unit, size in (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if n < 1024 * size or unit == "GiB":
            return f"{int(n)}B" if unit == "B" else f"{math.ceil(n * 10 / size) / 10:.1f}{unit}"
    raise AssertionError("unreachable")

