"""Score variants of written-out attention, proven from the graph (used by
`passes/masks/explicit_attention.py`):

Soft-capping (Gemma 2's `attn_logit_softcapping`): between the scores S = scale * q @ k^T
and the mask, the chain is

    c2 * tanh(a * S)            (c2, a Python numbers; `S / c` is a = 1/c)

which is cap * tanh(scale' * q.k / cap) with cap = c2 and scale' = a * c2 * scale, for any
nonzero c2 and a: the chunk attention computes exactly that (`chunk_attention/kernels/variants.py`).
The tanh must sit below the mask: tanh(S + mask) caps the mask's -inf to -c2, so blocked
keys would get weight; that (and a tanh anywhere else in the chain) is refused.

Attention sinks (GPT-OSS's eager attention):

    X  = cat([S_masked, sink.reshape(1, h, 1, 1).expand(b, h, T, 1)], -1)   [b, h, T, T + 1]
    X' = X - X.max(-1, keepdim=True).values        (optional)
    P  = softmax(X', -1)[..., :T]                  (the sink column dropped)
    out = P @ v

softmax is invariant to subtracting any per-row constant, so X' gives the same P as X
(and the max, a [.., 1] row constant, gets gradient exactly 0); P_ij = exp(s_ij) /
(exp(sink_h) + sum_j exp(s_ij)): a per-head logit in the denominator only, what the chunk
attention's `sinks` computes. Proven: the sink column is one value per head (a [1, h, 1, 1]
tensor broadcast over batch and queries; a per-query or per-batch column is refused), it is
the last column, and it is sliced off before the values (an unsliced sink column, or a
slice that keeps it, is refused).
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node

aten = torch.ops.aten

_EXPANDS = {aten.expand.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default}


def _number(arg):
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None


def _scalar_operand(node: fx.Node):
    """(tensor operand, factor) of a mul/div of a node by a Python number, else None."""
    if node.op != "call_function" or node.target not in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                                                         aten.div.Scalar):
        return None
    a, b = node.args[0], node.args[1]
    c = _number(b)
    if c is None and node.target in (aten.mul.Tensor, aten.mul.Scalar) and _number(a) is not None:
        a, c = b, _number(a)
    if c is None or not isinstance(a, fx.Node) or c == 0:
        return None
    return a, (c if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / c)


@dataclasses.dataclass
class Softcap:
    cap: float    # c2
    inner: float  # a
    nodes: list   # the mul by c2, the tanh, the inner mul/div (top down)


def strip_softcap(node: fx.Node) -> tuple[fx.Node, Softcap | None]:
    """`c2 * tanh(a * x)` -> (x, Softcap); anything else -> (node, None)."""
    outer = _scalar_operand(node)
    if outer is None or outer[0].target is not aten.tanh.default:
        return node, None
    tanh = outer[0]
    inner, a, nodes = tanh.args[0], 1.0, [node, tanh]
    while (step := _scalar_operand(inner)) is not None:
        nodes.append(inner)
        inner, a = step[0], a * step[1]
    return inner, Softcap(outer[1], a, nodes)


def refuse_stray_tanh(node: fx.Node, where: str) -> None:
    raise SppoError(f"{describe_node(node)}: attention soft-capping {where}; sppo_fx proves soft-capping "
                    "only as cap * tanh(scores / cap) between the scaled scores and the mask (Gemma 2's "
                    "form): blocked keys must keep -inf")


@dataclasses.dataclass
class Sink:
    scores: fx.Node     # S_masked, [b, h, T, T]
    per_head: fx.Node   # the [1, h, 1, 1] sink values
    heads: int
    slice: fx.Node      # P[..., :T]
    nodes: list         # cat, max, getitem, sub (erased with the chain)


def _is(size, expr) -> bool:
    e = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
    return sympy.simplify(e - expr) == 0


def match_sink(softmax: fx.Node, seq) -> Sink | None:
    """The sink structure around `softmax` (module docstring), None if its input is no cat
    with a column of one, or SppoError for a near variant that is not a sink."""
    x = softmax.args[0]
    nodes = []
    if x.op == "call_function" and x.target is aten.sub.Tensor and isinstance(x.args[1], fx.Node):
        m = x.args[1]
        if m.target is operator.getitem and m.args[0].target in (aten.max.dim,) \
                and m.args[0].args[0] is x.args[0] or m.target is aten.amax.default and m.args[0] is x.args[0]:
            red = m.args[0] if m.target is not aten.amax.default else m
            dims = red.args[1] if len(red.args) > 1 else None
            keep = red.args[2] if len(red.args) > 2 else red.kwargs.get("keepdim", False)
            nd = x.meta["val"].dim()
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            if [d % nd for d in dims] != [nd - 1] or not keep:
                return None
            nodes += [x, m] + ([red] if red is not m else [])
            x = x.args[0]
    if not (x.op == "call_function" and x.target is aten.cat.default):
        return None
    parts, dim = x.args[0], x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    nd = x.meta["val"].dim()
    if dim % nd != nd - 1 or len(parts) != 2:
        return None
    scores, col = parts
    sv, cv = scores.meta["val"], col.meta["val"]
    if nd != 4 or not (_is(sv.shape[-1], seq) and _is(sv.shape[-2], seq)) or not _is(cv.shape[-1], 1):
        return None
    nodes.insert(0, x)
    heads = sv.shape[1]
    if isinstance(heads, torch.SymInt):
        return None
    # the column: a [1, h, 1, 1] tensor broadcast by expand (views in between keep one value per head)
    base = col
    while base.op == "call_function" and base.target in _EXPANDS:
        base = base.args[0]
    bv = base.meta["val"] if isinstance(base, fx.Node) and "val" in base.meta else None
    if bv is None or bv.dim() != 4 or list(bv.shape) != [1, heads, 1, 1]:
        raise SppoError(f"{describe_node(col)}: the extra softmax column {tuple(cv.shape)} concatenated to the "
                        "attention scores is not one sink logit per head broadcast over batch and queries "
                        f"(it comes from shape {tuple(bv.shape) if bv is not None else '?'}); sppo_fx proves "
                        "per-head attention sinks only (GPT-OSS's form)")
    # after the softmax: the sink column dropped
    users = list(softmax.users)
    sl = users[0] if len(users) == 1 else None
    ok = sl is not None and sl.target is aten.slice.Tensor and sl.args[1] % nd == nd - 1 \
        and (sl.args[2] if len(sl.args) > 2 else 0) in (0, None) and len(sl.args) > 3 \
        and (sl.args[3] == -1 or isinstance(sl.args[3], torch.SymInt) and _is(sl.args[3], seq)
             or isinstance(sl.args[3], fx.Node) and _is(sl.args[3].meta.get("val", -7), seq)) \
        and (len(sl.args) < 5 or sl.args[4] == 1)
    if not ok:
        raise SppoError(f"{describe_node(softmax)}: the attention probabilities include an extra (sink) column "
                        "that is not sliced off before the values ([..., :-1]); sppo_fx proves attention sinks "
                        "only in GPT-OSS's form (softmax over the scores and the sink, then the sink dropped)")
    for n in nodes:  # the cat and the max only feed this chain
        if any(u not in nodes and u is not softmax for u in n.users):
            return None
    return Sink(scores, base, int(heads), sl, nodes)
