"""The bounded K/V skeleton of sliding-window and packed-document sites (skeleton="keep").

A chunk of a site with window W reads only positions start-W+1..start-1 of the earlier
chunks' K/V, and a chunk of a packed-document site only those from the document of its
first token on (the earliest over the batch rows; `StageRunner._prefix_starts`): per chunk,
a first position read. Rather than a [b, h_kv, T, d] buffer, the prefix is then built from
the earlier chunks' own K/V outputs (`_ChunkState.kv`), which each chunk holds until its
backward anyway (to receive dK/dV from later chunks):

* the rows read lie inside the previous chunk (chunks at least W-1 long; documents that
  started in the previous chunk or later): the prefix is a view of that chunk's K/V output,
  so the skeleton allocates nothing;
* they span several earlier chunks (shorter chunks; a document that started earlier): one
  contiguous copy of those rows, private to the reading chunk and dropped with its state
  at its backward. Every chunk's backward reads its prefix again after all forwards, so
  these copies add up over the sequence; when they would reach one full-sequence buffer
  (`skeleton_rows.copy_rows` >= T), the site keeps that buffer instead (the smaller of the two, both
  exact). `skeleton_rows.keeps_no_buffer` decides, for the runtime and for the memory model
  (solver/memory_model.py, windows only: document boundaries are data) alike.

Either way a chunk's rows are read by no chunk whose first position read is past them,
and the gradient of the prefix is split over the earlier chunks exactly as for a full buffer
(`StageRunner.backward`), since the prefix covers the same positions. Causal sites keep
the full buffer.
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
