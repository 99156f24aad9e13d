"""The process's resident memory on Linux (`/proc/self/status`): what a CPU step's peak is
measured with (the demo, the benchmark's workers) and what chunk 0's compile leaves behind
(`codegen/background.py`). Elsewhere every reading is 0."""
from __future__ import annotations


def rss_bytes(field: str = "VmRSS") -> int:
    """A memory field of /proc/self/status in bytes ("VmRSS": now, "VmHWM": the high-water
    mark since the last `reset_high_water`); 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_high_water() -> None:
    """Set VmHWM to the current RSS (no-op where /proc cannot be written)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
