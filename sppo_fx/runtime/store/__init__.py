"""The activation store: asynchronous offload of saved activations to a memory tier.

docs/architecture.md, section 3 "Memory model" (tiers) and section 2 "S5 Nothing silently
wrong" (an async copy is never read before it completes; a failing disk tier raises).

    store = ActivationStore(tier="disk")          # or "host" (pinned CPU memory), "device"
    h = store.offload(t)        # starts an async copy off the device; returns a Handle
    del t                       # the device memory goes once the copy is done
    store.prefetch(h)           # starts bringing it back (optional: wait() does it too)
    t = store.wait(h)           # blocks until the data is back; bitwise equal to t

Tiers:
    device  nothing moves; the store keeps the tensor (a baseline for plans and tests).
    host    CUDA tensors are copied into pinned host memory on a dedicated CUDA stream
            (D2H) and back (H2D) on another, each fenced by an event. On a CPU-only machine
            the device *is* host memory, so the tier is a no-op that keeps the tensor.
    disk    a background thread writes the tensor's bytes to a file in a private temp dir
            (CUDA tensors are first staged through pinned host memory); once the write is
            done the store drops its reference, so the memory is freed when the caller
            drops theirs. prefetch reads the file into a new tensor in a background thread
            and removes the file as soon as the data is back.

Ordering guarantees (the "never read before complete" rule): every read of a handle runs
after its write has completed — a read task first waits for the write's future (reads and
writes run on separate thread pools, so a read waiting for a write can never block that
write); `wait()` returns only after the read has completed. A failed write or read raises
`StoreError` (an `SppoError`) from `prefetch`/`wait` of that handle, and — if nobody has
seen it yet — from the next call on the store.

Layout: dense, non-overlapping tensors (contiguous or permuted, e.g. transposes) are copied
as their raw memory span and come back with the *same strides*, so kernels that pick an
algorithm by layout (matmul) do exactly the same arithmetic after a round trip — this is
what makes offloading bitwise-neutral. Other tensors (expanded, sliced with gaps) come back
contiguous with the same values.

Autograd: `store.saved_tensor_hooks()` is a `torch.autograd.graph.saved_tensors_hooks`
context (pack = offload, unpack = wait); `store.scope()` collects the handles packed while
it is active so that a runtime can `scope.prefetch()` one chunk's activations before that
chunk's backward.

Temp files live in a directory created per store (`tempfile.mkdtemp`, under `dir`), removed
on `close()`, on exiting `with ActivationStore(...)`, and when the store is garbage
collected; a handle's file is removed as soon as its data has been read back, or when the
handle is released / garbage collected — or, with `reuse_files=True` (what
`sppo_fx.compile` uses), kept in a pool and overwritten by a later write, and removed with
the directory.

Modules: `activation_store.py` (ActivationStore, Handle, Scope), `core.py` (threads, CUDA staging,
ordering, accounting), `tier.py` (the tier interface, device tier), `host.py`, `disk.py`,
`pool.py` (file pool, recycled read buffers), `records.py` (per-tensor state, errors).
"""
from sppo_fx.runtime.store.records import StoreError, StoreReadError, StoreWriteError

_LAZY = {"TIERS", "ActivationStore", "Handle", "Scope"}


def __getattr__(name: str):
    # the store and its tiers (threads, temp files, CUDA streams) load when first used, not
    # when `import sppo_fx` reaches the errors in records.py
    if name in _LAZY:
        from sppo_fx.runtime.store import activation_store
        return getattr(activation_store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ActivationStore", "Handle", "Scope", "StoreError", "StoreReadError", "StoreWriteError", "TIERS"]
