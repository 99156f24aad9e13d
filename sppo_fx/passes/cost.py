"""Cost model of the per-chunk program (docs/architecture.md, section 1 "Pipeline of steps": analyse).

For one chunk of `c` tokens whose queries see a K/V prefix of `p` earlier tokens, this
module gives, as sympy expressions of the symbols `c`, `p` and `b` (batch):

* per node of the chunk program: forward FLOPs, backward FLOPs and bytes written;
* the tensors the forward saves for backward, each classified as
  level 1 — the K/V "skeleton": the chunk's own K and V (the program outputs after the
  partials), which every later chunk reads and which stay for the whole step — or
  level 2 — chunk-private: everything else the chunk's backward needs (what SPPO
  offloads).

How the expressions are obtained
--------------------------------
*Shapes.* The chunk program is re-run on fake tensors under a `ShapeEnv` with two
symbolic sizes, the chunk length (`chunk_len` and the sequence dim of every chunk input)
and the prefix length (the K/V prefix inputs' dim -2 and `chunk_start`, which equals the
number of tokens before the chunk). Every node — including the ones the chunk pass
inserted without `meta["val"]` (the `cat` of prefix + chunk K/V, the attention call) —
gets a shape in `c` and `p`.

*Batch.* The traced batch `B` is static in the captured graph (views carry it as a
literal), so shapes never contain `b`. Costs are made linear in `b` by a documented rule:
a node (or saved tensor) whose tensors depend on `c`/`p` and whose leading dim is the
batch — `B` itself, or a flattened `B * f(c, p)` such as the `[B*c, vocab]` logits — is
scaled by `b / B`; others (position tables `[c, d]`, the attention mask `[c, p + c]`) are
not. Every expression is exact at `b = B`; for `B == 1` the rule cannot tell a batch dim
from a broadcast 1 and scales every `c`/`p`-dependent tensor. `ChunkCost.evaluate`
substitutes `b = B` unless told otherwise.

*FLOPs.* Matmuls (`linear`, `mm`, `bmm`, `matmul`, `addmm`, `baddbmm`): 2·M·N·K (+ M·N
for a bias). Causal chunk attention (q `[b, h, c, d]`, k/v `[b, h_kv, p + c, d]`):
2·b·h·c·(d + d_v)·(p + (c + 1)/2) — QKᵀ and PV over the lower-right causal region, i.e.
4·b·h·d·c·(p + (c + 1)/2) for d_v = d. Normalisations and softmax/cross-entropy count 5
FLOPs per input element (4 for RMSNorm); other pointwise ops and reductions 1 per element
(output for pointwise, input for reductions); views 0 FLOPs and 0 bytes; data movement
(`cat`, `embedding`, copies, factories) 0 FLOPs.

*Backward FLOPs* (approximate, the usual rule of thumb): a matmul costs 2·M·N·K per operand
that requires grad (dX and dW: 2x forward when both do); attention 2.5x forward (dQ, dK,
dV plus the recomputed probabilities); embedding backward is a scatter-add of its output
(1 per element); every other differentiable node 2x forward. Nodes that do not depend on
a parameter or a K/V prefix (token ids, positions, valid-token counts) cost nothing.

*Saved activations.* AOTAutograd's partitioner (`default_partition`, or
`min_cut_rematerialization_partition` — what Inductor uses, which recomputes cheap
pointwise ops and saves less) runs on the chunk program with concrete example inputs for
one chunk (`c0`, `p0` chosen so that c0, p0, p0 + c0, B·c0, ... collide with no static dim
of the program). The forward graph's saved outputs are grouped by the storage they alias
(q, k and v of a fused QKV projection are views of one buffer; saving q keeps the whole
buffer alive — this is what eager autograd does too), and each group's size is expressed
symbolically by matching its dims against c0, p0, p0 + c0, B·c0, ... Parameter-derived
saved values (weights, their transposes) are not activations and are dropped; saved K/V
prefix inputs are views of earlier chunks' skeleton and are dropped too. A second trace at
p = 0 covers the first chunk, where attention may take another path (the reference path
calls causal SDPA without a mask there); when it saves something else, `level2_bytes` is a
`sympy.Piecewise` (first chunk; otherwise). Checked against eager autograd
(`measure_saved_bytes`): the predictions are exact for the GPT, Llama and Hugging Face
Llama reference models at every (c, p) tried.

Findings worth knowing (documented in tests/test_cost.py too): the reference attention
path saves `cat(prefix, k)` and `cat(prefix, v)` — per chunk, a private copy of all K/V
up to the chunk (kind "kv_concat", `2·b·h_kv·(p + c)·d` per layer) — and a float
`[c, p + c]` mask (kind "mask"). Both grow with the prefix; an attention kernel whose
backward reads the prefix from the skeleton would not need them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

import sympy
import torch
import torch.fx as fx
from tabulate import tabulate

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.aliasing import alias_base as _alias_base
from sppo_fx.passes.aliasing import is_view_op as _is_view_op
from sppo_fx.passes.aliasing import storage_key as _storage_key
from sppo_fx.passes.offload import memory_partitioner

aten = torch.ops.aten

#: Chunk length, prefix length (tokens before the chunk) and batch.
c, p, b = sympy.symbols("c p b", integer=True, nonnegative=True)

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


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class NodeCost:
    """Cost of one node of the chunk program.

    Attributes:
        name: the FX node's name.
        target: printable op name (e.g. "aten.linear.default", "chunk_causal_attention").
        kind: "matmul" | "attention" | "norm" | "pointwise" | "reduction" | "movement" |
            "view" | "size".
        fwd_flops: forward FLOPs (sympy, in c, p, b).
        bwd_flops: backward FLOPs (sympy; 0 when the node is not differentiated).
        bytes_written: bytes of freshly allocated outputs (0 for views).
    """

    name: str
    target: str
    kind: str
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    bytes_written: sympy.Expr


@dataclasses.dataclass
class SavedTensor:
    """A tensor (storage) a chunk keeps between its forward and its backward.

    Attributes:
        name: node name in the AOT forward graph (level 2) or in the chunk program (level 1).
        shape_expr: shape as sympy expressions of c, p, b (of the whole storage).
        dtype: element type.
        bytes_expr: size in bytes (sympy).
        level: 1 = K/V skeleton (read by later chunks), 2 = chunk-private.
        kind: "kv" (skeleton K or V), "kv_concat" (the cat of prefix and chunk K/V the
            attention saves), "mask" (a [c, p + c] attention mask), "input" (a chunk
            input, e.g. token ids), "activation" (everything else).
        aliases: the saved values that are views of this storage (AOT node names).
        exact: False when a dim of the example could not be matched to an expression of
            c, p, b and was kept as the example's number.
    """

    name: str
    shape_expr: tuple
    dtype: torch.dtype
    bytes_expr: sympy.Expr
    level: int
    kind: str = "activation"
    aliases: tuple = ()
    exact: bool = True


@dataclasses.dataclass
class ChunkCost:
    """Costs of one chunk as sympy expressions of c (chunk length), p (prefix), b (batch).

    Attributes:
        fwd_flops: forward FLOPs of the chunk program.
        bwd_flops: backward FLOPs (see the module docstring for the rule).
        saved: saved tensors, level 1 (K/V skeleton) first.
        level1_bytes: total bytes of level 1 (the chunk's K and V, every attention site).
        level2_bytes: total bytes of level 2 (chunk-private saved activations).
        nodes: per-node costs, in graph order.
        batch: the traced (static) batch B; `evaluate` substitutes b = B by default.
        example: the (c0, p0) the saved tensors were measured at.
        partition: the AOTAutograd partitioner used ("default" or "min_cut").
        saved_first: the saved tensors of a chunk without prefix (p = 0), traced separately
            because attention may save different things there; when they differ from
            `saved` at p = 0, `level2_bytes` is a `Piecewise` (first chunk, otherwise).
    """

    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    saved: list[SavedTensor]
    level1_bytes: sympy.Expr
    level2_bytes: sympy.Expr
    nodes: list[NodeCost]
    batch: int
    example: tuple[int, int]
    partition: str = "default"
    saved_first: list[SavedTensor] | None = None

    @property
    def saved_bytes(self) -> sympy.Expr:
        """level1_bytes + level2_bytes."""
        return self.level1_bytes + self.level2_bytes

    @property
    def bytes_written(self) -> sympy.Expr:
        """Bytes written by the forward (sum over nodes)."""
        return sympy.Add(*[n.bytes_written for n in self.nodes])

    def _subs(self, c_val, p_val, b_val) -> dict:
        return {c: int(c_val), p: int(p_val), b: int(self.batch if b_val is None else b_val)}

    def evaluate(self, c: int, p: int = 0, b: int | None = None) -> dict[str, float]:
        """Numbers for one chunk.

        Args:
            c: chunk length (tokens).
            p: prefix length (tokens before the chunk).
            b: batch (default: the traced batch).

        Returns:
            {"fwd_flops", "bwd_flops", "level1_bytes", "level2_bytes", "saved_bytes",
            "bytes_written"} as ints.
        """
        subs = self._subs(c, p, b)
        exprs = {"fwd_flops": self.fwd_flops, "bwd_flops": self.bwd_flops,
                 "level1_bytes": self.level1_bytes, "level2_bytes": self.level2_bytes,
                 "saved_bytes": self.saved_bytes, "bytes_written": self.bytes_written}
        return {k: _to_int(e.subs(subs)) for k, e in exprs.items()}

    def table(self, c: int | None = None, p: int = 0, b: int | None = None, nodes: bool = False) -> str:
        """Printable summary: totals and the saved tensors (and per-node costs if asked).

        Args:
            c, p, b: also print numbers at this point (c=None: expressions only).
            nodes: include the per-node table.

        Returns:
            A multi-line string (tabulate).
        """
        subs = self._subs(c, p, b) if c is not None else None

        def num(e):
            return _to_int(e.subs(subs)) if subs else ""

        rows = [(k, _pretty(e), num(e)) for k, e in
                (("forward FLOPs", self.fwd_flops), ("backward FLOPs", self.bwd_flops),
                 ("level 1 bytes (K/V skeleton)", self.level1_bytes),
                 ("level 2 bytes (chunk-private)", self.level2_bytes))]
        head = ["", "expression (c, p, b)", f"at c={c}, p={p}" if subs else ""]
        out = [f"chunk cost (traced batch B={self.batch}; saved tensors from the "
               f"{self.partition} partition at c={self.example[0]}, p={self.example[1]})",
               tabulate(rows, headers=head)]
        saved_rows = [(s.level, s.kind, s.name, _shape_str(s.shape_expr), str(s.dtype).replace("torch.", ""),
                       str(s.bytes_expr), num(s.bytes_expr)) for s in self.saved]
        out += ["", tabulate(saved_rows, headers=["level", "kind", "name", "shape", "dtype", "bytes", ""])]
        if nodes:
            node_rows = [(n.name, n.target, n.kind, str(n.fwd_flops), str(n.bwd_flops), str(n.bytes_written))
                         for n in self.nodes if n.kind != "size"]
            out += ["", tabulate(node_rows, headers=["node", "op", "kind", "fwd FLOPs", "bwd FLOPs", "bytes"])]
        return "\n".join(out)

    def __str__(self):
        return self.table()


def _to_int(e) -> int:
    e = sympy.sympify(e)
    if not e.is_number:
        raise SppoError(f"cost expression {e} still depends on {sorted(map(str, e.free_symbols))}")
    return int(sympy.ceiling(e))


def _pretty(e) -> str:
    if isinstance(e, sympy.Piecewise):
        return "; ".join(f"{_pretty(v)} if {cond}" if cond is not sympy.true else f"{_pretty(v)} otherwise"
                         for v, cond in e.args)
    return str(sympy.factor(e))


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


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

    if batch is not None:
        scale = b / sympy.Integer(batch)
        if _batch_scaled(ins + outs, set(sizes), batch):
            fwd, bwd = fwd * scale, bwd * scale
        if _batch_scaled(fresh, set(sizes), batch):
            bytes_written = bytes_written * scale
    return NodeCost(name, target, kind, sympy.expand(fwd), sympy.expand(bwd), sympy.expand(bytes_written))


# ------------------------------------------------------------- symbolic propagation


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _prefix_shapes(program) -> dict[str, tuple[tuple, torch.dtype]]:
    out = {}
    for site in program.attention:
        out[f"{site.name}_k_prefix"] = (tuple(site.k_shape), site.dtype)
        out[f"{site.name}_v_prefix"] = (tuple(site.v_shape), site.dtype)
    return out


def _chunk_dim(program, node: fx.Node, seq) -> int | None:
    """The sequence dim of a chunk-input placeholder (from the program's boundaries)."""
    for spec in program.boundaries:
        if f"chunk_{spec.name}" == node.name:
            return spec.seq_dim
    val = node.meta.get("val")
    if seq is not None and isinstance(val, torch.Tensor):
        for i, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and sympy.simplify(s.node.expr - seq) == 0:
                return i
    return None


def _input_specs(program, seq=None) -> list[tuple[str, str, object]]:
    """(name, role, spec) per chunk-program placeholder, in order.

    role: "param" (spec = (shape, dtype)), "input" (spec = (shape with None at the seq dim,
    dtype)), "prefix" (shape with None at dim -2, dtype), "start", "len".
    """
    prefixes = _prefix_shapes(program)
    params = set(program.params)
    specs = []
    for n in _placeholders(program.chunk):
        if n.name == "chunk_start":
            specs.append((n.name, "start", None))
        elif n.name == "chunk_len":
            specs.append((n.name, "len", None))
        elif n.name in prefixes:
            shape, dtype = prefixes[n.name]
            shape = list(shape)
            shape[-2] = None
            specs.append((n.name, "prefix", (tuple(shape), dtype)))
        else:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise SppoError(f"chunk-program input {n.name!r} has no recorded shape (meta['val'])")
            dim = None if n.name in params else _chunk_dim(program, n, seq)
            shape = []
            for i, s in enumerate(val.shape):
                if i == dim:
                    shape.append(None)
                elif isinstance(s, torch.SymInt):
                    raise SppoError(f"chunk-program input {n.name!r} has a symbolic dim {i} ({s}) "
                                    "that is not its sequence dim")
                else:
                    shape.append(int(s))
            specs.append((n.name, "param" if n.name in params else "input", (tuple(shape), val.dtype)))
    return specs


def traced_batch(program, seq=None) -> int:
    """The static batch B of the chunk program: the leading dim of a sequence-dim input."""
    for _, role, spec in _input_specs(program, seq):
        if role == "input" and spec[0] and spec[0][0] is not None and None in spec[0]:
            return int(spec[0][0])
    for _, role, spec in _input_specs(program, seq):
        if role == "prefix" and spec[0]:
            return int(spec[0][0])
    return 1


def symbolic_values(program, seq=None, hints: tuple[int, int] = (7, 11)) -> dict[fx.Node, object]:
    """Run the chunk program on fake tensors with a symbolic chunk length and prefix.

    Args:
        program: a `ChunkedProgram`.
        seq: the captured sequence symbol (locates the sequence dim of chunk inputs whose
            boundary spec is missing).
        hints: example (c, p) the shape environment uses to decide guards (>= 2 each, so
            neither symbol is specialised to 0/1).

    Returns:
        node -> fake value (tensors with SymInt shapes, SymInts). The shapes are in the
        shape environment's own symbols; the returned dict's `rename` attribute maps them to
        the module symbols `c` and `p` (`expr.xreplace(values.rename)`).
    """
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sppo_fx._compat import symbolic_dispatch

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    c_sym = env.create_symbol(hints[0], ConstantSource("sppo_c"))
    p_sym = env.create_symbol(hints[1], ConstantSource("sppo_p"))
    c_int = env.create_symintnode(c_sym, hint=hints[0])
    p_int = env.create_symintnode(p_sym, hint=hints[1])
    # the program's own constants (get_attr buffers, e.g. RoPE's inv_freq) are real tensors:
    # its fake inputs go on their device
    metas = [n.meta.get("val") for n in program.chunk.graph.nodes if n.op == "placeholder"]
    device = next((t.device for t in (*metas, *program.chunk.buffers()) if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    args = []
    with mode:
        for name, role, spec in _input_specs(program, seq):
            if role == "start":
                args.append(p_int)
            elif role == "len":
                args.append(c_int)
            else:
                shape, dtype = spec
                fill = p_int if role == "prefix" else c_int
                args.append(torch.empty([fill if s is None else s for s in shape], dtype=dtype, device=device))
        values: dict[fx.Node, object] = {}

        current = []

        class _Recorder(fx.Interpreter):
            def run_node(self, n):
                current[:] = [n]
                r = super().run_node(n)
                values[n] = r
                return r

        try:
            with symbolic_dispatch():
                _Recorder(program.chunk).run(*args)
        except SppoError:
            raise
        except Exception as e:  # noqa: BLE001 - report which node failed
            where = describe_node(current[0]) if current else "the chunk program"
            raise SppoError(f"cost model: symbolic shape propagation failed at {where}: "
                            f"{type(e).__name__}: {e}") from e
    rename = {c_sym: c, p_sym: p}
    return _RenamedValues(values, rename)


class _RenamedValues(dict):
    """node -> value with SymInt expressions renamed to the module's c / p symbols."""

    def __init__(self, values, rename):
        super().__init__(values)
        self.rename = rename


def _renamed_shape(t: torch.Tensor, rename: dict) -> tuple:
    return tuple(e.xreplace(rename) for e in shape_exprs(t))


# ---------------------------------------------------------------- saved activations


def _static_dims(values: dict) -> set[int]:
    """Every static dim of the program's tensors, and products of adjacent static dims."""
    dims = set()
    for v in values.values():
        for t in _tensors(v):
            shape = [s for s in t.shape]
            for i in range(len(shape)):
                acc = 1
                for s in shape[i:]:
                    if isinstance(s, torch.SymInt):
                        break
                    acc *= int(s)
                    dims.add(acc)
    return dims


def _candidates(c0: int, p0: int, batch: int) -> list[tuple[int, sympy.Expr]]:
    base = [(c0, c), (p0, p), (p0 + c0, p + c), (c0 * (p0 + c0), c * (p + c)), (c0 * c0, c * c)]
    scaled = [(batch * v, b * e) for v, e in base[:3]] if batch > 1 else []
    return base + scaled


def choose_example(static_dims: set[int], batch: int) -> tuple[int, int]:
    """A (c0, p0) whose derived sizes collide with no static dim and with each other."""
    primes = [13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101]
    forbidden = set(static_dims) | {1, batch}
    for c0 in primes:
        for p0 in primes:
            if p0 <= c0:
                continue
            vals = [v for v, _ in _candidates(c0, p0, batch)]
            if len(set(vals)) == len(vals) and not (set(vals) & forbidden):
                # products with static dims (e.g. [h * c, d] after a flatten) must not collide either
                if not any(v * s in forbidden for v in vals[:3] for s in static_dims if s > 1):
                    return c0, p0
    return 13, 29  # pragma: no cover - every small prime pair collides; matching may be inexact


def _match_dim(v: int, c0: int, p0: int, batch: int, static: set[int]) -> tuple[sympy.Expr, bool]:
    for val, e in _candidates(c0, p0, batch):
        if v == val:
            return e, True
    if v in static or v in (0, 1):
        return sympy.Integer(v), True
    for val, e in _candidates(c0, p0, batch):
        if val > 0 and v % val == 0 and (v // val) in static:
            return (v // val) * e, True
    return sympy.Integer(v), False


def _data_dependent(graph: fx.Graph, is_data: Callable[[fx.Node], bool]) -> dict[fx.Node, bool]:
    """node -> whether it depends on a placeholder for which `is_data` holds (graph order)."""
    dep: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        dep[n] = is_data(n) if n.op == "placeholder" else any(dep.get(a, False) for a in n.all_input_nodes)
    return dep


def example_inputs(program, c_len: int, prefix: int, *, params: list[torch.Tensor] | None = None,
                   seq=None, requires_grad: bool = True, seed: int = 0, device=None) -> list:
    """Concrete arguments for one call of the chunk program.

    Args:
        program: a `ChunkedProgram`.
        c_len: chunk length.
        prefix: prefix length (also `chunk_start`).
        params: tensors for the parameter placeholders (default: random, N(0, 0.02); integer
            ones zeros). With `requires_grad`, float `p_*` (parameter) placeholders get
            detached copies that require grad, as in training.
        seq: the captured sequence symbol (see `symbolic_values`).
        requires_grad: make parameters and K/V prefixes require grad.
        seed: RNG seed for the random tensors.
        device: where to create the random tensors (default: the device of `params`, else
            CPU). Attention may save different tensors per device (the Triton kernel on
            CUDA saves no mask), so trace on the device you will train on.

    Returns:
        The argument list, in placeholder order. Integer chunk inputs (token ids, labels)
        are zeros, which is valid for embeddings and cross-entropy.
    """
    gen = torch.Generator().manual_seed(seed)
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    args, k = [], 0
    for name, role, spec in _input_specs(program, seq):
        if role == "start":
            args.append(prefix)
        elif role == "len":
            args.append(c_len)
        elif role == "param" and params is not None:
            t = params[k].detach()
            if requires_grad and t.is_floating_point() and name.startswith("p_"):
                t.requires_grad_(True)
            args.append(t)
            k += 1
        else:
            shape, dtype = spec
            fill = prefix if role == "prefix" else c_len
            shape = [fill if s is None else s for s in shape]
            if dtype.is_floating_point:
                t = (torch.randn(shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
                grad = requires_grad and (role == "prefix" or (role == "param" and name.startswith("p_")))
                t.requires_grad_(grad)
            else:
                t = torch.zeros(shape, dtype=dtype, device=device)
            args.append(t)
            k += role == "param"
    return args


def _aot_forward(program, args: list, partition: str, recompute: str = "none"):
    """Run AOTAutograd on the chunk program; returns (forward graph, #forward outputs).

    `recompute` (min_cut only): the memory passes' recompute policy (`passes.offload`)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    base = {"default": default_partition,
            "min_cut": memory_partitioner(recompute, offload=False) if recompute != "none" else
            functools.partial(min_cut_rematerialization_partition, compiler="inductor")}
    if partition not in base:
        raise SppoError(f"unknown partition {partition!r}; choose 'default' or 'min_cut'")
    if recompute != "none" and partition != "min_cut":
        raise SppoError("a recompute policy needs partition='min_cut'")
    rec = {}

    def part(joint, inputs, **kw):
        fw, bw = base[partition](joint, inputs, **kw)
        rec["fw"], rec["n"] = fw, kw["num_fwd_outputs"]
        return fw, bw

    slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*tensors):
        full = list(args)
        for i, t in zip(slots, tensors):
            full[i] = t
        return tuple(program.chunk(*full))

    def keep(gm, _inputs):
        return gm

    compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=part)
    compiled(*[args[i] for i in slots])
    if "fw" not in rec:
        raise SppoError("cost model: AOTAutograd produced no forward/backward partition "
                        "(does the chunk program depend on anything that requires grad?)")
    return rec["fw"], rec["n"], slots


def saved_tensors(program, values, batch: int, *, params: list[torch.Tensor] | None = None,
                  seq=None, partition: str = "default", example: tuple[int, int] | None = None,
                  device=None, recompute: str = "none") -> tuple[list[SavedTensor], tuple[int, int]]:
    """The saved-for-backward storages of one chunk, with symbolic sizes.

    Args:
        program: a `ChunkedProgram`.
        values: `symbolic_values(program)` (gives the level-1 K/V shapes and static dims).
        batch: the traced batch B.
        params: parameter tensors (default: random ones of the right shapes).
        seq: the captured sequence symbol.
        partition: "default" or "min_cut" (AOTAutograd partitioner).
        example: (c0, p0) to trace at (default: chosen to avoid ambiguous dims).
        device: device of the example tensors (see `example_inputs`).
        recompute: recompute policy (partition "min_cut" only; see `passes.offload`).

    Returns:
        (saved tensors, level 1 first; the (c0, p0) used).
    """
    rename = values.rename
    static = _static_dims(values)
    c0, p0 = example or choose_example(static, batch)
    args = example_inputs(program, c0, p0, params=params, seq=seq, device=device)
    fw, n_out, slots = _aot_forward(program, args, partition, recompute)

    names = [n for n, _, _ in _input_specs(program, seq)]
    roles = {n: r for n, r, _ in _input_specs(program, seq)}
    fw_ph = _placeholders(fw)
    ph_role = {ph: roles[names[i]] for ph, i in zip(fw_ph, slots)}
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    saved_nodes = [n for n in outs[n_out:] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]

    # Level 1: the chunk's K/V outputs (symbolic shapes from the fake run).
    chunk_out = next(n for n in program.chunk.graph.nodes if n.op == "output").args[0]
    kv_nodes = list(chunk_out)[program.num_partials:]
    result: list[SavedTensor] = []
    sizes = {c, p}
    for i, kv in enumerate(kv_nodes):
        val = values[kv]
        shape = _renamed_shape(val, rename)
        shape = _batch_shape(shape, batch, sizes)
        site = program.attention[i // 2].name if i // 2 < len(program.attention) else kv.name
        numel = sympy.Mul(*shape)
        result.append(SavedTensor(f"{site}.{'kv'[i % 2]}", shape, val.dtype,
                                  sympy.expand(numel * val.element_size()), 1, "kv", (kv.name,)))
    # K/V outputs of the AOT forward graph (to spot a saved value that *is* the skeleton).
    kv_fw_bases = {}
    for i, o in enumerate(outs[program.num_partials:program.num_partials + len(kv_nodes)]):
        if isinstance(o, fx.Node):
            kv_fw_bases[_alias_base(o)] = o

    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in saved_nodes:
        groups.setdefault(_alias_base(n), []).append(n)
    data_dep = _data_dependent(fw.graph, lambda ph: ph_role.get(ph) != "param")
    for base, members in groups.items():
        val = base.meta.get("val")
        if not isinstance(val, torch.Tensor):
            val = members[0].meta["val"]
        role = ph_role.get(base)
        if role in ("param", "prefix"):
            continue  # weights / views of earlier chunks' skeleton: not this chunk's activations
        matched = [_match_dim(int(s), c0, p0, batch, static) for s in val.shape]
        shape = tuple(e for e, _ in matched)
        exact = all(ok for _, ok in matched)
        depends = any(e.free_symbols & {c, p, b} for e in shape)
        if not depends and not data_dep[base]:
            continue  # parameter-derived (e.g. a transposed weight): per step, not per chunk
        if base in kv_fw_bases and val.numel() == kv_fw_bases[base].meta["val"].numel():
            continue  # the K/V output itself: counted once, at level 1
        shape = _batch_shape(shape, batch, {c, p})
        if role == "input":
            kind = "input"
        elif _is_prefix_cat(base, ph_role):
            kind = "kv_concat"
        elif len(shape) == 2 and shape[0] == c and shape[1] == p + c:
            kind = "mask"
        else:
            kind = "activation"
        numel = sympy.Mul(*shape) if shape else sympy.Integer(1)
        result.append(SavedTensor(base.name, shape, val.dtype, sympy.expand(numel * val.element_size()),
                                  2, kind, tuple(m.name for m in members), exact))
    return result, (c0, p0)


def _batch_shape(shape: tuple, batch: int, sizes: set) -> tuple:
    """Put the batch symbol into a symbolic shape (leading B, or a flattened B * f(c, p))."""
    if not shape or not any(e.free_symbols & sizes for e in shape):
        return shape
    lead = shape[0]
    if batch == 1:
        return (b * lead,) + tuple(shape[1:])
    if lead == batch:
        return (b,) + tuple(shape[1:])
    coeff, rest = lead.as_coeff_Mul()
    if rest.free_symbols & sizes and coeff.is_Integer and int(coeff) % batch == 0:
        return ((int(coeff) // batch) * b * rest,) + tuple(shape[1:])
    return shape


def _is_prefix_cat(node: fx.Node, ph_role: dict) -> bool:
    if node.op != "call_function" or _op_name(node.target) != "cat":
        return False
    parts = node.args[0] if node.args else []
    return any(isinstance(a, fx.Node) and ph_role.get(_alias_base(a)) == "prefix" for a in parts)


# ----------------------------------------------------------------------------- entry


def chunk_cost(program, captured_seq=None, *, params: list[torch.Tensor] | None = None,
               partition: str = "default", example: tuple[int, int] | None = None,
               first_chunk: bool = True, device=None, recompute: str = "none") -> ChunkCost:
    """Cost model of a chunk program: FLOPs, bytes, saved activations in c, p, b.

    Args:
        program: the `ChunkedProgram` from `sppo_fx.passes.transform`.
        captured_seq: the captured sequence-length symbol (`captured.seq`); used to find the
            sequence dim of chunk inputs (optional when the program's boundaries say it).
        params: tensors for the parameter placeholders (values only matter for data-
            dependent control flow; default: random tensors of the recorded shapes).
        partition: AOTAutograd partitioner for the saved tensors: "default" (saves what
            eager autograd saves) or "min_cut" (Inductor's: recomputes cheap ops).
        example: (c0, p0) for the AOT trace (default: chosen automatically).
        first_chunk: also trace a chunk with p = 0 (one more AOT trace) so that the
            first chunk's saved bytes are exact.
        device: where the example chunk runs for the AOT trace (default: the params'
            device, else CPU); what attention saves can differ per device.
        recompute: the memory passes' recompute policy ("none", "cheap", "full"; with
            partition "min_cut"): the saved set of the graphs that policy runs.

    Returns:
        A `ChunkCost`. Raises `SppoError` when the program cannot be propagated
        symbolically.
    """
    values = symbolic_values(program, captured_seq)
    rename = values.rename
    batch = traced_batch(program, captured_seq)

    # Grad sources: float parameters and K/V prefixes.
    roles = {n: r for n, r, _ in _input_specs(program, captured_seq)}
    grad_nodes = set()
    for n in program.chunk.graph.nodes:
        floating = any(t.is_floating_point() for t in _tensors(values.get(n)))
        if n.op == "placeholder":
            role = roles.get(n.name)
            if floating and (role == "prefix" or (role == "param" and n.name.startswith("p_"))):
                grad_nodes.add(n)
        elif floating and any(a in grad_nodes for a in n.all_input_nodes):
            grad_nodes.add(n)

    nodes = []
    for n in program.chunk.graph.nodes:
        if n.op != "call_function":
            continue
        nc = node_cost(n, values.get, requires_grad=grad_nodes.__contains__, batch=batch,
                       sizes=set(rename))
        nc.fwd_flops = sympy.expand(nc.fwd_flops.xreplace(rename))
        nc.bwd_flops = sympy.expand(nc.bwd_flops.xreplace(rename))
        nc.bytes_written = sympy.expand(nc.bytes_written.xreplace(rename))
        nodes.append(nc)
    saved, ex = saved_tensors(program, values, batch, params=params, seq=captured_seq,
                              partition=partition, example=example, device=device, recompute=recompute)
    level1 = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved if s.level == 1]))
    level2 = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved if s.level == 2]))
    saved_first = None
    if first_chunk:
        # The first chunk has no prefix; attention may take another path there (the reference
        # path uses is_causal SDPA and saves no mask), so its saved set is traced on its own.
        saved_first, _ = saved_tensors(program, values, batch, params=params, seq=captured_seq,
                                       partition=partition, example=(ex[0], 0), device=device,
                                       recompute=recompute)
        first = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved_first if s.level == 2]).subs(p, 0))
        if sympy.expand(first - level2.subs(p, 0)) != 0:
            level2 = sympy.Piecewise((first, sympy.Eq(p, 0)), (level2, True))
    return ChunkCost(
        fwd_flops=sympy.expand(sympy.Add(*[n.fwd_flops for n in nodes])),
        bwd_flops=sympy.expand(sympy.Add(*[n.bwd_flops for n in nodes])),
        saved=saved, level1_bytes=level1, level2_bytes=level2, nodes=nodes, batch=batch,
        example=ex, partition=partition, saved_first=saved_first)


def measure_saved_bytes(program, c_len: int, prefix: int, *, params: list[torch.Tensor] | None = None,
                        seq=None, device=None) -> dict[str, int]:
    """Run the chunk program eagerly on one chunk and measure what autograd saves.

    Every tensor packed by `torch.autograd.graph.saved_tensors_hooks` is attributed to its
    storage; unique storages are summed (views of one buffer count once, as in memory).
    Storages of parameters and of the K/V prefix inputs (views of earlier chunks' skeleton)
    are excluded, as in `chunk_cost`.

    Args:
        program: a `ChunkedProgram`.
        c_len: chunk length.
        prefix: prefix length.
        params: parameter tensors (default: random, see `example_inputs`).
        seq: the captured sequence symbol.
        device: device of the example tensors (see `example_inputs`).

    Returns:
        {"saved_bytes": bytes of unique saved storages, "kv_bytes": bytes of the chunk's K/V
        outputs (numel * itemsize), "num_saved": tensors packed}.
    """
    args = example_inputs(program, c_len, prefix, params=params, seq=seq, device=device)
    roles = [r for _, r, _ in _input_specs(program, seq)]
    excluded = {a.untyped_storage().data_ptr() for a, r in zip(args, roles)
                if isinstance(a, torch.Tensor) and r in ("param", "prefix") and a.numel()}
    storages: dict[int, int] = {}
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        s = t.untyped_storage()
        if s.data_ptr() not in excluded and s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = program.chunk(*args)
    kv = list(outs)[program.num_partials:]
    return {"saved_bytes": sum(storages.values()),
            "kv_bytes": sum(t.numel() * t.element_size() for t in kv), "num_saved": count}
