"""The abstract values of the mask proof (`passes/masks/proof.py`) and what a proven mask is.

    Affine   const + sum_k coef_k * idx_k: positions (an integer-valued tensor)
    Band     g(form): piecewise constant g of a primitive integer form of the indices
    Const    a value without positions

`compose` re-expresses a Band after its indices are renamed, scaled or fixed (slices,
transposes, broadcast dims of size 1); `mask_kind` reads what a Band of j - i lets each
query see; `SeqLimit` is how long a sequence a proof holds for (positions in a narrow dtype),
kept in the graph's meta and checked at every call (`check_seq_limit`), as are the inputs a
program treats as all ones (`check_ones_inputs`, `passes/ones_inputs.py`).
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from sppo_fx.errors import SppoError

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
    what: str = "the attention mask"  # what computes the positions

    def message(self, seq_len: int) -> str:
        return (f"{self.what} computes positions in {self.dtype} ({self.where}), exact only for "
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


def check_ones_inputs(gm: fx.GraphModule, tensors) -> None:
    """Raise SppoError (before any work of the call) when an input the program treats as all
    ones (`passes/ones_inputs.py`, gm.meta["sppo_ones_inputs"]) is not all ones in this call.

    Args:
        gm: the analysed graph of the program that runs the call.
        tensors: the call's flat input tensors (capture order), or the call's
            (args, kwargs, target) (every micro-batch at once).
    """
    guards = getattr(gm, "meta", {}).get("sppo_ones_inputs")
    if not guards:
        return
    if isinstance(tensors, tuple):
        tensors = [x for x in pytree.tree_leaves((tuple(tensors[0]), dict(tensors[1]), tensors[2]))
                   if isinstance(x, torch.Tensor)]
    for guard in guards:
        t = tensors[guard.index]
        bad = int((t != 1).sum())
        if bad:
            raise SppoError(
                f"{guard.label} was all ones when sppo_fx compiled this model, so the program treats it as "
                f"a mask of ones (no padding); in this call {bad} of its {t.numel()} values are not 1 "
                f"(padding), which that program would silently ignore. Pass {guard.label} of all ones or "
                "leave it out, or train on packed sequences (position_ids restarting at 0 per document, "
                "no padding) instead of padded ones")


def exact_range(dtype: torch.dtype) -> tuple[int, int] | None:
    """The integers a dtype holds exactly (None: not a number dtype for positions)."""
    if dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
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
