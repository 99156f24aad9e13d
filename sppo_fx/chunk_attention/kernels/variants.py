"""Chunk attention with score variants, in plain PyTorch over key blocks: logit soft-capping
(Gemma 2), attention sinks (GPT-OSS) and ALiBi (Bloom, MPT), optionally in a sliding window.

For query row r of a chunk with prefix p (absolute position i = p + r) and key position j:

    s_ij = cap * tanh(scale * q_i.k_j / cap)      (soft-capping; scale * q_i.k_j without)
           + slope_h * (j - i)                    (ALiBi)
    visible iff j <= i (and i - j < window)
    L_i  = log(exp(sink_h) + sum_visible exp(s_ij))   (the sink: a logit with no value)
    out_i = sum_visible exp(s_ij - L_i) v_j

ATen's flash kernels take none of these, so this is the exact fallback: keys go in blocks of
at most `BLOCK` positions, one [c, BLOCK] score tile at a time, merged by an online
log-sum-exp (the sink is its starting term), so nothing of size [c, p + c] or T x T exists;
the backward recomputes each tile from the saved lse (FlashAttention's recipe). The prefix
and the chunk stay separate tensors (the prefix is a view of the runtime's K/V buffer);
only the chunk's own causal square and a window's band build a [c, BLOCK] mask.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from sppo_fx.chunk_attention.kernels.common import _lse_dtype

BLOCK = 512


def _grouped(q: Tensor, h_kv: int, acc) -> Tensor:
    b, h, c, d = q.shape
    return q.reshape(b, h_kv, h // h_kv, c, d).to(acc)


def _per_head(x: Tensor | None, h_kv: int, acc) -> Tensor | None:
    # [h] -> [1, h_kv, g, 1]: query head i uses K/V head i // g, as the model's repeat_kv
    return None if x is None else x.reshape(1, h_kv, -1, 1).to(acc)


def _tiles(k_prefix, k, v_prefix, v):
    """(k tile, v tile, absolute key position of its first key, in the chunk's square)."""
    p = k_prefix.shape[-2]
    for kk, vv, base, square in ((k_prefix, v_prefix, 0, False), (k, v, p, True)):
        n = kk.shape[-2]
        for a in range(0, n, BLOCK):
            e = min(a + BLOCK, n)
            yield kk[:, :, a:e], vv[:, :, a:e], base + a, square


def _scores(qg, kt, base, square, rows, spec):
    """One tile's scores [b, h_kv, g, c, n] (-inf where not visible) and tanh (or None)."""
    scale, softcap, slopes, window = spec
    raw = torch.matmul(qg, kt.unsqueeze(2).to(qg.dtype).transpose(-1, -2))
    t = None
    if softcap is not None:
        t = torch.tanh(raw * (scale / softcap))
        s = t * softcap
    else:
        s = raw * scale
    cols = base + torch.arange(kt.shape[-2], device=qg.device)
    dist = rows.unsqueeze(-1) - cols  # i - j, [c, n]
    if slopes is not None:
        s = s - slopes * dist.to(s.dtype)
    visible = None
    if square:
        visible = dist >= 0
    if window is not None:
        far = dist < window
        visible = far if visible is None else visible & far
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, t


def variant_forward(q, k_prefix, k, v_prefix, v, spec, sinks):
    """(out [b, h, c, d] in q's dtype, lse [b, h_kv, g, c] in the accumulation dtype)."""
    b, h, c, d = q.shape
    h_kv, p = k.shape[1], k_prefix.shape[-2]
    acc_t = _lse_dtype(q.dtype)
    qg = _grouped(q, h_kv, acc_t)
    rows = p + torch.arange(c, device=q.device)
    sink = _per_head(sinks, h_kv, acc_t)
    m = (sink.expand(b, h_kv, h // h_kv, c).clone() if sink is not None
         else qg.new_full(qg.shape[:-1], float("-inf")))
    l = torch.ones_like(m) if sink is not None else torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    for kt, vt, base, square in _tiles(k_prefix, k, v_prefix, v):
        s, _ = _scores(qg, kt, base, square, rows, spec)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row seeing nothing yet
        alpha = torch.exp(m - m_safe)
        e = torch.exp(s - m_safe.unsqueeze(-1))
        l = l * alpha + e.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(e, vt.unsqueeze(2).to(acc_t))
        m = m_new
    lse = m + torch.log(l)
    out = (acc / l.unsqueeze(-1)).reshape(b, h, c, d).to(q.dtype)
    return out, lse


def variant_backward(dout, q, k_prefix, k, v_prefix, v, out, lse, spec, sinks):
    """(dq, dk_prefix, dk, dv_prefix, dv, dsinks or None)."""
    b, h, c, d = q.shape
    h_kv, p = k.shape[1], k_prefix.shape[-2]
    scale, softcap = spec[0], spec[1]
    acc_t = lse.dtype
    qg = _grouped(q, h_kv, acc_t)
    dog = _grouped(dout, h_kv, acc_t)
    delta = (dog * _grouped(out, h_kv, acc_t)).sum(-1)  # rowsum(dO * O) = sum_j P_ij dP_ij
    rows = p + torch.arange(c, device=q.device)
    dq = torch.zeros_like(qg)
    dks, dvs = [], []
    for kt, vt, base, square in _tiles(k_prefix, k, v_prefix, v):
        s, t = _scores(qg, kt, base, square, rows, spec)
        pr = torch.exp(s - lse.unsqueeze(-1))  # 0 where masked (-inf)
        dvs.append(torch.matmul(pr.transpose(-1, -2), dog).sum(2))
        dp = torch.matmul(dog, vt.unsqueeze(2).to(acc_t).transpose(-1, -2))
        ds = pr * (dp - delta.unsqueeze(-1))
        if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1 - t * t)
        kf = kt.unsqueeze(2).to(acc_t)
        dq = dq + torch.matmul(ds, kf) * scale
        dks.append(torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale)
    dk_all = torch.cat(dks, -2) if dks else k.new_zeros((b, h_kv, 0, d), dtype=acc_t)
    dv_all = torch.cat(dvs, -2) if dvs else dk_all
    dsinks = None
    if sinks is not None:  # the sink is one more key, with value 0: dS = P_sink * (0 - delta)
        p_sink = torch.exp(_per_head(sinks, h_kv, acc_t) - lse)
        dsinks = (-(p_sink * delta)).sum((0, 3)).reshape(h).to(sinks.dtype)
    return (dq.reshape(b, h, c, d).to(q.dtype),
            dk_all[:, :, :p].to(k_prefix.dtype), dk_all[:, :, p:].to(k.dtype),
            dv_all[:, :, :p].to(v_prefix.dtype), dv_all[:, :, p:].to(v.dtype), dsinks)


def _spec(q, k, scale, softcap, slopes, window):
    slopes_t = None
    if slopes:  # [1, h_kv, g, 1, 1]: broadcast over the tile's [c, n] distances
        slopes_t = _per_head(torch.tensor(slopes, dtype=torch.float64, device=q.device), k.shape[1],
                             _lse_dtype(q.dtype)).unsqueeze(-1)
    return (scale, softcap or None, slopes_t, window or None)


def _windowed(k_prefix, v_prefix, window):
    # keys before the window are never visible: not read
    if not window:
        return k_prefix, v_prefix
    p = k_prefix.shape[-2]
    keep = min(p, window - 1)
    return k_prefix[..., p - keep:, :], v_prefix[..., p - keep:, :]


def _use_triton(q, window, k_prefix) -> bool:
    from sppo_fx.chunk_attention.kernels.common import HAS_TRITON, _TRITON_DTYPES
    return (q.device.type != "cpu" and HAS_TRITON and q.dtype in _TRITON_DTYPES and not window)


# Opaque custom ops: Inductor calls them like SDPA (their bodies loop over key blocks of a
# length that is dynamic in the compiled chunk program). softcap 0 and window 0 mean "none".
@torch.library.custom_op("sppo_fx::variant_attention", mutates_args=())
def _variant_op(q: Tensor, k_prefix: Tensor, k: Tensor, v_prefix: Tensor, v: Tensor, sinks: Optional[Tensor],
                slopes: Optional[List[float]], scale: float, softcap: float, window: int) -> Tuple[Tensor, Tensor]:
    if _use_triton(q, window, k_prefix):
        from sppo_fx.chunk_attention.kernels.triton_launch import launch_variant_fwd
        return launch_variant_fwd(q, torch.cat([k_prefix, k], -2), torch.cat([v_prefix, v], -2), scale,
                                  softcap, sinks, slopes)
    k_prefix, v_prefix = _windowed(k_prefix, v_prefix, window)
    out, lse = variant_forward(q, k_prefix, k, v_prefix, v, _spec(q, k, scale, softcap, slopes, window), sinks)
    return out.contiguous(), lse.reshape(q.shape[:-1]).contiguous()


@_variant_op.register_fake
def _(q, k_prefix, k, v_prefix, v, sinks, slopes, scale, softcap, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("sppo_fx::variant_attention_bwd", mutates_args=())
def _variant_bwd_op(dout: Tensor, q: Tensor, k_prefix: Tensor, k: Tensor, v_prefix: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, sinks: Optional[Tensor], slopes: Optional[List[float]], scale: float, softcap: float,
                    window: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if _use_triton(q, window, k_prefix):
        from sppo_fx.chunk_attention.kernels.triton_launch import launch_variant_bwd
        p = k_prefix.shape[-2]
        dq, dk, dv, dsinks = launch_variant_bwd(dout, q, torch.cat([k_prefix, k], -2), torch.cat([v_prefix, v], -2),
                                                out, lse, scale, softcap, sinks, slopes)
        dkp, dvp = dk[:, :, :p].contiguous(), dv[:, :, :p].contiguous()
        dk, dv = dk[:, :, p:].contiguous(), dv[:, :, p:].contiguous()
    else:
        full_p = k_prefix.shape[-2]
        kp, vp = _windowed(k_prefix, v_prefix, window)
        b, h_kv = k.shape[0], k.shape[1]
        dq, dkp, dk, dvp, dv, dsinks = variant_backward(
            dout, q, kp, k, vp, v, out, lse.reshape(b, h_kv, -1, q.shape[2]).to(_lse_dtype(q.dtype)),
            _spec(q, k, scale, softcap, slopes, window), sinks)
        if kp.shape[-2] != full_p:  # keys before the window get no gradient
            pad = full_p - kp.shape[-2]
            dkp = torch.cat([dkp.new_zeros(dkp.shape[:2] + (pad,) + dkp.shape[3:]), dkp], -2)
            dvp = torch.cat([dvp.new_zeros(dvp.shape[:2] + (pad,) + dvp.shape[3:]), dvp], -2)
    if dsinks is None:
        dsinks = q.new_empty(0)
    # copies: the parts are slices of one buffer, and a custom op's outputs may not alias
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in (dq, dkp, dk, dvp, dv, dsinks))


@_variant_bwd_op.register_fake
def _(dout, q, k_prefix, k, v_prefix, v, out, lse, sinks, slopes, scale, softcap, window):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            *(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k_prefix, k, v_prefix, v)), dsinks)


