"""Byte sizes written by people: `24GiB`, `500MiB`, `1.5GB`, `7 kib` or a number of bytes.

The one parser of such sizes in sppo_fx (the `budget=` of `sppo_fx.compile`, the planner's
`--host-memory`; docs/architecture.md, section 2 "S4 Budget"). Binary units (KiB, MiB,
GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000; units are
case-insensitive and spaces are ignored.
"""
from __future__ import annotations

import math
import operator

from sppo_fx.errors import SppoError

__all__ = ["parse_bytes", "positive_int", "mib_below_and_above"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MAX = 2**63  # bytes: the largest size torch's allocators and the solver's floats take


def parse_bytes(value, what: str = "size") -> int:
    """Bytes from a positive int / float or a string such as "12GiB", "500MiB", "1.5GB".

    Args:
        value: the size.
        what: what the size is for, named in the error ("budget", "--host-memory", ...).

    Returns:
        The size in bytes (rounded down).

    Raises:
        SppoError: naming `what`, the value and the accepted forms, for anything else: zero
            and negative sizes, NaN, infinite or overflowing ones, unknown units, booleans,
            and a bare number below 1, which would be less than a byte (a fraction of
            something was probably meant).
    """
    forms = "give bytes (an int) or a string like '24GiB', '500MiB', '2GB'"
    if isinstance(value, bool):
        raise SppoError(f"{what}={value!r}: {forms}")
    if not isinstance(value, (int, float, str)):
        try:
            value = operator.index(value)  # numpy / torch integers
        except TypeError:
            raise SppoError(f"{what}={value!r}: {forms}") from None
    size, unit = value, ""
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        try:
            size = float(num) if unit in _UNITS and num else None
        except ValueError:
            size = None
        if size is None:
            percent = " (a percentage of a measured peak is for `sppo-fx bench --budget`)" if "%" in text else ""
            raise SppoError(f"{what}={value!r} cannot be read{percent}: {forms}")
    if isinstance(size, float) and not math.isfinite(size):
        raise SppoError(f"{what}={value!r} is not a finite size: {forms}")
    if size <= 0:
        raise SppoError(f"{what}={value!r} must be positive: {forms}")
    if _UNITS[unit] == 1 and size < 1:
        raise SppoError(f"{what}={value!r} is less than one byte: did you mean a fraction of something? "
                        f"{forms}")
    total = size * _UNITS[unit]
    if not total < _MAX:
        raise SppoError(f"{what}={value!r} is more than any machine holds (at most {_MAX - 1} bytes): {forms}")
    return int(total)


def positive_int(text: str) -> int:
    """argparse type (the command lines' counts): an integer >= 1."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive: give a whole number >= 1")
    return value


def mib_below_and_above(below: int, above: int) -> tuple[str, str]:
    """Two byte counts in MiB for a message such as "budget X MiB is below the minimum Y
    MiB": `below` rounded down and `above` rounded up (so a budget of the printed minimum
    fits), with as many decimals (1 to 4) as they need to lie at least two units of the last
    decimal apart, so that the rounding does not make the gap: never "0.3 MiB is below
    0.3 MiB", nor "0.2 below 0.3" for 0.25 and 0.28."""
    for decimals in range(1, 5):
        scale = 10 ** decimals
        low = math.floor(below / 2**20 * scale)
        high = math.ceil(above / 2**20 * scale)
        if high - low >= 2 or decimals == 4:
            low, high = low / scale, high / scale
            return f"{low:.{decimals}f}", f"{high:.{decimals}f}"
