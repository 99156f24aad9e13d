"""K/V skeleton ops: a chunk program whose K/V prefix lives in the runtime, not in its
inputs (`sppo_fx.passes.skeleton.stream_kv_skeleton` puts them into the graph).

Level 1 of SPPO's activation management is the K/V "skeleton": every later chunk reads
chunk j's K and V in forward and backward, and adds to their gradients. Passed as graph
inputs, the whole prefix of every attention site would be on the device for a chunk's
whole forward and backward. With these ops the chunk graph holds none of it: the
attention op streams the prefix in, one earlier chunk (one block) at a time, from the
runtime's `KVSkeleton` (device, host or disk), and merges the partial results by
log-sum-exp.

    forward (site s)                                  backward
      k, v = ...                                        dq, dk, dv = sppo.prefix_attention_bwd(
      out, lse = sppo.prefix_attention(                        dout, q, k, v, out, lse, hk, hv, s, scale)
            q, k, v, hk, hv, s, scale)                    #  for every block j < i, streamed in:
      #  own causal part + every block j < i,          #  dK_j, dV_j -> the skeleton's gradient
      #  each streamed in and merged by lse             #  accumulators (side effect)
      hk_out = sppo.kv_out(k, 2s)  # k -> skeleton     dk += sppo.kv_grad(d hk_out, 2s)
      hv_out = sppo.kv_out(v, 2s+1)                      #  dK_i, dV_i summed over later chunks
      return ..., hk_out, hv_out   # empty handles

A sliding-window site (`window=W`) streams only the blocks that reach into the chunk's
window, each holding the rows later windows read, and a packed-document site (`doc_pos`)
only those of the documents the chunk sees (`sppo_fx.ops.skeleton_window`).

`hk`, `hv` (the prefix placeholders) and `hk_out`, `hv_out` are *empty handles* of
shape (*x.shape, 0): they carry shapes (the prefix length p) and autograd edges, never
data. The runtime state is the active `ChunkMemory` (`sppo_fx.ops.offload.active_memory`),
which knows the chunk index and the micro-batch's skeleton.
"""
from __future__ import annotations

from typing import Optional

import torch

from sppo_fx.errors import SppoError
from sppo_fx.ops.offload import _handle_like, _memory
from sppo_fx.ops.skeleton_window import acc_dtype as _acc_dtype
from sppo_fx.ops.skeleton_window import merge as _merge
from sppo_fx.ops.skeleton_window import windowed_backward, windowed_forward


def bshd_empty_like(q, dtype=None):
    # imported when called: the chunk-attention module loads Triton (see ops/__init__.py)
    from sppo_fx.chunk_attention.op import bshd_empty_like as empty_like
    return empty_like(q, dtype)


@torch.library.custom_op("sppo::prefix_attention", mutates_args=())
def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                     v_prefix: torch.Tensor, site: int, scale: float, window: Optional[int] = None,
                     doc_pos: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the chunk's queries over the skeleton's blocks of site `site`
    (every earlier chunk, streamed in one at a time; with a sliding `window`, only those
    that reach into it; inside packed documents, `doc_pos`, those of the documents it sees)
    and the chunk's own k, v."""
    blocks = _memory("prefix_attention").kv_blocks(site)
    if window is not None or doc_pos is not None:
        out, lse = windowed_forward(q, k, v, k_prefix.shape[2], blocks, scale, window, doc_pos)
        return _into(bshd_empty_like(q), out), lse.contiguous()
    fwd, _ = _block_kernels(q, k)
    out, lse = fwd(q, k, v, scale, True)
    if blocks:
        acc = out.to(_acc_dtype(q.dtype))
        for k_j, v_j in blocks:
            o_j, lse_j = fwd(q, k_j, v_j, scale, False)
            acc, lse = _merge(acc, lse, o_j, lse_j)
            del k_j, v_j, o_j  # before the stream reads the block after next
        out = acc
    return _into(bshd_empty_like(q), out), lse.contiguous()


def _block_kernels(q: torch.Tensor, k: torch.Tensor):
    """(fwd(q, k, v, scale, causal) -> (out, lse), bwd(dout, q, k, v, out, lse, scale, causal)
    -> (dq, dk, dv)) for the chunk's own part and each streamed block.

    On a CPU, ATen's flash kernels, which the chunk attention op runs there, called
    directly: the op's dispatch (a `triton_op` inside this custom op) and its no-op
    `.contiguous()` / `.to()` calls cost more than the kernels' arithmetic on a short
    block (bench/streamed_block.py). Each part is one key range the kernel takes whole (a
    block unmasked, the chunk's own keys causal), so the values are the op's; only the
    layouts differ, which the merge and the gradient sums do not see. `dout` must be
    contiguous. Elsewhere, the op."""
    from sppo_fx.chunk_attention.kernels.common import _check_inputs
    from sppo_fx.chunk_attention.kernels.cpu import _cpu_flash_ok
    from sppo_fx.chunk_attention.op import _use_triton
    if _cpu_flash_ok(q) and not _use_triton(q):
        _check_inputs(q, k, k, True)
        return _cpu_block_fwd, _cpu_block_bwd
    ops = torch.ops.sppo_fx

    def bwd(dout, q, k, v, out, lse, scale, causal):
        return ops.chunk_attention_bwd(dout, q, k, v, out, lse, None, scale, causal)
    return ops.chunk_attention_fwd, bwd


