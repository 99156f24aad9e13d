"""The tier interface of the activation store, and the device tier.

A tier holds the host-side copy of an offloaded tensor. The store's core does what every
tier shares (threads, CUDA staging through pinned memory, ordering, accounting, errors);
a tier only says whether a tensor moves at all and how its host-side bytes are kept:

    moves(t)                 False: the store keeps `t` itself (nothing to write or read)
    keep(core, rec, host)    store the dense CPU tensor `host` (pinned when it came from
                             CUDA); return what the record holds in memory afterwards
                             (`rec.host`), None if nothing (default: `host` itself)
    load(core, rec, on_cuda) a CPU tensor with the record's data, pinned when on_cuda
                             (default: `rec.host`)
    discard(core, rec, path, reusable)
                             the record's file at `path` is no longer needed
    close(core)              remove what the tier owns

docs/architecture.md, section 3 "Memory model" (tiers).
"""
from __future__ import annotations

import torch


class Tier:
    """Base class of the tiers (see the module docstring)."""

    name = "?"
    dir = None  # the tier's private directory (disk tier)
    fsync = False  # fsync each file after writing (disk tier)

    def __init__(self, dir: str | None = None, reuse_files: bool = False):
        """`dir` and `reuse_files` are the disk tier's (see `ActivationStore`)."""

    def moves(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def keep(self, core, rec, host: torch.Tensor):
        """By default the host-side copy stays in memory as `rec.host`."""
        return host

    def load(self, core, rec, on_cuda: bool) -> torch.Tensor:
        """By default the data is `rec.host`."""
        return rec.host

    def recycle_read_buffers(self, core, max_bytes: int) -> None:
        """Only the disk tier reads into new memory; other tiers have nothing to recycle."""

    def trim_read_buffers(self, core) -> None:
        """See `recycle_read_buffers`."""

    def read_buffer_bytes(self, core) -> int:
        return 0

    def pooled_files(self, core) -> tuple[int, int]:
        """(files, bytes) kept to be overwritten (disk tier with `reuse_files`)."""
        return 0, 0

    def drop_pooled_files(self, core) -> None:
        """Remove the pooled files (disk tier with `reuse_files`)."""

    def discard(self, core, rec, path, reusable: bool) -> None:
        """Nothing to discard unless the tier owns files."""

    def where(self) -> str:
        """Where the data goes, for error messages."""
        return "host memory"

    def close(self, core) -> None:
        """Nothing to remove by default."""


class DeviceTier(Tier):
    """Nothing moves: the store keeps the tensor (a baseline for plans and tests)."""

    name = "device"

    def moves(self, t: torch.Tensor) -> bool:
        return False
