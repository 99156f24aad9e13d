"""The RSS reader (sppo_fx/util/rss.py): a Linux process reads its RSS; a missing field is 0
for the demo and an error for the benchmark's rows, whose peak would otherwise read 0."""
import os

import pytest
import torch

from sppo_fx.util.rss import give_back_free_heap, reset_high_water, rss_bytes

linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                           reason="needs Linux's /proc/self/status, which this system lacks")


@linux
def test_rss_follows_a_tensor_that_is_kept():
    # glibc serves 64 MiB from a free run of the heap before it maps fresh pages. In a worker
    # that ran other tests such a run can be resident, and the tensor then adds no RSS (CI at
    # c28bbed). Made here on purpose: 16 KiB blocks (under the mmap threshold), the last kept
    # so that the run is not the heap's top, which free() trims.
    blocks = [torch.ones(4 << 10) for _ in range(8000)]
    del blocks[:-1]
    give_back_free_heap()  # as codegen/background.py does before it reads what is kept
    before = rss_bytes()
    kept = torch.ones(16 << 20)  # 64 MiB, touched
    assert rss_bytes() - before >= 60 << 20 and rss_bytes("VmHWM") >= rss_bytes()
    del kept
    give_back_free_heap()
    reset_high_water(strict=True)
    assert rss_bytes("VmHWM") - rss_bytes() < 16 << 20


def test_a_missing_field_is_zero_or_an_error_when_strict():
    assert rss_bytes("NoSuchField") == 0
    with pytest.raises(OSError):
        rss_bytes("NoSuchField", strict=True)
