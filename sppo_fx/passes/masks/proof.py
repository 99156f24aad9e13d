"""Symbolic proof of what a position-built attention mask is, for every sequence length.

A mask subgraph (built from `arange`, a registered mask buffer sliced to `[:T, :T]`,
comparisons, `where`, `masked_fill`, `triu`/`tril`, ...) is evaluated on abstract values
instead of on a probe tensor. Every value is a function of the element's index along each
dim (right-aligned keys: -1 is the last dim), exact at the node's real shape:

    Affine     an integer-valued tensor  const + sum_k coef_k * idx_k
               (`arange(a, b, s)` is a + s * idx_-1; `i[:, None] - i[None, :]` is i - j)
    Band       g(form), form = sum_k c_k * idx_k a primitive integer form (gcd 1, its
               rightmost coefficient > 0) and g piecewise constant over the integers:
               breakpoints and one value per piece. `form` () is a constant. Pointwise ops
               on Bands of one form run the real ATen op on the pieces' values, so dtypes,
               -inf and finfo.min behave exactly as in the model.
    Const      a value without positions (a Python scalar or a one-element tensor).

A dim of size 1 has index 0, so its coefficient is dropped at every node: a [1, T]
`triu` is g(j), not g(j - i), and stays g(j) when broadcast to [T, T]. A mask is causal only
when it evaluates to a Band of form j - i (`D_FORM`) that blocks exactly d = j - i >= 1;
since g holds for every integer d, that is the causal mask at every sequence length.

Positions are exact only inside their dtype's integer range (uint8 wraps at 256; float16
rounds past 2048). Every Affine node and every operand of the op that reads it is checked
against the range of the dtype the op computes in, with the node's sizes as functions of
T; the largest T for which all fit is `MaskEvaluator.limit` (the runtime refuses longer
sequences: `check_seq_limit`). Anything the evaluator does not model (a user input, a
buffer that is not constant along its diagonals, an op outside the list, a comparison of
positions other than through j - i) raises `NotProvable`; callers turn that into an
`SppoError`.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from fractions import Fraction
from typing import Callable

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import describe_node
from sppo_fx.passes.masks.values import (D_FORM, Affine, Band, Const, MaskKind, NotProvable, SeqLimit,  # noqa: F401
                                        _affine_predicate, _affine_scale, _affine_sub, _as_affine, _combine,
                                        _form_text, _raw, _rekey, _same, _scalar, _substitute, check_seq_limit,
                                        compose, exact_range, is_blocking_fill, mask_kind, record_seq_limit)
from sppo_fx.passes.seqdim import arg_expr

aten = torch.ops.aten

IDENTITY_OPS = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                aten.detach_.default, aten.lift_fresh_copy.default, aten.to.device}
CAST_OPS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}
_CMP = {aten.le: operator.le, aten.lt: operator.lt, aten.ge: operator.ge, aten.gt: operator.gt,
        aten.eq: operator.eq, aten.ne: operator.ne}
_AFFINE_ARITH = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.neg.default,
                 aten.mul.Tensor, aten.mul.Scalar, aten.rsub.Scalar}
_EXTRA_POINTWISE = {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                    aten.__or__.Tensor, aten.__and__.Tensor, aten.__xor__.Tensor}
_FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default}
_NEW_FACTORIES = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default}
_INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
_VIEWS = {aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _ndim(node: fx.Node) -> int:
    return node.meta["val"].dim()


def _size_expr(s) -> sympy.Expr:
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def _is_one(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 1


def _same_size(a, b) -> bool:
    return sympy.simplify(_size_expr(a) - _size_expr(b)) == 0


def _shift_unsqueeze(key: int, ndim_in: int, dim: int) -> int:
    """The right-aligned key of a dim after unsqueeze(dim) of an ndim_in tensor."""
    dim = dim % (ndim_in + 1)
    return key - 1 if ndim_in + key < dim else key


class MaskEvaluator:
    """Evaluates mask subgraphs abstractly (see the module docstring)."""

    def __init__(self, seq: sympy.Symbol, param_value: Callable[[str], torch.Tensor | None]):
        self.seq = seq
        self.param_value = param_value
        self.memo: dict[fx.Node, object] = {}
        self.limit: SeqLimit | None = None

    def value(self, arg):
        if isinstance(arg, fx.Node):
            if arg not in self.memo:
                self.memo[arg] = self._at_shape(arg, self._eval(arg))
            return self.memo[arg]
        if isinstance(arg, (bool, int, float)):
            return Const(arg)
        if arg is None:
            return None
        raise NotProvable(f"argument {arg!r} is not a number or a graph value")

    def _at_shape(self, node: fx.Node, x):
        """x with the coefficients of size-1 dims dropped; an Affine's range checked."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(x, (Affine, Band)):
            return x
        ones = {i - val.dim() for i, s in enumerate(val.shape) if _is_one(s)}
        if isinstance(x, Band):
            if x.form and ones & {k for k, _ in x.form}:
                x = compose(dataclasses.replace(x, form=()), {k: c for k, c in x.form if k not in ones}, 0, x.ndim)
            return x
        x = Affine(tuple((k, c) for k, c in x.coefs if k not in ones), x.const, x.ndim)
        self.check_range(x, node, val.dtype)
        return x

    def check_range(self, x: Affine, node: fx.Node, dtype: torch.dtype) -> None:
        """Require x's values (at node's sizes) to be exact integers in `dtype`; tighten the limit."""
        rng = exact_range(dtype)
        if rng is None or x.const.denominator != 1:
            raise NotProvable(f"{node.name} holds positions as {dtype} values "
                              f"{'that are not integers' if rng else 'that are not numbers'}")
        shape = node.meta["val"].shape
        lo = hi = sympy.Integer(int(x.const))
        for k, c in x.coefs:
            span = c * (_size_expr(shape[k]) - 1)
            lo, hi = (lo + span, hi) if c < 0 else (lo, hi + span)
        best = None
        for expr, bound, sign in ((hi, rng[1], 1), (lo, rng[0], -1)):
            e = sympy.expand(sign * (expr - bound))  # a * T + b <= 0 wanted
            a, b = e.coeff(self.seq, 1), e.subs(self.seq, 0)
            if not (a.is_Rational and b.is_Rational and sympy.expand(e - a * self.seq - b) == 0):
                raise NotProvable(f"{node.name}: the positions' range is not linear in the sequence length")
            a, b = Fraction(int(a.p), int(a.q)), Fraction(int(b.p), int(b.q))
            if a < 0:
                raise NotProvable(f"{node.name}: the positions' range shrinks with the sequence length")
            t_max = math.inf if a == 0 and b <= 0 else (0 if a == 0 else math.floor(-b / a))
            best = t_max if best is None else min(best, t_max)
        if best < 2:
            raise NotProvable(f"{node.name} computes positions in {dtype}, which does not hold their values "
                              "exactly (they would wrap or round) at any sequence length above 1")
        if best < 2 ** 62 and (self.limit is None or best < self.limit.max_len):
            self.limit = SeqLimit(int(best), dtype, describe_node(node))

    # -- node rules ---------------------------------------------------------------------
    def _eval(self, node: fx.Node):
        val = node.meta.get("val")
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op != "call_function":
            raise NotProvable(f"{node.name} is not an ATen call")
        t = node.target
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            raise NotProvable(f"{node.name} is a size, not a tensor")
        static = isinstance(val, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in val.shape)
        if static and val.numel() == 1 and t in _FACTORIES | {aten.scalar_tensor.default}:
            return Const(t(*node.args, **node.kwargs))
        if t in _NEW_FACTORIES and static and val.numel() == 1:
            fill = {aten.new_ones.default: 1, aten.new_zeros.default: 0}.get(t)
            fill = node.args[2] if fill is None else fill
            return Const(torch.full(tuple(val.shape), fill, dtype=val.dtype))
        if t in _FACTORIES and isinstance(val, torch.Tensor):
            return self._constant_band(node)
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            return self._arange(node)
        if t in IDENTITY_OPS:
            return self.value(node.args[0])
        if t in CAST_OPS:
            return self._cast(node)
        if t is aten.unsqueeze.default:
            return self._unsqueeze(node)
        if t in _VIEWS:
            return self._reshape(node)
        if t in (aten.transpose.int, aten.permute.default, aten.t.default):
            return self._permute(node)
        if t in (aten.slice.Tensor, aten.select.int):
            return self._slice(node)
        if t in (aten.triu.default, aten.tril.default):
            return self._triangle(node)
        packet = getattr(t, "overloadpacket", None)
        if packet in _CMP:
            return self._compare(node, _CMP[packet])
        args = [self.value(a) if isinstance(a, fx.Node) else a for a in node.args]
        if t in _AFFINE_ARITH and any(isinstance(a, Affine) for a in args):
            return self._affine_arith(node, args)
        if t in _EXTRA_POINTWISE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
            return self._pointwise(node, args)
        raise NotProvable(f"{node.name} ({t}) is not an op the mask proof models")

    def _placeholder(self, node: fx.Node):
        value = self.param_value(node.name)
        if value is None:
            raise NotProvable(f"it depends on the input '{node.name}'")
        if value.requires_grad:  # proven at its value now; training would change it after the proof
            raise NotProvable(f"it reads the trainable parameter '{node.name}', whose value training changes")
        value = value.detach().cpu()
        if value.numel() == 1:
            return Const(value.reshape(()).clone())
        if value.dim() < 2 or value.numel() == 0:
            raise NotProvable(f"the buffer '{node.name}' of shape {tuple(value.shape)} is not a mask table")
        # a table equal along each diagonal (and in every leading slice) is g(c - r)
        n, m = value.shape[-2:]
        flat = value.reshape(-1, n, m)
        diag = torch.cat([flat[0, 1:, 0].flip(0), flat[0, 0, :]])  # d = c - r from -(n-1) to m-1
        r, c = torch.arange(n)[:, None], torch.arange(m)[None, :]
        want = diag[c - r + n - 1]
        same = (flat == want) | (torch.isnan(flat) & torch.isnan(want)) if value.is_floating_point() \
            else flat == want
        if not bool(same.all()):
            raise NotProvable(f"the buffer '{node.name}' is not a lower-triangular or banded table "
                              "(constant along each diagonal) over its whole extent")
        breaks = [d for d in range(-(n - 1) + 1, m) if not _same(diag[d + n - 1], diag[d + n - 2])]
        vals = torch.stack([diag[0]] + [diag[d + n - 1] for d in breaks])
        return compose(Band(tuple(breaks), vals, value.dim()), dict(D_FORM), 0, value.dim())

    def _constant_band(self, node: fx.Node):
        """A tensor filled with one value: a Band of one piece."""
        val = node.meta["val"]
        fill = {aten.zeros.default: 0, aten.ones.default: 1}.get(node.target)
        if fill is None:
            fill = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
        if isinstance(fill, fx.Node) or fill is None:
            raise NotProvable(f"{node.name} is filled with a computed value")
        return Band((), torch.tensor([fill]).to(val.dtype), val.dim())

    def _arange(self, node: fx.Node):
        if node.target is aten.arange.default:
            lo, step = 0, 1
        else:
            lo, step = node.args[0], node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        lo_e = arg_expr(lo, self.seq)
        if lo_e is None or not lo_e.is_Integer or isinstance(step, (fx.Node, bool)) or step != int(step) \
                or step == 0:
            raise NotProvable(f"{node.name} is not a range of integers from a fixed start with a fixed step")
        return Affine(((-1, int(step)),), Fraction(int(lo_e)), 1)

    def _cast(self, node: fx.Node):
        x = self.value(node.args[0])
        out = node.meta["val"]
        if isinstance(x, Affine):
            if out.dtype == torch.bool:
                return _affine_predicate(x, operator.ne, node)
            return x  # `_at_shape` checks the new dtype holds every value
        if isinstance(x, Const):
            v = x.value if isinstance(x.value, torch.Tensor) else torch.tensor(x.value)
            return Const(v.to(out.dtype))
        if isinstance(x, Band):
            return dataclasses.replace(x, values=x.values.to(out.dtype))
        raise NotProvable(f"{node.name}: cannot cast {type(x).__name__}")

    def _unsqueeze(self, node: fx.Node):
        x, dim = self.value(node.args[0]), node.args[1]
        nd = _ndim(node.args[0])
        if isinstance(x, Const):
            return x
        if isinstance(x, (Affine, Band)):
            return _rekey(x, lambda k: _shift_unsqueeze(k, nd, dim), nd + 1)
        raise NotProvable(f"{node.name}: cannot unsqueeze {type(x).__name__}")

    def _permute(self, node: fx.Node):
        x = self.value(node.args[0])
        nd = _ndim(node)
        if isinstance(x, Const):
            return x
        if node.target is aten.permute.default:
            perm = [d % nd for d in node.args[1]]
        else:
            a, b = (node.args[1] % nd, node.args[2] % nd) if node.target is aten.transpose.int else (0, nd - 1)
            perm = list(range(nd))
            perm[a], perm[b] = perm[b], perm[a]
        where = {src - nd: out - nd for out, src in enumerate(perm)}
        return _rekey(x, where.get, nd)

    def _reshape(self, node: fx.Node):
        """expand/view/reshape that keep every dim from the first one the value varies along."""
        x = self.value(node.args[0])
        if isinstance(x, Const):
            return x
        if not isinstance(x, (Affine, Band)):
            raise NotProvable(f"{node.name}: cannot reshape {type(x).__name__}")
        src, out = node.args[0].meta["val"].shape, node.meta["val"].shape
        keys = [k for k, _ in (x.coefs if isinstance(x, Affine) else x.form)]
        keep = -min(keys) if keys else 0
        # row-major: when the trailing `keep` sizes agree, every element keeps those indices
        if keep and (len(out) < keep or any(not _same_size(src[i], out[i]) for i in range(-keep, 0))):
            raise NotProvable(f"{node.name} reshapes the position dims")
        return dataclasses.replace(x, ndim=len(out))

    def _slice(self, node: fx.Node):
        x = self.value(node.args[0])
        src = node.args[0].meta["val"]
        dim = (node.args[1] if len(node.args) > 1 else 0) % src.dim()
        key = dim - src.dim()
        if node.target is aten.select.int:
            start, step = node.args[2], 0  # idx = start: the dim goes
        else:
            start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
            step = node.args[4] if len(node.args) > 4 else 1
        start_e = arg_expr(start, self.seq)
        size = src.shape[dim]
        if not isinstance(step, int) or step < 0 or start_e is None or not start_e.is_Integer \
                or (int(start_e) < 0 and isinstance(size, torch.SymInt)):
            raise NotProvable(f"{node.name} cuts the mask from an offset that depends on the length")
        start = int(start_e) % int(size) if int(start_e) < 0 else int(start_e)
        if isinstance(x, Const):
            return x
        if not isinstance(x, (Affine, Band)):
            raise NotProvable(f"{node.name}: cannot slice {type(x).__name__}")
        x = _substitute(x, key, step, start)
        if node.target is aten.select.int:
            nd = src.dim() - 1
            x = _rekey(x, lambda k: None if k == key else (k + 1 if k < key else k), nd)
        return x

    def _triangle(self, node: fx.Node):
        x = self.value(node.args[0])
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        if not isinstance(k, int):
            raise NotProvable(f"{node.name} has a symbolic diagonal")
        nd = _ndim(node)
        if isinstance(x, Const):
            x = Band((), torch.as_tensor(x.value).reshape(1), nd)
        if not isinstance(x, Band):
            raise NotProvable(f"{node.name}: triu/tril of {type(x).__name__}")
        zero = torch.zeros((), dtype=x.values.dtype)
        keep = Band((k + 1,), torch.tensor([True, False]), nd, D_FORM) if node.target is aten.tril.default \
            else Band((k,), torch.tensor([False, True]), nd, D_FORM)
        # triu/tril act on this tensor's own last two dims: a size-1 one is index 0
        keep = self._at_shape(node, keep)
        return _combine(lambda m, v: torch.where(m, v, zero), [keep, x], nd, node)

    def _compare(self, node: fx.Node, op):
        a, b = (self.value(x) for x in node.args[:2])
        if isinstance(a, Affine) or isinstance(b, Affine):
            self._check_operands(node, [a, b])
            diff = _affine_sub(_as_affine(a), _as_affine(b))
            return _affine_predicate(diff, op, node)
        return self._pointwise(node, [a, b])

    def _check_operands(self, node: fx.Node, args) -> None:
        """Positions and numbers must be exact in the dtype the op computes in."""
        probes = [torch.empty([1] * a.meta["val"].dim(), dtype=a.meta["val"].dtype) if isinstance(a, fx.Node)
                  else a for a in node.args[:len(args)]]
        dtype = torch.result_type(*probes) if len(probes) > 1 else node.meta["val"].dtype
        for a, raw in zip(args, node.args):
            if isinstance(a, Affine):
                self.check_range(a, raw, dtype)
            elif isinstance(a, Const) and dtype != torch.bool:
                v = torch.as_tensor(a.value)
                if not bool((v.to(dtype).to(torch.float64) == v.to(torch.float64)).all()):
                    raise NotProvable(f"{node.name} computes in {dtype}, which does not hold {v.item()} exactly")

    def _affine_arith(self, node: fx.Node, args):
        t = node.target
        self._check_operands(node, args[:2] if t is not aten.neg.default else args[:1])
        if t is aten.neg.default:
            return _affine_scale(args[0], -1)
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            a, b = args[0], args[1]
            if isinstance(a, Affine) and isinstance(b, Affine):
                raise NotProvable(f"{node.name} multiplies positions by positions")
            aff, c = (a, b) if isinstance(a, Affine) else (b, a)
            c = _scalar(c)
            if c != int(c):
                raise NotProvable(f"{node.name} scales positions by a non-integer")
            return _affine_scale(aff, int(c))
        alpha = node.kwargs.get("alpha", 1)
        a, b = _as_affine(args[0]), _affine_scale(_as_affine(args[1]), alpha)
        if t is aten.rsub.Scalar:
            return _affine_sub(b, a)
        if t in (aten.sub.Tensor, aten.sub.Scalar):
            return _affine_sub(a, b)
        return _affine_sub(a, _affine_scale(b, -1))

    def _pointwise(self, node: fx.Node, args):
        if any(isinstance(a, Affine) for a in args):
            raise NotProvable(f"{node.name} ({node.target}) applies to raw positions")
        if not any(isinstance(a, Band) for a in args):
            raise NotProvable(f"{node.name} does not depend on positions")

        def call(*vals):
            it = iter(vals)
            real = [next(it) if isinstance(a, Band) else _raw(a) for a in args]
            return node.target(*real, **node.kwargs)
        return _combine(call, args, _ndim(node), node)


def evaluate_mask(node: fx.Node, seq: sympy.Symbol, param_value) -> object:
    """The abstract value of a mask node (Band, Affine or Const); raises NotProvable."""
    return MaskEvaluator(seq, param_value).value(node)
