"""Symbolic proof of what a position-built attention mask is, for every sequence length.

A mask subgraph (built from `arange(T)`, a registered `tril` buffer sliced to `[:T, :T]`,
comparisons, `where`, `masked_fill`, `triu`/`tril`, ...) is evaluated on abstract values
instead of on a probe tensor:

    Affine     an integer tensor whose value is  const + sum_k coef_k * (index along dim k)
               (`arange(T)` is index; `arange(T)[:, None] - arange(T)[None, :]` is i - j)
    Band       a tensor whose value depends only on d = key index - query index (the last
               two dims): piecewise constant over the integers, as breakpoints and one value
               per piece. A comparison of Affines that is a function of d gives a Band;
               pointwise ops on Bands run the real ATen op on the pieces' values, so dtypes,
               -inf and finfo.min behave exactly as in the model.
    Const      a value without positions (a Python scalar or a one-element tensor).

Since a Band holds its value for every integer d, a mask that evaluates to the Band
"blocked exactly where d >= 1" is the causal mask at every sequence length, not only at
probed ones. Anything the evaluator does not model (a user input, a buffer that is not
exactly lower-triangular over its whole extent, an op outside the list, a dependency on
i or j other than through j - i) makes `evaluate_mask` raise `NotProvable` with the
reason; callers turn that into an `SppoError`.
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

from sppo_fx.passes.seqdim import arg_expr

aten = torch.ops.aten


class NotProvable(Exception):
    """The mask cannot be evaluated symbolically; the message says why."""


@dataclasses.dataclass(frozen=True)
class Const:
    value: object  # Python scalar or a one-element tensor


@dataclasses.dataclass(frozen=True)
class Affine:
    coefs: tuple  # ((dim counted from the right, -1 = last), integer coefficient), sorted
    const: Fraction
    ndim: int


@dataclasses.dataclass(frozen=True)
class Band:
    breaks: tuple  # sorted ints; piece p covers breaks[p-1] <= d < breaks[p]
    values: torch.Tensor  # one value per piece (len(breaks) + 1)
    ndim: int

    def canonical(self) -> "Band":
        """The same function with equal neighbouring pieces merged."""
        keep_b, keep_v = [], [self.values[0]]
        for b, v in zip(self.breaks, self.values[1:]):
            if not _same(v, keep_v[-1]):
                keep_b.append(b)
                keep_v.append(v)
        return Band(tuple(keep_b), torch.stack(keep_v), self.ndim)

    def at(self, d: int):
        p = sum(1 for b in self.breaks if d >= b)
        return self.values[p]

    def describe(self) -> str:
        c = self.canonical()
        pieces, lo = [], None
        for p, v in enumerate(c.values.tolist()):
            hi = c.breaks[p] - 1 if p < len(c.breaks) else None
            rng = f"{'-inf' if lo is None else lo} <= j-i <= {'inf' if hi is None else hi}"
            pieces.append(f"{rng}: {v}")
            lo = c.breaks[p] if p < len(c.breaks) else None
        return "; ".join(pieces)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a == b) | (torch.isnan(a) & torch.isnan(b))) if a.is_floating_point() else bool(a == b)


@dataclasses.dataclass(frozen=True)
class _Table:
    """A concrete buffer equal to (a if j <= i else b) over its N x N extent; `sliced`
    says which of its last two dims have been cut to [0:T]."""

    inside: torch.Tensor
    outside: torch.Tensor
    ndim: int
    sliced: frozenset = frozenset()


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


def _ndim(node: fx.Node) -> int:
    return node.meta["val"].dim()


def _is_seq(size, seq) -> bool:
    e = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
    return sympy.simplify(e - seq) == 0


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

    def value(self, arg):
        if isinstance(arg, fx.Node):
            if arg not in self.memo:
                self.memo[arg] = self._eval(arg)
            return self.memo[arg]
        if isinstance(arg, (bool, int, float)):
            return Const(arg)
        if arg is None:
            return None
        raise NotProvable(f"argument {arg!r} is not a number or a graph value")

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
        if isinstance(val, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in val.shape) \
                and val.numel() == 1 and t in (aten.zeros.default, aten.ones.default, aten.full.default,
                                               aten.scalar_tensor.default):
            return Const(t(*node.args, **node.kwargs))
        if t in _NEW_FACTORIES and isinstance(val, torch.Tensor) and val.numel() == 1 \
                and not any(isinstance(s, torch.SymInt) for s in val.shape):
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
        if t in (aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return self._reshape(node)
        if t is aten.slice.Tensor:
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
        value = value.detach()
        if value.numel() == 1:
            return Const(value.reshape(()).clone())
        if value.dim() < 2 or value.shape[-1] != value.shape[-2]:
            raise NotProvable(f"the buffer '{node.name}' of shape {tuple(value.shape)} is not a square table")
        n = value.shape[-1]
        tril = torch.ones(n, n, dtype=torch.bool).tril()
        inside, outside = value[..., 0, 0].reshape(-1)[0], value[..., 0, 1].reshape(-1)[0] if n > 1 else None
        if outside is None or _same(inside, outside) or not bool(
                (value == torch.where(tril, inside, outside)).all()):
            raise NotProvable(f"the buffer '{node.name}' is not a lower-triangular table (tril) over its "
                              "whole extent")
        return _Table(inside.clone(), outside.clone(), value.dim())

    def _constant_band(self, node: fx.Node):
        """A position-shaped tensor filled with one value: a Band of one piece."""
        val = node.meta["val"]
        fill = {aten.zeros.default: 0, aten.ones.default: 1}.get(node.target)
        if fill is None:
            fill = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
        if isinstance(fill, fx.Node) or fill is None:
            raise NotProvable(f"{node.name} is filled with a computed value")
        return Band((), torch.tensor([fill], dtype=val.dtype), val.dim())

    def _arange(self, node: fx.Node):
        if node.target is aten.arange.default:
            lo, hi, step = sympy.Integer(0), arg_expr(node.args[0], self.seq), 1
        else:
            lo, hi = arg_expr(node.args[0], self.seq), arg_expr(node.args[1], self.seq)
            step = node.args[2] if len(node.args) > 2 else 1
        dtype = node.kwargs.get("dtype") or node.meta["val"].dtype
        if lo is None or hi is None or step != 1 or not lo.is_Integer or dtype not in _INT_DTYPES:
            raise NotProvable(f"{node.name} is not an integer range with step 1")
        return Affine(((-1, 1),), Fraction(int(lo)), 1)

    def _cast(self, node: fx.Node):
        x = self.value(node.args[0])
        out = node.meta["val"]
        if isinstance(x, Affine):
            if out.dtype not in _INT_DTYPES:
                raise NotProvable(f"{node.name} casts positions to {out.dtype}")
            return x
        if isinstance(x, Const):
            v = x.value if isinstance(x.value, torch.Tensor) else torch.tensor(x.value)
            return Const(v.to(out.dtype))
        if isinstance(x, Band):
            return Band(x.breaks, x.values.to(out.dtype), x.ndim)
        if isinstance(x, _Table):
            return dataclasses.replace(x, inside=x.inside.to(out.dtype), outside=x.outside.to(out.dtype))
        raise NotProvable(f"{node.name}: cannot cast {type(x).__name__}")

    def _unsqueeze(self, node: fx.Node):
        x, dim = self.value(node.args[0]), node.args[1]
        nd = _ndim(node.args[0])
        if isinstance(x, Const):
            return x
        if isinstance(x, Affine):
            coefs = tuple(sorted((_shift_unsqueeze(k, nd, dim), c) for k, c in x.coefs))
            return Affine(coefs, x.const, nd + 1)
        if isinstance(x, (Band, _Table)):
            if _shift_unsqueeze(-2, nd, dim) != -2:  # a new dim inside the last two
                raise NotProvable(f"{node.name} inserts a dim between the query and key dims")
            return dataclasses.replace(x, ndim=nd + 1)
        raise NotProvable(f"{node.name}: cannot unsqueeze {type(x).__name__}")

    def _reshape(self, node: fx.Node):
        """expand/view/reshape that only add, drop or broadcast dims the value does not vary along."""
        x = self.value(node.args[0])
        if isinstance(x, Const):
            return x
        src, out = node.args[0].meta["val"].shape, node.meta["val"].shape
        if isinstance(x, Affine):
            varying = [k for k, _ in x.coefs]
        elif isinstance(x, (Band, _Table)):
            varying = [-2, -1]
        else:
            raise NotProvable(f"{node.name}: cannot reshape {type(x).__name__}")
        keep = -min(varying) if varying else 0
        if keep and (len(out) < keep or any(not _same_size(src[i], out[i]) for i in range(-keep, 0))):
            raise NotProvable(f"{node.name} reshapes the position dims")
        if node.target is not aten.expand.default:
            # dims left of the varying ones must be all size 1 on both sides
            sizes = list(src[:len(src) - keep]) + list(out[:len(out) - keep])
            if any(not _is_one(s) for s in sizes):
                raise NotProvable(f"{node.name} merges position dims with others")
        return dataclasses.replace(x, ndim=len(out))

    def _slice(self, node: fx.Node):
        x = self.value(node.args[0])
        src = node.args[0].meta["val"]
        dim = (node.args[1] if len(node.args) > 1 else 0) % src.dim()
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        step = node.args[4] if len(node.args) > 4 else 1
        start_e = arg_expr(start, self.seq)
        out_size = node.meta["val"].shape[dim]
        if step != 1 or start_e is None or start_e != 0:
            raise NotProvable(f"{node.name} slices from an offset or with a step")
        full = _same_size(out_size, src.shape[dim])
        key = dim - src.dim()
        if isinstance(x, _Table) and key in (-2, -1):
            if not _is_seq(out_size, self.seq):
                raise NotProvable(f"{node.name} cuts the mask table to {out_size}, not to the sequence length")
            sliced = x.sliced | {key}
            if sliced == {-2, -1}:
                vals = torch.stack([x.inside, x.outside])
                return Band((1,), vals, x.ndim)
            return dataclasses.replace(x, sliced=sliced)
        if full or isinstance(x, Const):
            return x
        if isinstance(x, Affine) and key not in dict(x.coefs):
            return x
        if isinstance(x, (Band, _Table)) and key not in (-2, -1):
            return x
        raise NotProvable(f"{node.name} cuts a position dim")

    def _triangle(self, node: fx.Node):
        x = self.value(node.args[0])
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        if not isinstance(k, int):
            raise NotProvable(f"{node.name} has a symbolic diagonal")
        if isinstance(x, Const):
            x = Band((), torch.as_tensor(x.value).reshape(1), _ndim(node))
        if not isinstance(x, Band):
            raise NotProvable(f"{node.name}: triu/tril of {type(x).__name__}")
        zero = torch.zeros((), dtype=x.values.dtype)
        keep = Band((k + 1,), torch.tensor([True, False]), x.ndim) if node.target is aten.tril.default \
            else Band((k,), torch.tensor([False, True]), x.ndim)
        return _combine(lambda m, v: torch.where(m, v, zero), [keep, x], x.ndim)

    def _compare(self, node: fx.Node, op):
        a, b = (self.value(x) for x in node.args[:2])
        if isinstance(a, Affine) or isinstance(b, Affine):
            diff = _affine_sub(_as_affine(a), _as_affine(b))
            return _affine_predicate(diff, op, node)
        return self._pointwise(node, [a, b])

    def _affine_arith(self, node: fx.Node, args):
        t = node.target
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
        if any(isinstance(a, (Affine, _Table)) for a in args):
            raise NotProvable(f"{node.name} ({node.target}) applies to raw positions or an unsliced table")
        bands = [a for a in args if isinstance(a, Band)]
        if not bands:
            raise NotProvable(f"{node.name} does not depend on positions")
        ndim = _ndim(node)

        def call(*vals):
            it = iter(vals)
            real = [next(it) if isinstance(a, Band) else _raw(a) for a in args]
            return node.target(*real, **node.kwargs)
        return _combine(call, args, ndim)


def _same_size(a, b) -> bool:
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(int(a))
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(int(b))
    return sympy.simplify(ea - eb) == 0


def _is_one(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 1


def _raw(a):
    if isinstance(a, Const):
        return a.value
    return a


def _scalar(c) -> Fraction:
    v = c.value if isinstance(c, Const) else c
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        raise NotProvable("positions combined with a non-finite number")
    return Fraction(v)


def _as_affine(x) -> Affine:
    if isinstance(x, Affine):
        return x
    if isinstance(x, Const) or isinstance(x, (int, float)):
        return Affine((), _scalar(x), 0)
    raise NotProvable(f"positions combined with a {type(x).__name__}")


def _affine_scale(a: Affine, c) -> Affine:
    c = _scalar(c)
    return Affine(tuple((k, v * c) for k, v in a.coefs if v * c != 0), a.const * c, a.ndim)


def _affine_sub(a: Affine, b: Affine) -> Affine:
    coefs = dict(a.coefs)
    for k, v in b.coefs:
        coefs[k] = coefs.get(k, 0) - v
    return Affine(tuple(sorted((k, v) for k, v in coefs.items() if v != 0)), a.const - b.const,
                  max(a.ndim, b.ndim))


def _affine_predicate(diff: Affine, op, node: fx.Node) -> Band:
    """The Band of `diff OP 0` where diff must be lam * (j - i) + k (j: dim -1, i: dim -2)."""
    coefs = dict(diff.coefs)
    lam = coefs.pop(-1, 0)
    if coefs.pop(-2, 0) != -lam or coefs:
        raise NotProvable(f"{node.name} compares positions other than through j - i "
                          f"(coefficients {dict(diff.coefs)})")
    ndim = max(diff.ndim, 2)
    if lam == 0:
        return Band((), torch.tensor([bool(op(diff.const, 0))]), ndim)
    # lam * d + k OP 0: the predicate changes value only where lam * d + k crosses 0, so
    # evaluating it on each side of (and at) the crossing point gives it for every d.
    x = -diff.const / lam
    lo, hi = math.floor(x), math.ceil(x)
    breaks = sorted({lo, lo + 1, hi, hi + 1})
    reps = [breaks[0] - 1] + breaks
    vals = torch.tensor([bool(op(lam * d + diff.const, 0)) for d in reps])
    return Band(tuple(breaks), vals, ndim).canonical()


def _combine(fn, args, ndim) -> Band:
    """A pointwise function of Bands (and constants), piece by piece."""
    bands = [a for a in args if isinstance(a, Band)]
    breaks = sorted({b for band in bands for b in band.breaks})
    reps = [breaks[0] - 1] + breaks if breaks else [0]
    vals = [fn(*(torch.stack([band.at(d) for d in reps]) for band in bands))]
    return Band(tuple(breaks), vals[0].reshape(len(reps)), ndim).canonical()


def is_blocking_fill(value, dtype: torch.dtype) -> bool:
    """-inf, or at most the dtype's lowest finite number (exp underflows to exactly 0)."""
    v = value.item() if isinstance(value, torch.Tensor) else value
    if not isinstance(v, (int, float)):
        return False
    low = torch.finfo(dtype).min if dtype.is_floating_point else -math.inf
    return v == -math.inf or v <= low


