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

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.seqdim import arg_expr

aten = torch.ops.aten
D_FORM = ((-2, -1), (-1, 1))  # j - i: key index minus query index


class NotProvable(Exception):
    """The mask cannot be evaluated symbolically; the message says why."""


@dataclasses.dataclass(frozen=True)
class Const:
    value: object  # Python scalar or a one-element tensor


@dataclasses.dataclass(frozen=True)
class Affine:
    coefs: tuple  # ((key, integer coefficient), ...) sorted by key, no zeros
    const: Fraction
    ndim: int


@dataclasses.dataclass(frozen=True)
class Band:
    breaks: tuple  # sorted ints; piece p covers breaks[p-1] <= x < breaks[p]
    values: torch.Tensor  # one value per piece (len(breaks) + 1)
    ndim: int
    form: tuple = ()  # ((key, coefficient), ...): the value is g(sum coef * idx_key)

    def canonical(self) -> "Band":
        """The same function with equal neighbouring pieces merged."""
        keep_b, keep_v = [], [self.values[0]]
        for b, v in zip(self.breaks, self.values[1:]):
            if not _same(v, keep_v[-1]):
                keep_b.append(b)
                keep_v.append(v)
        return Band(tuple(keep_b), torch.stack(keep_v), self.ndim, self.form if keep_b else ())

    def at(self, x: int):
        return self.values[sum(1 for b in self.breaks if x >= b)]

    def describe(self) -> str:
        c, var = self.canonical(), _form_text(self.form)
        pieces, lo = [], None
        for p, v in enumerate(c.values.tolist()):
            hi = c.breaks[p] - 1 if p < len(c.breaks) else None
            pieces.append(f"{'-inf' if lo is None else lo} <= {var} <= {'inf' if hi is None else hi}: {v}")
            lo = c.breaks[p] if p < len(c.breaks) else None
        return "; ".join(pieces)


def _form_text(form) -> str:
    names = {-1: "j", -2: "i"}
    text = " + ".join(f"{'' if c == 1 else '-' if c == -1 else f'{c}*'}{names.get(k, f'dim {k}')}"
                      for k, c in form).replace("+ -", "- ")
    return "j-i" if form == D_FORM else text or "0"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a == b) | (torch.isnan(a) & torch.isnan(b))) if a.is_floating_point() else bool(a == b)


