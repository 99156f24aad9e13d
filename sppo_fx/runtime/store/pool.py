"""Reuse for the disk tier: pooled files (overwritten instead of created) and recycled
read-back buffers (filled instead of allocated). Both spare the kernel's work on fresh
pages, which on this project's CPU VM costs more than the copy itself.

docs/architecture.md, section 3 "Memory model" (tiers).
"""
from __future__ import annotations

import os

import torch

from sppo_fx.runtime.store.records import _remove

# References to a storage (tensors and Python storage objects); None if this torch lacks it.
_storage_use_count = (
    (lambda st: torch._C._storage_Use_Count(st._cdata)) if hasattr(torch._C, "_storage_Use_Count") else None)


class FilePool:
    """Files whose data is no longer needed, kept to be overwritten (`reuse_files`).

    The pool's files total at most the most bytes the tier held at once; a write that fits
    no pooled file removes the oldest one. All methods take the store's core, whose lock
    guards the pool."""

    def __init__(self, reuse_files: bool):
        self.reuse_files = reuse_files
        self.free_files: list[tuple[int, str]] = []  # (size, path) of pooled files holding no data
        self.pool_bytes = 0

    def take(self, core, rec, directory: str) -> tuple[str, int]:
        """(path, size) of a pooled file that fits rec (smallest first, at most 2x its
        bytes), or (a new path, 0). On a miss the oldest pooled file is removed: the new
        file takes its place, so sizes that no longer occur do not pile up."""
        stale = None
        with core.lock:
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
        return os.path.join(directory, f"t{rec.id}.bin"), 0

    def drop(self, core) -> None:
        """Remove every pooled file (e.g. after a failed write: the disk may be full)."""
        with core.lock:
            files, self.free_files, self.pool_bytes = self.free_files, [], 0
        for _, path in files:
            _remove(path)

    def free(self, core, path: str, size: int, reusable: bool = True) -> None:
        """A file whose data is no longer needed: into the pool (while the pool stays within
        the most bytes the tier ever held at once), or removed."""
        with core.lock:
            if (reusable and self.reuse_files and not core.closed
                    and self.pool_bytes + size <= core.peak_bytes_offloaded):
                self.free_files.append((size, path))
                self.pool_bytes += size
                return
        _remove(path)


class ReadBufferPool:
    """Read-back memory of the disk tier on the CPU, reused once the tensors read into it
    are gone (`ActivationStore.recycle_read_buffers`)."""

    def __init__(self):
        self.buffers: list[torch.UntypedStorage] = []
        self.limit = 0

    def take(self, core, rec) -> torch.Tensor | None:
        """An empty tensor for rec's data on memory a finished read used before (no page
        faults: on this project's CPU VM a fresh buffer costs about 0.3 s/GB in faults,
        more than the read itself), or on a new buffer kept for reuse; None when the pool
        is off or full.

        A buffer is free again once no tensor uses its storage (use count 1: the pool's own
        reference), i.e. once the backward graph has let go of the activation read into it.
        """
        n = rec.nbytes
        if not 0 < n <= self.limit or _storage_use_count is None:
            return None  # (a read larger than the limit must not flush the pool)
        with core.lock:
            best = None
            for st in self.buffers:
                size = st.nbytes()
                if n <= size <= 2 * n and (best is None or size < best.nbytes()) and _storage_use_count(st) == 1:
                    best = st
            if best is None:
                held = sum(st.nbytes() for st in self.buffers)
                for st in [st for st in self.buffers if _storage_use_count(st) == 1]:
                    if held + n <= self.limit:
                        break
                    self.buffers.remove(st)  # a free buffer of a size that did not fit
                    held -= st.nbytes()
                if held + n > self.limit:
                    return None
                best = torch.UntypedStorage(n)
                self.buffers.append(best)
            # made under the lock: from here on the use count says "taken"
            out = torch.empty(0, dtype=rec.dtype, device="cpu")
            return out.set_(best, 0, rec.shape, rec.stride if rec.stride is not None else ())  # (): contiguous

    def trim(self, core) -> None:
        """Give back the buffers no tensor uses any more."""
        with core.lock:
            self.buffers = [st for st in self.buffers if _storage_use_count(st) > 1]

    def held_bytes(self, core) -> int:
        with core.lock:
            return sum(st.nbytes() for st in self.buffers)

    def clear(self, core) -> None:
        with core.lock:
            self.buffers = []
