"""The streamed prefix attention of a sliding-window site (`sppo.prefix_attention` with
`window=W`, sppo_fx/ops/skeleton.py): query row r of a chunk starting at `start` sees the
keys at positions start+r-W+1 .. start+r; inside packed documents (`doc_pos`, each query's
position in its document) only those back to its document's start, every part masked.

The skeleton streams only the blocks that reach into the chunk's window
(`runtime.skeleton.BlockStream`, rows from `skeleton_rows.kept_first` on). Each part is
one of:

    a block every row sees whole (it starts at or after start + c - W)   kernel, no mask
    a block the window cuts (rows see a suffix of it)                    band mask
    the chunk's own keys: c <= W                                         kernel, causal
                          c > W (the window cuts the causal square)      band mask

merged by log-sum-exp. A masked part is plain PyTorch over [b, h, c, n] scores (n <= W-1
rows for a block), in float32 (float64 for float64); a row that sees none of a block's
keys gets lse = -inf and weight 0 there. The backward recomputes each part's
probabilities from the merged lse (P = exp(s - lse), delta = rowsum(dout * out)), exact
part by part, and hands each block's dK, dV (over its stored rows) to the skeleton.
"""
from __future__ import annotations

import torch

from sppo_fx.errors import SppoError


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge(out, lse, o_j, lse_j):
    """Log-sum-exp merge of two partial attentions over disjoint key sets (fp32 `out`); a
    part with lse_j = -inf (no visible key) adds nothing."""
    new = torch.logaddexp(lse, lse_j)
    out = out * torch.exp(lse - new).unsqueeze(-1) + o_j.to(out.dtype) * torch.exp(lse_j - new).unsqueeze(-1)
    return out, new


def visible(rows: int, keys: int, offset: int, window, doc_pos, device) -> torch.Tensor:
    """Row r sees key x iff 0 <= offset + r - x (< window) (<= doc_pos[b, r]); offset: the
    rows' first position minus the keys' first position. [rows, keys] bool, or
    [b, 1, 1, rows, keys] with `doc_pos` (against scores [b, h_kv, g, rows, keys])."""
    dist = (torch.arange(rows, device=device) + offset).unsqueeze(-1) - torch.arange(keys, device=device)
    seen = dist >= 0
    if window is not None:
        seen = seen & (dist < window)
    if doc_pos is not None:
        seen = (seen & (dist <= doc_pos.to(device).unsqueeze(-1)))[:, None, None]
    return seen


