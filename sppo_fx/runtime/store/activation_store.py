"""`ActivationStore`: the public face of the activation store (see the package docstring),
with its `Handle` and `Scope`."""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from concurrent.futures import Future

import torch

from sppo_fx.errors import SppoError
from sppo_fx.runtime.store.core import _Core, _discard, _read_done, profiled
from sppo_fx.runtime.store.disk import DiskTier
from sppo_fx.runtime.store.host import HostTier
from sppo_fx.runtime.store.records import StoreError, _fmt_bytes, _Record
from sppo_fx.runtime.store.tier import DeviceTier

_TIER_CLASSES = {"device": DeviceTier, "host": HostTier, "disk": DiskTier}
TIERS = tuple(_TIER_CLASSES)


class Handle:
    """A tensor offloaded by an `ActivationStore`; pass it to `prefetch` / `wait`.

    Attributes:
        shape, dtype, device, nbytes: of the offloaded tensor.
        tier: the store's tier.
    """

    __slots__ = ("_store", "_rec", "tier", "__weakref__")

    def __init__(self, store: "ActivationStore", rec: _Record):
        self._store = store
        self._rec = rec
        self.tier = store.tier
        weakref.finalize(self, _Core.release_record, store._core, rec)

    shape = property(lambda self: self._rec.shape)
    dtype = property(lambda self: self._rec.dtype)
    device = property(lambda self: self._rec.device)
    nbytes = property(lambda self: self._rec.nbytes)

    @property
    def state(self) -> str:
        """"writing" | "stored" | "reading" | "ready" | "failed" | "released"."""
        return self._rec.state

    def prefetch(self) -> None:
        """`store.prefetch(self)`."""
        self._store.prefetch(self)

    def wait(self) -> torch.Tensor:
        """`store.wait(self)`."""
        return self._store.wait(self)

    def release(self) -> None:
        """`store.release(self)`."""
        self._store.release(self)

    def __repr__(self):
        return (f"Handle(#{self._rec.id}, {list(self.shape)}, {str(self.dtype).replace('torch.', '')}, "
                f"{self.tier}, {self.state})")


