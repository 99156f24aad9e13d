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
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from sppo_fx.errors import SppoError

TIERS = ("device", "host", "disk")

# References to a storage (tensors and Python storage objects); None if this torch lacks it.
_storage_use_count = (
    (lambda st: torch._C._storage_Use_Count(st._cdata)) if hasattr(torch._C, "_storage_Use_Count") else None)


class StoreError(SppoError):
    """An offload or a read-back of the activation store failed (disk full, I/O error, ...)."""


class StoreWriteError(StoreError):
    """Writing a tensor to its tier failed; its data is not recoverable from the store."""


class StoreReadError(StoreError):
    """Reading a tensor back from its tier failed."""


# --------------------------------------------------------------------- raw byte I/O
#
# Module-level so tests can monkeypatch them (e.g. to make a write fail).


def _span(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory span of a dense CPU tensor (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _write_bytes(path: str, view: memoryview, overwrite: bool = False) -> None:
    """Write `view` to a new file at `path`, or with `overwrite` at the start of an existing
    (pooled) file, keeping its size: its page-cache pages are reused, where a new file
    would allocate fresh ones (whole-buffer loop over partial writes)."""
    fd = os.open(path, os.O_WRONLY) if overwrite else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        off, n = 0, len(view)
        while off < n:
            written = os.pwrite(fd, view[off:off + (64 << 20)], off)
            if written <= 0:
                raise OSError(f"os.pwrite wrote {written} bytes")
            off += written
    finally:
        os.close(fd)


def _read_bytes(path: str, view: memoryview, exact: bool = True) -> None:
    """Fill `view` from the file at `path`; raises if the file is shorter (or, with
    `exact`, longer: a pooled file may be larger than what was last written to it)."""
    with open(path, "rb", buffering=0) as f:
        off, n = 0, len(view)
        while off < n:
            got = f.readinto(view[off:])
            if not got:
                raise OSError(f"{path} ended after {off} of {n} bytes")
            off += got
        if exact and f.read(1):
            raise OSError(f"{path} holds more than the {n} bytes written")


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly its memory span (contiguous up to a permutation)."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# ------------------------------------------------------------------------- records


class _Record:
    """The mutable state of one offloaded tensor (shared by the store, tasks and Handle)."""

    __slots__ = ("id", "shape", "stride", "dtype", "device", "nbytes", "state", "src", "host",
                 "path", "capacity", "result", "write_future", "read_future", "error", "error_seen",
                 "released", "busy", "on_device", "offloaded", "keep", "__weakref__")

    def __init__(self, rid, t: torch.Tensor, keep: bool = False):
        self.id = rid
        self.keep = keep              # the copy stays in the tier: every read is a fresh one
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride()) if _dense(t) else None
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = t.numel() * t.element_size()
        self.state = "new"            # writing -> stored -> reading -> ready | failed | released
        self.src = None               # the original tensor, until the write completes
        self.host = None              # pinned host copy (host tier)
        self.path = None              # file (disk tier)
        self.capacity = 0             # its size (a pooled file may be larger than nbytes)
        self.result = None            # the tensor back on the device
        self.write_future: Future | None = None
        self.read_future: Future | None = None
        self.error: BaseException | None = None
        self.error_seen = False
        self.released = False
        self.busy = 0                 # background tasks submitted and not finished
        self.on_device = 0            # bytes of this record counted in bytes_on_device
        self.offloaded = 0            # bytes counted in bytes_offloaded


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


# ---------------------------------------------------------------------------- core


class _Core:
    """Everything background tasks touch (so that they never keep the store alive)."""

    def __init__(self, tier: str, dir: str | None, workers: int, reuse_files: bool = False):
        self.tier = tier
        self.reuse_files = reuse_files
        self.free_files: list[tuple[int, str]] = []  # (size, path) of pooled files holding no data
        self.pool_bytes = 0
        self.read_buffers: list[torch.UntypedStorage] = []  # recycled read-back memory (CPU, disk tier)
        self.read_buffer_limit = 0
        self.lock = threading.RLock()
        self.bytes_on_device = 0
        self.bytes_offloaded = 0
        self.peak_bytes_on_device = 0
        self.peak_bytes_offloaded = 0
        self.failed: list[_Record] = []
        self.closed = False
        self.delay_hook: Callable[[str], None] | None = None
        self.fsync = False
        self.tmpdir = tempfile.mkdtemp(prefix="sppo_store_", dir=dir) if tier == "disk" else None
        self.writer = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sppo-store-w")
        self.reader = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sppo-store-r")
        self.streams = None  # (d2h stream, h2d stream) per CUDA device, created lazily
        self.pending: dict[Future, int] = {}  # write futures not finished yet -> bytes, oldest first
        self.pending_bytes = 0

    def submit(self, pool: ThreadPoolExecutor, fn, rec: _Record, *args) -> Future:
        """Run fn(rec, *args) on `pool`; afterwards drop rec's data if it was released meanwhile."""
        with self.lock:
            rec.busy += 1

        def run():
            try:
                return fn(rec, *args)
            finally:
                with self.lock:
                    rec.busy -= 1
                    drop = rec.released and rec.busy == 0
                if drop:
                    self._drop_storage(rec)

        return pool.submit(run)

    # -- counters (call with the lock held)
    def _account(self, rec: _Record, on_device: int | None = None, offloaded: int | None = None):
        if on_device is not None:
            self.bytes_on_device += on_device - rec.on_device
            rec.on_device = on_device
            self.peak_bytes_on_device = max(self.peak_bytes_on_device, self.bytes_on_device)
        if offloaded is not None:
            self.bytes_offloaded += offloaded - rec.offloaded
            rec.offloaded = offloaded
            self.peak_bytes_offloaded = max(self.peak_bytes_offloaded, self.bytes_offloaded)

    def _fail(self, rec: _Record, err: BaseException):
        with self.lock:
            rec.error = err
            rec.state = "failed"
            self.failed.append(rec)

    def _delay(self, what: str):
        hook = self.delay_hook
        if hook is not None:
            hook(what)

    def _cuda_streams(self, device: torch.device):
        if self.streams is None:
            self.streams = {}
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self.streams:
            self.streams[key] = (torch.cuda.Stream(device=key), torch.cuda.Stream(device=key))
        return self.streams[key]

    # -- background tasks
    def write_task(self, rec: _Record, ready_event) -> None:
        """Copy rec.src off the device (host buffer and/or file); then drop rec.src."""
        try:
            self._delay("write")
            src = rec.src
            if src.device.type == "cuda":
                d2h, _ = self._cuda_streams(src.device)
                if rec.stride is not None:
                    host = torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, pin_memory=True)
                else:
                    host = torch.empty(rec.shape, dtype=rec.dtype, pin_memory=True)
                with torch.cuda.stream(d2h):
                    if ready_event is not None:
                        d2h.wait_event(ready_event)
                    host.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(d2h)
                done.synchronize()
            else:
                host = src if rec.stride is not None else src.contiguous()
            if self.tier == "disk":
                if rec.nbytes:
                    path, size = self._take_file(rec)
                    rec.path, rec.capacity = path, size or rec.nbytes
                    _write_bytes(path, _span(host), overwrite=bool(size))
                    if self.fsync:
                        fd = os.open(path, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                host = None
            with self.lock:
                rec.host = host
                rec.src = None
                if rec.state == "writing":
                    rec.state = "stored"
                self._account(rec, on_device=0, offloaded=rec.nbytes)
        except BaseException as e:  # noqa: BLE001 - reported at wait/prefetch/next call
            path, rec.path = rec.path, None
            rec.src = None
            with self.lock:
                self._account(rec, on_device=0, offloaded=0)
            if path:
                _remove(path)
            self._fail(rec, StoreWriteError(
                f"sppo_fx activation store ({self.tier} tier): offloading tensor #{rec.id} "
                f"{list(rec.shape)} {str(rec.dtype).replace('torch.', '')} ({_fmt_bytes(rec.nbytes)}) "
                f"{'to ' + path if path else ''} failed: {type(e).__name__}: {e}. Its data is "
                f"lost; check free space and permissions of {self.tmpdir or 'host memory'}"))
            raise

    def read_task(self, rec: _Record) -> torch.Tensor:
        """Wait for the write, bring the data back to rec.device, remove the file."""
        rec.write_future.result()  # never read before the write has completed (raises if it failed)
        if rec.released:
            return None
        try:
            with self.lock:
                rec.state = "reading"
            self._delay("read")
            on_cuda = rec.device.type == "cuda"
            if rec.stride is not None:
                make = lambda **kw: torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, **kw)  # noqa: E731
            else:
                make = lambda **kw: torch.empty(rec.shape, dtype=rec.dtype, **kw)  # noqa: E731
            if self.tier == "disk":
                staging = None if on_cuda else self._take_read_buffer(rec)
                if staging is None:
                    staging = make(pin_memory=True) if on_cuda else make()
                if rec.nbytes:
                    _read_bytes(rec.path, _span(staging), exact=rec.capacity == rec.nbytes)
            else:
                staging = rec.host
            if on_cuda:
                _, h2d = self._cuda_streams(rec.device)
                # allocated on the copy stream, so the copy need not wait for queued compute
                # (`wait` records the consumer's stream on it)
                with torch.cuda.stream(h2d):
                    out = make(device=rec.device)
                    out.copy_(staging, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(h2d)
                done.synchronize()
            else:
                out = staging
            if rec.keep:
                # a kept copy: the caller owns `out`; the tier's copy serves the next read
                with self.lock:
                    rec.state = "stored"
                return out
            path = rec.path
            with self.lock:
                rec.result = out
                rec.host = None
                rec.path = None
                rec.state = "ready"
                self._account(rec, on_device=rec.nbytes, offloaded=0)
            if path:
                self._free_file(path, rec.capacity)
            return out
        except BaseException as e:  # noqa: BLE001
            # the traceback outlives this call (in the Future and the error): it must not
            # keep a recycled buffer in use
            staging = out = None  # noqa: F841
            self._fail(rec, StoreReadError(
                f"sppo_fx activation store ({self.tier} tier): reading tensor #{rec.id} "
                f"{list(rec.shape)} {str(rec.dtype).replace('torch.', '')} back"
                f"{' from ' + rec.path if rec.path else ''} failed: {type(e).__name__}: {e}"))
            raise

    # -- recycled read-back buffers (CPU, disk tier)
    def _take_read_buffer(self, rec: _Record) -> torch.Tensor | None:
        """An empty tensor for rec's data on memory a finished read used before (no page
        faults: on this project's CPU VM a fresh buffer costs about 0.3 s/GB in faults,
        more than the read itself), or on a new buffer kept for reuse; None when the pool
        is off or full.

        A buffer is free again once no tensor uses its storage (use count 1: the pool's own
        reference), i.e. once the backward graph has let go of the activation read into it.
        """
        n = rec.nbytes
        if not 0 < n <= self.read_buffer_limit or _storage_use_count is None:
            return None  # (a read larger than the limit must not flush the pool)
        with self.lock:
            best = None
            for st in self.read_buffers:
                size = st.nbytes()
                if n <= size <= 2 * n and (best is None or size < best.nbytes()) and _storage_use_count(st) == 1:
                    best = st
            if best is None:
                held = sum(st.nbytes() for st in self.read_buffers)
                for st in [st for st in self.read_buffers if _storage_use_count(st) == 1]:
                    if held + n <= self.read_buffer_limit:
                        break
                    self.read_buffers.remove(st)  # a free buffer of a size that did not fit
                    held -= st.nbytes()
                if held + n > self.read_buffer_limit:
                    return None
                best = torch.UntypedStorage(n)
                self.read_buffers.append(best)
            # made under the lock: from here on the use count says "taken"
            out = torch.empty(0, dtype=rec.dtype, device="cpu")
            return out.set_(best, 0, rec.shape, rec.stride if rec.stride is not None else ())  # (): contiguous

    def trim_read_buffers(self) -> None:
        with self.lock:
            self.read_buffers = [st for st in self.read_buffers if _storage_use_count(st) > 1]

    # -- release
    def _drop_storage(self, rec: _Record):
        with self.lock:
            path, rec.path = rec.path, None
            rec.host = rec.result = None
            if rec.read_future is not None and rec.read_future.done():
                rec.read_future = None  # a finished read's Future holds the read-back tensor
            if rec.state != "failed":
                rec.state = "released"
            self._account(rec, on_device=0 if rec.src is None else rec.on_device, offloaded=0)
        if path:
            self._free_file(path, rec.capacity, reusable=rec.state != "failed")

    # -- the file pool (reuse_files)
    def _take_file(self, rec: _Record) -> tuple[str, int]:
        """(path, size) of a pooled file that fits rec (smallest first, at most 2x its
        bytes), or (a new path, 0). On a miss the oldest pooled file is removed: the new
        file takes its place, so sizes that no longer occur do not pile up."""
        stale = None
        with self.lock:
            fits = [(size, path) for size, path in self.free_files if rec.nbytes <= size <= 2 * rec.nbytes]
            if fits:
                best = min(fits)
                self.free_files.remove(best)
                self.pool_bytes -= best[0]
                return best[1], best[0]
            if self.free_files:
                stale = self.free_files.pop(0)
                self.pool_bytes -= stale[0]
        if stale is not None:
            _remove(stale[1])
        return os.path.join(self.tmpdir, f"t{rec.id}.bin"), 0

    def _free_file(self, path: str, size: int, reusable: bool = True) -> None:
        """A file whose data is no longer needed: into the pool (while the pool stays within
        the most bytes the tier ever held at once), or removed."""
        with self.lock:
            if (reusable and self.reuse_files and not self.closed
                    and self.pool_bytes + size <= self.peak_bytes_offloaded):
                self.free_files.append((size, path))
                self.pool_bytes += size
                return
        _remove(path)

    @staticmethod
    def release_record(core: "_Core", rec: _Record):
        """Forget a record: remove its file / buffers now, or when its running copy finishes."""
        with core.lock:
            if rec.released:
                return
            rec.released = True
            idle = rec.busy == 0
        if idle:
            core._drop_storage(rec)

    def close(self):
        if self.closed:
            return
        self.closed = True
        # never join our own pool from one of its threads (a finalizer may run anywhere)
        wait = not threading.current_thread().name.startswith("sppo-store-")
        self.writer.shutdown(wait=wait, cancel_futures=True)
        self.reader.shutdown(wait=wait, cancel_futures=True)
        with self.lock:
            self.read_buffers = []
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _discard(core: _Core, fut: Future):
    with core.lock:
        core.pending_bytes -= core.pending.pop(fut, 0)


def _remove(path: str):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- store


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
        self._core = _Core(tier, dir, workers, reuse_files)
        self._ids = itertools.count()
        self._scopes = threading.local()
        self._finalizer = weakref.finalize(self, _Core.close, self._core)

    # -- properties
    @property
    def dir(self) -> str | None:
        return self._core.tmpdir

    @property
    def delay_hook(self):
        return self._core.delay_hook

    @delay_hook.setter
    def delay_hook(self, fn):
        self._core.delay_hook = fn

    @property
    def fsync(self) -> bool:
        return self._core.fsync

    @fsync.setter
    def fsync(self, value: bool):
        self._core.fsync = bool(value)

    @property
    def bytes_on_device(self) -> int:
        """Bytes of device tensors the store references now (pending writes, read-backs, kept)."""
        return self._core.bytes_on_device

    @property
    def pooled_files(self) -> int:
        """Files in the pool (`reuse_files`): they hold no live data and wait to be overwritten."""
        with self._core.lock:
            return len(self._core.free_files)

    @property
    def pooled_bytes(self) -> int:
        """Total size of the pooled files."""
        return self._core.pool_bytes

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
        moves = self.tier == "disk" or (self.tier == "host" and t.device.type == "cuda")
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
            rec.read_future = core.submit(core.reader, core.read_task, rec)

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
        with self._core.lock:
            self._core.read_buffer_limit = max(self._core.read_buffer_limit, int(max_bytes))

    def trim_read_buffers(self) -> None:
        """Give back recycled read-back buffers that no tensor uses any more."""
        self._core.trim_read_buffers()

    @property
    def read_buffer_bytes(self) -> int:
        """Bytes of recycled read-back buffers held now (free or in use)."""
        with self._core.lock:
            return sum(st.nbytes() for st in self._core.read_buffers)

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
                oldest.result()
            except BaseException:  # noqa: BLE001 - surfaced by the handle
                pass
            _discard(self._core, oldest)  # its callback may not have run yet

    def synchronize(self) -> None:
        """Block until every write issued so far has completed (raises the first new error)."""
        with self._core.lock:
            pending = list(self._core.pending)
        for f in pending:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - surfaced by _check below
                pass
        self._check()

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
