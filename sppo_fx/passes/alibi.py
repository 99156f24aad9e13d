"""ALiBi proven from written-out attention (used by `passes/masks/explicit_attention.py`).

A bias B added to the scores below the mask, in one of two forms:

    scores = S * scale + B                                      (MPT: B = slopes * (j + 1 - T))
    scores = baddbmm(B3, q3, k3^T, beta, alpha).view(b, h, T, T)  (Bloom: B3 = slopes * j,
             q3 = q.reshape(b*h, T, d), ..., and probs.view(b*h, T, T).bmm(v3).view(b, h, T, d))

is ALiBi when, for every batch row b, head h, query i and key j,

    B[b, h, i, j] = slope_h * j + r(b, h, i)

with slope_h the same for every batch row and query: r is constant along each softmax row,
and softmax is invariant to adding a per-row constant, so the attention equals the chunk
attention's `alibi=` (score + slope_h * (j - i)) exactly. The proof evaluates B's subgraph
in `passes/alibi_values.py`'s affine form (exact in j, i and T, the slopes read from the
graph's constants and buffers): B must have no term in j other than C_j * j, and C_j must not
vary over batch or query. Refused with the reason: a bias read from an input (an attention
mask through cumsum) or a learned parameter, one quadratic in positions, a slope that varies
per query or per batch row, a [T, T] table sliced from a buffer, a bias rounded to a
narrower dtype than float32, non-finite values.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.alibi_values import Aff, Evaluator, NotAffine, _align, linear, reshape_to

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}


def has_ancestor(node: fx.Node, targets, limit: int = 12) -> bool:
    """Whether a call to one of `targets` lies within `limit` steps above `node` (which side
    of an add is the scores: the one a product of q and k feeds)."""
    seen, stack = set(), [(node, 0)]
    while stack:
        n, depth = stack.pop()
        if n in seen or depth > limit:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in targets:
            return True
        stack.extend((a, depth + 1) for a in n.all_input_nodes)
    return False


@dataclasses.dataclass
class Bias:
    node: fx.Node        # B (or Bloom's B3)
    beta: float          # B enters as beta * B
    via: list            # shapes B is broadcast/viewed through: ("expand", shape) / ("view", shape)
    nodes: list          # chain nodes (erased with it)


def strip_bias(s: fx.Node) -> tuple[fx.Node, Bias | None]:
    """`scores + B` (B without a matmul above it) -> (scores, Bias); else (s, None)."""
    if not (s.op == "call_function" and s.target is aten.add.Tensor and s.kwargs.get("alpha", 1) == 1):
        return s, None
    a, b = s.args[0], s.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return s, None
    pa, pb = has_ancestor(a, _PRODUCTS), has_ancestor(b, _PRODUCTS)
    if pa == pb:
        return s, None
    scores, bias = (a, b) if pa else (b, a)
    return scores, Bias(bias, 1.0, [("expand", list(s.meta["val"].shape))], [s])


@dataclasses.dataclass
class Baddbmm:
    q: fx.Node
    k: fx.Node
    alpha: float
    bias: Bias
    nodes: list


def _unflatten(node, b_h) -> fx.Node | None:
    """q4 of `q4.reshape(b*h, T, d)` when q4 is [b, h, T, d]."""
    if not (node.op == "call_function" and node.target in _VIEWS):
        return None
    src = node.args[0]
    sv, nv = src.meta["val"], node.meta["val"]
    if sv.dim() != 4 or nv.dim() != 3 or list(sv.shape[:2]) != list(b_h) or sv.shape[2:] != nv.shape[1:]:
        return None
    return src


def match_baddbmm(s: fx.Node) -> Baddbmm | None:
    """Bloom's `baddbmm(B3, q3, k3^T, beta, alpha).view(b, h, T, T)`, else None."""
    if not (s.op == "call_function" and s.target in _VIEWS and s.args[0].op == "call_function"
            and s.args[0].target is aten.baddbmm.default and s.meta["val"].dim() == 4):
        return None
    bmm = s.args[0]
    b_h = list(s.meta["val"].shape[:2])
    bias, q3, kt3 = bmm.args[:3]
    beta, alpha = bmm.kwargs.get("beta", 1), bmm.kwargs.get("alpha", 1)
    if not (isinstance(bias, fx.Node) and isinstance(beta, (int, float)) and isinstance(alpha, (int, float))):
        return None
    if not (kt3.op == "call_function" and kt3.target is aten.transpose.int
            and sorted(d % 3 for d in kt3.args[1:3]) == [1, 2]):
        return None
    q, k = _unflatten(q3, b_h), _unflatten(kt3.args[0], b_h)
    if q is None or k is None or len(bmm.users) != 1:
        return None
    via = [("expand", list(bmm.meta["val"].shape)), ("view", list(s.meta["val"].shape))]
    return Baddbmm(q, k, float(alpha), Bias(bias, float(beta), via, [bmm, s]), [q3, kt3, bmm, s])


