"""Causal attention of one chunk's queries over its K/V prefix and its own K/V.

q [b, h, c, d] attends to the prefix k_p, v_p [b, h_kv, p, d] followed by the chunk's own
k, v [b, h_kv, c, d]; query row i sees keys 0..p+i (lower-right aligned, as
`torch.nn.attention.bias.causal_lower_right`). The chunk pass emits
`prefix_causal_attention(q, k_prefix, k, v_prefix, v)`:

* on CUDA, where torch's flash kernels can run it (`chunk_attention.kernels.flash_split`: half
  precision, head dim a multiple of 8 up to 256, sm_80+), the prefix and the causal square
  run as two flash calls merged by log-sum-exp, saving the prefix as the view it is;
* on other GPU inputs it runs the Triton chunk-attention kernel on the concatenated K/V, as an opaque
  op (`chunk_attention.op.chunk_attention_opaque`: Inductor calls it like SDPA) with
  SDPA's output layout;
* on CPU it runs ATen's CPU flash-attention kernels twice, over the prefix (every query
  sees all of it: no mask) and over the chunk's own causal square, merged by log-sum-exp
  (`chunk_attention.op.cpu_flash_forward`), inside an autograd.Function that saves its
  inputs (the prefix is a view of the runtime's K/V buffer): no concatenation, no mask,
  no K/V heads repeated for grouped-query attention.

Never a T x T mask, except for sliding-window and document sites (below).

Sliding windows (`window=W`: query position t sees keys t-W+1..t, as HF's `sliding_window`)
keep only the last W-1 positions of the prefix and run SDPA with a band mask of
[c, min(p, W-1) + c] over them: exact, with work and reads bounded by W, not by the
prefix. (No fused kernel for this yet, on either device.)

Packed documents (`doc_pos=`: each query token's position inside its document, from
`document_positions`) restrict every query to keys of its own document: query row r of a
chunk with prefix p sees concatenated key m iff 0 <= (p + r) - m <= doc_pos[b, r] (and
< W with a window). The mask is [b, 1, c, p + c], bounded by the prefix the runtime hands
over, which starts at the document of the chunk's first token (runtime/local.py,
`StageRunner._prefix_starts`): documents that ended before the chunk are not read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_ready() -> bool:
    from sppo_fx.chunk_attention.op import HAS_TRITON
    return HAS_TRITON


def _flash_split_reason(q, k, v):
    from sppo_fx.chunk_attention.kernels.flash_split import flash_split_supported
    return flash_split_supported(q, k, v)


def _cpu_parts(k_prefix, k, v_prefix, v):
    # the prefix, seen whole by every query, then the chunk's own causal square
    return ([(k_prefix, v_prefix, False)] if k_prefix.shape[-2] else []) + [(k, v, True)]


class _PrefixAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_prefix, k, v_prefix, v, scale):
        from sppo_fx.chunk_attention.op import cpu_flash_forward
        out, lse = cpu_flash_forward(q, _cpu_parts(k_prefix, k, v_prefix, v), scale)
        ctx.save_for_backward(q, k_prefix, k, v_prefix, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        from sppo_fx.chunk_attention.op import cpu_flash_backward
        q, k_prefix, k, v_prefix, v, out, lse = ctx.saved_tensors
        dq, dkv = cpu_flash_backward(grad, q, _cpu_parts(k_prefix, k, v_prefix, v), out, lse, ctx.scale)
        dk, dv = dkv[-1]
        # no prefix part: the (empty) prefix's gradients are empty
        dk_prefix, dv_prefix = dkv[0] if len(dkv) == 2 else (torch.zeros_like(k_prefix), torch.zeros_like(v_prefix))
        return dq, dk_prefix, dk, dv_prefix, dv, None


def _autocast_like_sdpa(*tensors):
    """Under autocast, the inputs cast as autocast casts SDPA's (the op this one replaces is
    on its lower-precision list): the kernels below are not autocast ops themselves, and a
    model whose q/k leave RoPE in float32 while v is bfloat16 would pass them mixed dtypes."""
    dev = tensors[0].device.type
    # The cost model runs this on "meta" tensors, which have no autocast. Not
    # torch.amp.is_autocast_available: torch 2.11's Dynamo refuses to trace it.
    if dev == "meta" or not torch.is_autocast_enabled(dev):
        return tensors
    dtype = torch.get_autocast_dtype(dev)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def prefix_causal_attention(q, k_prefix, k, v_prefix, v, scale=None, enable_gqa=False, window=None,
                            doc_pos=None, softcap=None, sinks=None, alibi=None):
    """Lower-right causal attention of a chunk over its K/V prefix and its own K/V.

    Args:
        q: [b, h, c, d] queries of the chunk.
        k_prefix, v_prefix: [b, h_kv, p, d] keys/values of the earlier chunks (p may be 0).
        k, v: [b, h_kv, c, d] the chunk's own keys/values.
        scale: softmax scale (default 1/sqrt(d)).
        enable_gqa: allow h_kv < h (grouped-query attention).
        window: sliding window W (each query sees its W most recent keys, itself included),
            or None for plain causal attention.
        doc_pos: [b or 1, c] integer, each query's position inside its packed document
            (`document_positions`), or None when the sequence is one document.
        softcap, sinks, alibi: score variants (logit soft-cap, [h] sink logits, h ALiBi
            slopes), run by `chunk_attention.kernels.variants` (see docs/models-attention.md).

    Returns:
        [b, h, c, d] attention output.
    """
    q, k_prefix, k, v_prefix, v = _autocast_like_sdpa(q, k_prefix, k, v_prefix, v)
    if softcap is not None or sinks is not None or alibi is not None:
        from sppo_fx.chunk_attention.kernels.variants import variant_prefix_attention
        if doc_pos is not None:
            raise ValueError("soft-capping, sinks or ALiBi inside packed documents are not supported")
        return variant_prefix_attention(q, k_prefix, k, v_prefix, v, scale, softcap, sinks, alibi, window)
    if doc_pos is not None:
        k_all, v_all = torch.cat([k_prefix, k], -2), torch.cat([v_prefix, v], -2)
        mask = _document_mask(doc_pos, q.shape[-2], k_prefix.shape[-2], window)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if window is not None:
        return _windowed_prefix_attention(q, k_prefix, k, v_prefix, v, scale, enable_gqa, window)
    if q.device.type == "cuda" and _flash_split_reason(q, k, v) is None:
        from sppo_fx.chunk_attention.kernels.flash_split import flash_split_attention
        return flash_split_attention(q, k_prefix, k, v_prefix, v, scale)
    if q.device.type != "cpu" and _triton_ready():
        from sppo_fx.chunk_attention.op import chunk_attention_opaque
        return chunk_attention_opaque(q, torch.cat([k_prefix, k], -2), torch.cat([v_prefix, v], -2), scale=scale)
    if q.device.type == "cpu" and q.dtype in _FLASH_CPU_DTYPES:
        return _PrefixAttentionCPU.apply(q, k_prefix, k, v_prefix, v, scale)
    return chunk_causal_attention(q, torch.cat([k_prefix, k], -2), torch.cat([v_prefix, v], -2), scale, enable_gqa)


def chunk_causal_attention(q, k, v, scale=None, enable_gqa=False):
    """Lower-right causal attention over a concatenated K/V (prefix then chunk), with SDPA.

    Args:
        q: [b, h, c, d] queries of the chunk.
        k, v: [b, h_kv, p + c, d] keys/values of the prefix followed by the chunk.
        scale: softmax scale (default 1/sqrt(d)).
        enable_gqa: allow h_kv < h (grouped-query attention).

    Returns:
        [b, h, c, d] attention output.
    """
    c, kv_len = q.shape[-2], k.shape[-2]
    prefix = kv_len - c
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    mask = torch.ones(c, kv_len, dtype=torch.bool, device=q.device).tril(prefix)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _band_mask(rows: int, keys: int, offset, window: int, device) -> torch.Tensor:
    """[rows, keys] bool: row r (absolute position offset + r) sees key m (absolute m) iff
    0 <= offset + r - m < window."""
    dist = (torch.arange(rows, device=device) + offset).unsqueeze(-1) - torch.arange(keys, device=device)
    return (dist >= 0) & (dist < window)


def _windowed_prefix_attention(q, k_prefix, k, v_prefix, v, scale, enable_gqa, window):
    p, c = k_prefix.shape[-2], q.shape[-2]
    # torch.sym_min only for a symbolic prefix: on two ints torch 2.11's Dynamo refuses it
    keep = 0 if window <= 1 else min(p, window - 1) if isinstance(p, int) else torch.sym_min(p, window - 1)
    k_all = torch.cat([k_prefix[..., p - keep:, :], k], -2)
    v_all = torch.cat([v_prefix[..., p - keep:, :], v], -2)
    mask = _band_mask(c, keep + c, keep, window, q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def windowed_causal_attention(q, k, v, window, scale=None, enable_gqa=False, softcap=None, sinks=None,
                              alibi=None):
    """Causal attention where each query sees its `window` most recent keys (itself
    included): what `passes.masks.causal` turns a proven sliding-window SDPA into, in the
    captured graph (the chunk pass then makes it `prefix_causal_attention(..., window=W)`).
    It also carries proven score variants (`passes.masks.explicit_attention`), then with window
    None for plain causal attention.

    Args:
        q: [b, h, T, d]; k, v: [b, h_kv, T, d].
        window: W >= 1, or None (only with a variant).
        scale, enable_gqa: as for SDPA.
        softcap, sinks, alibi: as for `prefix_causal_attention`.

    Returns:
        [b, h, T, d].
    """
    if softcap is not None or sinks is not None or alibi is not None:
        from sppo_fx.chunk_attention.kernels.variants import variant_prefix_attention
        empty = k[..., :0, :]
        return variant_prefix_attention(q, empty, k, v[..., :0, :], v, scale, softcap, sinks, alibi, window)
    t = q.shape[-2]
    mask = _band_mask(t, t, 0, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


# ---------------------------------------------------------------- packed documents

DOCUMENT_CONVENTIONS = ("position_ids", "document_ids")


def document_positions(source: torch.Tensor, convention: str) -> torch.Tensor:
    """Each token's position inside its document, [B, T] int64 (a 1-D source gives [1, T]).

    Args:
        source: [B, T] (or [T]) integer tensor the model's mask was proven from.
        convention: "position_ids": a document starts wherever the position does not
            follow the previous one by exactly 1 (Hugging Face's packed-sequence rule,
            `position_ids` restarting at 0 for each document); "document_ids": a document
            is a run of equal ids, and every id must form one run per row (same-id
            attention is document attention only then).

    Returns:
        int64 tensor, 0 at each document's first token.
    """
    from sppo_fx.errors import SppoError
    x = source.reshape(1, -1) if source.dim() == 1 else source
    t = x.shape[-1]
    follows = x[:, 1:] == x[:, :-1] + 1 if convention == "position_ids" else x[:, 1:] == x[:, :-1]
    starts = torch.cat([torch.ones_like(x[:, :1], dtype=torch.bool), ~follows], -1)
    index = torch.arange(t, device=x.device)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    if convention == "document_ids" and not _is_symbolic(x):
        for row in range(x.shape[0]):
            if int(starts[row].sum()) != int(torch.unique(x[row]).numel()):
                raise SppoError(
                    f"the document ids of batch row {row} reuse an id after another document: the "
                    "model attends between equal ids, which is document attention only when each id "
                    "is one contiguous run; give every packed document an id of its own")
    return index - first


def _is_symbolic(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(x) or torch.compiler.is_compiling() or x.device.type == "meta"


def _document_mask(doc_pos: torch.Tensor, rows: int, prefix, window) -> torch.Tensor:
    """[b, 1, rows, prefix + rows] bool: query r (key index prefix + r) sees key m iff
    0 <= prefix + r - m <= doc_pos[b, r] (and < window)."""
    device = doc_pos.device
    dist = (torch.arange(rows, device=device) + prefix).unsqueeze(-1) - torch.arange(prefix + rows, device=device)
    visible = (dist >= 0) & (dist <= doc_pos.unsqueeze(-1))
    if window is not None:
        visible = visible & (dist < window)
    return visible.unsqueeze(1)


def document_causal_attention(q, k, v, doc_pos, window=None, scale=None, enable_gqa=False):
    """Causal attention inside packed documents: what `passes.masks.causal` (and
    `passes.masks.explicit_attention`) turn a proven document mask into, in the captured graph
    (the chunk pass then makes it `prefix_causal_attention(..., doc_pos=...)`).

    Args:
        q: [b, h, T, d]; k, v: [b, h_kv, T, d].
        doc_pos: [b or 1, T] each token's position inside its document (`document_positions`).
        window: optional sliding window W inside the document.
        scale, enable_gqa: as for SDPA.

    Returns:
        [b, h, T, d].
    """
    mask = _document_mask(doc_pos, q.shape[-2], 0, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
