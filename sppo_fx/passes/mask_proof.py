"""Proving what an attention mask built from positions is, for every sequence length.

A mask subgraph (arange, unsqueeze, comparisons, and/or, where, ...) is interpreted
symbolically: every tensor becomes a formula over the indices of its dimensions, with
the sequence length T a free symbol. The mask's last two dims are the query row i and
the key column j; the mask is accepted only if its "may attend" predicate reduces to a
conjunction of constraints on d = i - j alone, which gives an integer interval

    lo <= i - j <= hi        for every i, j < T and every T

Causal attention is lo = 0, hi = inf; a sliding window of W tokens (Mistral, Gemma,
Qwen2: `kv_idx > q_idx - W`) is lo = 0, hi = W - 1. Anything else -- another interval,
a disjunction, a constraint on i or j alone, an op this interpreter does not know, a
dependence on T or on a broadcast dim -- is *unproven* and the caller refuses the model.
Evaluating the mask at a few lengths would not do: a window wider than every probe
length looks causal at all of them (docs/architecture.md, "Semantics").
"""
from __future__ import annotations

import dataclasses
import math
import operator

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

# Values at or below this in an additive mask block a key (HF uses finfo.min or -inf).
BLOCKED = -1e4


class Unproven(Exception):
    """The mask could not be reduced to a causal or sliding-window mask; says why."""


@dataclasses.dataclass(frozen=True)
class MaskKind:
    """A proven mask: key j visible from query i iff 0 <= i - j < window (None: no bound).

    `window` counts the visible tokens, the query's own included (HF's `sliding_window`)."""

    window: int | None

    def __str__(self) -> str:
        return "causal" if self.window is None else f"causal, sliding window of {self.window} tokens"


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A symbolic tensor: `value` at index (r_{n-1}, ..., r_1, r_0) (r_k: k-th dim from
    the right), a sympy integer expression, a sympy Boolean, or ("where", pred, a, b) with
    a, b numbers (an additive mask). `shape`: sizes as sympy expressions."""

    value: object
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _is_pred(value) -> bool:
    """A boolean formula (sympy Symbols are Booleans too, so check the formula kinds)."""
    return isinstance(value, (sympy.logic.boolalg.BooleanAtom, sympy.Rel, sympy.And, sympy.Or, sympy.Not))


def _dim_symbol(k: int) -> sympy.Symbol:
    return sympy.Symbol(f"r{k}", integer=True, nonnegative=True)


def _size(s) -> sympy.Expr:
    if isinstance(s, torch.SymInt):
        return s.node.expr
    if isinstance(s, fx.Node):
        return _size(s.meta["val"])
    return sympy.Integer(int(s))


def _scalar(arg):
    """A number or size argument as a sympy number/expression, or None if it is a tensor."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(val, bool):
            return _size(val) if isinstance(val, (torch.SymInt, int)) else sympy.Float(float(val))
        return None
    if isinstance(arg, bool):
        return sympy.true if arg else sympy.false
    if isinstance(arg, int):
        return sympy.Integer(arg)
    if isinstance(arg, float):
        return sympy.Float(arg) if math.isfinite(arg) else (sympy.oo if arg > 0 else -sympy.oo)
    return None


def _broadcast(a: tuple, b: tuple) -> tuple:
    out = []
    for k in range(max(len(a), len(b))):
        x = a[len(a) - 1 - k] if k < len(a) else sympy.Integer(1)
        y = b[len(b) - 1 - k] if k < len(b) else sympy.Integer(1)
        if x == 1:
            out.append(y)
        elif y == 1 or sympy.simplify(x - y) == 0:
            out.append(x)
        else:
            raise Unproven(f"cannot broadcast sizes {x} and {y}")
    return tuple(reversed(out))


def _shift_dims(value, ndim: int, pos: int):
    """Re-index a value after inserting a size-1 dim at `pos` (left-counted, in the new
    ndim+1 dims): dims left of it move one further from the right."""
    right = ndim - pos  # dims with right-index < right keep theirs
    subs = {_dim_symbol(k): _dim_symbol(k + 1) for k in range(right, ndim)}
    return _map_value(value, lambda e: e.xreplace(subs))