class ActivationStore:
    """Offloads tensors to a memory tier and brings them back, asynchronously.

    Args:
        tier: "disk", "host" or "device" (see the module docstring).
        dir: parent directory of the disk tier's temp dir (default: the system temp dir).
        workers: background threads for writes (and as many for reads).
        reuse_files: disk tier: keep the files of released data in a pool and overwrite
            them (a file of 1-2x the tensor's bytes) instead of creating new ones. A new
            file gets fresh page-cache pages from the kernel; an overwritten one reuses
            its pages (measured here: 1.8 vs 4.4 GB/s for 1.2 MB writes). The pool's
            files total at most the most bytes the tier held at once
            (`peak_bytes_offloaded`); a write that fits no pooled file removes the oldest
            one; a file whose write or read failed is removed; `close()` removes them all.

    Attributes:
        tier: the tier.
        dir: the disk tier's private temp dir (None for other tiers).
        delay_hook: for tests — called in the worker thread before every copy with "write"
            or "read" (e.g. to sleep and provoke races).
        fsync: fsync each file after writing (default False: the page cache is enough for
            correctness within a process, and fsync costs the disk's latency).
    """

    def __init__(self, tier: str = "disk", dir: str | None = None, workers: int = 2, reuse_files: bool = False):
        if tier not in TIERS:
            raise SppoError(f"unknown activation-store tier {tier!r}; choose one of {', '.join(TIERS)}")
        self.tier = tier
        self._core = _Core(_TIER_CLASSES[tier](dir, reuse_files), workers)
        self._ids = itertools.count()
        self._scopes = threading.local()
        self._finalizer = weakref.finalize(self, _Core.close, self._core)

    # -- properties
    @property
    def dir(self) -> str | None:
        return self._core.tier.dir

    @property
    def delay_hook(self):
        return self._core.delay_hook

    @delay_hook.setter
    def delay_hook(self, fn):
        self._core.delay_hook = fn

    @property
    def fsync(self) -> bool:
        return self._core.tier.fsync

    @fsync.setter
    def fsync(self, value: bool):
        self._core.tier.fsync = bool(value)

    @property
    def bytes_on_device(self) -> int:
        """Bytes of device tensors the store references now (pending writes, read-backs, kept)."""
        return self._core.bytes_on_device

    @property
    def pooled_files(self) -> int:
        """Files in the pool (`reuse_files`): they hold no live data and wait to be overwritten."""
        return self._core.tier.pooled_files(self._core)[0]

    @property
    def pooled_bytes(self) -> int:
        """Total size of the pooled files."""
        return self._core.tier.pooled_files(self._core)[1]

    @property
    def bytes_offloaded(self) -> int:
        """Bytes held in the tier now (files, pinned host buffers)."""
        return self._core.bytes_offloaded

    @property
    def peak_bytes_on_device(self) -> int:
        """Maximum of `bytes_on_device` so far."""
        return self._core.peak_bytes_on_device

    @property
    def peak_bytes_offloaded(self) -> int:
        """Maximum of `bytes_offloaded` so far."""
        return self._core.peak_bytes_offloaded

    def stats(self) -> dict[str, int]:
        """The four counters as a dict."""
        return {"bytes_on_device": self.bytes_on_device, "bytes_offloaded": self.bytes_offloaded,
                "peak_bytes_on_device": self.peak_bytes_on_device,
                "peak_bytes_offloaded": self.peak_bytes_offloaded}

    # -- errors
    def _check(self, handle: Handle | None = None):
        core = self._core
        if core.closed:
            raise StoreError("the activation store is closed")
        if handle is not None:
            if handle._store is not self:
                raise StoreError("this handle belongs to another ActivationStore")
            rec = handle._rec
            if rec.error is not None:
                rec.error_seen = True
                raise rec.error
            if rec.released:
                raise StoreError(f"{handle!r} was released; its data is gone")
        with core.lock:
            # a released handle's data was never going to be read: its failed copy is not
            # an error of any later call (the step that released it has failed or moved on)
            core.failed = [r for r in core.failed if not r.released]
            unseen = [r for r in core.failed if not r.error_seen]
        if unseen:
            for r in unseen:
                r.error_seen = True
            if len(unseen) == 1:
                raise unseen[0].error
            raise type(unseen[0].error)(f"{unseen[0].error} (and {len(unseen) - 1} more failed copies)")

    # -- the API
    def offload(self, tensor: torch.Tensor, keep: bool = False) -> Handle:
        """Start copying `tensor` off the device.

        Args:
            tensor: a strided tensor (any dtype, any shape incl. 0-size, any strides).
            keep: the copy stays in the tier until the handle is released, and every
                `prefetch`/`wait` pair reads a fresh tensor that the caller owns (for data
                read many times, such as the K/V skeleton); by default a handle is read
                back once and its file / host buffer goes as soon as the data is back.

        Returns:
            A `Handle`. For the disk tier (and the host tier on CUDA) the store drops its
            reference to `tensor` once the copy has completed.
        """
        self._check()
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise StoreError(f"the activation store offloads strided tensors, got "
                             f"{type(tensor).__name__} with layout {getattr(tensor, 'layout', None)}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise StoreError(f"the activation store cannot offload tensors on {tensor.device}")
        t = tensor.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        rec = _Record(next(self._ids), t, keep)
        core = self._core
        handle = Handle(self, rec)
        moves = core.tier.moves(t)
        with core.lock:
            if moves:
                rec.src = t
                rec.state = "writing"
            else:
                rec.result = t
                rec.state = "ready"
            core._account(rec, on_device=rec.nbytes)
        if moves:
            ready = None
            if t.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(t.device))
            fut = core.submit(core.writer, core.write_task, rec, ready)
            with core.lock:
                if not fut.done():
                    core.pending[fut] = rec.nbytes
                    core.pending_bytes += rec.nbytes
            fut.add_done_callback(lambda f, core=core: _discard(core, f))
            rec.write_future = fut
        else:
            done = Future()
            done.set_result(None)
            rec.write_future = done
        for scope in getattr(self._scopes, "stack", []):
            scope._add(handle)
        return handle

    def prefetch(self, handle: Handle) -> None:
        """Start bringing the handle's data back (no-op if already on its way or back).

        The read starts only after the write has completed. Raises `StoreError` if the
        handle's write or read failed, or an unseen error of another handle.
        """
        self._check(handle)
        rec = handle._rec
        core = self._core
        with core.lock:
            if rec.read_future is not None or rec.state == "ready":
                return
            rec.read_future = fut = core.submit(core.reader, core.read_task, rec)
            core.reads.add(fut)
        fut.add_done_callback(lambda f, core=core: _read_done(core, f))

    def wait(self, handle: Handle) -> torch.Tensor:
        """Block until the handle's data is back on its device and return it.

        Returns:
            A tensor bitwise equal to the offloaded one (same strides for dense tensors); the
            same object on repeated calls until the handle is released.
        """
        self._check(handle)
        rec = handle._rec
        if rec.state == "ready" and rec.result is not None:
            return rec.result
        self.prefetch(handle)
        try:
            with profiled("sppo::copy_wait"):  # the step blocks here: not compute
                out = rec.read_future.result()
        except BaseException:
            if rec.error is not None:
                rec.error_seen = True
                raise rec.error from None
            raise
        if rec.keep:
            with self._core.lock:
                rec.read_future = None  # the next prefetch/wait reads again
        if out.device.type == "cuda":
            out.record_stream(torch.cuda.current_stream(out.device))
        return out

    def release(self, handle: Handle) -> None:
        """Forget the handle's data (file, host buffer, read-back tensor)."""
        _Core.release_record(self._core, handle._rec)

    def recycle_read_buffers(self, max_bytes: int) -> None:
        """Keep up to `max_bytes` of read-back memory (disk tier, CPU tensors) and read later
        tensors into it once the tensors read into it are gone, instead of allocating fresh
        memory per read. The executor sets this to its copy window, so the recycled memory is
        what the window has in flight anyway; `trim_read_buffers` (after each micro-batch's
        backward) gives the free ones back."""
        self._core.tier.recycle_read_buffers(self._core, max_bytes)

    def drop_pooled_files(self) -> None:
        """Remove the files kept for reuse (`reuse_files`); the executor does this when a
        step fails, so that a full disk gets its space back."""
        self._core.tier.drop_pooled_files(self._core)

    def trim_read_buffers(self) -> None:
        """Give back recycled read-back buffers that no tensor uses any more."""
        self._core.tier.trim_read_buffers(self._core)

    @property
    def read_buffer_bytes(self) -> int:
        """Bytes of recycled read-back buffers held now (free or in use)."""
        return self._core.tier.read_buffer_bytes(self._core)

    @property
    def pending_write_bytes(self) -> int:
        """Bytes offloaded whose write has not completed (still held where they came from)."""
        return self._core.pending_bytes

    def wait_writes(self, max_pending_bytes: int) -> None:
        """Block until at most `max_pending_bytes` of writes are pending (oldest first).

        The back-pressure that bounds what offloading holds on the device when the tier is
        slower than the compute producing tensors; a failed write is reported by the
        handle's wait/prefetch (or `synchronize`), not here."""
        while True:
            with self._core.lock:
                if self._core.pending_bytes <= max_pending_bytes or not self._core.pending:
                    return
                oldest = next(iter(self._core.pending))
            try:
                with profiled("sppo::copy_wait"):
                    oldest.result()
            except BaseException:  # noqa: BLE001 - surfaced by the handle
                pass
            _discard(self._core, oldest)  # its callback may not have run yet

    def synchronize(self) -> None:
        """Block until every write issued so far has completed (raises the first new error)."""
        self.settle()
        self._check()

    def settle(self) -> None:
        """Block until every copy issued so far has finished, writes then reads, raising nothing.

        For a failing step: once it has released its handles, this waits out their copies
        still running, so their files are gone before the step's error reaches the caller
        and no write of the failed step fails a later one. A released handle's read (a
        prefetch the backward never waited for) gives its bytes back when it ends, so after
        this the store's counters hold only live handles' bytes."""
        with self._core.lock:
            pending = list(self._core.pending) + list(self._core.reads)
        for f in pending:
            try:
                with profiled("sppo::copy_wait"):
                    f.result()
            except BaseException:  # noqa: BLE001 - the step is failing already
                pass

    # -- autograd integration (see _is_leaf_or_view_of_one below)
    def saved_tensor_hooks(self, min_bytes: int = 0, keep_leaves: bool = True):
        """A `torch.autograd.graph.saved_tensors_hooks` context: pack = offload, unpack = wait.

        Args:
            min_bytes: tensors smaller than this stay where they are.
            keep_leaves: keep leaf tensors that require grad (parameters) and views of them
                instead of offloading them — they live on the device anyway.

        Returns:
            The context manager (use `with store.saved_tensor_hooks(): loss = model(x)`).
        """
        store = self

        def pack(t: torch.Tensor):
            if (t.layout != torch.strided or t.device.type not in ("cpu", "cuda")
                    or type(t) not in (torch.Tensor, torch.nn.Parameter)
                    or t.numel() * t.element_size() < min_bytes
                    or (keep_leaves and _is_leaf_or_view_of_one(t))):
                return t
            return store.offload(t)

        def unpack(obj):
            return obj if isinstance(obj, torch.Tensor) else store.wait(obj)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def scope(self):
        """Collect the handles offloaded (in this thread) while the scope is active.

        Yields:
            A `Scope`; call `scope.prefetch()` later (e.g. before that chunk's backward).
        """
        scope = Scope(self)
        stack = getattr(self._scopes, "stack", None)
        if stack is None:
            stack = self._scopes.stack = []
        stack.append(scope)
        try:
            yield scope
        finally:
            stack.remove(scope)

    # -- lifetime
    def close(self) -> None:
        """Wait for running copies, stop the threads and remove the temp dir."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "ActivationStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        return (f"ActivationStore(tier={self.tier!r}, dir={self.dir!r}, on_device={_fmt_bytes(self.bytes_on_device)}, "
                f"offloaded={_fmt_bytes(self.bytes_offloaded)})")


def _is_leaf_or_view_of_one(t: torch.Tensor) -> bool:
    """A parameter (leaf that requires grad) or a view of one: `linear` saves `weight.t()`,
    which is not a leaf itself but lives as long as the weight does."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class Scope:
    """Handles offloaded while a `store.scope()` was active (weakly held).

    A scope never keeps data alive: handles freed by autograd disappear from it.
    """

    def __init__(self, store: ActivationStore):
        self._store = store
        self._handles: list[weakref.ref] = []

    def _add(self, handle: Handle):
        self._handles.append(weakref.ref(handle))

    @property
    def handles(self) -> list[Handle]:
        """The handles still alive and not released."""
        out = []
        for ref in self._handles:
            h = ref()
            if h is not None and not h._rec.released:
                out.append(h)
        return out

    @property
    def nbytes(self) -> int:
        """Total bytes of the live handles."""
        return sum(h.nbytes for h in self.handles)

    def prefetch(self) -> None:
        """Start reading back every live handle of the scope."""
        for h in self.handles:
            self._store.prefetch(h)

    def wait(self) -> list[torch.Tensor]:
        """Wait for every live handle; returns the tensors."""
        return [self._store.wait(h) for h in self.handles]
