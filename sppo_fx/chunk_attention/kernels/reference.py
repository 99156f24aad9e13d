"""Chunk attention in plain PyTorch (matmul + mask + softmax): float64, a backward that
also gets an lse gradient, and the tests' reference."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from sppo_fx.chunk_attention.kernels.common import _lse_dtype


def _visible_mask(c: int, n: int, causal: bool, device) -> Optional[Tensor]:
    if not causal:
        return None
    # Lower-right aligned: row i sees keys 0 .. (n - c) + i.
    return torch.ones(c, n, dtype=torch.bool, device=device).tril(n - c)


def _reference_probs(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    """Scores -> (probabilities [b, h_kv, g, c, n], lse [b, h_kv, g, c]) in the compute dtype."""
    b, h, c, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    acc = _lse_dtype(q.dtype)
    qg = q.reshape(b, h_kv, h // h_kv, c, d).to(acc)
    kg = k.unsqueeze(2).to(acc)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    mask = _visible_mask(c, n, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return p, lse


def _reference_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    b, h, c, d = q.shape
    p, lse = _reference_probs(q, k, scale, causal)
    out = torch.matmul(p, v.unsqueeze(2).to(p.dtype))
    out = out.reshape(b, h, c, d).to(q.dtype).contiguous()
    lse = lse.reshape(b, h, c).to(_lse_dtype(q.dtype)).contiguous()
    return out, lse


def _reference_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Optional[Tensor],
    scale: float,
    causal: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, c, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    g = h // h_kv
    acc = _lse_dtype(q.dtype)
    # Recompute the probabilities from the saved lse (like the kernel does).
    qg = q.reshape(b, h_kv, g, c, d).to(acc)
    kg = k.to(acc)
    vg = v.to(acc)
    dog = dout.reshape(b, h_kv, g, c, d).to(acc)
    s = torch.einsum("bkgcd,bknd->bkgcn", qg, kg) * scale
    p = torch.exp(s - lse.reshape(b, h_kv, g, c, 1).to(acc))
    mask = _visible_mask(c, n, causal, q.device)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O); an upstream lse gradient enters as
    # dS_ij += dlse_i * P_ij, i.e. it is subtracted from delta.
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    delta = delta.reshape(b, h_kv, g, c, 1)
    dp = torch.einsum("bkgcd,bknd->bkgcn", dog, vg)
    ds = p * (dp - delta)
    dq = torch.einsum("bkgcn,bknd->bkgcd", ds, kg) * scale
    dk = torch.einsum("bkgcn,bkgcd->bknd", ds, qg) * scale
    dv = torch.einsum("bkgcn,bkgcd->bknd", p, dog)
    return (
        dq.reshape(b, h, c, d).to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
    )


# ----------------------------------------------------------------------------------------
# CPU fast path: ATen's CPU flash-attention kernels (they take a mask and return lse)
# ----------------------------------------------------------------------------------------



def reference_chunk_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = True
) -> Tensor:
    """Chunk attention through ``scaled_dot_product_attention`` (for tests and checks).

    Args:
        q: queries ``[b, h, c, d]``.
        k: keys ``[b, h_kv, p + c, d]``.
        v: values ``[b, h_kv, p + c, d]``.
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.
        causal: lower-right causal mask (``causal_lower_right(c, p + c)``) if True,
            no mask otherwise.

    Returns:
        ``[b, h, c, d]`` attention output (differentiable by plain autograd).
    """
    h, h_kv = q.shape[1], k.shape[1]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    mask = _visible_mask(q.shape[2], k.shape[2], causal, q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