def _map_value(value, fn):
    if isinstance(value, tuple):
        return ("where", fn(value[1]), value[2], value[3])
    return fn(value) if isinstance(value, sympy.Basic) else value


_COMPARE = {
    aten.le: sympy.Le, aten.lt: sympy.Lt, aten.ge: sympy.Ge, aten.gt: sympy.Gt,
    aten.eq: sympy.Eq, aten.ne: sympy.Ne,
}
_ARITH = {aten.add: operator.add, aten.sub: operator.sub, aten.mul: operator.mul}
_IDENTITY = {aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default,
             aten.lift_fresh_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
             aten._to_copy.default}
_CONSTANTS = {aten.new_ones.default: 1, aten.ones.default: 1, aten.ones_like.default: 1,
              aten.new_zeros.default: 0, aten.zeros.default: 0, aten.zeros_like.default: 0}


class _Interpreter:
    def __init__(self):
        self.env: dict[fx.Node, object] = {}

    def arg(self, a):
        if isinstance(a, fx.Node):
            s = _scalar(a)
            if s is not None:
                return s
            if a not in self.env:
                raise Unproven(f"the mask reads the tensor '{a.name}', not positions only")
            return self.env[a]
        s = _scalar(a)
        if s is None:
            raise Unproven(f"argument {a!r} is not a number")
        return s

    def tensor(self, a) -> _Tensor:
        v = self.arg(a)
        return v if isinstance(v, _Tensor) else _Tensor(v, ())

    def run(self, node: fx.Node) -> _Tensor:
        t, args = node.target, node.args
        packet = getattr(t, "overloadpacket", None)
        val = node.meta.get("val")
        is_bool = isinstance(val, torch.Tensor) and val.dtype == torch.bool
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            if t is aten.arange.default:
                start, end, step = sympy.Integer(0), self.arg(args[0]), sympy.Integer(1)
            else:
                start, end = self.arg(args[0]), self.arg(args[1])
                step = self.arg(args[2]) if len(args) > 2 else sympy.Integer(1)
            if step != 1:
                raise Unproven("arange with a step other than 1")
            return _Tensor(start + _dim_symbol(0), (end - start,))
        if t in _IDENTITY:
            x = self.tensor(args[0])
            if isinstance(x.value, sympy.Basic) and not _is_pred(x.value) and is_bool:
                return _Tensor(sympy.Ne(x.value, 0), x.shape)
            if _is_pred(x.value) and not is_bool and isinstance(val, torch.Tensor):
                return _Tensor(("where", x.value, 1, 0), x.shape)
            return x
        if t in _CONSTANTS:
            fill = _CONSTANTS[t]
            shape = tuple(_size(s) for s in val.shape)
            return _Tensor(sympy.true if is_bool and fill else sympy.false if is_bool else sympy.Integer(fill), shape)
        if t in (aten.full.default, aten.new_full.default, aten.scalar_tensor.default):
            fill = args[-1] if t is not aten.scalar_tensor.default else args[0]
            shape = tuple(_size(s) for s in val.shape)
            return _Tensor(_number(fill, is_bool), shape)
        if t is aten.unsqueeze.default:
            x = self.tensor(args[0])
            pos = args[1] % (x.ndim + 1)
            return _Tensor(_shift_dims(x.value, x.ndim, pos), x.shape[:pos] + (sympy.Integer(1),) + x.shape[pos:])
        if t is aten.slice.Tensor:
            x = self.tensor(args[0])
            dim = (args[1] if len(args) > 1 else 0) % x.ndim
            start = args[2] if len(args) > 2 else None
            end = args[3] if len(args) > 3 else None
            step = args[4] if len(args) > 4 else 1
            end_expr = None if end is None or (isinstance(end, int) and end >= 2 ** 62) else _size(end)
            if start not in (None, 0) or step != 1 or (end_expr is not None and sympy.simplify(end_expr - x.shape[dim]) != 0):
                raise Unproven("a slice of the mask that is not the whole dimension")
            return x
        if t is aten.expand.default:
            x = self.tensor(args[0])
            sizes = list(args[1])
            lead = len(sizes) - x.ndim
            shape = tuple(x.shape[i - lead] if (s == -1 and i >= lead) else _size(s) for i, s in enumerate(sizes))
            _broadcast(x.shape, shape)  # checks compatibility
            return _Tensor(x.value, shape)
        if packet in _COMPARE:
            a, b = self.tensor(args[0]), self.tensor(args[1])
            if packet in (aten.eq, aten.ne) and _is_pred(a.value) \
                    and (b.value in (sympy.true, sympy.false) or (isinstance(b.value, sympy.Number)
                                                                  and float(b.value) in (0.0, 1.0))):
                keep = (b.value is sympy.true or (b.value is not sympy.false and float(b.value) == 1.0)) \
                    == (packet is aten.eq)  # mask == 0 / mask != 0 / mask == True
                return _Tensor(a.value if keep else sympy.Not(a.value), _broadcast(a.shape, b.shape))
            _require_index(a), _require_index(b)
            return _Tensor(_COMPARE[packet](a.value, b.value), _broadcast(a.shape, b.shape))
        if packet in (aten.__and__, aten.bitwise_and, aten.logical_and, aten.__or__, aten.bitwise_or,
                      aten.logical_or):
            a, b = self.tensor(args[0]), self.tensor(args[1])
            _require_bool(a), _require_bool(b)
            op = sympy.And if packet in (aten.__and__, aten.bitwise_and, aten.logical_and) else sympy.Or
            return _Tensor(op(a.value, b.value), _broadcast(a.shape, b.shape))
        if packet in (aten.logical_not, aten.bitwise_not):
            a = self.tensor(args[0])
            _require_bool(a)
            return _Tensor(sympy.Not(a.value), a.shape)
        if packet in _ARITH:
            a, b = self.tensor(args[0]), self.tensor(args[1])
            alpha = node.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            if alpha != 1:
                raise Unproven("add/sub with alpha")
            if isinstance(a.value, tuple) or isinstance(b.value, tuple):
                return _Tensor(_where_arith(_ARITH[packet], a.value, b.value), _broadcast(a.shape, b.shape))
            _require_index(a), _require_index(b)
            return _Tensor(_ARITH[packet](a.value, b.value), _broadcast(a.shape, b.shape))
        if t is aten.where.self:
            c, a, b = self.tensor(args[0]), self.tensor(args[1]), self.tensor(args[2])
            _require_bool(c)
            return _Tensor(("where", c.value, _constant(a), _constant(b)), _broadcast(_broadcast(c.shape, a.shape), b.shape))
        if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            x, c = self.tensor(args[0]), self.tensor(args[1])
            _require_bool(c)
            fill = _constant(self.tensor(args[2]))
            if isinstance(x.value, tuple):
                raise Unproven("masked_fill of an additive mask")
            return _Tensor(("where", c.value, fill, _constant(x)), _broadcast(x.shape, c.shape))
        raise Unproven(f"op {t} is not understood by the mask prover")


