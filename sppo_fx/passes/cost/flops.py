"""Per-node FLOP and byte rules of the cost model (matmuls, attention, reductions,
elementwise and data movement)."""
from __future__ import annotations

from typing import Callable, Iterable

import sympy
import torch
import torch.fx as fx

from sppo_fx.passes.aliasing import is_view_op as _is_view_op
from sppo_fx.passes.aliasing import storage_key as _storage_key
from sppo_fx.passes.cost.data import NodeCost, b

aten = torch.ops.aten


# FLOPs per input element for ops that are more than one pass over their input.
_PER_ELEMENT = {
    "layer_norm": 5, "native_layer_norm": 5, "group_norm": 5, "native_group_norm": 5,
    "batch_norm": 5, "native_batch_norm": 5, "instance_norm": 5,
    "rms_norm": 4, "_fused_rms_norm": 4,
    "softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5, "cross_entropy_loss": 5,
    "nll_loss": 1, "nll_loss_forward": 1,
}
_MATMUL = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "outer", "addbmm", "dot", "mv"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean",
               "norm", "linalg_vector_norm", "logsumexp", "prod", "any", "all", "argmax", "argmin",
               "count_nonzero"}
_MOVEMENT = {"cat", "stack", "clone", "contiguous", "_to_copy", "to", "copy", "copy_", "index",
             "index_select", "gather", "embedding", "repeat", "constant_pad_nd", "pad", "flip",
             "roll", "select_scatter", "slice_scatter", "index_put", "scatter", "lift_fresh_copy",
             "arange", "ones", "zeros", "full", "empty", "scalar_tensor", "zeros_like",
             "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_empty",
             "new_full", "empty_strided", "rand", "randn", "rand_like", "randn_like",
             "repeat_interleave", "expand_copy", "tensor", "_unsafe_view", "clone_"}
_ATTENTION_FUNCS = {"chunk_causal_attention", "chunk_attention", "reference_chunk_attention",
                    "chunk_attention_with_lse", "prefix_causal_attention"}


class _Concat:
    """Stands for cat([prefix, chunk], -2) where only the shape is needed."""

    def __init__(self, prefix, chunk):
        ps, cs = shape_exprs(prefix), shape_exprs(chunk)
        self.shape = (*cs[:-2], ps[-2] + cs[-2], cs[-1])


# ----------------------------------------------------------------------- node costs


def _op_name(target) -> str:
    """Short op name: 'linear' for aten.linear.default, the function name otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _target_str(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _expr(x) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return sympy.sympify(x.node.expr)
    if isinstance(x, sympy.Basic):
        return x
    return sympy.Integer(int(x))


def shape_exprs(t: torch.Tensor) -> tuple:
    """The shape of a (fake) tensor as sympy expressions."""
    return tuple(_expr(s) for s in t.shape)


def _numel(t: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*shape_exprs(t)) if t.dim() else sympy.Integer(1)


def _nbytes(t: torch.Tensor) -> sympy.Expr:
    return _numel(t) * t.element_size()


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _attention_kind(node: fx.Node) -> str | None:
    """"lower_right" | "upper_left" | "full" for attention calls, None otherwise."""
    name = _op_name(node.target)
    if name in _ATTENTION_FUNCS:
        return "lower_right" if node.kwargs.get("causal", True) else "full"
    if name == "chunk_attention_fwd":
        causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("causal", True)
        return "lower_right" if causal else "full"
    if name.startswith("scaled_dot_product") or name.startswith("_scaled_dot_product"):
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else \
            ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
        args = dict(zip(names, node.args))
        args.update(node.kwargs)
        if args.get("attn_mask") is not None:
            return "full"
        return "upper_left" if args.get("is_causal", False) else "full"
    return None


def attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "lower_right") -> sympy.Expr:
    """Forward FLOPs of attention: 2·(b·h)·Lq·(d + d_v)·visible keys per query.

    Args:
        q: [..., Lq, d] queries (leading dims: batch and heads).
        k, v: [..., Lk, d] / [..., Lk, d_v] keys and values.
        kind: "lower_right" (query i sees Lk - Lq + i + 1 keys: chunk attention over a
            prefix), "upper_left" (query i sees i + 1 keys) or "full".

    Returns:
        A sympy expression; for chunk attention with d_v = d: 4·b·h·d·c·(p + (c + 1)/2).
    """
    qs, ks, vs = shape_exprs(q), shape_exprs(k), shape_exprs(v)
    lq, d, lk, dv = qs[-2], qs[-1], ks[-2], vs[-1]
    heads = sympy.Mul(*qs[:-2])
    if kind == "lower_right":
        visible = (lk - lq) + (lq + 1) / sympy.Integer(2)
    elif kind == "upper_left":
        visible = (lq + 1) / sympy.Integer(2)
    else:
        visible = lk
    return sympy.expand(2 * heads * lq * (d + dv) * visible)


def _batch_scaled(tensors: Iterable[torch.Tensor], sizes: set, batch: int) -> bool:
    """Whether a node's cost scales with the batch (see the module docstring)."""
    for t in tensors:
        shape = shape_exprs(t)
        if not shape or not any(e.free_symbols & sizes for e in shape):
            continue
        if batch == 1:
            return True
        lead = shape[0]
        if lead == batch:
            return True
        coeff, rest = lead.as_coeff_Mul()
        if rest.free_symbols & sizes and coeff.is_Integer and int(coeff) % batch == 0:
            return True
    return False


