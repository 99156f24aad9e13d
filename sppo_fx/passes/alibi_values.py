"""Values of an attention bias subgraph as affine functions of its positions (for
`passes/alibi.py`).

A value of logical shape [n_0, .., n_k] (sizes concrete or multiples of the sequence length
T) is held as

    v[x_0, .., x_k] = K[x] + KT[x] * T + sum_d C_d[x] * x_d

where K, KT and each C_d are concrete float64 tensors broadcastable to the logical shape,
of size 1 along every sequence-length dim. So a value is exactly affine in T and in the
index along each dim that has a C_d (an `arange`), and anything else about it is a concrete
table. Ops that keep this form (add, sub, mul or div by a position-free value, views,
expand, repeat, slice, select, permute, casts to float32 or wider) are evaluated in it;
ops that do not (pow, exp, cat, ...) are evaluated concretely in the node's dtype and are
only allowed on position-free values of concrete shape (the slopes' own arithmetic). A
product of two position-dependent values (quadratic), an input, a learned parameter, a
cast of a position-dependent value to a narrower dtype, or any other op raises `NotAffine`
naming the node: the bias is then not proven.
"""
from __future__ import annotations

import dataclasses
import math

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import describe_node

aten = torch.ops.aten
F64 = torch.float64


class NotAffine(Exception):
    pass


@dataclasses.dataclass
class Aff:
    shape: list          # logical sizes: int or sympy expression in T
    K: torch.Tensor
    KT: torch.Tensor
    C: dict              # dim -> coefficient tensor

    def fixed(self) -> bool:  # no dependence on T or on any index
        return not self.C and not bool(self.KT.ne(0).any())


def _size(s):
    if isinstance(s, torch.SymInt):
        e = sympy.expand(s.node.expr)
        return int(e) if e.is_Integer else e
    return int(s)


def _shape(node) -> list:
    return [_size(s) for s in node.meta["val"].shape]


def _store_shape(shape) -> list:
    return [s if isinstance(s, int) else 1 for s in shape]


def _const(shape, t: torch.Tensor) -> Aff:
    t = t.to(F64)
    return Aff(list(shape), t, torch.zeros_like(t), {})


