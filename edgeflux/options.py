"""The base of every options class (params.yaml sections and the library's own option sets), and
memory sizes with units.

Validation is pydantic's: strict types, unknown keys rejected, frozen. Memory sizes take units:
``300MB`` (decimal, 10^6), ``1.5GiB`` (binary, 2^30), ``4096B``. A bare number is refused,
because ``300`` could mean bytes or megabytes, and so is a lowercase ``b`` (``24Mb`` is megabits).
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict

_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_bytes(value: str | int) -> int:
    """'300MB' -> 300_000_000, '1.5GiB' -> 1_610_612_736. Integers and unit-less strings are refused."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(
            f"a memory size needs a unit, e.g. '{value}MB' or '{value}MiB' "
            f"(allowed units: {', '.join(_pretty_units())})"
        )
    match = _BYTES_RE.match(value)
    if not match:
        raise ValueError(
            f"cannot read {value!r} as a memory size; write a number and a unit, e.g. '300MB' or "
            f"'1.5GiB' (allowed units: {', '.join(_pretty_units())})"
        )
    number, unit = match.groups()
    if unit.upper() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; allowed units: {', '.join(_pretty_units())}")
    if unit.endswith("b"):   # b is a bit by convention (24Mb: megabits): never read it as bytes
        fix = f"'{number}{unit[0].upper()}B' or '{number}{unit[0].upper()}iB'" if len(unit) > 1 else f"'{number}B'"
        raise ValueError(f"{value!r}: a lowercase b means bits; write bytes with a capital B, e.g. {fix}")
    size = int(round(float(number) * _UNITS[unit.upper()]))
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def _pretty_units() -> list[str]:
    return [u if len(u) <= 2 else u[0] + "iB" for u in _UNITS]


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class Options(BaseModel):
    """Strict, closed and frozen: an unknown key or a value of the wrong type is an error."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
