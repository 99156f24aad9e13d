"""The K/V skeleton of one micro-batch, off the chunk graphs' inputs (level 1 of SPPO's
two-level activation management).

Chunk j's K and V of every attention site are read by every later chunk, in forward and
in backward. With `skeleton="offload"` the chunk programs get them through the ops of
`sppo_fx.ops.skeleton`, and this object holds them:

    block (site s, chunk j)   K_j, V_j: kept on the device, or in the ActivationStore's tier
                              (one copy, read back as often as needed: `offload(keep=True)`)
    gradients (s, j)          dK_j, dV_j summed over the later chunks' backwards (device)

    forward of chunk i, site s:   blocks (s, 0..i-1) stream in one at a time; the next
                                  block's read starts while the current one is used
    backward of chunk i, site s:  the same blocks stream in again; their gradients add up
                                  here; chunk i's own backward then takes dK_i, dV_i

So the device holds one site's block or two at a time instead of the whole skeleton. The
last chunk's K/V is never a prefix: it is not stored at all.
"""
from __future__ import annotations

import torch


class BlockStream:
    """The blocks (K_j, V_j), j < chunk, of one site, in order; iterating reads them back
    one at a time with the next one prefetched."""

    def __init__(self, skeleton: "KVSkeleton", site: int, chunk: int):
        self.skeleton, self.site, self.chunk = skeleton, site, chunk

    def __len__(self) -> int:
        return self.chunk

    def __iter__(self):
        sk = self.skeleton
        if self.chunk > 0:
            sk._prefetch(self.site, 0)
        for j in range(self.chunk):
            if j + 1 < self.chunk:
                sk._prefetch(self.site, j + 1)
            yield sk._read(2 * self.site, j), sk._read(2 * self.site + 1, j)


class KVSkeleton:
    """K/V blocks and their gradient accumulators of one micro-batch.

    Args:
        store: the ActivationStore whose tier offloaded blocks go to (None keeps them all).
        offload: whether blocks go to the store.
        num_chunks: chunks of the micro-batch (the last one's K/V is not stored).
    """

    def __init__(self, store=None, offload: bool = False, num_chunks: int | None = None):
        self.store, self.offload, self.num_chunks = store, offload and store is not None, num_chunks
        self.blocks: dict[tuple[int, int], object] = {}   # (slot, chunk) -> tensor | Handle
        self.grads: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, slot: int, chunk: int, x: torch.Tensor) -> None:
        """Chunk `chunk`'s K (slot 2s) or V (2s + 1) of site s, after its forward."""
        if self.num_chunks is not None and chunk == self.num_chunks - 1:
            return  # never a prefix
        self.blocks[(slot, chunk)] = self.store.offload(x, keep=True) if self.offload else x

    def stream(self, site: int, chunk: int) -> BlockStream:
        """Site `site`'s blocks of every chunk before `chunk`."""
        return BlockStream(self, site, chunk)

    def _prefetch(self, site: int, j: int) -> None:
        for slot in (2 * site, 2 * site + 1):
            e = self.blocks[(slot, j)]
            if not isinstance(e, torch.Tensor):
                self.store.prefetch(e)

    def _read(self, slot: int, j: int) -> torch.Tensor:
        e = self.blocks[(slot, j)]
        return e if isinstance(e, torch.Tensor) else self.store.wait(e)

    def add_grad(self, site: int, j: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add a later chunk's contribution to dK_j, dV_j of `site`."""
        for slot, g in ((2 * site, dk), (2 * site + 1, dv)):
            acc = self.grads.get((slot, j))
            self.grads[(slot, j)] = g if acc is None else acc.add_(g)

    def take_grad(self, slot: int, chunk: int) -> torch.Tensor | None:
        """dK or dV of chunk `chunk` summed over the later chunks (None if none read it)."""
        return self.grads.pop((slot, chunk), None)

    def release(self, chunk: int) -> None:
        """After chunk `chunk`'s backward: its blocks have no reader left."""
        for key in [k for k in self.blocks if k[1] == chunk]:
            e = self.blocks.pop(key)
            if not isinstance(e, torch.Tensor):
                self.store.release(e)
        for key in [k for k in self.grads if k[1] == chunk]:
            del self.grads[key]