def _scalar(x, seq) -> Aff:
    """A Python number or a SymInt (node): a 0-d value affine in T."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    if isinstance(x, (torch.SymInt, _Expr)):
        e = sympy.expand(x.node.expr if isinstance(x, torch.SymInt) else x.expr)
        a, b = e.coeff(seq, 1), e.subs(seq, 0)
        if sympy.expand(e - a * seq - b) != 0 or not (a.is_number and b.is_number):
            raise NotAffine(f"the size {e} is not affine in the sequence length")
        return Aff([], torch.tensor(float(b), dtype=F64), torch.tensor(float(a), dtype=F64), {})
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return _const([], torch.tensor(float(x)))
    raise NotAffine(f"the argument {x!r} is not a number")


def _align(v: Aff, nd: int) -> Aff:
    pad = nd - len(v.shape)
    if pad == 0:
        return v
    r = lambda t: t.reshape([1] * pad + list(t.shape))  # noqa: E731
    return Aff([1] * pad + v.shape, r(v.K), r(v.KT), {d + pad: r(c) for d, c in v.C.items()})


def _bshape(a, b):
    out = []
    for x, y in zip(a, b):
        out.append(y if x == 1 else x)
    return out


def linear(a: Aff, b: Aff, fa: float, fb: float) -> Aff:
    nd = max(len(a.shape), len(b.shape))
    a, b = _align(a, nd), _align(b, nd)
    C = {d: fa * a.C.get(d, 0) + fb * b.C.get(d, 0) for d in set(a.C) | set(b.C)}
    return Aff(_bshape(a.shape, b.shape), fa * a.K + fb * b.K, fa * a.KT + fb * b.KT,
               {d: c if torch.is_tensor(c) else torch.tensor(float(c), dtype=F64) for d, c in C.items()})


def scale(a: Aff, f: Aff, node) -> Aff:
    """a * f with f position-free (else the product is quadratic in the positions)."""
    if not f.fixed():
        if a.fixed():
            a, f = f, a
        else:
            raise NotAffine(f"{describe_node(node)} multiplies two position-dependent values (not linear)")
    nd = max(len(a.shape), len(f.shape))
    a, f = _align(a, nd), _align(f, nd)
    return Aff(_bshape(a.shape, f.shape), a.K * f.K, a.KT * f.K, {d: c * f.K for d, c in a.C.items()})


def materialize(v: Aff, node) -> torch.Tensor:
    """The concrete values of a value of concrete shape that does not depend on T."""
    if any(not isinstance(s, int) for s in v.shape) or bool(v.KT.ne(0).any()):
        raise NotAffine(f"{describe_node(node)} computes a non-linear function of the sequence length or of "
                        "a position")
    out = v.K
    for d, c in v.C.items():
        shape = [1] * len(v.shape)
        shape[d] = v.shape[d]
        out = out + c * torch.arange(v.shape[d], dtype=F64).reshape(shape)
    return out.expand(v.shape).clone()


def select(v: Aff, d: int, start: Aff, length, step: int = 1) -> Aff:
    """v restricted along dim d to indices start + step * x (x < length); length None drops d."""
    K, KT, C = v.K, v.KT, dict(v.C)
    c = C.pop(d, None)
    if c is not None:  # x_d = start + step * x
        K, KT = K + c * float(start.K), KT + c * float(start.KT)
        if length is not None:
            C[d] = c * step
    elif v.K.shape[d] != 1 or v.KT.shape[d] != 1:  # a stored dim: index it concretely
        if not start.fixed():
            raise NotAffine("a table is indexed at a position that depends on the sequence length")
        s = int(start.K)
        n = 1 if length is None else length
        if not isinstance(n, int):
            raise NotAffine("a table is sliced to the sequence length (not proven linear)")
        idx = torch.arange(s, s + step * n, step)
        K = K.index_select(d, idx) if K.shape[d] != 1 else K
        KT = KT.index_select(d, idx) if KT.shape[d] != 1 else KT
        C = {k: (t.index_select(d, idx) if t.shape[d] != 1 else t) for k, t in C.items()}
    shape = list(v.shape)
    if length is None:
        sq = lambda t: t.squeeze(d)  # noqa: E731
        shape.pop(d)
        return Aff(shape, sq(K), sq(KT), {(k if k < d else k - 1): sq(t) for k, t in C.items()})
    shape[d] = length
    return Aff(shape, K, KT, C)


def permute(v: Aff, perm) -> Aff:
    inv = {p: i for i, p in enumerate(perm)}
    return Aff([v.shape[p] for p in perm], v.K.permute(perm), v.KT.permute(perm),
               {inv[d]: c.permute(perm) for d, c in v.C.items()})


def _drop_ones(v: Aff) -> Aff:
    keep = [d for d, s in enumerate(v.shape) if s != 1]
    pick = lambda t: t.reshape([t.shape[d] for d in keep])  # noqa: E731
    return Aff([v.shape[d] for d in keep], pick(v.K), pick(v.KT),
               {keep.index(d): pick(c) for d, c in v.C.items() if d in keep})


def reshape_to(v: Aff, out_shape: list, node) -> Aff:
    src = _drop_ones(v)
    dst = [s for s in out_shape if s != 1]
    # group dims whose sizes match one to one; everything else must be concrete
    groups, i, j = [], 0, 0
    while i < len(src.shape) or j < len(dst):
        if i < len(src.shape) and j < len(dst) and sympy.simplify(src.shape[i] - dst[j]) == 0:
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi <= pj and i < len(src.shape):
                if not isinstance(src.shape[i], int):
                    raise NotAffine(f"{describe_node(node)} merges or splits a sequence-length dim")
                pi *= src.shape[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                if not isinstance(dst[j], int):
                    raise NotAffine(f"{describe_node(node)} merges or splits a sequence-length dim")
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                raise NotAffine(f"{describe_node(node)}: a reshape that cannot be followed")
            if pi == pj and gi and gj:
                break
        groups.append((gi, gj))
    # evaluate grouped (merged/split) source dims to tables, then reshape the storage
    for gi, gj in groups:
        if len(gi) != 1 or len(gj) != 1:
            for d in gi:
                src = _table_dim(src, d)
    merged = {d for gi, gj in groups if len(gi) > 1 or len(gj) > 1 for d in gi}

    def mk(t):
        t = t.expand([src.shape[d] if d in merged else t.shape[d] for d in range(len(src.shape))])
        return _regroup(t, groups, dst)

    C = {}
    for d, c in src.C.items():
        gj = next(gj for gi, gj in groups if gi == [d])
        C[gj[0]] = mk(c)
    out = Aff(dst, mk(src.K), mk(src.KT), C)
    # re-insert the size-1 dims of the output
    ones = [k for k, s in enumerate(out_shape) if s == 1]
    for k in ones:
        out = Aff(out.shape[:k] + [1] + out.shape[k:], out.K.unsqueeze(k), out.KT.unsqueeze(k),
                  {(d if d < k else d + 1): c.unsqueeze(k) for d, c in out.C.items()})
    return out


def _table_dim(v: Aff, d: int) -> Aff:
    """Fold dim d's coefficient (concrete size) into the tables."""
    c = v.C.pop(d, None)
    if c is not None:
        shape = [1] * len(v.shape)
        shape[d] = v.shape[d]
        v.K = v.K + c * torch.arange(v.shape[d], dtype=F64).reshape(shape)
    return v


