"""Shared pieces of the chunk-attention implementations: Triton availability, input
validation, dtypes and the default scale (see `sppo_fx/chunk_attention/op.py` for the
op's contract)."""
import math
from typing import Optional

import torch
from torch import Tensor

try:  # Triton is optional: without it every device uses the reference path.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

_LOG2E = 1.4426950408889634
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


def _default_scale(q: Tensor, scale: Optional[float]) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
