"""What the activation store keeps per offloaded tensor, its errors, and small helpers
shared by its tiers (docs/architecture.md, section 3 "Memory model")."""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future

import torch

from sppo_fx.errors import SppoError


class StoreError(SppoError):
    """An offload or a read-back of the activation store failed (disk full, I/O error, ...)."""


class StoreWriteError(StoreError):
    """Writing a tensor to its tier failed; its data is not recoverable from the store."""


class StoreReadError(StoreError):
    """Reading a tensor back from its tier failed."""


def _span(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory span of a dense CPU tensor (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


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


class _Record:
    """The mutable state of one offloaded tensor (shared by the store, tasks and Handle)."""

    __slots__ = ("id", "shape", "stride", "dtype", "device", "nbytes", "state", "src", "host",
                 "path", "capacity", "result", "write_future", "read_future", "error", "error_seen",
                 "released", "busy", "on_device", "offloaded", "keep", "checksum", "__weakref__")

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
        self.checksum = None          # sampled checksum of the written bytes (disk tier)

    def empty_like(self, **kw) -> torch.Tensor:
        """An uninitialised tensor of the record's shape, dtype and (if dense) strides."""
        if self.stride is not None:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, **kw)
        return torch.empty(self.shape, dtype=self.dtype, **kw)