@dataclasses.dataclass
class BmmOut:
    out: fx.Node
    v: fx.Node
    nodes: list


def match_bmm_out(u: fx.Node, probs: fx.Node) -> BmmOut | None:
    """Bloom's `probs.view(b*h, T, T).bmm(v3).view(b, h, T, d)` starting at the view u."""
    pv = probs.meta["val"]
    if not (u.target in _VIEWS and u.args[0] is probs and pv.dim() == 4 and len(u.users) == 1):
        return None
    bmm = next(iter(u.users))
    if not (bmm.target is aten.bmm.default and bmm.args[0] is u and len(bmm.users) == 1):
        return None
    v = _unflatten(bmm.args[1], pv.shape[:2])
    out = next(iter(bmm.users))
    if v is None or out.target not in _VIEWS or list(out.meta["val"].shape) != list(v.meta["val"].shape):
        return None
    return BmmOut(out, v, [u, bmm, out])


def _follow(v: Aff, via, node) -> Aff:
    for how, shape in via:
        if how == "expand":
            v = _align(v, len(shape))
            v = Aff([s if isinstance(s, int) else s for s in _sizes(shape)], v.K, v.KT, v.C)
        else:
            v = reshape_to(v, _sizes(shape), node)
    return v


def _sizes(shape):
    from sppo_fx.passes.alibi_values import _size
    return [_size(s) for s in shape]


def prove_alibi(bias: Bias, seq, param_value, softmax: fx.Node) -> list[float] | None:
    """The per-head slopes of a proven ALiBi bias (None: the bias is constant along each row
    and softmax cancels it), or SppoError naming why the bias is not ALiBi."""
    def refuse(why):
        raise SppoError(f"{describe_node(bias.node)}: the bias added to the attention scores of "
                        f"{describe_node(softmax)} is not proven to be ALiBi (slope_h * key position plus a "
                        f"per-row constant): {why}. sppo_fx chunks attention with an ALiBi bias only")
    try:
        v = Evaluator(seq, param_value)(bias.node)
        v = linear(v, v, bias.beta, 0.0)
        v = _follow(v, bias.via, bias.node)
    except NotAffine as e:
        refuse(str(e))
    if len(v.shape) != 4 or any(isinstance(s, int) for s in v.shape[2:]):
        refuse(f"it has shape {v.shape}, not [batch, heads, T, T]")
    parts = [v.K, v.KT] + list(v.C.values())
    if not all(bool(torch.isfinite(t).all()) for t in parts):
        refuse("it has non-finite values")
    if any(t.shape[2] != 1 or t.shape[3] != 1 for t in parts):  # defensive: the form keeps them 1
        refuse("it varies along the sequence other than linearly")
    heads = v.shape[1]
    c = v.C.get(3)
    if c is None or not bool(c.ne(0).any()):
        return None
    c = c.expand(v.shape[0], heads, 1, 1)
    if not bool((c == c[:1]).all()):
        refuse("its slope differs between batch rows")
    return [float(x) for x in c[0, :, 0, 0]]
