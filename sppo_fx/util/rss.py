"""The process's resident memory on Linux (`/proc/self/status`): what a CPU step's peak is
measured with (the demo, the benchmark's workers) and what chunk 0's compile leaves behind
(`codegen/background.py`)."""
from __future__ import annotations

import ctypes
import gc


def rss_bytes(field: str = "VmRSS", strict: bool = False) -> int:
    """A memory field of /proc/self/status in bytes ("VmRSS": now, "VmHWM": the high-water
    mark since the last `reset_high_water`). Where there is no /proc (or no such field):
    0, or with `strict` an OSError, for callers whose figure would otherwise read as a
    peak of 0 (the benchmark's rows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        if strict:
            raise
        return 0
    if strict:
        raise OSError(f"/proc/self/status has no {field} line")
    return 0


def reset_high_water(strict: bool = False) -> None:
    """Set VmHWM to the current RSS. Where /proc/self/clear_refs cannot be written: nothing
    (VmHWM then holds earlier peaks), or with `strict` the OSError."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        if strict:
            raise


def give_back_free_heap() -> None:
    """Collect Python's garbage and hand glibc's free heap pages back to the OS
    (`malloc_trim`), so that RSS read next is memory in use, not freed scratch; only the
    collection where the C library is not glibc."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def start_peak(strict: bool = False) -> int:
    """Begin measuring a step's peak extra memory: the heap's free pages given back (a step
    that reused them while resident would add nothing to RSS for them: 2.5-5 MiB a step in
    the demo's plan), VmHWM reset; returns the RSS the peak is counted over: the step's
    peak is `rss_bytes("VmHWM")` after it minus this value."""
    give_back_free_heap()
    base = rss_bytes("VmRSS", strict)
    reset_high_water(strict)
    return base