def compose(band: Band, linear: dict, k0: int, ndim: int) -> Band:
    """The canonical Band of x -> g(sum linear[key] * idx_key + k0), g being `band`'s pieces."""
    linear = {k: c for k, c in linear.items() if c != 0}
    if not linear:
        return Band((), band.at(k0).reshape(1), ndim)
    keys = sorted(linear)
    m = math.gcd(*(int(linear[k]) for k in keys)) * (1 if linear[keys[-1]] > 0 else -1)
    # g(m*x + k0) changes value only next to x = (b - k0) / m for a break b of g
    cands = sorted({f + e for b in band.breaks for f in (math.floor(Fraction(b - k0, m)),
                                                          math.ceil(Fraction(b - k0, m))) for e in (0, 1)})
    reps = [cands[0] - 1] + cands if cands else [0]
    vals = torch.stack([band.at(m * x + k0) for x in reps])
    return Band(tuple(cands), vals, ndim, tuple((k, linear[k] // m) for k in keys)).canonical()


@dataclasses.dataclass(frozen=True)
class SeqLimit:
    """The longest sequence a proven mask is exact for, and why (positions in `dtype`)."""

    max_len: int
    dtype: torch.dtype
    where: str

    def message(self, seq_len: int) -> str:
        return (f"the attention mask computes positions in {self.dtype} ({self.where}), exact only for "
                f"sequences of at most {self.max_len} tokens; this sequence has {seq_len}. Compute the "
                "positions in torch.int64 (or a wider dtype), or train on shorter sequences")


def record_seq_limit(gm: fx.GraphModule, limit: SeqLimit | None) -> None:
    """Keep the tightest limit of a graph's proven masks in gm.meta["sppo_seq_limit"]."""
    old = gm.meta.get("sppo_seq_limit")
    if limit is not None and (old is None or limit.max_len < old.max_len):
        gm.meta["sppo_seq_limit"] = limit


def check_seq_limit(gm: fx.GraphModule, seq_len: int) -> None:
    """Raise SppoError (before any step) when `seq_len` exceeds a proven mask's limit."""
    limit = getattr(gm, "meta", {}).get("sppo_seq_limit")
    if limit is not None and seq_len > limit.max_len:
        raise SppoError(limit.message(seq_len))


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


def exact_range(dtype: torch.dtype) -> tuple[int, int] | None:
    """The integers a dtype holds exactly (None: not a number dtype for positions)."""
    if dtype in _INT_DTYPES:
        info = torch.iinfo(dtype)
        return info.min, info.max
    if dtype.is_floating_point and not dtype.is_complex:
        top = 2 ** {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}.get(dtype, 0)
        return (-top, top) if top > 1 else None
    return None


def _rekey(x, mapping: Callable[[int], int | None], ndim: int):
    """An Affine or Band with each varying key k moved to mapping(k) (None: dim removed)."""
    items = x.coefs if isinstance(x, Affine) else x.form
    moved = {}
    for k, c in items:
        nk = mapping(k)
        if nk is None:
            raise NotProvable("a dim the mask varies along is removed")
        moved[nk] = moved.get(nk, 0) + c
    if isinstance(x, Affine):
        return Affine(tuple(sorted((k, c) for k, c in moved.items() if c)), x.const, ndim)
    return compose(dataclasses.replace(x, form=()), moved, 0, ndim) if moved else dataclasses.replace(x, ndim=ndim)


def _substitute(x, key: int, scale: int, offset: int):
    """x with idx_key replaced by offset + scale * idx_key (a slice or a select)."""
    if isinstance(x, Affine):
        c = dict(x.coefs).get(key, 0)
        coefs = tuple((k, v * scale if k == key else v) for k, v in x.coefs if k != key or v * scale)
        return Affine(coefs, x.const + c * offset, x.ndim)
    lin = dict(x.form)
    c = lin.get(key, 0)
    if not c:
        return x
    lin[key] = c * scale
    return compose(dataclasses.replace(x, form=()), lin, c * offset, x.ndim)


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


def _raw(a):
    return a.value if isinstance(a, Const) else a


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
    """The Band of `diff OP 0` (diff: integer coefficients, any rational constant)."""
    if any(Fraction(c).denominator != 1 for _, c in diff.coefs):
        raise NotProvable(f"{node.name} compares positions scaled by a non-integer")
    nd = max(diff.ndim, 1)
    if not diff.coefs:
        return Band((), torch.tensor([bool(op(diff.const, 0))]), nd)
    # with x the primitive form and diff = m * x + k: the predicate changes value only where
    # m * x + k crosses 0, so evaluating it on each side of (and at) that point is exact
    lin = {k: int(c) for k, c in diff.coefs}
    keys = sorted(lin)
    m = math.gcd(*lin.values()) * (1 if lin[keys[-1]] > 0 else -1)
    x = -diff.const / m
    breaks = sorted({math.floor(x), math.floor(x) + 1, math.ceil(x), math.ceil(x) + 1})
    vals = torch.tensor([bool(op(m * d + diff.const, 0)) for d in [breaks[0] - 1] + breaks])
    return Band(tuple(breaks), vals, nd, tuple((k, lin[k] // m) for k in keys)).canonical()


def _combine(fn, args, ndim, node: fx.Node | None = None) -> Band:
    """A pointwise function of Bands of one form (and constants), piece by piece."""
    bands = [a for a in args if isinstance(a, Band)]
    forms = {b.form for b in bands} - {()}
    if len(forms) > 1:
        raise NotProvable(f"{node.name if node is not None else 'a mask op'} combines masks that vary along "
                          f"different positions ({', '.join(sorted(_form_text(f) for f in forms))})")
    breaks = sorted({b for band in bands for b in band.breaks})
    reps = [breaks[0] - 1] + breaks if breaks else [0]
    vals = fn(*(torch.stack([band.at(d) for d in reps]) for band in bands))
    return Band(tuple(breaks), vals.reshape(len(reps)), ndim, next(iter(forms), ())).canonical()


def is_blocking_fill(value, dtype: torch.dtype) -> bool:
    """-inf, or at most the dtype's lowest finite number (exp underflows to exactly 0)."""
    v = value.item() if isinstance(value, torch.Tensor) else value
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not dtype.is_floating_point:
        return False
    return v == -math.inf or v <= torch.finfo(dtype).min


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
        band: the mask's value (`evaluate_mask`), broadcast to the scores' [.., Tq, Tk].
        how: "allowed" (True = may attend: SDPA's boolean mask, `where(mask, s, -inf)`),
            "blocked" (True = blocked: `masked_fill(s, mask, -inf)`) or "additive"
            (0 = may attend, -inf / finfo.min = blocked: added to the scores).
        dtype: the scores' dtype (what counts as a blocking additive value).

    Returns:
        MaskKind(None) for causal, MaskKind(W) for a sliding window of W tokens. Raises
        NotProvable for anything else: keys after the query, the diagonal hidden, holes, a
        mask that varies along anything but d = j - i.
    """
    c = band.canonical()
    if c.form not in ((), D_FORM):
        raise NotProvable(f"the mask varies with {_form_text(c.form)}, not only with the key's offset j - i "
                          f"from the query ({band.describe()})")
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
    if not c.form:
        raise NotProvable(f"the mask is the same for every query and key ({'all visible' if visible[0] else 'all hidden'})")
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
