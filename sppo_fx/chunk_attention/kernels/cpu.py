"""Chunk attention on CPU: ATen's flash kernels over key parts (the unmasked prefix, the
causal square), merged by log-sum-exp; no mask is built and grouped K/V stay unexpanded."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from sppo_fx.chunk_attention.kernels.common import _lse_dtype

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
    out = lse = None
    for k, v, causal in parts:
        o, l = fwd(q, k, v, 0.0, causal, scale=scale)
        if out is None:
            out, lse = o, l
            continue
        new = torch.logaddexp(lse, l)
        # merged in float32 (the kernel's own accumulation type), out of place: the result
        # is a new tensor, never the kernel's output written over or an identity `.float()`
        # of it (tests/chunk_attention/test_autograd_function_outputs.py says why)
        out = out.float() * torch.exp(lse - new).unsqueeze(-1) + o.float() * torch.exp(l - new).unsqueeze(-1)
        lse = new
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
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
