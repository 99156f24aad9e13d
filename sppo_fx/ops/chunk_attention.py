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
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

try:  # Triton is optional: without it every device uses the reference path.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "chunk_attention",
    "chunk_attention_with_lse",
    "segmented_chunk_attention",
    "chunk_attention_fwd_triton",
    "chunk_attention_bwd_triton",
    "reference_chunk_attention",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------
# Input validation and small helpers
# ----------------------------------------------------------------------------------------


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "chunk_attention expects q [b, h, c, d] and k, v [b, h_kv, n, d]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, c, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch size and head dim"
        )
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    n = k.shape[2]
    if n == 0:
        raise ValueError("chunk_attention needs at least one key position (k.shape[2] == 0)")
    if causal and n < c:
        raise ValueError(
            f"causal chunk attention needs k/v length (prefix + chunk) >= chunk length; "
            f"got k length {n} < q length {c}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"chunk_attention needs floating-point inputs; got {q.dtype}")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Test hook: run the Triton kernels for CPU tensors too.  Only meaningful in a process
# started with TRITON_INTERPRET=1 (never under torch.compile, which cannot launch Triton
# on CPU); off by default.
_FORCE_TRITON_ON_CPU = False


def _use_triton(q: Tensor) -> bool:
    """Whether the op body should launch the Triton kernels (vs. the reference path)."""
    if q.device.type == "cpu" and not _FORCE_TRITON_ON_CPU:
        return False
    return HAS_TRITON and q.dtype in _TRITON_DTYPES


def _default_scale(q: Tensor, scale: Optional[float]) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


# ----------------------------------------------------------------------------------------
# Reference path (plain PyTorch; used on CPU and for float64)
# ----------------------------------------------------------------------------------------


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

_CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_flash_ok(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES


def cpu_flash_parts(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> List[Tuple[Tensor, Tensor, bool]]:
    """The key ranges one lower-right causal chunk attention splits into for ATen's CPU
    flash kernels: [(k_part, v_part, is_causal)], views of k and v (no copies).

    With a prefix (n > c keys for c queries) the prefix is seen whole by every query and
    the last c keys form a plain causal square, so neither part needs a mask (a masked
    call computes every tile and builds a c x n mask; the split does neither)."""
    c, n = q.shape[2], k.shape[2]
    if not causal or n == c:
        return [(k, v, causal)]
    p = n - c
    return [(k[:, :, :p], v[:, :, :p], False), (k[:, :, p:], v[:, :, p:], True)]


def cpu_flash_forward(q: Tensor, parts, scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """Attention of q over the key parts (`cpu_flash_parts`), merged by log-sum-exp.

    Every query row must see at least one key of every part (true of the parts
    `cpu_flash_parts` makes: a whole prefix, a causal square); a row with none would get
    lse = -inf and NaN weights.

    Returns (out in the kernel's layout and q's dtype, lse [b, h, c] float32). Grouped-query
    K/V (h_kv < h) go to the kernel as they are: it maps query heads to K/V heads itself."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = acc = lse = None
    for k, v, causal in parts:
        o, l = fwd(q, k, v, 0.0, causal, scale=scale)
        if out is None:
            out, lse = o, l
            continue
        new = torch.logaddexp(lse, l)
        if acc is None:  # merge in float32 (the kernel's own accumulation type)
            acc = out.float() if out.dtype != torch.float32 else out
        acc = acc.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.float() * torch.exp(l - new).unsqueeze(-1))
        lse = new
    if acc is not None and acc is not out:
        out = out.copy_(acc)
    return out, lse


def cpu_flash_backward(dout: Tensor, q: Tensor, parts, out: Tensor, lse: Tensor,
                       scale: Optional[float]) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
    """Gradients of `cpu_flash_forward`: (dq, [(dk_part, dv_part)] per part).

    Given the merged out and lse, each part's flash backward is exact on its own
    (P = exp(s - lse), delta = rowsum(dout * out)); dq is the sum over parts."""
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    dout = dout.contiguous()
    dq, dkv = None, []
    for k, v, causal in parts:
        dq_j, dk, dv = bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        if dq is None:
            dq = dq_j
        else:  # summed in float32, rounded once
            dq = (dq if dq.dtype == torch.float32 else dq.float()).add_(dq_j)
        dkv.append((dk.to(k.dtype), dv.to(v.dtype)))
    return dq.to(q.dtype), dkv


def _cpu_flash_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    out, lse = cpu_flash_forward(q, cpu_flash_parts(q, k, v, causal), scale)
    return out.contiguous(), lse.to(_lse_dtype(q.dtype)).contiguous()


def _cpu_flash_bwd(dout, q, k, v, out, lse, scale, causal) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dkv = cpu_flash_backward(dout, q, cpu_flash_parts(q, k, v, causal), out, lse, scale)
    if len(dkv) == 1:  # contiguous, as the fake implementation promises
        return dq.contiguous(), dkv[0][0].contiguous(), dkv[0][1].contiguous()
    return dq.contiguous(), torch.cat([dk for dk, _ in dkv], 2), torch.cat([dv for _, dv in dkv], 2)


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


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
        """Load a [len(rows), len(cols)] tile, zero-filling out-of-range rows/cols."""
        if CHECK_ROWS:
            if CHECK_COLS:
                t = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
            else:
                t = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            if CHECK_COLS:
                t = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
            else:
                t = tl.load(ptrs)
        return t

    @triton.jit
    def _store_tile(ptrs, val, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
        if CHECK_COLS:
            tl.store(ptrs, val, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, val, mask=rows[:, None] < n_rows)

    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b.  UPCAST computes in fp32 (exact for 16-bit operands); it exists only
        because the Triton interpreter mishandles bf16 ``tl.dot`` (it multiplies the raw
        uint16 storage) and is never set on a GPU."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _fwd_inner(
        acc, l_i, m_i, q,
        k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_n, offs_d,
        lo, hi, N, PREFIX, qk_scale,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Online-softmax accumulation over key blocks [lo, hi)."""
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n
            k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            # Scores in the log2 domain: s2 = scale * log2(e) * q.k
            s = _dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST) * qk_scale
            if MASKED:
                visible = cols[None, :] < N
                if CAUSAL:
                    visible = visible & (cols[None, :] <= PREFIX + offs_m[:, None])
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            acc = acc * alpha[:, None]
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _chunk_attn_fwd_kernel(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, GROUP, C, N, PREFIX, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Grid: (cdiv(C, BLOCK_M), B * H).  One program = one query block of one head."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        off_hk = off_h // GROUP

        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)

        q_base = Q + off_b * stride_qb + off_h * stride_qh
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        if CAUSAL:
            # Keys <= PREFIX + start_m are visible to every row of the block; the block's
            # last valid row sees keys up to PREFIX + min(start_m + BLOCK_M, C) - 1.
            full_hi = (tl.minimum(PREFIX + start_m + 1, N) // BLOCK_N) * BLOCK_N
            hi = PREFIX + tl.minimum(start_m + BLOCK_M, C)
        else:
            full_hi = (N // BLOCK_N) * BLOCK_N
            hi = N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n, offs_d, 0, full_hi, N, PREFIX, qk_scale,
                                   HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, False, DOT_PRECISION, UPCAST)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n, offs_d, full_hi, hi, N, PREFIX, qk_scale,
                                   HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, True, DOT_PRECISION, UPCAST)

        # Every valid row sees at least one key, so l_i > 0 there; guard padding rows.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        o_base = O + off_b * stride_ob + off_h * stride_oh
        _store_tile(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(O.dtype.element_ty),
                    offs_m, C, offs_d, HEAD_DIM, CHECK_D)
        tl.store(LSE + pid_bh.to(tl.int64) * C + offs_m, lse, mask=offs_m < C)

    @triton.jit
    def _chunk_attn_bwd_preprocess_kernel(
        O, DO, DLSE, DELTA,
        stride_ob, stride_oh, stride_om,
        stride_dob, stride_doh, stride_dom,
        H, C,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        HAS_DLSE: tl.constexpr,
    ):
        """delta = rowsum(dO * O) - dlse.  Grid: (cdiv(C, BLOCK_M), B * H)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        o = _load_tile(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D).to(tl.float32)
        do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                        offs_m, C, offs_d, HEAD_DIM, True, CHECK_D).to(tl.float32)
        delta = tl.sum(o * do, 1)
        row = pid_bh.to(tl.int64) * C
        if HAS_DLSE:
            delta = delta - tl.load(DLSE + row + offs_m, mask=offs_m < C, other=0.0).to(tl.float32)
        tl.store(DELTA + row + offs_m, delta, mask=offs_m < C)

    @triton.jit
    def _bwd_dkdv_inner(
        dk, dv, k, v,
        q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
        cols, offs_d, lo, hi, C, N, PREFIX, qk_scale,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Accumulate dK, dV of one key block over query blocks [lo, hi) (transposed form)."""
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _load_tile(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                           rows, C, offs_d, HEAD_DIM, MASKED, CHECK_D)
            do = _load_tile(do_base + rows[:, None] * stride_dom + offs_d[None, :],
                            rows, C, offs_d, HEAD_DIM, MASKED, CHECK_D)
            if MASKED:
                lse = tl.load(lse_base + rows, mask=rows < C, other=0.0)
                delta = tl.load(delta_base + rows, mask=rows < C, other=0.0)
            else:
                lse = tl.load(lse_base + rows)
                delta = tl.load(delta_base + rows)
            qkT = _dot(k, tl.trans(q), None, DOT_PRECISION, UPCAST)  # [BLOCK_N, BLOCK_M]
            pT = tl.math.exp2(qkT * qk_scale - (lse * 1.4426950408889634)[None, :])
            if MASKED:
                visible = (rows[None, :] < C) & (cols[:, None] < N)
                if CAUSAL:
                    visible = visible & (cols[:, None] <= PREFIX + rows[None, :])
                pT = tl.where(visible, pT, 0.0)
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION, UPCAST)
            dpT = _dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST)
            dsT = pT * (dpT - delta[None, :])
            dk = _dot(dsT.to(q.dtype), q, dk, DOT_PRECISION, UPCAST)
        return dk, dv

    @triton.jit
    def _chunk_attn_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        H, H_KV, GROUP, C, N, PREFIX, scale, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Grid: (cdiv(N, BLOCK_N), B * H_KV).  One program = one key block of one kv head,
        looping over the GROUP query heads that share it (no atomics needed)."""
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        off_b = (pid_bhk // H_KV).to(tl.int64)
        off_hk = (pid_bhk % H_KV).to(tl.int64)

        start_n = pid_n * BLOCK_N
        cols = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_tile(K + off_b * stride_kb + off_hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
                       cols, N, offs_d, HEAD_DIM, True, CHECK_D)
        v = _load_tile(V + off_b * stride_vb + off_hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
                       cols, N, offs_d, HEAD_DIM, True, CHECK_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

        # Query blocks [lo, mid) see this key block partially (diagonal), [mid, full_end)
        # see all of it, [full_end, C) is the ragged last query block.
        full_end = (C // BLOCK_M) * BLOCK_M
        if CAUSAL:
            lo = (tl.maximum(start_n - PREFIX, 0) // BLOCK_M) * BLOCK_M
            mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - PREFIX, 0), BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
            mid = lo
        # A ragged (partly out-of-range) key block is masked everywhere.
        mid = tl.where(start_n + BLOCK_N > N, full_end, mid)
        mid = tl.maximum(lo, tl.minimum(mid, full_end))
        tail = tl.maximum(full_end, lo)

        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            q_base = Q + off_b * stride_qb + off_h * stride_qh
            do_base = DO + off_b * stride_dob + off_h * stride_doh
            row0 = (off_b * H + off_h) * C
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, lo, mid, C, N, PREFIX,
                                     qk_scale, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, True, DOT_PRECISION, UPCAST)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, mid, full_end, C, N, PREFIX,
                                     qk_scale, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, False, DOT_PRECISION, UPCAST)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, tail, C, C, N, PREFIX,
                                     qk_scale, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, True, DOT_PRECISION, UPCAST)

        dk = dk * scale
        _store_tile(DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :],
                    dk.to(DK.dtype.element_ty), cols, N, offs_d, HEAD_DIM, CHECK_D)
        _store_tile(DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :],
                    dv.to(DV.dtype.element_ty), cols, N, offs_d, HEAD_DIM, CHECK_D)

    @triton.jit
    def _bwd_dq_inner(
        dq, q, do, lse2, delta,
        k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, lo, hi, N, PREFIX, qk_scale,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n
            k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            s = _dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST) * qk_scale
            p = tl.math.exp2(s - lse2[:, None])
            if MASKED:
                visible = cols[None, :] < N
                if CAUSAL:
                    visible = visible & (cols[None, :] <= PREFIX + offs_m[:, None])
                p = tl.where(visible, p, 0.0)
            dp = _dot(do, tl.trans(v), None, DOT_PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION, UPCAST)
        return dq

    @triton.jit
    def _chunk_attn_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm,
        H, GROUP, C, N, PREFIX, scale, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Grid: (cdiv(C, BLOCK_M), B * H).  One program = one query block of one head."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        off_hk = off_h // GROUP

        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_tile(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)
        do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                        offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)
        row0 = pid_bh.to(tl.int64) * C
        lse2 = tl.load(LSE + row0 + offs_m, mask=offs_m < C, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < C, other=0.0)
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        if CAUSAL:
            full_hi = (tl.minimum(PREFIX + start_m + 1, N) // BLOCK_N) * BLOCK_N
            hi = PREFIX + tl.minimum(start_m + BLOCK_M, C)
        else:
            full_hi = (N // BLOCK_N) * BLOCK_N
            hi = N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n, offs_d, 0, full_hi, N, PREFIX, qk_scale,
                           HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, False, DOT_PRECISION, UPCAST)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n, offs_d, full_hi, hi, N, PREFIX, qk_scale,
                           HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, True, DOT_PRECISION, UPCAST)
        dq = dq * scale
        _store_tile(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
                    dq.to(DQ.dtype.element_ty), offs_m, C, offs_d, HEAD_DIM, CHECK_D)


# ----------------------------------------------------------------------------------------
# Kernel launchers (shared by the op bodies and the direct test helpers)
# ----------------------------------------------------------------------------------------


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # Triton's default on NVIDIA; only affects fp32 operands


# Tile configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by the 16-bit /
# fp32 input type and BLOCK_D.  Chosen without a GPU, by compiling for sm_90 and picking
# configurations that fit shared memory and (mostly) avoid register spills; not tuned
# for speed on hardware.
_FWD_CONFIGS = {
    (True, 64): (128, 64, 4, 3),
    (True, 128): (128, 64, 8, 3),
    (False, 64): (64, 32, 8, 2),
    (False, 128): (32, 64, 8, 2),
}
_DKDV_CONFIGS = {
    (True, 64): (32, 128, 8, 2),
    (True, 128): (16, 128, 8, 2),
    (False, 64): (32, 32, 8, 1),
    (False, 128): (16, 64, 8, 1),
}
_DQ_CONFIGS = {
    (True, 64): (128, 64, 8, 2),
    (True, 128): (128, 32, 8, 2),
    (False, 64): (64, 32, 8, 1),
    (False, 128): (16, 32, 8, 1),
}
_WIDE_CONFIGS = {"fwd": (64, 32, 8, 1), "dkdv": (16, 32, 8, 1), "dq": (32, 32, 8, 1)}  # BLOCK_D > 128


def _kernel_config(kind: str, dtype: torch.dtype, block_d: int,
                   block_m: Optional[int] = None, block_n: Optional[int] = None) -> dict:
    if block_d > 128:
        bm, bn, warps, stages = _WIDE_CONFIGS[kind]
    else:
        table = {"fwd": _FWD_CONFIGS, "dkdv": _DKDV_CONFIGS, "dq": _DQ_CONFIGS}[kind]
        bm, bn, warps, stages = table[(dtype != torch.float32, 64 if block_d <= 64 else 128)]
    return dict(
        BLOCK_M=bm if block_m is None else block_m,
        BLOCK_N=bn if block_n is None else block_n,
        num_warps=warps,
        num_stages=stages,
    )


def _kernels_interpreted() -> bool:
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_chunk_attn_fwd_kernel, InterpretedFunction)


_INTERPRETED = _kernels_interpreted()  # TRITON_INTERPRET=1 was set when triton was imported


def _wrap_triton(kernel):
    """``wrap_triton(kernel)``; an interpreter kernel (TRITON_INTERPRET=1) launches as it is,
    since it cannot be traced (torch 2.13 passes it through; torch 2.11 raises on it)."""
    return kernel if _INTERPRETED else wrap_triton(kernel)


def _needs_upcast(dtype: torch.dtype) -> bool:
    """True under TRITON_INTERPRET=1 for bf16 (see ``_dot``); always False on a GPU build."""
    return _INTERPRETED and dtype == torch.bfloat16


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_head_dim(d: int) -> None:
    if d > 256:
        raise ValueError(f"the chunk attention Triton kernels support head dims up to 256; got {d}")


def _launch_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, direct: bool,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    b, h, c, d = q.shape
    _check_head_dim(d)
    h_kv, n = k.shape[1], k.shape[2]
    out = torch.empty((b, h, c, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, c), dtype=torch.float32, device=q.device)
    if b * h * c == 0:
        return out, lse
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_d = _block_d(d)
    cfg = _kernel_config("fwd", q.dtype, block_d, block_m, block_n)
    grid = (triton.cdiv(c, cfg["BLOCK_M"]), b * h, 1)
    upcast = _needs_upcast(q.dtype)
    kernel = _chunk_attn_fwd_kernel if direct else _wrap_triton(_chunk_attn_fwd_kernel)
    kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, h // h_kv, c, n, n - c, scale * _LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype), UPCAST=upcast,
        **cfg,
    )
    return out, lse


def _launch_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    dlse: Optional[Tensor], scale: float, causal: bool, direct: bool,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, c, d = q.shape
    _check_head_dim(d)
    h_kv, n = k.shape[1], k.shape[2]
    dq = torch.empty((b, h, c, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, h_kv, n, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, h_kv, n, d), dtype=v.dtype, device=v.device)
    if b * h * c == 0:
        return dq, dk.zero_(), dv.zero_()
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout)
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    block_d = _block_d(d)
    precision = _dot_precision(q.dtype)
    upcast = _needs_upcast(q.dtype)
    group = h // h_kv

    delta = torch.empty((b, h, c), dtype=torch.float32, device=q.device)
    pre = _chunk_attn_bwd_preprocess_kernel if direct else _wrap_triton(_chunk_attn_bwd_preprocess_kernel)
    pre[(triton.cdiv(c, 64), b * h, 1)](
        out, dout, dlse if dlse is not None else delta, delta,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        h, c,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, BLOCK_M=64, HAS_DLSE=dlse is not None,
    )

    cfg = _kernel_config("dkdv", q.dtype, block_d, block_m, block_n)
    dkdv = _chunk_attn_bwd_dkdv_kernel if direct else _wrap_triton(_chunk_attn_bwd_dkdv_kernel)
    dkdv[(triton.cdiv(n, cfg["BLOCK_N"]), b * h_kv, 1)](
        q, k, v, dout, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        h, h_kv, group, c, n, n - c, scale, scale * _LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=precision, UPCAST=upcast, **cfg,
    )

    cfg = _kernel_config("dq", q.dtype, block_d, block_m, block_n)
    dqk = _chunk_attn_bwd_dq_kernel if direct else _wrap_triton(_chunk_attn_bwd_dq_kernel)
    dqk[(triton.cdiv(c, cfg["BLOCK_M"]), b * h, 1)](
        q, k, v, dout, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        h, group, c, n, n - c, scale, scale * _LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=precision, UPCAST=upcast, **cfg,
    )
    return dq, dk, dv


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; the chunk attention Triton kernels are unavailable")


def chunk_attention_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = True,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Launch the forward Triton kernel directly (test helper, bypasses the custom op).

    With ``TRITON_INTERPRET=1`` set before ``triton`` is imported this runs on CPU tensors.

    Args:
        q, k, v: as for :func:`chunk_attention` (fp16/bf16/fp32).
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.
        causal: lower-right causal mask if True.
        block_m, block_n: override the query/key tile sizes (powers of two, >= 16).

    Returns:
        ``(out [b, h, c, d], lse [b, h, c] float32)``.
    """
    _require_triton()
    _check_inputs(q, k, v, causal)
    return _launch_fwd(q, k, v, _default_scale(q, scale), causal, True, block_m, block_n)


def chunk_attention_bwd_triton(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    dlse: Optional[Tensor] = None, scale: Optional[float] = None, causal: bool = True,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Launch the backward Triton kernels directly (test helper, bypasses the custom op).

    Args:
        dout: gradient of ``out``, ``[b, h, c, d]``.
        q, k, v: forward inputs.
        out, lse: forward outputs (from :func:`chunk_attention_fwd_triton`).
        dlse: optional gradient of ``lse``, ``[b, h, c]``.
        scale: softmax scale; ``None`` means ``1 / sqrt(d)``.
        causal: lower-right causal mask if True.
        block_m, block_n: override the query/key tile sizes (powers of two, >= 16).

    Returns:
        ``(dq, dk, dv)`` with ``dk``/``dv`` shaped like ``k``/``v``.
    """
    _require_triton()
    _check_inputs(q, k, v, causal)
    return _launch_bwd(dout, q, k, v, out, lse, dlse, _default_scale(q, scale), causal, True,
                       block_m, block_n)


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
