"""Symbolic proof of packed-document masks: causal (or windowed) attention inside documents.

`mask_proof.MaskEvaluator` proves masks that are functions of d = j - i only. A packed
batch's mask also reads a user input: Hugging Face's `position_ids` restarting at each
document (masking_utils: `find_packed_sequence_indices`, then `pos[kv] <= pos[q]` and
`seg[q] == seg[kv]`), or a document-id tensor (`doc[:, :, None] == doc[:, None, :]`).
This evaluator adds two abstract values:

    Tok   a per-token integer tensor read from one input `root` [B, T] (or [T]), at the
          query index (seq dim -2), the key index (-1) or still along its own seq dim,
          plus an integer offset; role "raw" (the input's values) or "segments"
          (`cumsum(diff(root, prepend=..) != 1)`: labels equal exactly on the runs where
          the root steps by 1, i.e. Hugging Face's packed-sequence indices).
    Seg   a mask whose value is `inside(d)` for a query and key in the same document and
          `outside(d)` (None: unknown) across documents, where "document" is
          Documents(root, convention):
              "position_ids"  runs where the root steps by 1. Inside one, pos[j] - pos[i]
                              = j - i, so comparing positions is a Band of d;
              "document_ids"  runs of equal ids (the runtime checks each id is one run).

Comparisons produce Segs: `seg_q == seg_k` and `id_q == id_k` are (inside True, outside
False); `pos_k <= pos_q - c` is (inside: a Band of d, outside: unknown). Pointwise ops
combine Segs of the same Documents piece by piece; `&` with a known False outside stays
False, anything else unknown stays unknown. A mask is a document mask when its inside is
causal (or a sliding window) by `mask_proof.mask_kind` and its outside is known and blocks
every key; anything else raises `NotProvable`. Without an input in the mask the proof is
the plain one (a Band); an `index` of a position range by position ranges (Hugging Face's
mask functions with position_ids = arange) stays an Affine of the indices.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch
import torch.fx as fx

from sppo_fx.passes.masks.proof import (CAST_OPS, IDENTITY_OPS, _CMP, _EXTRA_POINTWISE, _NEW_FACTORIES, Affine, Band, Const, MaskEvaluator,
                                       MaskKind, NotProvable, SeqLimit, _affine_predicate, _affine_scale, _affine_sub,
                                       _combine, _same, _shift_unsqueeze, evaluate_mask, is_blocking_fill,
                                       mask_kind)

aten = torch.ops.aten
_INTS = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
_AND = {aten.__and__.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor}


@dataclasses.dataclass(frozen=True)
class Documents:
    """How a proven mask splits the sequence into documents (see the module docstring)."""

    source: str  # the input placeholder's name
    convention: str  # "position_ids" | "document_ids"


@dataclasses.dataclass(frozen=True)
class Tok:
    root: fx.Node
    role: str  # "raw" | "segments"
    seq_key: int  # right-aligned dim the token index runs along
    batch_key: int | None  # right-aligned dim of the root's batch rows (None: rows all alike)
    offset: Fraction
    ndim: int


@dataclasses.dataclass(frozen=True)
class Seg:
    docs: Documents
    inside: Band
    outside: Band | None  # None: unknown across documents
    batch_key: int | None
    ndim: int


@dataclasses.dataclass(frozen=True)
class ProvenMask:
    """A proven mask: `kind` inside each document; `documents` None for one document."""

    kind: MaskKind
    documents: Documents | None = None
    limit: SeqLimit | None = None  # the longest sequence the proof holds for (narrow dtypes)


def _shift(key, nd_in, dim):
    return None if key is None else _shift_unsqueeze(key, nd_in, dim)


class DocumentMaskEvaluator(MaskEvaluator):
    """`MaskEvaluator` plus user inputs read per token (module docstring)."""

    def _placeholder(self, node: fx.Node):
        if self.param_value(node.name) is not None:
            return super()._placeholder(node)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in _INTS or val.dim() not in (1, 2) \
                or not _is_seq_size(val.shape[-1], self.seq):
            raise NotProvable(f"it depends on the input '{node.name}', which is not a [batch, seq] integer "
                              "tensor (position ids or document ids)")
        rows = val.shape[0] if val.dim() == 2 else 1
        return Tok(node, "raw", -1, -2 if rows != 1 else None, Fraction(0), val.dim())

    def _eval(self, node: fx.Node):
        if node.op != "call_function":
            return super()._eval(node)
        t = node.target
        if t is aten.cumsum.default:
            seg = self._segments(node)
            if seg is not None:
                return seg
        if t is aten.index.Tensor:
            return self._index(node)
        if t in _NEW_FACTORIES:  # reads only its argument's dtype and device
            return super()._eval(node)
        # tensor arguments only: a size node (arange(T)'s T) is not a value the proof models
        args = [self.value(a) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else a
                for a in node.args]
        if not any(isinstance(a, (Tok, Seg)) for a in args):
            return super()._eval(node)
        x = args[0]
        if t in IDENTITY_OPS:
            return x
        if t in CAST_OPS:
            return self._cast_doc(node, x)
        if t is aten.unsqueeze.default:
            nd, dim = node.args[0].meta["val"].dim(), node.args[1]
            if isinstance(x, Tok):
                return dataclasses.replace(x, seq_key=_shift(x.seq_key, nd, dim),
                                           batch_key=_shift(x.batch_key, nd, dim), ndim=nd + 1)
            if _shift_unsqueeze(-2, nd, dim) != -2:
                raise NotProvable(f"{node.name} inserts a dim between the query and key dims")
            return dataclasses.replace(x, batch_key=_shift(x.batch_key, nd, dim), ndim=nd + 1)
        if t in (aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return self._reshape_tok(node, x)
        if t is aten.slice.Tensor:
            src, out = node.args[0].meta["val"], node.meta["val"]
            if all(_same_dim(a, b) for a, b in zip(src.shape, out.shape)):
                return x
            raise NotProvable(f"{node.name} slices a value read from the input")
        packet = getattr(t, "overloadpacket", None)
        if packet in _CMP and any(isinstance(a, Tok) for a in args[:2]):
            return self._compare_tok(node, _CMP[packet], args[0], args[1])
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and isinstance(x, Tok):
            return self._offset(node, x, args[1], node.kwargs.get("alpha", 1))
        if any(isinstance(a, Tok) for a in args):
            raise NotProvable(f"{node.name} ({t}) applies to values read from the input other than by "
                              "comparing them")
        if not (packet in _CMP or t in _EXTRA_POINTWISE
                or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)):
            # evaluated piece by piece only when the op acts on each element alone
            raise NotProvable(f"{node.name} ({t}) is not an op the mask proof models")
        return self._seg_pointwise(node, args)

    # -- values read from the input -----------------------------------------------------
    def _segments(self, node: fx.Node):
        """cumsum(ne(diff(P, 1, dim, prepend), 1), dim): Hugging Face's packed-sequence
        indices of P, or None when the node is not that pattern."""
        dim = node.args[1]
        ne = node.args[0]
        if not (isinstance(ne, fx.Node) and ne.target in (aten.ne.Scalar, aten.ne.Tensor)
                and ne.args[1] == 1 and isinstance(ne.args[0], fx.Node)
                and ne.args[0].target is aten.diff.default):
            return None
        diff = ne.args[0]
        d_args = list(diff.args) + [None] * (5 - len(diff.args))
        n, ddim, prepend, append = d_args[1] or 1, d_args[2] if d_args[2] is not None else -1, d_args[3], d_args[4]
        nd = node.meta["val"].dim()
        if node.meta["val"].dtype is not torch.int64:  # a narrower count could wrap: ids would repeat
            return None
        if n != 1 or append is not None or ddim % nd != dim % nd or not isinstance(prepend, fx.Node) \
                or not _is_one(prepend.meta["val"].shape[ddim]):
            return None
        src = self.value(diff.args[0])
        if isinstance(src, Tok) and src.role == "raw" and src.offset == 0 and src.seq_key == dim % nd - nd:
            _wide(src, node)
            return dataclasses.replace(src, role="segments")
        if isinstance(src, Affine) and dict(src.coefs).get(dim % nd - nd) == 1 \
                and _is_first_minus_one(prepend, diff.args[0], ddim % nd):
            # a position range steps by 1 everywhere and its prepend makes the first step 1: all 0
            return Affine((), Fraction(0), nd)
        return None

    def _index(self, node: fx.Node):
        """x[i0, i1]: a [B, T] (or [T]) value read at index tensors that are position ranges."""
        x = self.value(node.args[0])
        indices = node.args[1]
        src = node.args[0].meta["val"]
        out_nd = node.meta["val"].dim()
        if len(indices) != src.dim() or any(not isinstance(i, fx.Node) for i in indices):
            raise NotProvable(f"{node.name} indexes with something other than one index tensor per dim")
        idx = [self.value(i) for i in indices]
        if not all(isinstance(i, Affine) for i in idx):
            raise NotProvable(f"{node.name} indexes with computed indices")
        idx = [dataclasses.replace(i, ndim=out_nd) for i in idx]
        if isinstance(x, Affine):  # value = const + sum over x's dims of coef * index along it
            out = Affine((), x.const, out_nd)
            for k, c in x.coefs:
                out = _affine_sub(out, _affine_scale(idx[src.dim() + k], -c))
            return out
        if isinstance(x, Tok) and x.ndim == src.dim() and x.seq_key == -1:
            seq = _single_index(idx[-1], node)
            batch = None
            if x.batch_key is not None:
                batch = _single_index(idx[0], node)
                if not _same_dim(node.meta["val"].shape[batch], x.root.meta["val"].shape[0]):
                    raise NotProvable(f"{node.name} reads some batch rows of '{x.root.name}' for all of them")
            return dataclasses.replace(x, seq_key=seq, batch_key=batch, ndim=out_nd)
        raise NotProvable(f"{node.name} indexes a value the mask proof does not model")

    def _cast_doc(self, node: fx.Node, x):
        src, out = node.args[0].meta["val"].dtype, node.meta["val"].dtype
        if isinstance(x, Tok):
            # equality of ids survives only a cast that cannot merge two of them
            if out != src and out is not torch.int64:
                raise NotProvable(f"{node.name} casts values read from the input to {out}")
            return x
        cast = lambda b: None if b is None else dataclasses.replace(b, values=b.values.to(out))  # noqa: E731
        return dataclasses.replace(x, inside=cast(x.inside), outside=cast(x.outside))

    def _reshape_tok(self, node: fx.Node, x):
        """expand (broadcast, right-aligned keys kept) or a view that only adds or drops dims
        of size 1 left of the position dims."""
        src, out = node.args[0].meta["val"].shape, node.meta["val"].shape
        if node.target is aten.expand.default:
            return dataclasses.replace(x, ndim=len(out))
        if isinstance(x, Seg):
            return self._reshape_seg(node, x, src, out)
        keys = [k for k in ((x.seq_key, x.batch_key) if isinstance(x, Tok) else (-2, -1, x.batch_key))
                if k is not None]
        keep = -min(keys)
        if len(out) < keep or any(not _same_dim(src[i], out[i]) for i in range(-keep, 0)):
            raise NotProvable(f"{node.name} reshapes the dims of a value read from the input")
        if any(not _is_one(s) for s in list(src[:len(src) - keep]) + list(out[:len(out) - keep])):
            raise NotProvable(f"{node.name} merges dims of a value read from the input")
        return dataclasses.replace(x, ndim=len(out))

    def _reshape_seg(self, node: fx.Node, x: Seg, src, out) -> Seg:
        """A view that keeps the position dims and the other dims of size > 1 in order
        (e.g. [B, T, T] -> [B, 1, T, T]); the batch dim moves with them."""
        if len(src) < 2 or len(out) < 2 or not all(_same_dim(src[i], out[i]) for i in (-2, -1)):
            raise NotProvable(f"{node.name} reshapes the position dims")
        big_src = [i - len(src) for i in range(len(src) - 2) if not _is_one(src[i])]
        big_out = [i - len(out) for i in range(len(out) - 2) if not _is_one(out[i])]
        if len(big_src) != len(big_out) or not all(_same_dim(src[a], out[b]) for a, b in zip(big_src, big_out)):
            raise NotProvable(f"{node.name} merges or splits the batch dims of a mask")
        if x.batch_key is not None and x.batch_key not in big_src:
            raise NotProvable(f"{node.name} reshapes the batch dim of a mask")
        batch = None if x.batch_key is None else big_out[big_src.index(x.batch_key)]
        return dataclasses.replace(x, batch_key=batch, ndim=len(out))

    def _offset(self, node: fx.Node, x: Tok, other, alpha):
        c = other.value if isinstance(other, Const) else other
        if isinstance(c, torch.Tensor):
            c = c.item()
        if x.role != "raw" or isinstance(c, bool) or not isinstance(c, int) or not isinstance(alpha, int):
            raise NotProvable(f"{node.name} adds something other than an integer to values read from the input")
        _wide(x, node)
        sign = -1 if node.target in (aten.sub.Tensor, aten.sub.Scalar) else 1
        return dataclasses.replace(x, offset=x.offset + sign * alpha * c)

    def _compare_tok(self, node: fx.Node, op, a, b) -> Seg:
        if not (isinstance(a, Tok) and isinstance(b, Tok)) or a.root is not b.root or a.role != b.role:
            raise NotProvable(f"{node.name} compares a value read from the input with something else")
        if {a.seq_key, b.seq_key} != {-2, -1}:
            raise NotProvable(f"{node.name} compares values read from the input other than query against key")
        if a.batch_key != b.batch_key:
            raise NotProvable(f"{node.name} compares values of different batch rows")
        nd = max(a.ndim, b.ndim, 2)
        if op in (_CMP[aten.eq], _CMP[aten.ne]) and a.offset == b.offset:
            same = op is _CMP[aten.eq]
            conv = "position_ids" if a.role == "segments" else "document_ids"
            return Seg(Documents(a.root.name, conv), _const_band(same, nd), _const_band(not same, nd),
                       a.batch_key, nd)
        if a.role != "raw":
            raise NotProvable(f"{node.name} orders document indices")
        _wide(a, node)
        # inside one run where the root steps by 1, root[j] - root[i] = j - i
        diff = Affine(tuple(sorted(((a.seq_key, 1), (b.seq_key, -1)))), a.offset - b.offset, nd)
        return Seg(Documents(a.root.name, "position_ids"), _affine_predicate(diff, op, node), None, a.batch_key, nd)

    # -- masks split by documents -------------------------------------------------------
    def _seg_pointwise(self, node: fx.Node, args) -> Seg:
        segs = [a for a in args if isinstance(a, Seg)]
        docs = {s.docs for s in segs}
        if len(docs) != 1:
            raise NotProvable(f"{node.name} combines masks of different document splits "
                              f"({', '.join(sorted(f'{d.convention} of {d.source}' for d in docs))})")
        batch = {s.batch_key for s in segs} - {None}
        if len(batch) > 1:
            raise NotProvable(f"{node.name} combines masks of different batch rows")
        if any(isinstance(a, (Affine, Tok)) for a in args) or any(
                not isinstance(a, (Seg, Band, Const, bool, int, float)) and a is not None for a in args):
            raise NotProvable(f"{node.name} ({node.target}) combines a mask with raw positions")
        ndim = node.meta["val"].dim()

        def side(pick):
            parts = [pick(a) if isinstance(a, Seg) else a for a in args]
            if any(p is None for p, a in zip(parts, args) if isinstance(a, Seg)):
                return None
            return self._pointwise(node, parts)

        inside = side(lambda s: s.inside)
        outside = side(lambda s: s.outside)
        if outside is None and node.target in _AND and any(
                isinstance(a, Seg) and a.outside is not None and _all_false(a.outside) for a in args):
            outside = _const_band(False, ndim)
        if not isinstance(inside, Band) or (outside is not None and not isinstance(outside, Band)):
            raise NotProvable(f"{node.name} does not give a mask over query and key positions")
        return Seg(segs[0].docs, inside, outside, next(iter(batch), None), ndim)


def _wide(tok: Tok, node: fx.Node) -> None:
    """Positions read from the input step by 1 inside a document only if they cannot wrap:
    in int8, 127 is followed by -128 (127 + 1 wraps), yet -128 < 127 orders them backwards."""
    dtype = tok.root.meta["val"].dtype
    if dtype not in (torch.int64, torch.int32):
        raise NotProvable(f"{node.name} orders or offsets positions read from the input '{tok.root.name}', "
                          f"which holds them as {dtype} and wraps: pass them as torch.int64")


def _const_band(value: bool, ndim: int) -> Band:
    return Band((), torch.tensor([value]), ndim)


def _all_false(band: Band) -> bool:
    return band.values.dtype == torch.bool and not bool(band.values.any())


def _is_seq_size(size, seq) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == seq


def _same_dim(a, b) -> bool:
    ea = a.node.expr if isinstance(a, torch.SymInt) else int(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else int(b)
    return ea == eb


def _is_one(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 1


def _single_index(idx: Affine, node: fx.Node) -> int:
    """The dim a [0, n) index range runs along (it must be exactly that range)."""
    if idx.const != 0 or len(idx.coefs) != 1 or idx.coefs[0][1] != 1:
        raise NotProvable(f"{node.name} indexes at positions other than 0..n-1 along one dim")
    return idx.coefs[0][0]


def _is_first_minus_one(prepend: fx.Node, source: fx.Node, dim: int) -> bool:
    """prepend = source[..., :1] - 1 (Hugging Face's `position_ids[:, :1] - 1`)."""
    if prepend.target not in (aten.sub.Tensor, aten.sub.Scalar) or prepend.args[1] != 1:
        return False
    first = prepend.args[0]
    if not (isinstance(first, fx.Node) and first.target is aten.slice.Tensor and first.args[0] is source):
        return False
    lo = first.args[2] if len(first.args) > 2 else 0
    hi = first.args[3] if len(first.args) > 3 else None
    return first.args[1] % prepend.meta["val"].dim() == dim and lo == 0 and hi == 1


def _outside_blocked(band: Band, how: str, dtype: torch.dtype) -> bool:
    vals = band.canonical().values
    if how == "additive":
        return vals.dtype != torch.bool and all(is_blocking_fill(v, dtype) for v in vals.tolist())
    if vals.dtype != torch.bool:
        return False
    return all(bool(v) == (how == "blocked") for v in vals.tolist())


def prove_mask(mask: fx.Node, seq, param_value, how: str, dtype: torch.dtype, batch_ndim: int) -> ProvenMask:
    """What an attention mask lets each query see, for every length and every input.

    Args:
        mask: the mask node (boolean "allowed"/"blocked" or "additive", as `mask_kind`).
        seq: the sequence symbol.
        param_value: parameter/buffer/constant tensor of a placeholder, None for inputs.
        how, dtype: as for `mask_proof.mask_kind`.
        batch_ndim: the attention scores' rank ([b, h, T, T]: 4); a mask that reads a
            batched input must vary along the scores' batch dim (right-aligned -batch_ndim).

    Returns:
        ProvenMask. Raises NotProvable with the reason otherwise.
    """
    evaluator = DocumentMaskEvaluator(seq, param_value)
    value = evaluator.value(mask)
    if isinstance(value, Band):
        return ProvenMask(mask_kind(value, how, dtype), None, evaluator.limit)
    if isinstance(value, Seg):
        kind = mask_kind(value.inside, how, dtype)
        if value.outside is None:
            raise NotProvable(f"it does not say what a query sees in other documents ({value.docs.convention} "
                              f"of '{value.docs.source}')")
        if not _outside_blocked(value.outside, how, dtype):
            raise NotProvable(f"queries see keys of other documents ({value.docs.convention} of "
                              f"'{value.docs.source}')")
        if value.batch_key is not None and value.batch_key != -batch_ndim:
            raise NotProvable("its batch rows are not the attention's batch rows")
        return ProvenMask(kind, value.docs, evaluator.limit)
    raise NotProvable("it is not a sequence x sequence mask that depends on the query and key positions")


__all__ = ["Documents", "ProvenMask", "prove_mask", "DocumentMaskEvaluator", "evaluate_mask", "_same"]


def document_positions_node(gm: fx.GraphModule, docs: Documents, memo: dict) -> fx.Node:
    """The node computing `attention.document_positions` of the documents' source input,
    inserted after the placeholders (one per source and convention)."""
    from sppo_fx.chunk_attention.functions import document_positions
    key = (docs.source, docs.convention)
    if key not in memo:
        nodes = list(gm.graph.nodes)
        source = next(n for n in nodes if n.op == "placeholder" and n.name == docs.source)
        last = [n for n in nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            node = gm.graph.call_function(document_positions, (source, docs.convention))
        val = source.meta["val"]
        with val.fake_mode:
            node.meta["val"] = document_positions(val, docs.convention)
        node.meta["stack_trace"] = source.meta.get("stack_trace")
        memo[key] = node
    return memo[key]
