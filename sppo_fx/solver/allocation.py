"""What allocating a tensor costs on this machine, by size: the clock's allocation term.

A chunk program op by op allocates a fresh output for nearly every op, forward and
backward. Whether that costs anything depends on the process's allocator, not on torch:
glibc serves a block from memory it already holds (nothing to pay) or maps fresh pages for
it, which the kernel then faults in one 4 KiB page at a time as the op writes them. Which
one happens depends on the block's size against glibc's mmap threshold: 128 KiB fixed under
`MALLOC_MMAP_THRESHOLD_=131072` (the benchmark workers' setting, so that RSS follows live
tensors), else a threshold that rises to the largest block freed so far (up to 32 MiB on
64-bit Linux). Measured on the 2-core test VM: a 4 MiB tensor allocated, filled and freed
took 1,169 us under the benchmark's setting against 40 us filled in place, and 27 us
under glibc's default.

`calibration.allocation_prices` measures that price per byte at `PROBE_SIZES` in the
process that will train, so the figure follows its allocator settings by itself; the clock
charges every allocation of a chunk's programs at its size
(`solver.clock.Clock.allocation_seconds`, sizes from `solver.partition.cost_model_from_graph`). The probes of the clock's other terms
write into buffers allocated once (the matmul), or have their own allocations taken out (the
element-wise chain, `clock_calibration.elementwise_bytes_per_s`, with `allocated_seconds`), so
no byte is charged twice.

On CUDA the caching allocator hands back blocks it holds: nothing is measured (an empty
table, the term left out).
"""
from __future__ import annotations

#: sizes the price is measured at (bytes); between them the clock interpolates in log size,
#: beyond them it holds the nearest figure
PROBE_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def price(table, nbytes: float) -> float:
    """Seconds per byte of allocating a block of `nbytes`: the table interpolated in log
    size, the nearest figure beyond it; 0 without a table."""
    import math
    if not table or nbytes <= 0:
        return 0.0
    x = math.log(nbytes)
    points = [(math.log(n), s) for n, s in table]
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def allocated_seconds(fn, table) -> float:
    """What the tensors `fn()` allocates cost at the `table`'s prices (`price`): every
    fresh output of the ops it runs (not a view of an input, not written in place),
    counted on one call."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def storages(tree):
        return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}

    class Count(TorchDispatchMode):
        seconds = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = storages((args, kwargs))
            for ptr_t in {t.untyped_storage().data_ptr(): t for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor)}.items():
                ptr, t = ptr_t
                if ptr not in inputs:
                    n = t.untyped_storage().nbytes()
                    Count.seconds += n * price(table, n)
            return out

    with Count():
        fn()
    return Count.seconds