def _number(v, is_bool):
    s = _scalar(v)
    if s is None:
        raise Unproven(f"fill value {v!r} is not a number")
    if is_bool:
        return sympy.true if s != 0 else sympy.false
    return s


def _constant(x: _Tensor):
    if isinstance(x.value, sympy.Number) or x.value in (sympy.oo, -sympy.oo):
        return x.value
    raise Unproven("a mask value that is not a constant")


def _where_arith(op, a, b):
    if isinstance(a, tuple) and isinstance(b, sympy.Number):
        return ("where", a[1], op(a[2], b), op(a[3], b))
    if isinstance(b, tuple) and isinstance(a, sympy.Number):
        return ("where", b[1], op(a, b[2]), op(a, b[3]))
    raise Unproven("arithmetic between two masks")


def _require_index(x: _Tensor):
    if isinstance(x.value, tuple) or _is_pred(x.value):
        raise Unproven("arithmetic or comparison on a boolean or additive mask")


def _require_bool(x: _Tensor):
    if not _is_pred(x.value):
        raise Unproven("a logical op on a non-boolean tensor")


def _visible(value) -> sympy.Basic:
    """The 'may attend' predicate of a final mask value (boolean or additive)."""
    if _is_pred(value):
        return value
    if isinstance(value, tuple):
        _, pred, a, b = value
        a, b = float(a), float(b)  # sympy >= 1.13: Float(0.0) != Integer(0)
        if a == 0 and b <= BLOCKED:
            return pred
        if a <= BLOCKED and b == 0:
            return sympy.Not(pred)
        raise Unproven(f"an additive mask with values {a} and {b} (expected 0 and -inf/finfo.min)")
    raise Unproven("the mask is neither boolean nor additive")


