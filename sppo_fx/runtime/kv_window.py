"""The bounded K/V skeleton of sliding-window attention sites (skeleton="keep").

A chunk of a site with window W reads only positions start-W+1..start-1 of the earlier
chunks' K/V (`StageRunner._prefix_starts`), so the runtime keeps no [b, h_kv, T, d] buffer
for it. The prefix is built from the earlier chunks' own K/V outputs (`_ChunkState.kv`),
which each chunk holds until its backward anyway (to receive dK/dV from later chunks):

* the window lies inside the previous chunk (chunks at least W-1 long): the prefix is a view
  of that chunk's K/V output, so the skeleton allocates nothing;
* it spans several earlier chunks (shorter chunks): one contiguous copy of those <= W-1 rows,
  private to the reading chunk and dropped with its state at its backward. Every chunk's
  backward reads its window again after all forwards, so these copies add up over the
  sequence; when they would exceed one full-sequence buffer (`copy_rows` >= T), the site
  keeps that buffer instead (the smaller of the two, both exact). `keeps_no_buffer` decides,
  for the runtime and for the memory model (solver/budget.py) alike.

Either way a chunk's rows are read by no chunk that starts W-1 or more positions after them,
and the gradient of the prefix is split over the earlier chunks exactly as for a full buffer
(`StageRunner.backward`), since the prefix covers the same positions.
"""
from __future__ import annotations

import torch


def window_prefix(kv_of, bounds: list[tuple[int, int]], k: int, lo: int, start: int,
                  empty_shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows lo..start-1 of K/V buffer `k` (K then V per site), detached.

    Args:
        kv_of: chunk index -> that chunk's K/V outputs (a list, K then V per site).
        bounds: (start, end) of the chunks before the reading one.
        k: which K/V output.
        lo / start: the first position read, and the reading chunk's first position.
        empty_shape / dtype / device: the K/V shape with 0 rows, for a chunk that reads none.

    Returns:
        A view of one earlier chunk's output, or a copy when the rows span several chunks.
    """
    pieces = [kv_of(c)[k].detach()[..., max(s, lo) - s:, :] for c, (s, e) in enumerate(bounds) if e > lo]
    if lo >= start or not pieces:
        return torch.empty(empty_shape, dtype=dtype, device=device)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, -2)


def chunk_copy_rows(bounds: list[tuple[int, int]], window: int) -> list[int]:
    """Per chunk: the K/V rows per buffer its window prefix copies (`window_prefix`), those
    of a chunk whose window reaches back past the previous chunk's start (0 otherwise)."""
    rows = [0] * len(bounds)
    for i in range(1, len(bounds)):
        start, lo = bounds[i][0], max(0, bounds[i][0] - (window - 1))
        rows[i] = start - lo if lo < bounds[i - 1][0] else 0
    return rows


def copy_rows(bounds: list[tuple[int, int]], window: int) -> int:
    """K/V rows per buffer the window prefixes copy over the whole sequence (`window_prefix`)."""
    return sum(chunk_copy_rows(bounds, window))


def keeps_no_buffer(bounds: list[tuple[int, int]], window: int | None) -> bool:
    """Whether a site with this window (None: unbounded) keeps no full-sequence K/V buffer
    under these chunk bounds: its window copies are fewer rows than the sequence. The one
    test the runtime (`StageRunner._prefix`) and the memory model (`solver.budget`) share."""
    return window is not None and bool(bounds) and copy_rows(bounds, window) < bounds[-1][1]


def skeleton_bytes(states, buffers) -> int:
    """Bytes of K/V skeleton storage alive for one micro-batch: the full-sequence buffers, and
    every storage a chunk's prefix holds that is not an earlier chunk's own K/V output
    (those the chunks keep until their backward regardless of the skeleton)."""
    own = {t.untyped_storage().data_ptr() for st in states.values() for t in st.kv}
    held = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in buffers if b is not None}
    for st in states.values():
        for t in st.prefix:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in own and t.untyped_storage().nbytes():
                held[ptr] = t.untyped_storage().nbytes()
    return sum(held.values())
