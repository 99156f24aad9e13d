"""Chunk attention on torch's own flash kernels, without concatenating the K/V prefix.

A chunk's c queries attend to the prefix (p keys, every query sees all of them: no mask)
and to the chunk's own c keys (a plain causal square). Each part runs on
`aten._scaled_dot_product_flash_attention` (CUDA), which returns the log-sum-exp; the parts
are merged by log-sum-exp. Backward runs each part's flash backward with the merged out and
lse, which is exact: P_part = exp(s - lse) and delta = rowsum(dout * out) are the merged
attention's own, so the per-part gradients are the slices of the whole one, and dq is their
sum.

What the autograd.Function saves: q, the prefix *views* (the runtime's K/V buffer, no new
memory), the chunk's k/v, out and lse. A concatenation would allocate [b, h_kv, p + c, d]
twice per layer and chunk and keep it alive until backward; this does not, so a chunk's
saved memory stays flat as its prefix grows (tests/chunk_attention/test_flash_split.py counts it).

Grouped-query attention: the flash kernel maps query heads to K/V heads itself (torch's
flash check accepts h % h_kv == 0), and its backward returns h_kv-head gradients: K/V heads
are never repeated.

The same code runs with ATen's CPU flash kernels (which also return the log-sum-exp) for
CPU tensors, which is how the merge and the backward are tested without a GPU; the CUDA
kernels are exercised on fake CUDA tensors (meta kernels) for shapes and saved memory.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sppo_fx.util import compat as _compat

# flash's own limits (torch's sdp_utils): half precision, head dim a multiple of 8 up to
# 256, Ampere (sm_80) or newer; fp32 and other head dims go to the fallback
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MIN_CAPABILITY = (8, 0)


def flash_split_supported(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why the flash split cannot run these inputs, or None when it can.

    Args:
        q: [b, h, c, d] queries; k, v: [b, h_kv, n, d] (the chunk's own keys/values).

    Returns:
        None when the CUDA flash split can run, else a short reason (the caller then takes
        the Triton or SDPA fallback)."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in _FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (flash runs float16 and bfloat16)"
    d = q.shape[-1]
    if d % 8 or d > _MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim {d} (flash needs a multiple of 8 up to {_MAX_HEAD_DIM})"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} K/V heads"
    return cuda_environment_reason(q.device.index)


@torch.compiler.assume_constant_result
def cuda_environment_reason(index: Optional[int]) -> Optional[str]:
    """Why this torch and GPU cannot run the flash split at all, or None.

    Dynamo calls this once while it traces a chunk program and keeps the answer as a
    constant: torch 2.11's Dynamo cannot trace `torch.backends.cuda.flash_sdp_enabled()`
    (a bool from a torch.* op). So a compiled program keeps the routing it was built with;
    `enable_flash_sdp(False)` after the first step changes new programs only."""
    if _compat.flash_attention_ops() is None:
        return "this torch has no aten._scaled_dot_product_flash_attention(_backward)"
    if not _compat.flash_sdp_enabled():
        return "flash SDPA is disabled (torch.backends.cuda.enable_flash_sdp(False))"
    cap = _compat.cuda_capability(torch.device("cuda", index) if index is not None else "cuda")
    if cap is None or tuple(cap) < _MIN_CAPABILITY:
        return f"GPU capability {cap} (flash needs sm_80 or newer)"
    return None


# ---------------------------------------------------------------- the kernels, per device
# fwd(q, k, v, causal, scale) -> (out, lse, aux); bwd(dout, q, k, v, out, lse, aux, causal,
# scale) -> (dq, dk, dv). `aux` is what the CUDA backward needs back (rng state: empty with
# no dropout).


def _cuda_fwd(q, k, v, causal, scale):
    fwd, _ = _compat.flash_attention_ops()
    out, lse, _cq, _ck, _mq, _mk, seed, offset, _dbg = fwd(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset)


def _cuda_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    _, bwd = _compat.flash_attention_ops()
    seed, offset = aux
    # dense inputs: no cumulative sequence lengths; max lengths are the sizes themselves
    return bwd(dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset,
               scale=scale)


def _cpu_fwd(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_bwd(dout, q, k, v, out, lse, aux, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


_KERNELS = {"cuda": (_cuda_fwd, _cuda_bwd), "cpu": (_cpu_fwd, _cpu_bwd)}


def _merge(parts):
    """Merge [(out, lse)] by log-sum-exp: (out in the first part's layout and dtype, lse fp32)."""
    out0, lse = parts[0]
    if len(parts) == 1:
        return out0, lse
    acc = out0.float()
    for o, l in parts[1:]:
        new = torch.logaddexp(lse, l)
        acc = acc * torch.exp(lse - new).unsqueeze(-1) + o.float() * torch.exp(l - new).unsqueeze(-1)
        lse = new
    # elementwise ops keep their inputs' layout: the kernel's ([b, c, h, d] memory on CUDA,
    # as SDPA's output, which the graph's views after attention were traced against).
    # No identity `.to`: an autograd.Function output that aliases an intermediate gets
    # zero gradients under torch 2.11's Dynamo.
    return (acc if acc.dtype == out0.dtype else acc.to(out0.dtype)), lse


class _FlashSplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_prefix, k, v_prefix, v, scale):
        fwd, _ = _KERNELS[q.device.type]
        with_prefix = k_prefix.shape[-2] > 0
        results = []
        auxes = []
        if with_prefix:
            o, l, a = fwd(q, k_prefix, v_prefix, False, scale)
            results.append((o, l))
            auxes.extend(a)
        o, l, a = fwd(q, k, v, True, scale)
        results.append((o, l))
        auxes.extend(a)
        out, lse = _merge(results)
        ctx.save_for_backward(q, k_prefix, k, v_prefix, v, out, lse, *auxes)
        ctx.scale, ctx.with_prefix = scale, with_prefix
        return out

    @staticmethod
    def backward(ctx, dout):
        _, bwd = _KERNELS[dout.device.type]
        q, k_prefix, k, v_prefix, v, out, lse, *auxes = ctx.saved_tensors
        n_aux = len(auxes) // (2 if ctx.with_prefix else 1)
        if dout.stride(-1) != 1:  # the kernels read rows of d contiguous elements
            dout = dout.contiguous()
        dq, dk, dv = bwd(dout, q, k, v, out, lse, tuple(auxes[-n_aux:]) if n_aux else (), True, ctx.scale)
        if not ctx.with_prefix:
            return dq, torch.zeros_like(k_prefix), dk, torch.zeros_like(v_prefix), dv, None
        dq_p, dk_p, dv_p = bwd(dout, q, k_prefix, v_prefix, out, lse, tuple(auxes[:n_aux]), False, ctx.scale)
        # summed in float32 and rounded once
        dq = (dq.float() + dq_p.float()).to(q.dtype)
        return dq, dk_p, dk, dv_p, dv, None


def flash_split_attention(q: Tensor, k_prefix: Tensor, k: Tensor, v_prefix: Tensor, v: Tensor,
                          scale: Optional[float] = None) -> Tensor:
    """Lower-right causal attention of a chunk over its K/V prefix and its own K/V, on the
    device's flash kernels, without concatenating prefix and chunk.

    Args:
        q: [b, h, c, d] queries of the chunk.
        k_prefix, v_prefix: [b, h_kv, p, d] keys/values of the earlier chunks (p may be 0;
            views of a larger buffer are fine, the last dim must be contiguous).
        k, v: [b, h_kv, c, d] the chunk's own keys/values.
        scale: softmax scale (default 1/sqrt(d)).

    Returns:
        [b, h, c, d] attention output in q's dtype.

    Runs on CUDA when `flash_split_supported` says so, and on CPU (float32, bfloat16,
    float16) with ATen's CPU flash kernels."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _FlashSplitAttention.apply(q, k_prefix, k, v_prefix, v, float(scale))
