"""Positions from a cumulative sum over an all-ones tensor -> a position range.

OPT (and models written like it) compute their position ids from a mask:

    mask = ones(B, T)                                   (no attention_mask given)
    position_ids = (cumsum(mask, 1) * mask - 1).long()  then + 2 into a learned table

A `cumsum` along the sequence mixes positions (docs/architecture.md, "S3"): chunk i alone
would restart the sum at 0. But a cumulative sum of ones is a position range,

    cumsum(ones, d)[..., k, ...] = k + 1,

so this pass rewrites it to `arange(T) + 1` cast to the cumsum's dtype and broadcast to
its shape, which the chunk pass offsets by the chunk's start like any position source.

What is proven, from the graph, before the rewrite: the cumsum runs along a dim of size
exactly T, and its input is the constant 1 everywhere, for every T (the mask proof's
evaluator, `mask_proof.MaskEvaluator`, evaluates it: a factory of ones, casts, expands,
...; a user input or anything computed from data is not). Any other cumsum along the
sequence is left alone, so the sequence analysis refuses it by name (`passes/seqdim.py`),
unless it reads user inputs only (OPT's explicit `attention_mask`): then it is computed
once on the whole sequence in the prologue and sliced per chunk, exact for any mask, zeros
included.

The sum of ones is exact only while every partial sum k + 1 <= T is an integer the dtype
holds (float32: T <= 2**24); the rewrite records that limit (`mask_values.SeqLimit`) and
the runtime refuses longer sequences, since there eager's sum stops counting while the
range would not.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import describe_node
from sppo_fx.passes.masks.proof import MaskEvaluator
from sppo_fx.passes.masks.values import Band, Const, NotProvable, SeqLimit, exact_range, record_seq_limit

aten = torch.ops.aten


def _is_seq(size, seq) -> bool:
    return isinstance(size, torch.SymInt) and sympy.simplify(size.node.expr - seq) == 0


def ones_cumsum_reason(node: fx.Node, seq: sympy.Symbol, param_value) -> str | None:
    """None when `node` is `cumsum(x, d)` along the sequence with x == 1 everywhere, else
    why not (for messages and tests)."""
    if node.target is not aten.cumsum.default:
        return "it is not a cumsum"
    x = node.args[0]
    val = x.meta.get("val")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or not _is_seq(val.shape[dim % val.dim()], seq):
        return "it does not run along a dim of exactly the sequence length"
    try:
        value = MaskEvaluator(seq, param_value).value(x)
    except NotProvable as e:
        return f"its input is not a constant built from positions ({e})"
    if isinstance(value, Band) and not value.form and value.values.numel() == 1:
        fill = value.values.reshape(())
    elif isinstance(value, Const):
        fill = torch.as_tensor(value.value)
        if fill.numel() != 1:
            return "its input is not one constant"
        fill = fill.reshape(())
    else:
        return "its input varies along the tensor (it is not a tensor of ones)"
    if fill.item() != 1:
        return f"its input is the constant {fill.item()}, not 1"
    if exact_range(node.meta["val"].dtype) is None:
        return f"it sums in {node.meta['val'].dtype}, which does not hold positions"
    return None


def _size(g: fx.Graph, x: fx.Node, d: int):
    """Dim d of x's size as a graph argument: an int, or a sym_size node when symbolic."""
    s = x.meta["val"].shape[d]
    if not isinstance(s, torch.SymInt):
        return int(s)
    n = g.call_function(aten.sym_size.int, (x, d))
    n.meta["val"] = s
    return n


def _range_along(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """arange(T) + 1, in the cumsum's dtype, broadcast to its shape along its dim (a fresh
    contiguous tensor, as cumsum's output is)."""
    x, out = node.args[0], node.meta["val"]
    nd = out.dim()
    dim = node.args[1] % nd
    g = gm.graph
    with g.inserting_before(node):
        sizes = [_size(g, x, d) for d in range(nd)]
        rng = g.call_function(aten.arange.default, (sizes[dim],), {"dtype": torch.int64, "device": out.device})
        plus = g.call_function(aten.add.Tensor, (rng, 1))
        # int64 sums (an int64 mask's) need no cast, which the ALiBi proof would refuse (passes/alibi_values.py)
        cast = plus if out.dtype == torch.int64 else g.call_function(aten._to_copy.default, (plus,), {"dtype": out.dtype})
        viewed = g.call_function(aten.view.default, (cast, [s if d == dim else 1 for d, s in enumerate(sizes)]))
        full = g.call_function(aten.expand.default, (viewed, sizes))
        dense = g.call_function(aten.clone.default, (full,), {"memory_format": torch.contiguous_format})
    with out.fake_mode:
        T = out.shape[dim]
        r = torch.arange(T, dtype=torch.int64, device=out.device)
        vals = [r, r + 1, (r + 1).to(out.dtype)]
        vals.append(vals[-1].view([T if d == dim else 1 for d in range(nd)]))
        vals.append(vals[-1].expand(out.shape))
        vals.append(vals[-1].clone(memory_format=torch.contiguous_format))
    for n, v in zip((rng, plus, cast, viewed, full, dense), vals):
        n.meta["val"] = v
        n.meta["stack_trace"] = node.meta.get("stack_trace")
    return dense


def recognize_cumsum_positions(gm: fx.GraphModule, seq: sympy.Symbol, param_value) -> fx.GraphModule:
    """Rewrite every cumsum of ones along the sequence to a position range (module docstring).

    Args:
        gm: the captured graph; modified in place and returned.
        seq: the sympy symbol of the sequence length.
        param_value: the tensor of a parameter/buffer/constant placeholder, None for inputs.

    Returns:
        `gm`. Nothing else changes: a cumsum that is not proven a sum of ones is left for
        the sequence analysis to judge.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cumsum.default:
            continue
        if ones_cumsum_reason(node, seq, param_value) is not None:
            continue
        dtype = node.meta["val"].dtype
        top = exact_range(dtype)[1]
        if top < 2 ** 62:  # beyond it eager's running sum stops counting exactly
            record_seq_limit(gm, SeqLimit(int(top), dtype, describe_node(node), "the position ids' cumsum"))
        node.replace_all_uses_with(_range_along(gm, node))
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


__all__ = ["recognize_cumsum_positions", "ones_cumsum_reason"]