def node_cost(node: fx.Node, value_of: Callable[[fx.Node], object] | None = None, *,
              requires_grad: Callable[[fx.Node], bool] | None = None,
              batch: int | None = None, sizes: Iterable[sympy.Symbol] = ()) -> NodeCost:
    """FLOPs and bytes of one FX node.

    Args:
        node: a node of a chunk (or captured) program.
        value_of: node -> its (fake) value; default `node.meta.get("val")`. Expressions come
            out in the symbols of these values (`chunk_cost` passes values in c and p; the
            captured graph's meta values are in the sequence symbol).
        requires_grad: node -> whether its value is differentiated (default: every floating
            tensor is).
        batch: the traced batch B; when given, batch-proportional nodes are scaled by b / B.
        sizes: the symbols that mean "depends on the sequence" for the batch rule.

    Returns:
        A `NodeCost` (kind "size" with zero costs for non-tensor nodes; an unknown op
        producing a tensor is costed as pointwise).
    """
    value_of = value_of or (lambda n: n.meta.get("val"))
    zero = sympy.Integer(0)
    name, target = node.name, _target_str(node.target)
    out = value_of(node) if node.op == "call_function" else None
    outs = _tensors(out)
    if node.op != "call_function" or not outs:
        return NodeCost(name, target, "size", zero, zero, zero)
    in_nodes = node.all_input_nodes
    in_vals = {n: value_of(n) for n in in_nodes}
    ins = [t for n in in_nodes for t in _tensors(in_vals[n])]

    def grad(n):
        if requires_grad is not None:
            return requires_grad(n)
        return any(t.is_floating_point() for t in _tensors(in_vals.get(n)))

    def arg_val(i):
        a = node.args[i] if i < len(node.args) else None
        return in_vals.get(a) if isinstance(a, fx.Node) else None

    in_storages = {_storage_key(t) for t in ins}
    fresh = [t for t in outs if _storage_key(t) not in in_storages or _storage_key(t) is None]
    bytes_written = sympy.Add(*[_nbytes(t) for t in fresh]) if fresh else zero
    differentiated = any(t.is_floating_point() for t in outs) and any(grad(n) for n in in_nodes)
    op = _op_name(node.target)
    attn = _attention_kind(node)

    if not fresh and _is_view_op(node.target):
        kind, fwd, bwd = "view", zero, zero
    elif attn is not None:
        kind = "attention"
        if op == "prefix_causal_attention":  # (q, k_prefix, k, v_prefix, v): keys = prefix + chunk
            k_all, v_all = _Concat(arg_val(1), arg_val(2)), _Concat(arg_val(3), arg_val(4))
            fwd = attention_flops(arg_val(0), k_all, v_all, attn)
        else:
            fwd = attention_flops(arg_val(0), arg_val(1), arg_val(2), attn)
        bwd = sympy.Rational(5, 2) * fwd if differentiated else zero
    elif op in _MATMUL:
        kind = "matmul"
        first = 1 if op in ("addmm", "baddbmm", "addbmm") else 0
        a = arg_val(first)
        k = _expr(a.shape[-1]) if a is not None and a.dim() else sympy.Integer(1)
        if op == "outer":
            k = sympy.Integer(1)
        mnk = 2 * _numel(outs[0]) * k
        has_bias = (op == "linear" and len(node.args) > 2 and node.args[2] is not None) or first == 1
        fwd = mnk + (_numel(outs[0]) if has_bias else zero)
        operands = [node.args[i] for i in (first, first + 1) if i < len(node.args)]
        n_grad = sum(1 for x in operands if isinstance(x, fx.Node) and grad(x))
        bwd = mnk * n_grad if differentiated else zero
    elif op in _PER_ELEMENT:
        kind = "norm"
        src = arg_val(0)
        fwd = _PER_ELEMENT[op] * _numel(src if src is not None else outs[0])
        bwd = 2 * fwd if differentiated else zero
    elif op in _MOVEMENT or _is_view_op(node.target):
        kind = "movement"
        fwd = zero
        if op == "embedding":
            weight = node.args[0]
            bwd = _numel(outs[0]) if isinstance(weight, fx.Node) and grad(weight) else zero
        elif op in ("index", "index_select", "gather") and differentiated:
            bwd = _numel(outs[0])
        else:
            bwd = zero
    elif op in _REDUCTIONS:
        kind = "reduction"
        src = arg_val(0)
        fwd = _numel(src if src is not None else outs[0])
        bwd = 2 * fwd if differentiated else zero
    else:
        kind = "pointwise"
        fwd = sympy.Add(*[_numel(t) for t in outs])
        bwd = 2 * fwd if differentiated else zero

    moved = elementwise_bytes(node, value_of)
    if batch is not None:
        scale = b / sympy.Integer(batch)
        if _batch_scaled(ins + outs, set(sizes), batch):
            fwd, bwd, moved = fwd * scale, bwd * scale, moved * scale
        if _batch_scaled(fresh, set(sizes), batch):
            bytes_written = bytes_written * scale
    return NodeCost(name, target, kind, sympy.expand(fwd), sympy.expand(bwd), sympy.expand(bytes_written),
                    sympy.expand(moved))


