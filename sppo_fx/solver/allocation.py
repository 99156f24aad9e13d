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
charges every allocation of a chunk's programs at its size (`solver.clock.allocation_price`,
`Clock.allocation_seconds`; sizes from the memory model's traced graphs,
`passes.cost.saved.allocated_tensors`, else `solver.partition.cost_model_from_graph`). The probes
of the clock's other terms write into buffers allocated once (the matmul), or have their own
allocations taken out (the element-wise chain, `clock_calibration.elementwise_bytes_per_s`,
with `allocated_seconds`), so no byte is charged twice.

On CUDA the caching allocator hands back blocks it holds: nothing is measured (an empty
table, the term left out).
"""
from __future__ import annotations

#: sizes the price is measured at (bytes); between them the clock interpolates in log size,
#: beyond them it holds the nearest figure
PROBE_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)

#: bytes of tensors of one size the probe holds at once (`calibration.allocation_prices`):
#: more than the free blocks a process's heap keeps after training steps (a few MiB), so
#: that most of them get fresh pages, as a step's do
PROBE_VOLUME = 16 << 20


def allocated_seconds(fn, table) -> float:
    """What the tensors `fn()` allocates cost at the `table`'s prices
    (`clock.allocation_price`): every
    fresh output of the ops it runs (not a view of an input, not written in place),
    counted on one call."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from sppo_fx.solver.clock import allocation_price as price
    seconds = 0.0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal seconds
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                     if isinstance(t, torch.Tensor)}
            seconds += sum(n * price(table, n) for ptr, n in fresh.items() if ptr not in inputs)
            return out

    with Count():
        fn()
    return seconds
