"""Chunk attention: one sequence chunk's queries attending to its prefix plus itself.

SPPO trains on a long sequence one chunk at a time.  While chunk ``t`` is processed,
its ``c`` queries attend to the keys/values of every earlier chunk (the *prefix*, ``p``
positions) followed by the chunk's own ``c`` positions.  This module provides that
attention as PyTorch custom operators with Triton (FlashAttention-2 style) kernels.

Shapes (``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``d`` head dim)::

    q    [b, h,    c,     d]
    k, v [b, h_kv, p + c, d]      h % h_kv == 0 (grouped-query attention)
    out  [b, h,    c,     d]      dtype of q
    lse  [b, h,    c]             float32 (float64 for float64 inputs), natural log

Query head ``i`` uses key/value head ``i // (h // h_kv)``.

Mask alignment (``causal=True``, the default) is *lower-right*: the chunk's last query is
aligned with the last key, so query row ``i`` (``0 <= i < c``) sees keys ``0 .. p + i``
inclusive.  This equals ``torch.nn.functional.scaled_dot_product_attention`` with
``attn_mask=torch.nn.attention.bias.causal_lower_right(c, p + c)`` (with k/v repeated
to ``h`` heads), i.e. the boolean mask ``ones(c, p + c).tril(p)``.  With ``causal=False``
every query sees every key (used for prefix segments that lie entirely in the past);
then the key length may be any positive number.

``scale`` defaults to ``1 / sqrt(d)``.  ``lse[i] = logsumexp_j(scale * q_i . k_j)`` over
the visible keys.

Operators (registered with :func:`torch.library.triton_op`, so ``torch.compile`` and
``torch.export`` can trace them; fake/meta implementations are registered too):

* ``torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, scale, causal) -> (out, lse)``
* ``torch.ops.sppo_fx.chunk_attention_bwd(dout, q, k, v, out, lse, dlse, scale, causal)
  -> (dq, dk, dv)`` where ``dk``/``dv`` have ``h_kv`` heads (grouped query heads summed)
  and ``dlse`` (optional) is the gradient flowing into ``lse``.

Autograd is registered on the forward op, and both ``out`` and ``lse`` are
differentiable; this is what lets :func:`segmented_chunk_attention` merge per-segment
results by log-sum-exp and still back-propagate through the kernels.

Execution: on CUDA (or any non-CPU device Triton supports) with fp16/bf16/fp32 inputs the
Triton kernels run.  On CPU with fp32/bf16/fp16 the op calls ATen's CPU flash-attention
kernels (`_scaled_dot_product_flash_attention_for_cpu` and its backward) on two key
ranges, the prefix (no mask) and the causal square, merged by log-sum-exp (no mask is
built, no masked tile computed; grouped-query K/V go in unexpanded); a backward that also
receives an lse gradient, float64 inputs, and the tests' reference use a plain-PyTorch
path (matmul + mask + softmax) that materializes the ``[b, h, c, p + c]`` scores.  The
device check is a Python branch inside the op body, which is what keeps
``torch.compile`` on CPU tensors working (a Triton launch there fails with
"0 active drivers").

Kernels: the forward kernel tiles one query block against key blocks with an online
softmax (unmasked key blocks first, then the diagonal/ragged ones with the mask) and
stores ``lse``.  The backward computes ``delta = rowsum(dO * O) - dlse``, then ``dK, dV``
in a kernel that owns one key block of one kv head and loops over the query heads of its
group and the query blocks that see it (no atomics), and ``dQ`` in a kernel per query
block.  All accumulate in fp32; head dims up to 256 are padded to a power of two >= 16
with masking.

For testing the kernels without a GPU, :func:`chunk_attention_fwd_triton` and
:func:`chunk_attention_bwd_triton` launch the raw ``@triton.jit`` kernels directly; with
``TRITON_INTERPRET=1`` set before ``triton`` is imported they run on CPU tensors.

Limitations: tile sizes are fixed per dtype/head dim (no autotuning; chosen so the sm_90
build fits shared memory without register spills, not measured on hardware); offsets
within one (batch, head) slice use 32-bit arithmetic, so ``(p + c) * k.stride(2)`` must
stay below 2**31; fp32 inputs use IEEE fp32 dots unless
``torch.backends.cuda.matmul.allow_tf32`` is set.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.library import triton_op

# The implementations live in sppo_fx/chunk_attention/kernels/, one job a module; the names the
# tests and other modules use are re-exported here.
from sppo_fx.chunk_attention.kernels.common import (  # noqa: F401
    HAS_TRITON, _TRITON_DTYPES, _check_inputs, _default_scale, _lse_dtype)
from sppo_fx.chunk_attention.kernels.cpu import (  # noqa: F401
    _cpu_flash_bwd, _cpu_flash_fwd, _cpu_flash_ok, cpu_flash_backward, cpu_flash_forward, cpu_flash_parts)
from sppo_fx.chunk_attention.kernels.reference import (  # noqa: F401
    _reference_bwd, _reference_fwd, _visible_mask, reference_chunk_attention)
from sppo_fx.chunk_attention.kernels.triton_launch import (  # noqa: F401
    _block_d, _dot_precision, _kernel_config, _launch_bwd, _launch_fwd, chunk_attention_bwd_triton,
    chunk_attention_fwd_triton)
from sppo_fx.chunk_attention.kernels.triton_kernels import *  # noqa: F401,F403  (kernels, for the kernel tests)

__all__ = [
    "chunk_attention",
    "chunk_attention_with_lse",
    "segmented_chunk_attention",
    "chunk_attention_fwd_triton",
    "chunk_attention_bwd_triton",
    "reference_chunk_attention",
]


# Test hook: run the Triton kernels for CPU tensors too.  Only meaningful in a process
# started with TRITON_INTERPRET=1 (never under torch.compile, which cannot launch Triton
# on CPU); off by default.
_FORCE_TRITON_ON_CPU = False


def _use_triton(q: Tensor) -> bool:
    """Whether the op body should launch the Triton kernels (vs. the reference path)."""
    if q.device.type == "cpu" and not _FORCE_TRITON_ON_CPU:
        return False
    return HAS_TRITON and q.dtype in _TRITON_DTYPES


# ----------------------------------------------------------------------------------------
# Custom operators
# ----------------------------------------------------------------------------------------


@triton_op("sppo_fx::chunk_attention_fwd", mutates_args=())
def _chunk_attention_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True
) -> Tuple[Tensor, Tensor]:
    _check_inputs(q, k, v, causal)
    if not _use_triton(q):
        if _cpu_flash_ok(q):
            return _cpu_flash_fwd(q, k, v, scale, causal)
        return _reference_fwd(q, k, v, scale, causal)
    return _launch_fwd(q, k, v, scale, causal, False)


@_chunk_attention_fwd_op.register_fake
def _chunk_attention_fwd_fake(q, k, v, scale, causal=True):
    _check_inputs(q, k, v, causal)
    b, h, c, d = q.shape
    out = q.new_empty((b, h, c, d))
    lse = q.new_empty((b, h, c), dtype=_lse_dtype(q.dtype))
    return out, lse


@triton_op("sppo_fx::chunk_attention_bwd", mutates_args=())
def _chunk_attention_bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Optional[Tensor],
    scale: float,
    causal: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    _check_inputs(q, k, v, causal)
    if not _use_triton(q):
        if _cpu_flash_ok(q) and dlse is None:
            return _cpu_flash_bwd(dout, q, k, v, out, lse, scale, causal)
        return _reference_bwd(dout, q, k, v, out, lse, dlse, scale, causal)
    return _launch_bwd(dout, q, k, v, out, lse, dlse, scale, causal, False)


@_chunk_attention_bwd_op.register_fake
def _chunk_attention_bwd_fake(dout, q, k, v, out, lse, dlse, scale, causal=True):
    _check_inputs(q, k, v, causal)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale
    ctx.causal = causal


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.sppo_fx.chunk_attention_bwd(
        dout, q, k, v, out, lse, dlse, ctx.scale, ctx.causal
    )
    return dq, dk, dv, None, None


torch.library.register_autograd(
    "sppo_fx::chunk_attention_fwd", _backward, setup_context=_setup_context
)


# ----------------------------------------------------------------------------------------
# Opaque variant for compiled chunk programs
# ----------------------------------------------------------------------------------------
#
# Inside an Inductor-compiled graph, `triton_op` kernels are recompiled by Inductor itself;
# with torch 2.11 + Triton 3.6 on an H200 that compile failed (a `tl.dot` accumulator
# assertion) while the same kernels launched directly passed every test. These ops wrap
# the kernels as opaque custom ops (Inductor calls them like an extern kernel, as it calls
# SDPA), and return SDPA's output layout ([b, c, h, d] memory, viewed as [b, h, c, d]),
# which is what the captured graph's views after attention were traced against.


def bshd_empty_like(q: Tensor, dtype=None) -> Tensor:
    """An empty [b, h, c, d] tensor laid out as [b, c, h, d] (SDPA's output layout)."""
    b, h, c, d = q.shape
    return q.new_empty((b, c, h, d), dtype=dtype or q.dtype).transpose(1, 2)


def _as_layout(like: Tensor, x: Tensor) -> Tensor:
    return x if x.stride() == like.stride() else like.copy_(x)


@torch.library.custom_op("sppo_fx::chunk_attention_opaque", mutates_args=())
def _chunk_attention_opaque(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    out, lse = torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, scale, causal)
    return _as_layout(bshd_empty_like(q), out), lse


@_chunk_attention_opaque.register_fake
def _(q, k, v, scale, causal):
    out, lse = _chunk_attention_fwd_fake(q, k, v, scale, causal)
    return bshd_empty_like(q), lse


@torch.library.custom_op("sppo_fx::chunk_attention_opaque_bwd", mutates_args=())
def _chunk_attention_opaque_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.sppo_fx.chunk_attention_bwd(dout, q, k, v, out, lse, None, scale, causal)
    return (_as_layout(torch.empty_like(q), dq), _as_layout(torch.empty_like(k), dk),
            _as_layout(torch.empty_like(v), dv))


@_chunk_attention_opaque_bwd.register_fake
def _(dout, q, k, v, out, lse, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _opaque_setup(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.scale, ctx.causal = scale, causal


def _opaque_backward(ctx, dout, dlse):
    # callers use only `out` (dlse is None or zeros)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _chunk_attention_opaque_bwd(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


torch.library.register_autograd("sppo_fx::chunk_attention_opaque", _opaque_backward, setup_context=_opaque_setup)


def chunk_attention_opaque(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None) -> Tensor:
    """`chunk_attention` (lower-right causal) as an opaque op with SDPA's output layout.

    Args:
        q: [b, h, c, d]; k, v: [b, h_kv, p + c, d].
        scale: softmax scale (default 1/sqrt(d)).

    Returns:
        [b, h, c, d] (memory laid out as [b, c, h, d]).
    """
    return torch.ops.sppo_fx.chunk_attention_opaque(q, k, v, _default_scale(q, scale), True)[0]


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------


def chunk_attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = True
) -> Tuple[Tensor, Tensor]:
    """Chunk attention returning the output and the softmax log-sum-exp.

    Args:
        q: queries ``[b, h, c, d]`` (fp16, bf16, fp32; fp64 uses the reference path).
        k: keys ``[b, h_kv, p + c, d]`` with ``h % h_kv == 0``.
        v: values, same shape as ``k``.
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.
        causal: if True (default) query ``i`` sees keys ``0 .. p + i`` (lower-right
            aligned); if False every query sees every key (any key length >= 1).

    Returns:
        ``(out, lse)``: ``out`` ``[b, h, c, d]`` in q's dtype and ``lse`` ``[b, h, c]``
        (float32; float64 for float64 inputs), natural-log ``logsumexp`` of the scaled
        visible scores.  Both are differentiable.
    """
    return torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, _default_scale(q, scale), bool(causal))


def chunk_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = True
) -> Tensor:
    """Chunk attention: ``c`` queries attend to ``p`` prefix keys plus the chunk itself.

    Equivalent to ``scaled_dot_product_attention(q, k_rep, v_rep,
    attn_mask=causal_lower_right(c, p + c), scale=scale)`` where ``k_rep``/``v_rep``
    repeat each key/value head ``h // h_kv`` times.

    Args:
        q: queries ``[b, h, c, d]``.
        k: keys ``[b, h_kv, p + c, d]`` with ``h % h_kv == 0``.
        v: values, same shape as ``k``.
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.
        causal: lower-right causal mask if True (default), no mask if False.

    Returns:
        Attention output ``[b, h, c, d]`` in q's dtype (differentiable w.r.t. q, k, v).
    """
    return chunk_attention_with_lse(q, k, v, scale, causal)[0]