# ------------------------------------------------------------------ element-wise bytes

# Ops that only make a tensor (no input read): their writes are small tables (positions).
_FACTORIES = {"arange", "ones", "zeros", "full", "empty", "scalar_tensor", "zeros_like", "ones_like",
              "full_like", "empty_like", "new_zeros", "new_ones", "new_empty", "new_full", "empty_strided",
              "rand", "randn", "rand_like", "randn_like", "tensor", "lift_fresh_copy"}


def elementwise_bytes(node: fx.Node, value_of: Callable[[fx.Node], object] | None = None) -> sympy.Expr:
    """Bytes a memory-bound node reads and writes in its forward: every tensor input and
    every output, whole (pointwise ops, norms, reductions, copies, `cat`, gathers).
    Matmuls, attention, views and factories count 0: their time is FLOPs or pairs (the
    clock's other terms), or nothing. Shapes are the values' (sympy in their symbols)."""
    value_of = value_of or (lambda n: n.meta.get("val"))
    zero = sympy.Integer(0)
    if node.op != "call_function":
        return zero
    op = _op_name(node.target)
    if op in _MATMUL or op in _FACTORIES or _attention_kind(node) is not None:
        return zero
    outs = _tensors(value_of(node))
    if not outs:
        return zero
    ins = [t for n in node.all_input_nodes for t in _tensors(value_of(n))]
    in_storages = {_storage_key(t) for t in ins}
    fresh = [t for t in outs if _storage_key(t) not in in_storages or _storage_key(t) is None]
    if not fresh and _is_view_op(node.target):  # a view: no pass over memory of its own
        return zero
    # an in-place op (copy_, add_) writes its output over an input: counted as written too
    return sympy.Add(*[_nbytes(t) for t in ins + outs])