def _cpu_block_fwd(q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_block_bwd(dout, q, k, v, out, lse, scale, causal):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk if dk.dtype == k.dtype else dk.to(k.dtype), dv if dv.dtype == v.dtype else dv.to(v.dtype)


def _into(empty: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x with `empty`'s dtype and strides (the layout the fake implementation promised):
    x itself when they already agree, else `empty` filled with x."""
    if x.dtype == empty.dtype and x.stride() == empty.stride():
        return x
    return empty.copy_(x)


@prefix_attention.register_fake
def _(q, k, v, k_prefix, v_prefix, site, scale, window=None, doc_pos=None):
    # SDPA's output layout ([b, c, h, d] memory): the captured graph's views after attention
    return bshd_empty_like(q), q.new_empty(q.shape[:-1], dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("sppo::prefix_attention_bwd", mutates_args=())
def prefix_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                         site: int, scale: float, window: Optional[int] = None,
                         doc_pos: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `prefix_attention` for q and the chunk's own k, v; the blocks'
    gradients go to the skeleton's accumulators.

    With the merged `out` and `lse`, each key block's part of the flash-attention backward
    is exact on its own (P = exp(s - lse), delta = rowsum(dout * out)), so the blocks are
    streamed in again one at a time."""
    memory = _memory("prefix_attention_bwd")
    blocks = memory.kv_blocks(site)
    if window is not None or doc_pos is not None:
        dq, dk, dv = windowed_backward(dout, q, k, v, out, lse, k_prefix.shape[2], blocks, memory, site, scale,
                                        window, doc_pos)
        return _into(torch.empty_like(q), dq), _into(torch.empty_like(k), dk), _into(torch.empty_like(v), dv)
    _, bwd = _block_kernels(q, k)
    dout = dout.contiguous()  # the kernels read rows of d contiguous elements
    dq, dk, dv = bwd(dout, q, k, v, out, lse, scale, True)
    if blocks:
        dq = dq.to(_acc_dtype(q.dtype))
        for j, (k_j, v_j) in enumerate(blocks):
            dq_j, dk_j, dv_j = bwd(dout, q, k_j, v_j, out, lse, scale, False)
            dq += dq_j
            memory.kv_add_grad(site, j, dk_j, dv_j)
            del k_j, v_j, dq_j, dk_j, dv_j  # before the stream reads the block after next
    return _into(torch.empty_like(q), dq), _into(torch.empty_like(k), dk), _into(torch.empty_like(v), dv)


@prefix_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, k_prefix, v_prefix, site, scale, window=None, doc_pos=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, k_prefix, v_prefix, site, scale, *rest = inputs
    window, doc_pos = (list(rest) + [None, None])[:2]
    ctx.save_for_backward(q, k, v, output[0], output[1], k_prefix, v_prefix, doc_pos)
    ctx.site, ctx.scale, ctx.window = site, scale, window


def _attention_backward(ctx, dout, dlse):
    # `streamed_prefix_attention` returns only `out`: lse never gets a gradient
    q, k, v, out, lse, k_prefix, v_prefix, doc_pos = ctx.saved_tensors
    dq, dk, dv = prefix_attention_bwd(dout, q, k, v, out, lse, k_prefix, v_prefix, ctx.site, ctx.scale, ctx.window,
                                      doc_pos)
    return dq, dk, dv, torch.zeros_like(k_prefix), torch.zeros_like(v_prefix), None, None, None, None


torch.library.register_autograd("sppo::prefix_attention", _attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("sppo::kv_out", mutates_args=())
def kv_out(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Hand the chunk's own K (slot 2s) or V (2s + 1) of site s to the skeleton; returns
    an empty handle that stands for it among the chunk's outputs."""
    _memory("kv_out").kv_out(x, slot)
    return _handle_like(x)


@kv_out.register_fake
def _(x, slot):
    return _handle_like(x)


@torch.library.custom_op("sppo::kv_grad", mutates_args=())
def kv_grad(handle: torch.Tensor, slot: int) -> torch.Tensor:
    """The gradient of the chunk's own K or V summed over every later chunk (zeros when no
    later chunk read it)."""
    shape = handle.shape[:-1]
    g = _memory("kv_grad").kv_grad(slot)
    if g is None:
        return handle.new_zeros(shape)
    if tuple(g.shape) != tuple(shape):
        raise SppoError(f"sppo.kv_grad slot {slot}: the skeleton holds a gradient of shape {tuple(g.shape)}, "
                        f"the graph expects {tuple(shape)}")
    return g.to(handle.dtype).contiguous()


@kv_grad.register_fake
def _(handle, slot):
    return handle.new_empty(handle.shape[:-1])


def _kv_out_setup(ctx, inputs, output):
    ctx.slot = inputs[1]


def _kv_out_backward(ctx, grad_handle):
    return kv_grad(grad_handle, ctx.slot), None


torch.library.register_autograd("sppo::kv_out", _kv_out_backward, setup_context=_kv_out_setup)


def streamed_prefix_attention(q, k_prefix, k, v_prefix, v, site: int, scale=None, enable_gqa=False, window=None,
                              doc_pos=None):
    """`sppo_fx.chunk_attention.functions.prefix_causal_attention` with the prefix in the skeleton:
    `k_prefix`, `v_prefix` are empty handles (shape [b, h_kv, p, d, 0]).

    Args:
        q: [b, h, c, d]; k, v: [b, h_kv, c, d] the chunk's own keys/values.
        k_prefix, v_prefix: handles of the prefix (never read).
        site: the attention site (index into the program's `attention`).
        scale: softmax scale (default 1/sqrt(d)).
        enable_gqa: accepted for signature parity (grouped heads are always allowed).
        window: sliding window W (each query sees its W most recent keys), or None.
        doc_pos: [b or 1, c] each query's position inside its packed document, or None.

    Returns:
        [b, h, c, d] attention output.
    """
    from sppo_fx.chunk_attention.op import _default_scale
    return prefix_attention(q, k, v, k_prefix, v_prefix, site, _default_scale(q, scale), window, doc_pos)[0]
