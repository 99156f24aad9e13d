"""Launch configuration and launchers of the Triton chunk-attention kernels (used by the
op bodies and, directly, by the kernel tests)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from torch.library import wrap_triton

from sppo_fx.chunk_attention.kernels.common import HAS_TRITON, _LOG2E, _check_inputs, _default_scale, triton
from sppo_fx.chunk_attention.kernels.triton_kernels import *  # noqa: F401,F403  (the kernels)


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


def _variant_args(q: Tensor, scale: float, softcap: float, slopes) -> tuple:
    """(slopes tensor or a dummy pointer, cap_in, cap_out, SOFTCAP, HAS_ALIBI) for the kernels."""
    slopes_t = q if slopes is None else torch.as_tensor(slopes, dtype=torch.float32, device=q.device)
    cap_in, cap_out = (scale / softcap, softcap * _LOG2E) if softcap else (0.0, 0.0)
    return slopes_t, cap_in, cap_out, bool(softcap), slopes is not None


def _launch_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, direct: bool,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
    softcap: float = 0.0, sinks: Optional[Tensor] = None, slopes=None,
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
    slopes_t, cap_in, cap_out, has_cap, has_alibi = _variant_args(q, scale, softcap, slopes)
    kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, h // h_kv, c, n, n - c, scale * _LOG2E, q if sinks is None else sinks.contiguous(), slopes_t, cap_in, cap_out,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype), UPCAST=upcast,
        SOFTCAP=has_cap, HAS_SINK=sinks is not None, HAS_ALIBI=has_alibi, **cfg,
    )
    return out, lse


def _launch_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    dlse: Optional[Tensor], scale: float, causal: bool, direct: bool,
    block_m: Optional[int] = None, block_n: Optional[int] = None,
    softcap: float = 0.0, slopes=None, delta_out: Optional[list] = None,
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
    slopes_t, cap_in, cap_out, has_cap, has_alibi = _variant_args(q, scale, softcap, slopes)

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
        h, h_kv, group, c, n, n - c, scale, scale * _LOG2E, slopes_t, cap_in, cap_out,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=precision, UPCAST=upcast,
        SOFTCAP=has_cap, HAS_ALIBI=has_alibi, **cfg,
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
        h, group, c, n, n - c, scale, scale * _LOG2E, slopes_t, cap_in, cap_out,
        HEAD_DIM=d, BLOCK_D=block_d, CHECK_D=block_d != d, CAUSAL=causal, DOT_PRECISION=precision, UPCAST=upcast,
        SOFTCAP=has_cap, HAS_ALIBI=has_alibi, **cfg,
    )
    if delta_out is not None:
        delta_out.append(delta)
    return dq, dk, dv


def launch_variant_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float, sinks: Optional[Tensor],
                       slopes, direct: bool = False, block_m: Optional[int] = None,
                       block_n: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Causal chunk attention with soft-capping (0: none), [h] sinks and h ALiBi slopes
    (`chunk_attention/kernels/variants.py` states the math) in the Triton kernels: (out, lse), the
    lse including the sink."""
    return _launch_fwd(q, k, v, scale, True, direct, block_m, block_n, softcap=softcap, sinks=sinks, slopes=slopes)


def launch_variant_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                       softcap: float, sinks: Optional[Tensor], slopes, direct: bool = False,
                       block_m: Optional[int] = None, block_n: Optional[int] = None):
    """Gradients of `launch_variant_fwd`: (dq, dk, dv, dsinks or None). The sink is a key
    with value 0, so its logit's gradient is -sum_i P_sink,i * delta_i (delta = rowsum(dO * O))."""
    deltas = []
    dq, dk, dv = _launch_bwd(dout, q, k, v, out, lse, None, scale, True, direct, block_m, block_n,
                             softcap=softcap, slopes=slopes, delta_out=deltas)
    dsinks = None
    if sinks is not None:
        h = q.shape[1]
        p_sink = torch.exp(sinks.float().reshape(1, h, 1) - lse.float())
        dsinks = (-(p_sink * deltas[0])).sum((0, 2)).to(sinks.dtype) if deltas else torch.zeros_like(sinks)
    return dq, dk, dv, dsinks


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