def segmented_chunk_attention(
    q: Tensor,
    k_segments: Sequence[Tensor],
    v_segments: Sequence[Tensor],
    scale: Optional[float] = None,
) -> Tensor:
    """Chunk attention whose key/value prefix is a list of segments (never concatenated).

    ``k_segments = [k_0, ..., k_{m-1}, k_cur]``: the earlier chunks' keys (each
    ``[b, h_kv, len_j, d]``) followed by the current chunk's keys; likewise for values.
    Every prefix segment is attended fully (no mask) and the last segment with the
    lower-right causal mask; the partial results are merged by log-sum-exp.  The result
    equals ``chunk_attention(q, torch.cat(k_segments, 2), torch.cat(v_segments, 2))``
    and is differentiable w.r.t. ``q`` and every segment.  Empty prefix segments are
    skipped.

    Args:
        q: queries ``[b, h, c, d]``.
        k_segments: key segments, the current chunk's keys last (its length must be >= c).
        v_segments: value segments matching ``k_segments`` one to one.
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.

    Returns:
        Attention output ``[b, h, c, d]`` in q's dtype.
    """
    k_segments = list(k_segments)
    v_segments = list(v_segments)
    if len(k_segments) == 0 or len(k_segments) != len(v_segments):
        raise ValueError(
            "segmented_chunk_attention needs equally many (>= 1) key and value segments; "
            f"got {len(k_segments)} and {len(v_segments)}"
        )
    scale = _default_scale(q, scale)
    last = len(k_segments) - 1
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for j, (ks, vs) in enumerate(zip(k_segments, v_segments)):
        if j != last and ks.shape[2] == 0:
            continue
        o, lse = chunk_attention_with_lse(q, ks, vs, scale, causal=(j == last))
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0]
    lse_all = torch.logsumexp(torch.stack(lses, 0), 0)
    acc_dtype = lse_all.dtype
    merged = None
    for o, lse in zip(outs, lses):
        term = torch.exp(lse - lse_all).unsqueeze(-1) * o.to(acc_dtype)
        merged = term if merged is None else merged + term
    return merged.to(q.dtype)
