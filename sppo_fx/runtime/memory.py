"""Where one chunk's saved activations live between its forward and its backward.

The chunk program's graphs call `sppo.offload(x, slot)` for every offloadable saved
activation and `sppo.wait(h, slot, ...)` before its first use in backward
(`sppo_fx.passes.offload`). The executor makes the chunk's `ChunkMemory` active around
the chunk's forward and backward (`sppo_fx.ops.offload.active_memory`); it decides per
slot, in the order the forward produces them:

    keep     the tensor stays on the device (held here until its backward waits for it)
    offload  it goes to the ActivationStore's tier (async copy; its device memory is freed
             once the copy completes) while the chunk's byte quota lasts

so one compiled graph serves every chunk, each with its own plan.

Copies in flight are bounded by a `CopyWindow` (the plan's `copy_window_bytes`), so that
what offloading holds on the device does not grow with the chunk:

    forward   offload(x) hands x to the store's writer; while more than the window is
              waiting to be written, the compute thread waits for the oldest write
    backward  the executor requests a whole chunk's reads before its backward runs, in
              reverse production order (the last layer's tensors are needed first); reads
              start while the bytes read but not yet consumed by a wait fit the window; a
              wait on a slot not started yet starts it at once

Without a window every requested read starts at once and writes are not throttled.
"""
from __future__ import annotations

import collections

import torch

from sppo_fx.ops.offload import MatmulGrad
from sppo_fx.runtime.store.records import StoreError


def adopted_grad(grad: torch.Tensor, leaf: torch.Tensor, held) -> torch.Tensor | None:
    """`grad`'s memory as a parameter's first gradient, without a copy, or None where a copy
    is needed: `grad` must span its whole storage (no other tensor of the graph's can sit
    beside it in the same buffer) in the parameter's dtype and layout, and no gradient in
    `held` (those taken over before) may use that storage already (the same tensor handed
    for two parameters). The result aliases the storage but is not a view: later additions
    into `.grad` touch only these bytes, and no `_base` is kept alive through it."""
    if (grad.dtype != leaf.dtype or grad.device != leaf.device or grad.shape != leaf.shape
            or grad.stride() != leaf.stride() or grad.storage_offset() != 0 or grad.requires_grad):
        return None
    storage = grad.untyped_storage()
    if storage.nbytes() != grad.numel() * grad.element_size():
        return None
    ptr = storage.data_ptr()
    if any(h is not None and h.untyped_storage().data_ptr() == ptr for h in held):
        return None
    return torch.empty(0, dtype=grad.dtype, device=grad.device).set_(storage, 0, grad.shape, grad.stride())


