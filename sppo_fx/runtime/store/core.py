"""The part of the activation store that background tasks touch (so that they never keep
the store alive): threads, CUDA staging, ordering, accounting and errors, the same for
every tier; what differs per tier is in `tier.py`, `host.py` and `disk.py`.

docs/architecture.md, section 2 "S5 Nothing silently wrong": every read of a record waits
for its write's future first; a failed copy is recorded and raised by the store.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from sppo_fx.runtime.store.records import StoreReadError, StoreWriteError, _fmt_bytes, _Record
from sppo_fx.runtime.store.tier import Tier


def profiled(name: str):
    """A profiler range named `name` while a profiler runs, else nothing: the copy overlap
    measurement (`sppo_fx/benchmark/copy_overlap.py`) finds the store's copies and waits
    by these ranges; without a profiler they would cost a dispatcher call per copy."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class _Core:
    """Everything background tasks touch (so that they never keep the store alive)."""

    def __init__(self, tier: Tier, workers: int):
        self.tier = tier
        self.lock = threading.RLock()
        self.bytes_on_device = 0
        self.bytes_offloaded = 0
        self.peak_bytes_on_device = 0
        self.peak_bytes_offloaded = 0
        self.failed: list[_Record] = []
        self.closed = False
        self.delay_hook: Callable[[str], None] | None = None
        self.writer = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sppo-store-w")
        self.reader = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sppo-store-r")
        self.streams = None  # (d2h stream, h2d stream) per CUDA device, created lazily
        self.pending: dict[Future, int] = {}  # write futures not finished yet -> bytes, oldest first
        self.pending_bytes = 0
        self.reads: set[Future] = set()  # read futures not finished yet (prefetches included)

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
        """Copy rec.src off the device into the tier; then drop rec.src."""
        try:
            self._delay("write")
            with profiled("sppo::offload_write"):
                src = rec.src
                if src.device.type == "cuda":
                    d2h, _ = self._cuda_streams(src.device)
                    host = rec.empty_like(pin_memory=True)
                    with torch.cuda.stream(d2h):
                        if ready_event is not None:
                            d2h.wait_event(ready_event)
                        host.copy_(src, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(d2h)
                    done.synchronize()
                else:
                    host = src if rec.stride is not None else src.contiguous()
                host = self.tier.keep(self, rec, host)
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
                self.tier.discard(self, rec, path, reusable=False)
            self._fail(rec, StoreWriteError(
                f"sppo_fx activation store ({self.tier.name} tier): offloading tensor #{rec.id} "
                f"{list(rec.shape)} {str(rec.dtype).replace('torch.', '')} ({_fmt_bytes(rec.nbytes)}) "
                f"{'to ' + path if path else ''} failed: {type(e).__name__}: {e}. Its data is "
                f"lost; check free space and permissions of {self.tier.where()}"))
            raise

    def read_task(self, rec: _Record) -> torch.Tensor:
        """Wait for the write, bring the data back to rec.device, let the tier drop its copy."""
        rec.write_future.result()  # never read before the write has completed (raises if it failed)
        if rec.released:
            return None
        try:
            with self.lock:
                rec.state = "reading"
            self._delay("read")
            with profiled("sppo::offload_read"):
                on_cuda = rec.device.type == "cuda"
                staging = self.tier.load(self, rec, on_cuda)
                if on_cuda:
                    _, h2d = self._cuda_streams(rec.device)
                    # allocated on the copy stream, so the copy need not wait for queued compute
                    # (`wait` records the consumer's stream on it)
                    with torch.cuda.stream(h2d):
                        out = rec.empty_like(device=rec.device)
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
                self.tier.discard(self, rec, path, reusable=True)
            return out
        except BaseException as e:  # noqa: BLE001
            # the traceback outlives this call (in the Future and the error): it must not
            # keep a recycled buffer in use
            staging = out = None  # noqa: F841
            self._fail(rec, StoreReadError(
                f"sppo_fx activation store ({self.tier.name} tier): reading tensor #{rec.id} "
                f"{list(rec.shape)} {str(rec.dtype).replace('torch.', '')} back"
                f"{' from ' + rec.path if rec.path else ''} failed: {type(e).__name__}: {e}"))
            raise

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
            self.tier.discard(self, rec, path, reusable=rec.state != "failed")

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
        self.tier.close(self)


def _discard(core: _Core, fut: Future):
    with core.lock:
        core.pending_bytes -= core.pending.pop(fut, 0)


def _read_done(core: _Core, fut: Future):
    with core.lock:
        core.reads.discard(fut)