def evaluate_mask(node: fx.Node, seq: sympy.Symbol, param_value) -> object:
    """The abstract value of a mask node (Band, Affine or Const); raises NotProvable."""
    return MaskEvaluator(seq, param_value).value(node)


@dataclasses.dataclass(frozen=True)
class MaskKind:
    """A proven mask: key j visible from query i iff 0 <= i - j < window (None: no bound).

    `window` counts the visible tokens, the query's own included (HF's `sliding_window`)."""

    window: int | None

    def __str__(self) -> str:
        return "causal" if self.window is None else f"causal, sliding window of {self.window} tokens"


def mask_kind(band: Band, how: str, dtype: torch.dtype) -> MaskKind:
    """What a mask Band lets each query see, proven for every sequence length.

    Args:
        band: the mask's value by key offset d = j - i (`evaluate_mask`).
        how: "allowed" (True = may attend: SDPA's boolean mask, `where(mask, s, -inf)`),
            "blocked" (True = blocked: `masked_fill(s, mask, -inf)`) or "additive"
            (0 = may attend, -inf / finfo.min = blocked: added to the scores).
        dtype: the scores' dtype (what counts as a blocking additive value).

    Returns:
        MaskKind(None) for causal, MaskKind(W) for a sliding window of W tokens. Raises
        NotProvable for anything else: keys after the query, the diagonal hidden, holes.
    """
    c = band.canonical()
    if how == "additive":
        if c.values.dtype == torch.bool:
            raise NotProvable("a boolean mask is added to the scores")
        visible = []
        for v in c.values.tolist():
            if v == 0:
                visible.append(True)
            elif is_blocking_fill(v, dtype):
                visible.append(False)
            else:
                raise NotProvable(f"the additive mask holds {v}, neither 0 nor -inf/finfo({dtype}).min")
    else:
        if c.values.dtype != torch.bool:
            raise NotProvable("the mask is not boolean")
        visible = [bool(v) == (how == "allowed") for v in c.values.tolist()]
    # piece p covers breaks[p-1] <= d < breaks[p]; merge neighbours of equal visibility
    runs = []  # (visible, lo, hi) with None for -inf / +inf
    for p, vis in enumerate(visible):
        lo = c.breaks[p - 1] if p > 0 else None
        hi = c.breaks[p] - 1 if p < len(c.breaks) else None
        if runs and runs[-1][0] == vis:
            runs[-1] = (vis, runs[-1][1], hi)
        else:
            runs.append((vis, lo, hi))
    shown = [(lo, hi) for vis, lo, hi in runs if vis]
    if len(shown) != 1:
        raise NotProvable(f"the visible keys are not one range of offsets ({band.describe()})")
    lo, hi = shown[0]
    if hi != 0:
        raise NotProvable(f"the last visible key is at offset j - i = {'inf' if hi is None else hi}, "
                          f"not the query's own position ({band.describe()})")
    return MaskKind(None if lo is None else 1 - lo)