def _setup(ctx, inputs, output):
    q, k_prefix, k, v_prefix, v, sinks, slopes, scale, softcap, window = inputs
    ctx.save_for_backward(q, k_prefix, k, v_prefix, v, output[0], output[1], sinks)
    ctx.args = (slopes, scale, softcap, window)
    ctx.has_sinks = sinks is not None


def _backward(ctx, dout, dlse):
    # callers use only `out` (the lse output is not differentiated)
    q, k_prefix, k, v_prefix, v, out, lse, sinks = ctx.saved_tensors
    dq, dkp, dk, dvp, dv, dsinks = _variant_bwd_op(dout.contiguous(), q, k_prefix, k, v_prefix, v, out, lse,
                                                   sinks if ctx.has_sinks else None, *ctx.args)
    return dq, dkp, dk, dvp, dv, (dsinks if ctx.has_sinks else None), None, None, None, None


torch.library.register_autograd("sppo_fx::variant_attention", _backward, setup_context=_setup)


def variant_prefix_attention(q, k_prefix, k, v_prefix, v, scale=None, softcap=None, sinks=None, alibi=None,
                             window=None):
    """Lower-right causal attention of a chunk over its prefix and itself with soft-capping,
    sinks and/or ALiBi (module docstring), differentiable in q, the K/V parts and `sinks`.

    Args:
        q: [b, h, c, d]; k_prefix, v_prefix: [b, h_kv, p, d] (p may be 0); k, v: [b, h_kv, c, d].
        scale: the softmax scale (None: 1/sqrt(d)).
        softcap: cap > 0 or None.
        sinks: [h] per-head sink logits (learned) or None.
        alibi: h per-head ALiBi slopes (a sequence of floats) or None.
        window: sliding window W >= 1 or None.

    Returns:
        [b, h, c, d] in q's dtype.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    slopes = None if alibi is None else [float(x) for x in alibi]
    return _variant_op(q, k_prefix, k, v_prefix, v, sinks, slopes, float(scale),
                       0.0 if softcap is None else float(softcap), 0 if window is None else int(window))[0]


def dense_variant_attention(q, k, v, scale=None, softcap=None, sinks=None, alibi=None, window=None):
    """The same attention written out densely (scores [b, h, c, p + c], plain autograd):
    the tests' reference, in the model's way of writing it (repeat K/V, cat the sink, softmax,
    drop the sink)."""
    b, h, c, d = q.shape
    n = k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    dist = (n - c + torch.arange(c, device=q.device)).unsqueeze(-1) - torch.arange(n, device=q.device)
    if alibi is not None:
        slopes = torch.as_tensor(alibi, dtype=s.dtype, device=q.device).reshape(1, h, 1, 1)
        s = s - slopes * dist
    visible = dist >= 0
    if window is not None:
        visible = visible & (dist < window)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, h, 1, 1).expand(b, h, c, 1).to(s.dtype)], -1)
    probs = torch.softmax(s, -1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)
