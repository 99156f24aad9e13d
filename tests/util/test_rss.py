"""The RSS reader (sppo_fx/util/rss.py): a Linux process reads its RSS; a missing field is 0
for the demo and an error for the benchmark's rows, whose peak would otherwise read 0."""
import os

import pytest
import torch

from sppo_fx.util.rss import give_back_free_heap, reset_high_water, rss_bytes, start_peak

linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                           reason="needs Linux's /proc/self/status, which this system lacks")


def _resident_free_run() -> torch.Tensor:
    """A free, resident run of about 125 MiB in the heap: 16 KiB blocks (under glibc's mmap
    threshold), freed but the last, so that the run is not the heap's top, which free()
    trims. glibc serves a 64 MiB request from such a run before it maps fresh pages, and
    RSS then does not grow (CI at c28bbed met one in a worker that had run other tests)."""
    blocks = [torch.ones(4 << 10) for _ in range(8000)]
    return blocks[-1]


@linux
def test_rss_follows_a_tensor_that_is_kept():
    last_block = _resident_free_run()
    give_back_free_heap()  # as codegen/background.py does before it reads what is kept
    before = rss_bytes()
    kept = torch.ones(16 << 20)  # 64 MiB, touched
    assert rss_bytes() - before >= 60 << 20 and rss_bytes("VmHWM") >= rss_bytes()
    del kept
    give_back_free_heap()
    reset_high_water(strict=True)
    assert rss_bytes("VmHWM") - rss_bytes() < 16 << 20


@linux
def test_a_step_peak_counts_memory_it_reused_from_the_free_heap():
    """The demo's and the benchmark's workers' peak: 64 MiB of small blocks that a step holds
    at once count, though the heap had them free and resident before the step."""
    last_block = _resident_free_run()
    base = start_peak(strict=True)
    held = [torch.ones(4 << 10) for _ in range(4000)]  # 64 MiB in 16 KiB blocks
    del held
    assert rss_bytes("VmHWM") - base >= 60 << 20


def test_a_missing_field_is_zero_or_an_error_when_strict():
    assert rss_bytes("NoSuchField") == 0
    with pytest.raises(OSError):
        rss_bytes("NoSuchField", strict=True)
