"""The disk tier: a background thread writes the tensor's bytes to a file in a private
temp dir (CUDA tensors are first staged through pinned host memory by the core); once the
write is done the store drops its reference, so the memory is freed when the caller drops
theirs. A read fills a new tensor (or a recycled buffer, `pool.ReadBufferPool`) from the
file, which is then removed, or pooled and later overwritten (`pool.FilePool`).

docs/architecture.md, section 3 "Memory model" (tiers).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import zlib

import torch

from sppo_fx.runtime.store.pool import FilePool, ReadBufferPool
from sppo_fx.runtime.store.records import _dense, _span  # noqa: F401  (_dense: tests read it here)
from sppo_fx.runtime.store.tier import Tier

# Raw byte I/O: module-level so tests can monkeypatch them (e.g. to make a write fail).


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


# A sampled checksum: every file's bytes are checked on read at 4 KiB of each MiB (and the
# last 4 KiB): a truncated, zero-filled or overwritten file is caught for 0.4% of a full
# checksum's work, off the compute (in the store's I/O threads).
_SAMPLE, _STRIDE = 4096, 1 << 20


def _sampled_checksum(view: memoryview) -> int:
    n, acc = len(view), 1
    for off in range(0, n, _STRIDE):
        acc = zlib.adler32(view[off:off + _SAMPLE], acc)
    if n > _SAMPLE:
        acc = zlib.adler32(view[n - _SAMPLE:], acc)
    return acc


def _dir_prefix() -> str:
    """Store dirs are named after their host and process, so that a later run can tell a
    dead process's leftovers from a live one's (`sweep_leftovers`)."""
    return f"sppo_store_{socket.gethostname()}_{os.getpid()}_"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _leftover_pattern() -> re.Pattern:
    """The whole name of a store dir of this host: `_dir_prefix()` and mkdtemp's 8 random
    characters. Matched in full, so that on host `vm` a dir of host `vm_5`
    (`sppo_store_vm_5_<pid>_<8 chars>`) is not read as process 5's."""
    return re.compile(re.escape(f"sppo_store_{socket.gethostname()}_") + r"([0-9]+)_[a-z0-9_]{8}")


def sweep_leftovers(parent: str | None = None) -> list[str]:
    """Remove the store dirs in `parent` (default: the temp dir) left by processes of this
    host that are no longer running (a killed run); returns what was removed. Only a real
    directory (not a link) that this user owns, whose name is exactly a store dir's of this
    host (`_leftover_pattern`), of a process that is not running, is removed; anything that
    could not be removed is not reported."""
    parent = parent or tempfile.gettempdir()
    pattern = _leftover_pattern()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue  # a link, a file, or another user's: not ours to remove
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


class DiskTier(Tier):
    name = "disk"

    def __init__(self, dir: str | None = None, reuse_files: bool = False):
        sweep_leftovers(dir)
        self.dir = tempfile.mkdtemp(prefix=_dir_prefix(), dir=dir)
        self.files = FilePool(reuse_files)
        self.read_buffers = ReadBufferPool()

    def moves(self, t: torch.Tensor) -> bool:
        return True

    def keep(self, core, rec, host: torch.Tensor):
        if rec.nbytes:
            path, size = self.files.take(core, rec, self.dir)
            rec.path, rec.capacity = path, size or rec.nbytes
            _write_bytes(path, _span(host), overwrite=bool(size))
            rec.checksum = _sampled_checksum(_span(host))
            if self.fsync:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return None  # nothing stays in memory

    def load(self, core, rec, on_cuda: bool) -> torch.Tensor:
        staging = None if on_cuda else self.read_buffers.take(core, rec)
        if staging is None:
            staging = rec.empty_like(pin_memory=True) if on_cuda else rec.empty_like()
        if rec.nbytes:
            _read_bytes(rec.path, _span(staging), exact=rec.capacity == rec.nbytes)
            if rec.checksum is not None and _sampled_checksum(_span(staging)) != rec.checksum:
                raise OSError(f"{rec.path} does not hold the bytes written to it (checksum mismatch): "
                              "the file was changed or corrupted after the write")
        return staging

    def discard(self, core, rec, path, reusable: bool) -> None:
        self.files.free(core, path, rec.capacity, reusable)

    def where(self) -> str:
        return self.dir

    def recycle_read_buffers(self, core, max_bytes: int) -> None:
        with core.lock:
            self.read_buffers.limit = max(self.read_buffers.limit, int(max_bytes))

    def trim_read_buffers(self, core) -> None:
        self.read_buffers.trim(core)

    def read_buffer_bytes(self, core) -> int:
        return self.read_buffers.held_bytes(core)

    def pooled_files(self, core) -> tuple[int, int]:
        with core.lock:
            return len(self.files.free_files), self.files.pool_bytes

    def drop_pooled_files(self, core) -> None:
        self.files.drop(core)

    def close(self, core) -> None:
        self.read_buffers.clear(core)
        shutil.rmtree(self.dir, ignore_errors=True)
