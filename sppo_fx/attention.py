"""Causal attention of one chunk's queries over its K/V prefix (reference path).

q [b, h, c, d] attends to k, v [b, h_kv, p + c, d]; query row i sees keys 0..p+i
(lower-right aligned, as `torch.nn.attention.bias.causal_lower_right`). The chunk pass
emits calls to `chunk_causal_attention`. On a GPU it runs `sppo_fx.ops.chunk_attention`
(the Triton kernel, visible to Inductor); on CPU it runs SDPA with a c x (p + c) boolean
mask (ATen's CPU flash kernel, which measured faster here than the op's CPU path). Never
a T x T mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _triton_ready() -> bool:
    from sppo_fx.ops.chunk_attention import HAS_TRITON
    return HAS_TRITON


def chunk_causal_attention(q, k, v, scale=None, enable_gqa=False):
    """Lower-right causal attention over a K/V prefix.

    Args:
        q: [b, h, c, d] queries of the chunk.
        k, v: [b, h_kv, p + c, d] keys/values of the prefix followed by the chunk.
        scale: softmax scale (default 1/sqrt(d)).
        enable_gqa: allow h_kv < h (grouped-query attention).

    Returns:
        [b, h, c, d] attention output.
    """
    if q.device.type != "cpu" and _triton_ready():
        # The Triton kernel (a torch.library.triton_op: Inductor sees through it) handles
        # grouped-query heads and the lower-right mask itself.
        from sppo_fx.ops import chunk_attention
        return chunk_attention(q, k, v, scale=scale)
    c, kv_len = q.shape[-2], k.shape[-2]
    prefix = kv_len - c
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    mask = torch.ones(c, kv_len, dtype=torch.bool, device=q.device).tril(prefix)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