class ProductBuffer:
    """One buffer that op-by-op programs' weight-gradient products (`MatmulGrad`) are
    written into before they are added to `.grad`: `mm` then `add_`, autograd's arithmetic,
    without a gradient-sized allocation per chunk (page faults on a CPU). It grows to the
    largest product and is given back at the end of each backward (`release`)."""

    def __init__(self):
        self.storage: torch.UntypedStorage | None = None

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`a @ b` (2-D), written into the buffer: valid until the next call."""
        shape = (a.shape[0], b.shape[1])
        nbytes = shape[0] * shape[1] * a.element_size()
        if self.storage is None or self.storage.nbytes() < nbytes or self.storage.device != a.device:
            self.storage = torch.UntypedStorage(nbytes, device=a.device)
        out = torch.empty(0, dtype=a.dtype, device=a.device).set_(self.storage, 0, shape, (shape[1], 1))
        return torch.mm(a, b, out=out)

    def release(self) -> None:
        self.storage = None


class CopyWindow:
    """Bytes of offload copies allowed in flight, shared by the chunks of one executor.

    Args:
        store: the ActivationStore the chunks offload to.
        window_bytes: writes pending plus reads started but not yet waited for, each at
            most this many bytes (a read larger than the window still starts when no other
            read is in flight; a write larger than it is waited for before the producer
            goes on).

    Used from the executor's thread only (the store's background threads never touch it).
    """

    def __init__(self, store, window_bytes: int):
        self.store, self.window_bytes = store, int(window_bytes)
        self.queue: collections.OrderedDict = collections.OrderedDict()  # handles requested, in order
        self.reading: dict = {}  # handle -> bytes, read started and not waited for
        self.reading_bytes = 0

    def after_offload(self) -> None:
        """Back-pressure on the producer: wait while too many bytes are not written yet."""
        self.store.wait_writes(self.window_bytes)

    def request(self, handle) -> None:
        """Queue a read (no-op if queued or started; `ChunkMemory` requests a handle only
        before its wait)."""
        if handle not in self.queue and handle not in self.reading:
            self.queue[handle] = None
            self._pump()

    def take(self, handle) -> None:
        """A wait needs `handle` now: start its read if it has not started."""
        if handle not in self.reading:
            self.queue.pop(handle, None)
            self._start(handle)

    def forget(self, handles) -> None:
        """The handles are released without a wait (or their wait failed): drop them all,
        then start what fits."""
        for handle in handles:
            self.queue.pop(handle, None)
            self.reading_bytes -= self.reading.pop(handle, 0)
        self._pump()

    def started(self, handle) -> bool:
        return handle in self.reading

    def _start(self, handle) -> None:
        self.store.prefetch(handle)  # raises before any bookkeeping if the store has failed
        self.reading[handle] = handle.nbytes
        self.reading_bytes += handle.nbytes

    def _pump(self) -> None:
        while self.queue:
            handle = next(iter(self.queue))
            if self.reading and self.reading_bytes + handle.nbytes > self.window_bytes:
                return
            del self.queue[handle]
            self._start(handle)


class ChunkMemory:
    """The saved activations of one chunk (one micro-batch), by slot.

    Args:
        store: the ActivationStore to offload to; None keeps everything.
        quota: bytes this chunk may offload (the plan's ratio times its level-2 bytes).
        min_bytes: tensors smaller than this stay on the device.
        grad_sink: `(parameter index, gradient) -> None`, where `sppo.accumulate_grad`
            sends parameter gradients during the chunk's backward; from
            `sppo.accumulate_grad_mm` the gradient is a `sppo_fx.ops.offload.MatmulGrad`.
            The sink must use (or copy) what it gets before it returns: with Inductor
            the tensors are graph buffers that the backward may reuse right after.
        skeleton: the micro-batch's `runtime.skeleton.KVSkeleton`, for chunk programs whose
            K/V prefix is streamed (`sppo_fx.ops.skeleton`); None otherwise.
        chunk: this chunk's index in its micro-batch (with `skeleton`).
        window: the executor's `CopyWindow` (None: reads start when requested, writes
            are not throttled).
    """

    def __init__(self, store=None, quota: float = float("inf"), min_bytes: int = 1 << 16, grad_sink=None,
                 skeleton=None, chunk: int = 0, window: CopyWindow | None = None):
        self.store, self.left, self.min_bytes = store, quota, min_bytes
        self.window = window
        self.grad_sink = grad_sink
        self.skeleton, self.chunk = skeleton, chunk
        self.entries: dict[int, object] = {}  # slot -> kept tensor | store Handle
        self.error: StoreError | None = None  # a failed offload of this chunk's forward
        self.offloaded_bytes = 0
        self.kept_bytes = 0

    def offload(self, x: torch.Tensor, slot: int) -> None:
        n = x.numel() * x.element_size()
        if self.store is not None and self.error is None and self.min_bytes <= n <= self.left:
            handle = None
            try:
                handle = self.store.offload(x)
                if self.window is not None:
                    self.window.after_offload()
            except StoreError as e:
                # Not raised here, inside the compiled chunk program (Dynamo masks it as
                # "Attempt to trace generator"): the executor raises it once the program
                # returns (`StageRunner.forward`), and the step stops there.
                self.error = e
                if handle is not None:
                    self._release_quietly(handle)
            else:
                self.entries[slot] = handle
                self.left -= n
                self.offloaded_bytes += n
                return
        self.kept_bytes += n
        self.entries[slot] = x

    def _release_quietly(self, handle) -> None:
        if self.window is not None:
            self.window.forget([handle])
        try:
            self.store.release(handle)
        except StoreError:
            pass  # the step is failing with `self.error` already

    def prefetch(self) -> None:
        """Start reading back every offloaded slot, last produced first (a backward needs
        the last layer's tensors first); with a window, queue the reads. Requested again
        (by the schedule's PREFETCH, then by `StageRunner.backward`), a read is not repeated."""
        for e in reversed(self.entries.values()):
            if not isinstance(e, torch.Tensor):
                if self.window is None:
                    self.store.prefetch(e)
                else:
                    self.window.request(e)

    def wait(self, slot: int | None = None):
        """The slot's tensor (blocking until it is back); with no slot, wait for all reads
        (with a window: for the reads it has started; the others start at their slot's wait,
        so that the chunk never comes back all at once)."""
        if slot is None:
            for s in list(self.entries):
                e = self.entries[s]
                if not isinstance(e, torch.Tensor) and (self.window is None or self.window.started(e)):
                    self.store.wait(e)
            return None
        if slot not in self.entries:
            from sppo_fx.errors import SppoError
            raise SppoError(f"saved activation slot {slot} was already consumed: a chunk's backward "
                            "runs once (retain_graph is not supported with offloaded activations)")
        e = self.entries.pop(slot)
        if isinstance(e, torch.Tensor):
            return e
        try:
            if self.window is not None:
                self.window.take(e)
            t = self.store.wait(e)
        finally:
            if self.window is not None:
                self.window.forget([e])  # consumed (or failed): no longer in flight
            self.store.release(e)
        return t

    def accumulate_grad(self, grad: torch.Tensor, index: int) -> None:
        if self.grad_sink is None:
            from sppo_fx.errors import SppoError
            raise SppoError("a backward graph accumulates parameter gradients, but its chunk has no grad sink")
        self.grad_sink(index, grad)

    def accumulate_grad_mm(self, a: torch.Tensor, b: torch.Tensor, index: int) -> None:
        self.accumulate_grad(MatmulGrad(a, b), index)

    # ---- the K/V skeleton (sppo_fx.ops.skeleton) --------------------------------------
    def _skeleton(self, op: str):
        if self.skeleton is None:
            from sppo_fx.errors import SppoError
            raise SppoError(f"sppo.{op}: this chunk program streams its K/V prefix, but its executor "
                            "gave it no skeleton (StageRunner(..., skeleton='offload'))")
        return self.skeleton

    def kv_out(self, x: torch.Tensor, slot: int) -> None:
        self._skeleton("kv_out").put(slot, self.chunk, x)

    def kv_blocks(self, site: int):
        return self._skeleton("prefix_attention").stream(site, self.chunk)

    def kv_add_grad(self, site: int, j: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self._skeleton("prefix_attention_bwd").add_grad(site, j, dk, dv)

    def kv_grad(self, slot: int):
        return self._skeleton("kv_grad").take_grad(slot, self.chunk)

    def release(self) -> None:
        """Drop whatever the backward did not consume (files are removed)."""
        handles = [e for e in self.entries.values() if not isinstance(e, torch.Tensor)]
        self.entries.clear()
        if self.window is not None:
            self.window.forget(handles)  # all of them first: no read starts for a handle released next
        for e in handles:
            self.store.release(e)
