"""Mixture-of-experts dispatch proven token-local (docs/models-moe.md).

A token-choice MoE layer flattens the tokens to rows, gives every token k (expert, weight)
slots, reorders the slots by expert (a sort over the whole flattened batch and sequence),
runs each expert on its contiguous group of rows and puts the rows back in token order.
Each op on its own mixes tokens along the sequence; the composition does not. This pass
proves that, by abstract interpretation over the graph, and marks the nodes it proved
(`node.meta["sppo_moe"]`, read by `seqdim.analyse`). Nothing is matched by name alone:
every value carries an abstract layout, and every op on such a value has a rule that
states what the op does to it; an op without a rule is refused, naming it.

Abstract values (the flattened token axis is always dim 0; N tokens, k slots per token):

    Rows(order, k)   row r holds a function of slot s (its weights and its token's data
                     only), where s = r (order None) or s = P[r] for the permutation P
                     made by the sort `order`; slot s belongs to token s // k. A value the
                     sequence analysis accepts as token-local with its one sequence dim at
                     dim 0 is Rows(None, 1).
    Index(j, order, k)  integers: row r holds s // (k / j) (s as for Rows): the number of
                     its slot in a layout of j slots per token. A row number of the whole
                     batch, so it may only index; used as data it is refused.
    Inverse(P)       the inverse permutation of P (inv[P] = arange).
    Offsets(P, E)    cumsum of the per-expert counts of P's sorted expert ids.

Rules (why each keeps row r a function of its own slot):
- reshape [N*k, ...] -> [N*k', ...] with order None: each token's block of memory stays
  one block (the sizes after dim 0 absorb the ratio); k' must be a whole number, or a row
  would hold parts of two tokens. k' = 1 is the standard token layout again.
- repeat_interleave(x, r, dim=0): copies of a row are adjacent: Rows(None, k * r).
- pointwise ops and ops along other dims: row r from rows r of operands of the same
  layout (and values without a sequence dim); operands of different layouts are refused.
- sort(x) of Rows(None, k), 1-D: values[r] = x[P[r]] -> Rows(P, k); indices -> Index(k, P, k).
- floor_divide(Index(j), m), m | j: (s // (k/j)) // m = s // (k / (j/m)) -> Index(j/m).
- x[I] with x Rows(None, j), I = Index(j, order, k): row r = x's row s // (k/j), which is
  a function of slot s -> Rows(order, k).
- table[ids] with a table without a sequence dim and ids a Rows: a per-row lookup.
- inv = empty(n); inv[P] = arange(n) with n = len(P): Inverse(P); x[inv] with x Rows(P, k)
  gives row r = x[inv[r]], the row that holds slot P[inv[r]] = r -> Rows(None, k).
- grouped_mm(x, W, offs), x Rows(P, k) with P the ascending sort of expert ids in [0, E),
  offs = cumsum(histc(sorted ids)) with the histc checked to count each id in its own bin:
  rows of expert e are exactly the group [offs[e-1], offs[e]), so row r = x[r] @ W[id of
  slot P[r]] -> Rows(P, k).
Reductions over the whole row axis (histc, sum over dim 0) are left to the sequence
analysis, which accumulates them over chunks (the router's auxiliary loss).
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node

aten = torch.ops.aten

_SORTS = {aten.sort.default, aten.sort.stable}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_SAME_ROWS = {  # layout ops that keep dim 0 in place when their dim arguments are not 0
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
    aten.lift_fresh_copy.default,
}
_DIM_ARG_OPS = {  # op -> argument positions that hold dims; dim 0 must not be among them
    aten.squeeze.dim: (1,), aten.squeeze.dims: (1,),
    aten.transpose.int: (1, 2), aten.chunk.default: (2,), aten.split.Tensor: (2,),
    aten.split_with_sizes.default: (2,), aten.select.int: (1,), aten.slice.Tensor: (1,),
    aten.narrow.default: (1,), aten.sum.dim_IntList: (1,), aten.mean.dim: (1,),
    aten.amax.default: (1,), aten.softmax.int: (1,), aten._softmax.default: (1,),
    aten.log_softmax.int: (1,), aten._log_softmax.default: (1,), aten.topk.default: (2,),
    aten.permute.default: (1,),
}
_DIM_DEFAULTS = {aten.chunk.default: 0, aten.split.Tensor: 0, aten.split_with_sizes.default: 0,
                 aten.topk.default: -1}
_MATMULS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default}
_WHOLE_REDUCTIONS = {aten.histc.default, aten.sum.dim_IntList, aten.sum.default, aten.mean.default,
                     aten.mean.dim}
_FLOOR_DIVS = {aten.floor_divide.default, aten.floor_divide.Scalar}


@dataclasses.dataclass(frozen=True)
class Rows:
    order: fx.Node | None
    k: int
    ids: int | None = None        # the values are expert ids in [0, ids)
    sorted_ids: bool = False       # ... in ascending order along the rows (sort `order`'s values)


@dataclasses.dataclass(frozen=True)
class Index:
    j: int
    order: fx.Node | None
    k: int


@dataclasses.dataclass(frozen=True)
class Inverse:
    order: fx.Node
    k: int


@dataclasses.dataclass(frozen=True)
class Counts:
    order: fx.Node
    experts: int
    cumulative: bool = False


@dataclasses.dataclass(frozen=True)
class Claimed:  # an arange or a base tensor used only to build an inverse permutation
    pass


GROUPED_MM = {aten._grouped_mm.default}


def _grouped_mm_ops() -> set:
    ops = set(GROUPED_MM)
    try:  # Hugging Face's fallback for grouped_mm (registered when transformers' MoE code is imported)
        ops.add(torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):
        pass
    return ops


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _expr(size):
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


def _seq_dims(val, seq) -> list[int]:
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and seq in s.node.expr.free_symbols]


def _arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


class _Refused(Exception):
    pass


class _Walk:
    def __init__(self, gm: fx.GraphModule, seq):
        self.seq = seq
        self.gm = gm
        self.absval: dict[fx.Node, object] = {}
        self.expert_ids: dict[fx.Node, int] = {}  # standard values that are expert ids in [0, E)
        self.notes: dict[fx.Node, str] = {}
        self.grouped = _grouped_mm_ops()

    # -- helpers -------------------------------------------------------------------------
    def refuse(self, node: fx.Node, why: str):
        raise SppoError(
            f"{describe_node(node)} {why}. sppo_fx proves a mixture-of-experts dispatch token-local "
            "when every token's output depends only on its own router scores and the experts' "
            "weights (docs/models-moe.md); this op breaks that proof, so the model cannot be cut "
            "into sequence chunks exactly")

    def rows_of(self, node) -> Rows | None:
        """The Rows layout of a graph value, the standard token layout as Rows(None, 1)."""
        a = self.absval.get(node)
        if isinstance(a, Rows):
            return a
        if a is not None:
            return None
        dims = _seq_dims(_val(node), self.seq)
        if dims == [0]:
            return Rows(None, 1, self.expert_ids.get(node))
        return None

    def seq_inputs(self, node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if _seq_dims(_val(a), self.seq)]

    def abstract_inputs(self, node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if a in self.absval]

    def set(self, node, value, note):
        self.absval[node] = value
        self.notes[node] = note

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> dict[fx.Node, str]:
        for node in self.gm.graph.nodes:
            if node.op == "output":
                for a in node.all_input_nodes:
                    if a in self.absval and not isinstance(self.absval[a], Claimed):
                        self.refuse(a, "is a value in the experts' row order that leaves the graph")
                continue
            if node.op != "call_function":
                continue
            self.visit(node)
        for node, value in self.absval.items():  # a claimed value read by anything else
            if isinstance(value, Claimed):
                for u in node.users:
                    if u not in self.notes:
                        self.refuse(u, f"reads {node.name}, which builds the inverse of an expert sort")
        return self.notes

    def visit(self, node: fx.Node):
        t = node.target
        ins = self.abstract_inputs(node)
        self.track_expert_ids(node)
        if not ins:
            self.entry(node)
            return
        kinds = {type(self.absval[a]) for a in ins}
        if t in (aten.empty_like.default, aten.zeros_like.default) and kinds == {Index}:
            return self.set(node, Claimed(), "a fresh tensor for the inverse of an expert sort")
        if Claimed in kinds and not (t is aten.index_put_.default or t is aten.index_put.default):
            self.refuse(node, "reads a tensor that builds the inverse of an expert sort")
        if t in self.grouped:
            return self.grouped_mm(node)
        if t is aten.histc.default:
            return self.histc(node)
        if t is aten.cumsum.default:
            return self.cumsum(node)
        if t in (aten.index_put_.default, aten.index_put.default):
            return self.inverse(node)
        if Index in kinds or Inverse in kinds:
            if t is aten.index.Tensor:
                return self.gather(node)
            if t in _FLOOR_DIVS or (t is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor"):
                return self.floor_divide(node)
            if t in _SAME_ROWS or t is operator.getitem:
                if len(ins) == 1 and isinstance(self.absval[ins[0]], Index) and t is not operator.getitem \
                        and not _val(node).dtype.is_floating_point:
                    return self.set(node, self.absval[ins[0]], "the same index")
            self.refuse(node, "uses a row number of the whole flattened batch (the position of a slot after "
                        "sorting the tokens by expert) as a value, e.g. to limit each expert's capacity; a "
                        "chunk would number its own rows")
        if Counts in kinds and t in _SAME_ROWS and len(ins) == 1:  # e.g. float counts to int32 offsets
            return self.set(node, self.absval[ins[0]], "the same counts")
        if Counts in kinds:
            self.refuse(node, "reads the per-expert token counts of a sort for something other than grouping the "
                        "rows of a grouped matmul (e.g. an expert capacity limit), which depends on the tokens "
                        "of the whole batch")
        if t is aten.index.Tensor:
            return self.gather(node)
        if t in _SORTS or t in (aten.argsort.default, aten.argsort.stable):
            return self.sort(node)
        if t is operator.getitem:
            src = self.absval[node.args[0]]
            if isinstance(src, tuple):  # a sort's (values, indices)
                return self.set(node, src[node.args[1]], "an output of a sort by expert")
            return self.set(node, src, "a part of a row-wise value")
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
            return self.reshape(node)
        if t is aten.repeat_interleave.self_int:
            return self.repeat_interleave(node)
        return self.rowwise(node)

    def track_expert_ids(self, node: fx.Node):
        """Standard values that hold expert ids: topk's indices over a dim of E experts."""
        if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node) \
                and node.args[0].target is aten.topk.default:
            x = _val(node.args[0].args[0])
            dim = _arg(node.args[0], 2, "dim", -1) % x.dim()
            if dim not in _seq_dims(x, self.seq) and not isinstance(x.shape[dim], torch.SymInt):
                self.expert_ids[node] = int(x.shape[dim])
        elif node.target in _SAME_ROWS and node.args and node.args[0] in self.expert_ids:
            self.expert_ids[node] = self.expert_ids[node.args[0]]

    def entry(self, node: fx.Node):
        """Ops on standard values that make the slot layout (their results are Rows k > 1)."""
        t = node.target
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
            x = node.args[0]
            if self.rows_of(x) is not None and _seq_dims(_val(node), self.seq) == [0]:
                ratio = sympy.simplify(_expr(_val(node).shape[0]) / _expr(_val(x).shape[0]))
                if ratio.is_Integer and int(ratio) > 1:
                    self.reshape(node)
        elif t is aten.repeat_interleave.self_int and self.rows_of(node.args[0]) is not None:
            self.repeat_interleave(node)
        elif t in _SORTS or t in (aten.argsort.default, aten.argsort.stable):
            if self.rows_of(node.args[0]) is not None and _val(node.args[0]).dim() == 1:
                self.sort(node)

    # -- rules -----------------------------------------------------------------------------
    def reshape(self, node):
        x = node.args[0]
        r = self.rows_of(x)
        if r is None or _seq_dims(_val(node), self.seq) != [0]:
            self.refuse(node, "reshapes rows of the experts' layout so that dim 0 is no longer the row dim")
        ratio = sympy.simplify(_expr(_val(node).shape[0]) / _expr(_val(x).shape[0]))
        k = sympy.Integer(r.k) * ratio
        if not (k.is_Integer and int(k) >= 1):
            self.refuse(node, f"reshapes token-expert rows ({r.k} per token) into rows that hold parts of "
                        "several tokens")
        if r.order is not None and int(k) != r.k:
            self.refuse(node, "regroups token-expert rows while they are sorted by expert")
        ids = r.ids  # a reshape keeps the values
        if int(k) == 1 and r.order is None:  # the standard token layout again: the sequence analysis' own
            self.notes[node] = "token-expert rows folded back to one row per token"
            return
        self.set(node, Rows(r.order, int(k), ids, r.sorted_ids and ratio == 1),
                 f"token-expert rows, {int(k)} per token, each token's rows adjacent")

    def repeat_interleave(self, node):
        r = self.rows_of(node.args[0])
        repeats, dim = _arg(node, 1, "repeats"), _arg(node, 2, "dim")
        if r is None or r.order is not None or dim is None or dim % _val(node.args[0]).dim() != 0 \
                or not isinstance(repeats, int):
            self.refuse(node, "repeats rows other than each token's own rows in place")
        self.set(node, Rows(None, r.k * repeats), f"each token's rows repeated {repeats} times, adjacent")

    def sort(self, node):
        x = node.args[0]
        r = self.rows_of(x)
        dim = _arg(node, 1, "dim", -1) if node.target is not aten.sort.stable else node.kwargs.get("dim", -1)
        descending = node.kwargs.get("descending", _arg(node, 2, "descending", False)
                                     if node.target is aten.sort.default else False)
        if r is None or r.order is not None or _val(x).dim() != 1 or dim not in (0, -1):
            self.refuse(node, "sorts rows that are not one value per token-expert slot in token order")
        perm = Index(r.k, node, r.k)
        if node.target in (aten.argsort.default, aten.argsort.stable):
            return self.set(node, perm, "the slots' order after sorting by expert")
        values = Rows(node, r.k, r.ids, sorted_ids=not descending)
        self.set(node, (values, perm), "a sort of the token-expert slots by expert")

    def floor_divide(self, node):
        i, m = self.absval[node.args[0]], node.args[1]
        if not isinstance(i, Index) or not isinstance(m, int) or m <= 0 or i.j % m:
            self.refuse(node, "divides a slot number by something other than a divisor of the slots per token")
        self.set(node, Index(i.j // m, i.order, i.k), f"slot numbers, {i.j // m} per token")

    def gather(self, node):
        x, indices = node.args[0], list(node.args[1])
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            self.refuse(node, "indexes token-expert rows with more than one index tensor")
        idx = self.absval.get(indices[0])
        if isinstance(idx, Inverse):
            r = self.absval.get(x)
            if not isinstance(r, Rows) or r.order is not idx.order:
                self.refuse(node, "applies an inverse permutation to rows that the matching sort did not order")
            return self.set(node, Rows(None, r.k), "rows put back in token order (inverse of the expert sort)")
        if isinstance(idx, Index):
            r = self.rows_of(x)
            if r is None or r.order is not None or r.k != idx.j:
                self.refuse(node, f"gathers rows by slot numbers of {idx.j} per token from a tensor that does not "
                            f"hold {idx.j} rows per token in token order")
            return self.set(node, Rows(idx.order, idx.k), "rows gathered by their slots' numbers")
        r = self.rows_of(indices[0])
        if _seq_dims(_val(x), self.seq) or r is None:
            self.refuse(node, "indexes along the token rows")
        if r.ids is not None and r.ids != _val(x).shape[0]:
            self.refuse(node, f"looks up a table of {_val(x).shape[0]} rows by expert ids in [0, {r.ids})")
        self.set(node, Rows(r.order, r.k), "a per-row lookup of a table (an expert's weights)")

    def inverse(self, node):
        base, indices, values = node.args[0], list(node.args[1]), node.args[2]
        accumulate = _arg(node, 3, "accumulate", False)
        idx = self.absval.get(indices[0]) if len(indices) == 1 else None
        if not isinstance(idx, Index) or idx.j != idx.k or accumulate or not isinstance(values, fx.Node):
            self.refuse(node, "writes rows by slot number other than as the inverse of an expert sort")
        n = _expr(_val(indices[0]).shape[0])
        if values.target not in _ARANGES or not self._is_range(values, n) or \
                base.target not in (aten.empty_like.default, aten.zeros_like.default) or \
                sympy.simplify(_expr(_val(base).shape[0]) - n) != 0 or _val(base).dim() != 1:
            self.refuse(node, "writes rows by slot number other than inv[P] = arange(len(P)) into a fresh tensor")
        for claimed in (values, base):
            if self.notes.get(claimed) is None:
                self.set(claimed, Claimed(), "builds the inverse of an expert sort")
        for u in base.users:
            if u is not node:
                self.refuse(u, "reads the tensor that the inverse of an expert sort is written into")
        self.set(node, Inverse(idx.order, idx.k), "the inverse permutation of the expert sort")

    def _is_range(self, node, n) -> bool:
        if node.target is aten.arange.default:
            lo, hi, step = 0, _expr(node.meta["val"].shape[0]), 1
        else:
            lo = node.args[0]
            hi = _expr(node.meta["val"].shape[0])
            step = node.args[2] if len(node.args) > 2 else 1
        return lo == 0 and step == 1 and sympy.simplify(hi - n) == 0

    def histc(self, node):
        r = self.absval.get(node.args[0])
        bins, lo, hi = _arg(node, 1, "bins", 100), _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
        if not (isinstance(r, Rows) and r.order is not None and r.sorted_ids and r.ids is not None):
            return None  # a count over all rows: a reduction, the sequence analysis' to accumulate
        # histc is a function of each value: check on 0..E-1 that expert e lands in bin e
        ids = torch.arange(r.ids, dtype=_val(node.args[0]).dtype)
        counted = torch.histc(ids, bins=bins, min=lo, max=hi)
        if bins != r.ids or not torch.equal(counted, torch.ones(r.ids, dtype=counted.dtype)):
            self.refuse(node, f"counts sorted expert ids in [0, {r.ids}) with bins that do not give each "
                        f"expert its own bin (bins={bins}, min={lo}, max={hi})")
        self.set(node, Counts(r.order, r.ids), f"rows per expert ({r.ids} experts) of the expert sort")

    def cumsum(self, node):
        c = self.absval.get(node.args[0])
        if isinstance(c, Rows) and _arg(node, 1, "dim") % _val(node.args[0]).dim() != 0:
            return self.rowwise(node)  # along another dim of each row
        if not isinstance(c, Counts) or c.cumulative or _arg(node, 1, "dim") not in (0, -1):
            self.refuse(node, "accumulates along the token rows (e.g. numbering each expert's tokens to drop those "
                        "past a capacity: the count runs over the whole batch, a chunk would count its own)")
        self.set(node, Counts(c.order, c.experts, cumulative=True), "group ends of the expert sort")

    def grouped_mm(self, node):
        x, w, offs = node.args[0], node.args[1], _arg(node, 2, "offs")
        r, o = self.absval.get(x), self.absval.get(offs) if isinstance(offs, fx.Node) else None
        if not (isinstance(r, Rows) and isinstance(o, Counts) and o.cumulative and r.order is o.order):
            self.refuse(node, "is a grouped matmul whose groups are not the expert groups of its rows' own sort")
        if _seq_dims(_val(w), self.seq) or _val(w).shape[0] != o.experts:
            self.refuse(node, f"is a grouped matmul with weights of {_val(w).shape[0]} groups for {o.experts} experts")
        self.set(node, Rows(r.order, r.k), "each row times its own expert's weights")

    def rowwise(self, node):
        t = node.target
        ins = self.abstract_inputs(node)
        layouts = {self.absval[a] for a in ins}
        for a in self.seq_inputs(node):
            if a not in self.absval:
                layouts.add(self.rows_of(a))
        if any(not isinstance(r, Rows) for r in layouts):
            self.refuse(node, "reads a value of a sort by expert that is not row-wise data")
        rows = {(r.order, r.k) for r in layouts}
        if len(rows) != 1:
            self.refuse(node, "combines token-expert rows of different layouts (other orders or slots per token)")
        (order, k), = rows
        out_dims = [_seq_dims(v, self.seq) for v in (_val(node) if isinstance(_val(node), (list, tuple))
                                                      else [_val(node)]) if isinstance(v, torch.Tensor)]
        ok = all(d == [0] for d in out_dims) and out_dims
        if not any(out_dims) and t in _WHOLE_REDUCTIONS:
            return None  # a sum or count over every row: the sequence analysis accumulates it over chunks
        if t in _SAME_ROWS and len(ins) == 1:  # dtype/copy: the values (expert ids, their order) stay
            return self.set(node, self.absval[ins[0]], "a copy of token-expert rows")
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            pass
        elif t is aten.one_hot.default:
            pass  # each value to its own row of zeros and a one
        elif t is aten.cumsum.default:
            pass  # along another dim than the rows (checked by `cumsum`)
        elif t is aten.unsqueeze.default:
            ok = ok and node.args[1] % (_val(node.args[0]).dim() + 1) != 0
        elif t in _SAME_ROWS or t in _MATMULS:
            if t in _MATMULS and _seq_dims(_val(node.args[1] if t is not aten.addmm.default else node.args[2]),
                                           self.seq):
                ok = False
        elif t is aten.bmm.default:
            ok = ok and all(_val(a).shape[0] == _val(node).shape[0] for a in node.args[:2])
        elif t in _DIM_ARG_OPS:
            x = _val(node.args[0])
            for pos in _DIM_ARG_OPS[t]:
                dims = _arg(node, pos, "dim", _DIM_DEFAULTS.get(t))
                if t is aten.permute.default:
                    ok = ok and dims[0] % x.dim() == 0
                elif dims is None or any(d % x.dim() == 0 for d in (dims if isinstance(dims, (list, tuple)) else [dims])):
                    ok = False
        elif t is aten.index.Tensor:
            ok = ok and (not node.args[1] or node.args[1][0] is None)
        else:
            ok = False
        if not ok:
            self.refuse(node, f"is not known to keep the token-expert rows apart ({t})")
        value = Rows(order, k)
        self.set(node, tuple(value for _ in _val(node)) if isinstance(_val(node), (list, tuple)) else value,
                 "row-wise on token-expert rows")


def prove_dispatch(gm: fx.GraphModule, seq: sympy.Symbol) -> dict[str, str]:
    """Prove the graph's MoE dispatches token-local; mark the proven nodes.

    Sets `node.meta["sppo_moe"]` (why the node is token-local) on every node it proved and
    returns {node name: why}. Raises `SppoError` for an op that takes part in a dispatch
    and keeps no rule (named, with why). A graph without dispatches gets no marks."""
    for node in gm.graph.nodes:
        node.meta.pop("sppo_moe", None)
    notes = _Walk(gm, seq).run()
    for node, why in notes.items():
        node.meta["sppo_moe"] = why
    return {n.name: why for n, why in notes.items()}