def _regroup(t: torch.Tensor, groups, dst) -> torch.Tensor:
    shape = []
    for gi, gj in groups:
        if len(gi) == 1 and len(gj) == 1:
            shape.append(t.shape[gi[0]])
        elif all(t.shape[d] == 1 for d in gi):
            shape += [1] * len(gj)
        else:
            shape += [dst[k] for k in gj]
    return t.reshape(shape)


_PASS = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
         aten.detach_.default, aten.lift_fresh_copy.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.type_as.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# position-free values of concrete shape only (the slopes' arithmetic), run in the node's dtype
_CONCRETE = {aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.exp.default,
             aten.log.default, aten.log2.default, aten.sqrt.default, aten.rsqrt.default,
             aten.reciprocal.default, aten.cat.default, aten.floor.default, aten.ceil.default,
             aten.exp2.default, aten.abs.default}
_NARROW = {torch.float16, torch.bfloat16}


def _dtype_of(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class Evaluator:
    """Evaluates nodes to `Aff` values (memoised). `param_value(node)` gives the live tensor of
    a parameter/buffer/constant placeholder, None for inputs."""

    def __init__(self, seq, param_value):
        self.seq, self.param_value, self.memo = seq, param_value, {}

    def __call__(self, x) -> Aff:
        if not isinstance(x, fx.Node):
            return _scalar(x, self.seq)
        if x not in self.memo:
            self.memo[x] = self._eval(x)
        return self.memo[x]

    def _eval(self, n: fx.Node) -> Aff:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt) or isinstance(val, (int, float)) and n.op == "call_function":
            return _scalar(val, self.seq)
        if n.op in ("placeholder", "get_attr"):
            t = self.param_value(n.name if n.op == "placeholder" else n.target)
            if t is None:
                raise NotAffine(f"it depends on the input '{n.name}' (only a bias computed from positions and "
                                "constants can be proven)")
            if t.requires_grad:
                raise NotAffine(f"it reads the learned parameter '{n.name}' (a learned bias is not ALiBi)")
            return _const(list(t.shape), t.detach().cpu())
        if n.op != "call_function":
            raise NotAffine(f"{describe_node(n)} is not an op the bias proof follows")
        t, a = n.target, n.args
        if t in _PASS:
            return self(a[0])
        if t in _CASTS:
            v = self(a[0])
            dt = _dtype_of(n)
            if dt in _NARROW and not v.fixed():
                raise NotAffine(f"{describe_node(n)} rounds the position-dependent bias to {dt} (the chunk "
                                "attention computes it unrounded; keep the model in float32 or use autocast)")
            if dt is not None and not dt.is_floating_point and not v.fixed():
                raise NotAffine(f"{describe_node(n)} casts a position-dependent value to {dt}")
            return v if not v.fixed() or dt is None else _const(v.shape, materialize_cast(v, dt, n))
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            start, end, step = (0, a[0], 1) if t is aten.arange.default else (a[0], a[1], a[2] if len(a) > 2 else 1)
            step = n.kwargs.get("step", step)
            s = self(start)
            if not isinstance(step, (int, float)):
                raise NotAffine(f"{describe_node(n)}: arange with a non-constant step")
            return Aff(_shape(n), s.K.reshape(1), s.KT.reshape(1), {0: torch.tensor([float(step)], dtype=F64)})
        if t in (aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default,
                 aten.full_like.default, aten.zeros_like.default, aten.ones_like.default):
            fill = {aten.zeros.default: 0.0, aten.ones.default: 1.0, aten.zeros_like.default: 0.0,
                    aten.ones_like.default: 1.0}.get(t)
            if fill is None:
                fill = a[0] if t is aten.scalar_tensor.default else a[1]
            f = self(fill)
            shape = _shape(n)
            ones = [1] * len(shape)
            return Aff(shape, f.K.reshape(ones), f.KT.reshape(ones), {})
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
                 aten.rsub.Tensor):
            alpha = n.kwargs.get("alpha", 1)
            x, y = self(a[0]), self(a[1])
            if t in (aten.rsub.Scalar, aten.rsub.Tensor):
                x, y = y, x
            sign = 1.0 if t in (aten.add.Tensor, aten.add.Scalar) else -1.0
            return linear(x, y, 1.0, sign * float(alpha))
        if t is aten.neg.default:
            return linear(self(a[0]), _const([], torch.tensor(0.0)), -1.0, 0.0)
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            return scale(self(a[0]), self(a[1]), n)
        if t in (aten.div.Tensor, aten.div.Scalar):
            d = self(a[1])
            if not d.fixed():
                raise NotAffine(f"{describe_node(n)} divides by a position-dependent value (not linear)")
            return scale(self(a[0]), _const(d.shape, 1.0 / d.K), n)
        if t in _VIEWS:
            return reshape_to(self(a[0]), _shape(n), n)
        if t is aten.unsqueeze.default:
            v = self(a[0])
            d = a[1] % (len(v.shape) + 1)
            u = lambda x: x.unsqueeze(d)  # noqa: E731
            return Aff(v.shape[:d] + [1] + v.shape[d:], u(v.K), u(v.KT),
                       {(k if k < d else k + 1): u(c) for k, c in v.C.items()})
        if t in (aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims):
            return reshape_to(self(a[0]), _shape(n), n)
        if t is aten.expand.default:
            v = _align(self(a[0]), len(_shape(n)))
            return Aff(_shape(n), v.K, v.KT, v.C)
        if t is aten.repeat.default:
            v = _align(self(a[0]), len(a[1]))
            if any(r != 1 and not isinstance(s, int) for r, s in zip(a[1], v.shape)):
                raise NotAffine(f"{describe_node(n)} repeats along the sequence")
            for d, r in enumerate(a[1]):
                if r != 1:
                    v = _table_dim(v, d)
            rep = lambda x: x.expand(  # noqa: E731
                [v.shape[d] if a[1][d] != 1 else x.shape[d] for d in range(len(v.shape))]).repeat(list(a[1]))
            return Aff(_shape(n), rep(v.K), rep(v.KT), {d: rep(c) for d, c in v.C.items()})
        if t in (aten.permute.default, aten.transpose.int, aten.t.default):
            v = self(a[0])
            nd = len(v.shape)
            if t is aten.permute.default:
                perm = [p % nd for p in a[1]]
            else:
                i, j = (a[1] % nd, a[2] % nd) if t is aten.transpose.int else (0, 1)
                perm = list(range(nd))
                perm[i], perm[j] = perm[j], perm[i]
            return permute(v, perm)
        if t is aten.slice.Tensor:
            v = self(a[0])
            d = (a[1] if len(a) > 1 else 0) % len(v.shape)
            start = a[2] if len(a) > 2 and a[2] is not None else 0
            step = a[4] if len(a) > 4 else 1
            length = _shape(n)[d]
            if v.shape[d] == 1:  # whatever the start (MPT's max(0, 1 - T)): the one row (an empty
                return v         # slice would not broadcast against the scores)
            st = self(_max0(start))
            if st.fixed() and float(st.K) < 0:  # a negative start counts from the end
                st = linear(_scalar_size(v.shape[d], self.seq), st, 1.0, 1.0)
            elif not st.fixed() and not (float(st.KT) < 0 <= float(st.K) and isinstance(v.shape[d], int)):
                # max_len - T (MPT's last T columns) is the one symbolic start followed: it is >= 0
                # for every T the table holds; others may wrap around at runtime
                raise NotAffine(f"{describe_node(n)} slices from a start that depends on the sequence length")
            return select(v, d, st, length, int(step))
        if t is aten.select.int:
            v = self(a[0])
            d = a[1] % len(v.shape)
            st = self(a[2])
            if st.fixed() and float(st.K) < 0:
                st = linear(_scalar_size(v.shape[d], self.seq), st, 1.0, 1.0)
            return select(v, d, st, None)
        if t in _CONCRETE:
            args = [self(x) if isinstance(x, fx.Node) else x for x in (a[0] if t is aten.cat.default else a)]
            vals = [materialize(x, n).to(_dtype_of(n)) if isinstance(x, Aff) else x for x in args]
            out = t(vals, *a[1:]) if t is aten.cat.default else t(*vals)
            return _const(list(out.shape), out)
        raise NotAffine(f"{describe_node(n)} is not an op the bias proof follows")


