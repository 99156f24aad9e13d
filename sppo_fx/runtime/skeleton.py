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

Sliding-window and packed-document sites (`skeleton_rows`): chunk i reads from a first
position on (its window's, `window_firsts`, or its first token's document's, given as
`first_read`), so a block holds only the rows the next chunk reads (the chunk's last W-1
for a window, `stored_first`), chunk i streams only the blocks that end after its first
position (`blocks_read`), and a block's gradient covers its stored rows (`take_grad` pads
it to the chunk with zeros: earlier rows are read by no one). Without a backward
(evaluation) a block goes as soon as the last chunk reaching it has run (`last_reader`);
with one, after the backward of chunk j+1, its last reader there. For a window the bytes
stored per chunk and read per chunk are then bounded by W, not by T.

The block of chunk j waits for chunk j+1's backward in training, so the tier holds a block
of every chunk at the turn from forward to backward: bounded per chunk, not in total.
"""
from __future__ import annotations

import torch

from sppo_fx.runtime.skeleton_log import SkeletonLog
from sppo_fx.util.skeleton_rows import blocks_read, last_reader, stored_first, window_firsts


class BlockStream:
    """The blocks (K_j, V_j) of one site that chunk `chunk` reads, in order; iterating reads
    them back one at a time with the next one prefetched.

    Attributes:
        index: the chunks j whose blocks stream (every earlier chunk of a causal site).
        positions: the absolute position of each block's first stored row.
        start: the reading chunk's first position; window: the site's window (or None).
    """

    def __init__(self, skeleton: "KVSkeleton", site: int, chunk: int):
        self.skeleton, self.site, self.chunk = skeleton, site, chunk
        self.window = skeleton.window(site)
        bounds = skeleton.bounds
        if bounds is None:
            self.index, self.start = list(range(chunk)), None
        else:
            self.index = blocks_read(bounds, chunk, None, skeleton.firsts(site))
            self.start = bounds[chunk][0]
        self.positions = [skeleton.first_row.get((2 * site, j)) for j in self.index]

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self):
        sk, index = self.skeleton, self.index
        if sk.log is not None and index:  # one in-order task reads them all from the one file
            for j in index:
                sk.bytes_read += sk.nbytes[(2 * self.site, j)] + sk.nbytes[(2 * self.site + 1, j)]
            yield from sk.log.stream([(sk.blocks[(2 * self.site, j)], sk.blocks[(2 * self.site + 1, j)])
                                      for j in index])
            return
        if index:
            sk._prefetch(self.site, index[0])
        for n, j in enumerate(index):
            if n + 1 < len(index):
                sk._prefetch(self.site, index[n + 1])
            yield sk._read(2 * self.site, j), sk._read(2 * self.site + 1, j)


class KVSkeleton:
    """K/V blocks and their gradient accumulators of one micro-batch.

    Args:
        store: the ActivationStore whose tier offloaded blocks go to (None keeps them all).
        offload: whether blocks go to the store.
        num_chunks: chunks of the micro-batch (the last one's K/V is not stored).
        bounds: (start, end) of every chunk (needed with windows).
        windows: per attention site, its sliding window W or None.
        first_read: per attention site, the first position each chunk reads (packed
            documents: `StageRunner._prefix_starts`); default: from the site's window.
        backward: a backward follows (blocks stay until it has read them); False for
            evaluation, where a windowed block goes after its last forward reader.

    Attributes:
        bytes_read: bytes of blocks handed to attention ops so far (forward and backward).
        bytes_held / peak_bytes_held: bytes of blocks stored now / at most so far.
    """

    def __init__(self, store=None, offload: bool = False, num_chunks: int | None = None,
                 bounds: list[tuple[int, int]] | None = None, windows: list | None = None,
                 first_read: list | None = None, backward: bool = True):
        self.store, self.offload, self.num_chunks = store, offload and store is not None, num_chunks
        self.bounds, self.windows, self.backward = bounds, list(windows or []), backward
        self.first_read = first_read
        if bounds is not None and num_chunks is None:
            self.num_chunks = len(bounds)
        self.blocks: dict[tuple[int, int], object] = {}   # (slot, chunk) -> tensor | Handle
        self.first_row: dict[tuple[int, int], int] = {}  # (slot, chunk) -> first stored position
        self.nbytes: dict[tuple[int, int], int] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.bytes_read = self.bytes_held = self.peak_bytes_held = 0
        # the disk tier: every block once in one file, each stream one in-order read (skeleton_log)
        self.log = SkeletonLog(store.dir) if self.offload and getattr(store, "tier", None) == "disk" else None

    def window(self, site: int) -> int | None:
        return self.windows[site] if site < len(self.windows) else None

    def firsts(self, site: int) -> list[int]:
        """The first position each chunk reads of site `site`'s K/V."""
        if self.first_read is not None and self.first_read[site] is not None:
            return self.first_read[site]
        return window_firsts(self.bounds, self.window(site))

    def put(self, slot: int, chunk: int, x: torch.Tensor) -> None:
        """Chunk `chunk`'s K (slot 2s) or V (2s + 1) of site s, after its forward."""
        if self.num_chunks is not None and chunk == self.num_chunks - 1:
            return  # never a prefix
        if self.bounds is None:
            if self.window(slot // 2) is not None or self.first_read is not None:
                raise ValueError("KVSkeleton: a windowed or document site needs the chunk bounds")
            start = first = 0
        else:
            start, first = self.bounds[chunk][0], stored_first(self.bounds, self.firsts(slot // 2), chunk)
        if first > start:  # rows no later window reaches are not kept (a copy: x's storage goes)
            x = x[..., first - start:, :].clone()
        self.first_row[(slot, chunk)] = first
        self.nbytes[(slot, chunk)] = x.numel() * x.element_size()
        if self.log is not None:
            self.blocks[(slot, chunk)] = self.log.put(x)
        else:
            self.blocks[(slot, chunk)] = self.store.offload(x, keep=True) if self.offload else x
        self.bytes_held += self.nbytes[(slot, chunk)]
        self.peak_bytes_held = max(self.peak_bytes_held, self.bytes_held)

    def end_forward(self, chunk: int) -> None:
        """Chunk `chunk`'s forward has returned: without a backward, drop the blocks whose
        last reader it was. Not earlier (in `put`): a compiler may run a chunk's `kv_out`
        before its attention, which is still to read those blocks."""
        for slot in sorted({key[0] for key in self.blocks}):
            self._expire(slot, chunk)

    def _expire(self, slot: int, chunk: int) -> None:
        """Without a backward: drop the blocks of `slot` whose last reader was `chunk`."""
        if self.backward or self.bounds is None:
            return
        firsts = self.firsts(slot // 2)
        for j in range(chunk):
            if (slot, j) in self.blocks and last_reader(self.bounds, j, firsts) <= chunk:
                self._drop(slot, j)

    def _drop(self, slot: int, j: int) -> None:
        e = self.blocks.pop((slot, j), None)
        if e is None:
            return
        self.bytes_held -= self.nbytes.pop((slot, j), 0)
        if self.log is not None:
            self.log.drop(e)
        elif not isinstance(e, torch.Tensor):
            self.store.release(e)

    def stream(self, site: int, chunk: int) -> BlockStream:
        """Site `site`'s blocks that chunk `chunk` reads (every earlier one without a window)."""
        return BlockStream(self, site, chunk)

    def _prefetch(self, site: int, j: int) -> None:
        for slot in (2 * site, 2 * site + 1):
            e = self.blocks[(slot, j)]
            if not isinstance(e, torch.Tensor):
                self.store.prefetch(e)

    def _read(self, slot: int, j: int) -> torch.Tensor:
        e = self.blocks[(slot, j)]
        self.bytes_read += self.nbytes[(slot, j)]
        return e if isinstance(e, torch.Tensor) else self.store.wait(e)

    def add_grad(self, site: int, j: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add a later chunk's contribution to dK_j, dV_j of `site` (over the stored rows)."""
        for slot, g in ((2 * site, dk), (2 * site + 1, dv)):
            acc = self.grads.get((slot, j))
            self.grads[(slot, j)] = g if acc is None else acc.add_(g)

    def take_grad(self, slot: int, chunk: int) -> torch.Tensor | None:
        """dK or dV of chunk `chunk` summed over the later chunks (None if none read it),
        over the whole chunk: rows before the stored ones get zeros."""
        g = self.grads.pop((slot, chunk), None)
        first = self.first_row.get((slot, chunk))
        if g is None or self.bounds is None or first is None or first == self.bounds[chunk][0]:
            return g
        return torch.nn.functional.pad(g, (0, 0, first - self.bounds[chunk][0], 0))

    def release(self, chunk: int) -> None:
        """After chunk `chunk`'s backward: its blocks have no reader left, nor has the
        previous chunk's (chunk `chunk` was its last reader in backward); its gradient
        accumulators stay until that chunk's own backward takes them."""
        for key in [k for k in self.blocks if k[1] in (chunk, chunk - 1)]:
            self._drop(*key)
        for key in [k for k in self.grads if k[1] == chunk]:
            del self.grads[key]
        for key in [k for k in self.first_row if k[1] == chunk]:
            del self.first_row[key]
