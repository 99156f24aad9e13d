"""The streamed K/V skeleton's blocks on the disk tier: one append-only file per
micro-batch, read in order by one background task per stream.

Why: chunk i reads every earlier block, so over N chunks the skeleton is read N^2/2 blocks
at a time. Through the ActivationStore each of those reads was a file of its own (open,
read, close, a thread handoff per block, two files a block: K and V). Here every block is
written once, at its offset in a single file, and a stream (chunk i, one site, one pass)
is one task that preads its blocks in order: files and tasks per step grow as N, only the
preads (one syscall a block) grow as N^2. The device side is unchanged: a stream holds at
most two blocks (K and V) at a time, the one in use and the next one (`_AHEAD` tokens),
which is the stream buffer the memory model counts (`solver.memory_model.predict_peak`).

Nothing silently wrong: a read waits for its block's write; a failed write or a short or
changed read (sampled checksum, as the disk tier's) raises at the reader, naming the file.
"""
from __future__ import annotations

import os
import queue
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sppo_fx.runtime.store.disk import _sampled_checksum
from sppo_fx.runtime.store.records import StoreReadError, StoreWriteError, _span

_AHEAD = 2  # blocks of a stream alive at once: the one in use and the one read ahead
# A stream whose blocks are all this small is read inline, in the consumer's thread: a
# handoff to the reader thread (its wake-up, the GIL passed back and forth) cost about
# 80 us a block on one core, where a pread of a page-cached block this size costs a few us.
# Larger blocks, and blocks bound for a GPU, are read ahead in the background, where their
# reads can hide behind the ops (which release the GIL).
INLINE_READ_BYTES = 256 << 10
_POOLS: list = []


def _pools() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    # shared by every micro-batch: threads are not started per step
    if not _POOLS:
        _POOLS.extend((ThreadPoolExecutor(1, thread_name_prefix="sppo-skel-w"),
                       ThreadPoolExecutor(4, thread_name_prefix="sppo-skel-r")))
    return _POOLS[0], _POOLS[1]


def _close(state: dict) -> None:
    fd, path = state.pop("fd", None), state.pop("path", None)
    if fd is not None:
        os.close(fd)
    if path is not None and os.path.exists(path):
        os.remove(path)


class _Block:
    __slots__ = ("offset", "nbytes", "shape", "stride", "dtype", "device", "checksum", "written")

    def __init__(self, offset, host: torch.Tensor, device):
        self.offset, self.nbytes = offset, host.numel() * host.element_size()
        self.shape, self.stride, self.dtype, self.device = host.shape, host.stride(), host.dtype, device
        self.checksum, self.written = None, None


class SkeletonLog:
    """Blocks of one micro-batch's skeleton in one file under `dir`.

    Attributes:
        files_opened / streams / block_reads: counters of the I/O done (tests, the clock).
    """

    def __init__(self, dir: str | None):
        self.dir = dir
        self.state: dict = {}  # fd, path of the open file (closed with the log at the latest)
        self.end = self.live = 0
        self.last_write: Future | None = None
        self.writer, self.reader = _pools()
        self.files_opened = self.streams = self.block_reads = 0
        self._finalizer = weakref.finalize(self, _close, self.state)

    @property
    def fd(self):
        return self.state.get("fd")

    @property
    def path(self):
        return self.state.get("path")

    def _open(self) -> None:
        fd, path = tempfile.mkstemp(prefix="skeleton_", dir=self.dir)
        self.state.update(fd=fd, path=path)
        self.end = 0
        self.files_opened += 1

    def put(self, x: torch.Tensor) -> _Block:
        """Append x's bytes (in the background); the block keeps its shape and strides."""
        if self.fd is None:
            self._open()
        cuda = x.device.type == "cuda"
        host = torch.empty_like(x, device="cpu", pin_memory=cuda)
        host.copy_(x, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        block = _Block(self.end, host, x.device)
        self.end += block.nbytes
        self.live += 1
        fd, path = self.fd, self.path

        def write():
            if ready is not None:
                ready.synchronize()
            try:
                view, off = _span(host), 0
                while off < len(view):
                    n = os.pwrite(fd, view[off:off + (64 << 20)], block.offset + off)
                    if n <= 0:
                        raise OSError(f"os.pwrite wrote {n} bytes")
                    off += n
                block.checksum = _sampled_checksum(view)
            except BaseException as e:  # noqa: BLE001 - raised at the block's first read
                raise StoreWriteError(f"sppo_fx K/V skeleton: writing a block of {block.nbytes} bytes to {path} "
                                      f"failed: {type(e).__name__}: {e}; check free space and permissions") from e
        block.written = self.last_write = self.writer.submit(write)
        return block

    def drop(self, block: _Block) -> None:
        """A block has no reader left; with none left, the file goes."""
        self.live -= 1
        if self.live == 0 and self.fd is not None:
            if self.last_write is not None:
                self.last_write.exception()  # the writes into this file are done (an error was raised at its read)
            _close(self.state)

    def stream(self, blocks: list[tuple[_Block, _Block]]):
        """Yield (K_j, V_j) of `blocks` in order: one background task preads them, at most
        `_AHEAD` pairs alive at once (each pair's token returns when the next is asked for);
        CPU blocks of at most `INLINE_READ_BYTES` each are read when asked for, inline."""
        self.streams += 1
        tokens = threading.Semaphore(_AHEAD)
        out: queue.Queue = queue.Queue()
        stop = threading.Event()
        fd = self.fd

        def read_one(block: _Block) -> torch.Tensor:
            block.written.result()  # raises the write's error
            t = torch.empty_strided(block.shape, block.stride, dtype=block.dtype,
                                    pin_memory=block.device.type == "cuda")
            view = _span(t)
            n = os.preadv(fd, [view], block.offset) if len(view) else 0
            if n != len(view) or (block.checksum is not None and _sampled_checksum(view) != block.checksum):
                raise StoreReadError(f"sppo_fx K/V skeleton: {self.path} does not hold the {block.nbytes} bytes "
                                     f"written at offset {block.offset} (read {n}): the file was changed")
            return t

        def produce():
            try:
                for pair in blocks:
                    while not tokens.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    out.put(tuple(read_one(b) for b in pair))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                out.put(e)

        if all(b.device.type == "cpu" and b.nbytes <= INLINE_READ_BYTES for pair in blocks for b in pair):
            for pair in blocks:  # at most one pair alive: the op drops it before asking again
                got = tuple(read_one(b) for b in pair)
                self.block_reads += 1
                yield got
                del got
            return
        task: Future = self.reader.submit(produce)
        try:
            for n in range(len(blocks)):
                if n:
                    tokens.release()  # the previous pair is no longer used (the ops drop it first)
                got = out.get()
                if isinstance(got, BaseException):
                    raise got
                self.block_reads += 1
                dev = blocks[n][0].device
                yield tuple(t if dev.type == "cpu" else t.to(dev, non_blocking=True) for t in got)
                del got
        finally:
            stop.set()
            tokens.release()
            task.result()

    def close(self) -> None:
        if self.last_write is not None:
            self.last_write.exception()
        _close(self.state)