def _max0(start):
    """max(0, L - T) as a slice start (MPT's last T of L columns) is L - T: the slice has the
    sequence length T only while T <= L (checked by the caller's shape), where the two agree."""
    val = start.meta.get("val") if isinstance(start, fx.Node) else None
    if isinstance(val, torch.SymInt) and type(val.node.expr).__name__ == "Max" and len(val.node.expr.args) == 2 \
            and 0 in val.node.expr.args:
        return _Expr(next(a for a in val.node.expr.args if a != 0))
    return start


class _Expr:
    def __init__(self, expr):
        self.expr = expr


def _scalar_size(size, seq) -> Aff:
    if isinstance(size, int):
        return _const([], torch.tensor(float(size)))
    a, b = sympy.expand(size).coeff(seq, 1), sympy.expand(size).subs(seq, 0)
    return Aff([], torch.tensor(float(b), dtype=F64), torch.tensor(float(a), dtype=F64), {})


def materialize_cast(v: Aff, dt, node) -> torch.Tensor:
    """A position-free value cast to `dt` (rounded as eager rounds it), kept broadcastable."""
    if bool(v.KT.ne(0).any()):
        raise NotAffine(f"{describe_node(node)} casts a value that depends on the sequence length")
    return v.K.to(dt).to(F64)