def _scores(q, k, scale):
    b, h, c, d = q.shape
    h_kv = k.shape[1]
    acc = acc_dtype(q.dtype)
    qg = q.reshape(b, h_kv, h // h_kv, c, d).to(acc)
    return qg, torch.matmul(qg, k.unsqueeze(2).to(acc).transpose(-1, -2)) * scale  # [b, h_kv, g, c, n]


def masked_forward(q, k, v, scale, mask):
    """(out [b, h, c, d], lse [b, h, c]) in the accumulation dtype, over the keys `mask`
    [c, n] lets each row see (lse = -inf and out = 0 for a row that sees none)."""
    b, h, c, d = q.shape
    _, s = _scores(q, k, scale)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.matmul(p, v.unsqueeze(2).to(p.dtype))
    return out.reshape(b, h, c, d), lse.reshape(b, h, c)


def masked_backward(dout, q, k, v, out, lse, scale, mask):
    """(dq in the accumulation dtype, dk, dv in k's dtype) of one masked part, given the
    merged `out` and `lse` of every part."""
    b, h, c, d = q.shape
    h_kv = k.shape[1]
    qg, s = _scores(q, k, scale)
    acc = s.dtype
    p = torch.exp(s - lse.reshape(b, h_kv, h // h_kv, c, 1).to(acc)).masked_fill(~mask, 0.0)
    dog = dout.reshape(b, h_kv, h // h_kv, c, d).to(acc)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, h_kv, h // h_kv, c, 1)
    ds = p * (torch.matmul(dog, v.unsqueeze(2).to(acc).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.unsqueeze(2).to(acc)) * scale
    dk = torch.einsum("bkgcn,bkgcd->bknd", ds, qg) * scale
    dv = torch.einsum("bkgcn,bkgcd->bknd", p, dog)
    return dq.reshape(b, h, c, d), dk.to(k.dtype), dv.to(v.dtype)


def _stream_parts(blocks, start: int, c: int, window, doc_pos):
    """(chunk j, first position, whether every row sees the whole block) per streamed block,
    after checking that the stream is the one this window needs."""
    if getattr(blocks, "window", window) != window or getattr(blocks, "start", None) not in (None, start):
        raise SppoError(f"sppo.prefix_attention: the skeleton streams blocks for window "
                        f"{getattr(blocks, 'window', None)} from position {getattr(blocks, 'start', None)}, "
                        f"the chunk program has window {window} from position {start}")
    positions = getattr(blocks, "positions", None)
    if positions is None or None in positions:
        raise SppoError("sppo.prefix_attention: a sliding-window site needs the skeleton's block positions "
                        "(runtime.skeleton.KVSkeleton with the chunk bounds)")
    return [(j, pos, doc_pos is None and pos >= start + c - window) for j, pos in zip(blocks.index, positions)]


def windowed_forward(q, k, v, start: int, blocks, scale: float, window, doc_pos=None):
    """(out, lse) of a windowed (or packed-document) chunk at `start` over its streamed
    blocks and its own k, v."""
    from sppo_fx.chunk_attention.op import chunk_attention_with_lse
    c = q.shape[-2]
    parts = _stream_parts(blocks, start, c, window, doc_pos)
    if doc_pos is None and c <= window:
        out, lse = chunk_attention_with_lse(q, k, v, scale, causal=True)
        out = out.to(acc_dtype(q.dtype))
    else:
        out, lse = masked_forward(q, k, v, scale, visible(c, c, 0, window, doc_pos, q.device))
    for (j, pos, whole), (k_j, v_j) in zip(parts, blocks):
        if whole:
            o_j, lse_j = chunk_attention_with_lse(q, k_j, v_j, scale, causal=False)
        else:
            mask = visible(c, k_j.shape[-2], start - pos, window, doc_pos, q.device)
            o_j, lse_j = masked_forward(q, k_j, v_j, scale, mask)
        out, lse = merge(out, lse, o_j, lse_j)
        del k_j, v_j, o_j  # before the stream reads the block after next
    return out, lse


def windowed_backward(dout, q, k, v, out, lse, start: int, blocks, memory, site: int, scale: float, window,
                      doc_pos=None):
    """(dq, dk, dv) of `windowed_forward`; each block's dK, dV go to `memory.kv_add_grad`."""
    bwd = torch.ops.sppo_fx.chunk_attention_bwd
    c = q.shape[-2]
    parts = _stream_parts(blocks, start, c, window, doc_pos)
    if doc_pos is None and c <= window:
        dq, dk, dv = bwd(dout, q, k, v, out, lse, None, scale, True)
        dq = dq.to(acc_dtype(q.dtype))
    else:
        dq, dk, dv = masked_backward(dout, q, k, v, out, lse, scale, visible(c, c, 0, window, doc_pos, q.device))
    for (j, pos, whole), (k_j, v_j) in zip(parts, blocks):
        if whole:
            dq_j, dk_j, dv_j = bwd(dout, q, k_j, v_j, out, lse, None, scale, False)
        else:
            mask = visible(c, k_j.shape[-2], start - pos, window, doc_pos, q.device)
            dq_j, dk_j, dv_j = masked_backward(dout, q, k_j, v_j, out, lse, scale, mask)
        dq += dq_j
        memory.kv_add_grad(site, j, dk_j, dv_j)
        del k_j, v_j, dq_j, dk_j, dv_j  # before the stream reads the block after next
    return dq, dk, dv
