"""Byte sizes written by people: `24GiB`, `500MiB`, `1.5GB`, `7 kib` or a number of bytes.

The one parser of such sizes in sppo_fx (the `budget=` of `sppo_fx.compile`, the planner's
`--host-memory`; docs/architecture.md, section 2 "S4 Budget"). Binary units (KiB, MiB,
GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000; units are
case-insensitive and spaces are ignored.
"""
from __future__ import annotations

from sppo_fx.errors import SppoError

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, what: str = "size") -> int:
    """Bytes from a positive int / float or a string such as "12GiB", "500MiB", "1.5GB".

    Args:
        value: the size.
        what: what the size is for, named in the error ("budget", "host memory", ...).

    Returns:
        The size in bytes (rounded down).

    Raises:
        SppoError: naming the accepted forms, for anything else (zero and negative sizes,
            unknown units, booleans).
    """
    if isinstance(value, bool):
        raise SppoError(f"{what} must be bytes (int) or a string like '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise SppoError(f"{what} must be positive, got {value}")
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if num and unit in _UNITS:
            try:
                size = float(num) * _UNITS[unit]
            except ValueError:
                size = -1
            if size > 0:
                return int(size)
    raise SppoError(f"cannot read {what} {value!r}: give bytes (int) or a string like '24GiB', '500MiB', "
                    f"'2GB'")
