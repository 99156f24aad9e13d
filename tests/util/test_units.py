"""Byte sizes in messages (`sppo_fx/util/units.py`)."""
from __future__ import annotations

from sppo_fx.util.units import mib_below_and_above

MiB = 2**20


def test_a_budget_and_a_minimum_that_round_alike_read_apart():
    # 0.25 MiB and 0.28 MiB both print as 0.3 at one decimal
    asked, needed = mib_below_and_above(int(0.25 * MiB), int(0.28 * MiB))
    assert (asked, needed) == ("0.25", "0.28")


def test_the_minimum_rounds_up_so_that_its_printed_value_fits():
    asked, needed = mib_below_and_above(100 * MiB, 100 * MiB + 1)
    assert float(asked) < float(needed) and float(needed) * MiB >= 100 * MiB + 1
    asked, needed = mib_below_and_above(10 * MiB, int(12.34 * MiB) + 1)
    assert (asked, needed) == ("10.0", "12.4")