def _atoms(pred) -> list:
    if pred is sympy.true:
        return []
    if isinstance(pred, sympy.And):
        return [a for arg in pred.args for a in _atoms(arg)]
    if isinstance(pred, sympy.Rel):
        return [pred]
    raise Unproven(f"the visibility condition {pred} is not a conjunction of inequalities")


def _interval(atoms, i, j) -> tuple:
    lo, hi = -sympy.oo, sympy.oo
    for atom in atoms:
        if isinstance(atom, sympy.Ne):
            raise Unproven(f"'{atom}' leaves holes in the mask")
        expr = sympy.expand(atom.lhs - atom.rhs)
        if expr.free_symbols - {i, j}:
            raise Unproven(f"'{atom}' depends on {sorted(map(str, expr.free_symbols - {i, j}))} "
                           "(the sequence length or another dim), not on query and key positions only")
        a_i, a_j = expr.coeff(i), expr.coeff(j)
        rest = sympy.expand(expr - a_i * i - a_j * j)
        if rest.free_symbols or a_i.free_symbols or a_j.free_symbols or a_i + a_j != 0 or a_i == 0:
            raise Unproven(f"'{atom}' is not a condition on the distance query - key")
        # a_i * d + rest (rel) 0  ->  d (rel') bound
        bound = -rest / a_i
        rel = type(atom) if a_i > 0 else {sympy.Le: sympy.Ge, sympy.Lt: sympy.Gt, sympy.Ge: sympy.Le,
                                           sympy.Gt: sympy.Lt, sympy.Eq: sympy.Eq}[type(atom)]
        if rel in (sympy.Ge, sympy.Eq):
            lo = max(lo, sympy.ceiling(bound))
        if rel is sympy.Gt:
            lo = max(lo, sympy.floor(bound) + 1)
        if rel in (sympy.Le, sympy.Eq):
            hi = min(hi, sympy.floor(bound))
        if rel is sympy.Lt:
            hi = min(hi, sympy.ceiling(bound) - 1)
    return lo, hi


def prove_mask(nodes: list[fx.Node], mask: fx.Node, seq: sympy.Symbol) -> MaskKind:
    """The kind of the mask `mask`, computed by `nodes` (its ancestors, in graph order,
    placeholders and size nodes included). Raises `Unproven` with the reason."""
    interp = _Interpreter()
    for n in nodes:
        if n.op == "placeholder" or _scalar(n) is not None:
            continue
        if n.op != "call_function":
            raise Unproven(f"{n.op} {n.target} in the mask")
        interp.env[n] = interp.run(n)
    out = interp.tensor(mask)
    if out.ndim < 2 or any(sympy.simplify(s - seq) != 0 for s in out.shape[-2:]):
        raise Unproven(f"the mask's last two dims are {out.shape[-2:]}, not sequence x sequence")
    visible = _visible(out.value)
    i, j = _dim_symbol(1), _dim_symbol(0)
    extra = visible.free_symbols - {i, j}
    if extra:
        raise Unproven(f"the mask depends on {sorted(map(str, extra))}, not on query and key positions only")
    lo, hi = _interval(_atoms(visible), i, j)
    if lo != 0:
        raise Unproven(f"keys at distances {lo}..{hi} are visible, not 0..(window - 1)")
    if hi == sympy.oo:
        return MaskKind(None)
    if hi < 0:
        raise Unproven("no key is visible")
    return MaskKind(int(hi) + 1)
