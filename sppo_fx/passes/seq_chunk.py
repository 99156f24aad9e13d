"""The chunk pass: one captured graph -> prologue, per-chunk program, epilogue.

Chunk i covers tokens [start, start + c). The per-chunk program is the captured graph
with every sequence size set to c and these rewrites (per attention site, per position
source, per sequence reduction):

    captured graph                           chunk program
    ──────────────                           ─────────────
    arange(T)                          ->    arange(chunk_start, chunk_start + chunk_len)
    buf[:T]                            ->    buf[chunk_start : chunk_start + chunk_len]
    sdpa(q, k, v, is_causal=True)      ->    k = contiguous(k); v = contiguous(v)
                                             prefix_causal_attention(q, k_prefix, k, v_prefix, v)
                                                                  (k_prefix, v_prefix: placeholders)
                                             k, v                               (outputs)
    cross_entropy(x, y, mean)          ->    cross_entropy(x, y, sum), its divisor (partials out;
    mean(x) / sum(x)                   ->    sum(x) [, numel(x)]          passes/loss_epilogue.py)

Values computed only from the inputs that mix positions (Hugging Face's label shift:
pad + slice) go to the *prologue*, which runs once on the full sequence; the runtime
slices its outputs per chunk. Everything computed from the reductions only (`loss * 0.5`)
goes to the *epilogue*, which takes the partials summed over all chunks (mean = total sum /
global count, so `ignore_index` means use the global count of valid tokens).

    prologue(seq_len, *user_inputs)                          -> boundary values (full length)
    chunk(*params, *boundary slices, *kv prefixes, chunk_start, chunk_len)
                                                             -> (*partials, *k/v per site)
    epilogue(seq_len, *epilogue params, *partial totals)     -> loss
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv, ToFloat

from sppo_fx.chunk_attention.functions import document_causal_attention, prefix_causal_attention
from sppo_fx.errors import SppoError, describe_node, source_line
from sppo_fx.passes.loss_epilogue import build_epilogue, carried_partial, input_ancestors, reduction_partials
from sppo_fx.passes.seqdim import INPUT, _is_size_node, arg_expr

aten = torch.ops.aten


@dataclasses.dataclass
class AttentionSite:
    """A causal attention call turned into attention over a K/V prefix.

    Attributes:
        name: the SDPA node's name in the captured graph.
        source: the user's source line.
        k_shape / v_shape: shapes of K and V with the sequence dim (-2) set to 0.
        dtype: K/V dtype.
        window: sliding window W (a query sees its W most recent keys), None if unbounded.
        documents: the boundary (prologue output, `attention.document_positions`) holding
            each token's position inside its packed document; None: one document. The
            runtime reads it to start a chunk's prefix at its first token's document.
    """

    name: str
    source: str
    k_shape: tuple
    v_shape: tuple
    dtype: torch.dtype
    window: int | None = None
    documents: str | None = None


@dataclasses.dataclass
class ReductionSite:
    """A reduction over the sequence, accumulated across chunks.

    Attributes:
        name: node name in the captured graph.
        op: e.g. "cross_entropy(mean)", "kl_div(sum)", "mean", "sum"; "carried" for an input
            value the epilogue reads (`loss_epilogue.carried_partial`).
        source: the user's source line.
        has_count: whether a denominator partial (count / numel) is accumulated too.
        inputs: for a value carried to the epilogue (op "carried", `loss_epilogue`), the
            user-input placeholders it is computed from.
    """

    name: str
    op: str
    source: str
    has_count: bool
    inputs: tuple = ()


@dataclasses.dataclass
class Boundary:
    """A value the prologue hands to every chunk: sliced along `seq_dim` (or whole if None)."""

    name: str
    seq_dim: int | None


@dataclasses.dataclass
class Activation:
    """A per-chunk tensor exchanged with a neighbouring pipeline stage.

    Attributes:
        name: the placeholder (received) or node (sent) name.
        shape: sizes as sympy expressions of the sequence symbol, which stands for the
            chunk length here.
        dtype: element type.
        seq: the sequence symbol.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    seq: sympy.Symbol

    def concrete_shape(self, chunk_len: int) -> tuple[int, ...]:
        """The shape for a chunk of `chunk_len` tokens."""
        return tuple(int(sympy.sympify(e).subs(self.seq, chunk_len)) for e in self.shape)

    @classmethod
    def of(cls, node: fx.Node, seq) -> "Activation":
        val = node.meta["val"]
        shape = tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in val.shape)
        return cls(node.name, shape, val.dtype, seq)


@dataclasses.dataclass
class ChunkedProgram:
    """The three graphs the runtime runs, and how to feed them.

    Attributes:
        prologue: (seq_len, *user_inputs) -> boundary values.
        chunk: (*params, *boundary slices, *received activations, *k/v prefixes,
            chunk_start, chunk_len) -> (*partials, *sent activations, *[k, v] per attention site).
        epilogue: (seq_len, *epilogue_params, *partial totals) -> loss; None for a pipeline
            stage that does not compute the loss.
        params: parameter/buffer/constant placeholder names the chunk program takes, in order.
        epilogue_params: those the epilogue takes (usually none), in order.
        boundaries: the prologue outputs, in chunk-program order.
        attention: attention sites, in chunk-program K/V order.
        reductions: reduction sites; partials are (sum[, count]) per site in this order.
        recvs: activations received from the previous pipeline stage, per chunk.
        sends: activations sent to the next pipeline stage, per chunk.
        seq_parallel: S > 1 after `passes.sequence_parallel.shard_attention_heads`: the
            chunk program runs on one rank's share of each chunk and takes the whole
            chunk's length as `sp_chunk_len` after `chunk_len`.
    """

    prologue: fx.GraphModule
    chunk: fx.GraphModule
    epilogue: fx.GraphModule
    params: list[str]
    epilogue_params: list[str]
    boundaries: list[Boundary]
    attention: list[AttentionSite]
    reductions: list[ReductionSite]
    recvs: list[Activation] = dataclasses.field(default_factory=list)
    sends: list[Activation] = dataclasses.field(default_factory=list)
    seq_parallel: int = 1

    @property
    def num_partials(self) -> int:
        return sum(2 if r.has_count else 1 for r in self.reductions)


def build_size(graph: fx.Graph, expr: sympy.Expr, symbols: dict):
    """FX nodes computing an integer sympy expression from symbol -> node/int bindings."""
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, ToFloat):  # float(T), e.g. a token count in a router's auxiliary loss
        return graph.call_function(torch.sym_float, (build_size(graph, expr.args[0], symbols),))
    if expr.is_Symbol:
        if expr not in symbols:
            raise SppoError(f"size {expr} depends on a symbol other than the sequence length")
        return symbols[expr]
    if isinstance(expr, FloorDiv):
        return graph.call_function(operator.floordiv, tuple(build_size(graph, a, symbols) for a in expr.args))
    if expr.is_Add or expr.is_Mul:
        fn = operator.add if expr.is_Add else operator.mul
        acc = build_size(graph, expr.args[0], symbols)
        for a in expr.args[1:]:
            acc = graph.call_function(fn, (acc, build_size(graph, a, symbols)))
        return acc
    raise SppoError(f"cannot express the size {expr} per chunk")


def _info(node):
    return node.meta["sppo_seq"]


def _copy_meta(new: fx.Node, old: fx.Node):
    for key in ("stack_trace", "nn_module_stack", "val", "sppo_seq", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    return new


class _Builder:
    """Copies nodes of the captured graph into a new graph, sizes bound to a node."""

    def __init__(self, seq: sympy.Symbol):
        self.graph = fx.Graph()
        self.env: dict[fx.Node, object] = {}
        self.seq = seq
        self.length = None

    def placeholder(self, name: str, like: fx.Node | None = None) -> fx.Node:
        node = self.graph.placeholder(name)
        if like is not None:
            _copy_meta(node, like)
        return node

    def size(self, node: fx.Node):
        expr = arg_expr(node, self.seq)
        if expr is None:
            raise SppoError(f"{describe_node(node)}: a non-integer size is not supported")
        return self.expr(expr)

    def expr(self, expr: sympy.Expr):
        """An integer sympy expression of the sequence symbol, at this graph's length."""
        return build_size(self.graph, expr, {self.seq: self.length})

    def get(self, node: fx.Node, lazy: bool = False):
        """The new value for `node`; with lazy=True, copies missing ancestors too."""
        if node in self.env:
            return self.env[node]
        if _is_size_node(node) and node.op != "placeholder":
            self.env[node] = self.size(node)
            return self.env[node]
        if not lazy or node.op != "call_function":
            raise AssertionError(f"sppo_fx internal error: {node.name} used before it was copied")
        self.env[node] = _copy_meta(self.graph.node_copy(node, lambda n: self.get(n, lazy=True)), node)
        return self.env[node]

    def bind(self, node: fx.Node, new: fx.Node):
        """`new` stands for `node` in this graph (with its metadata)."""
        self.env[node] = _copy_meta(new, node)

    def copy(self, node: fx.Node):
        self.env[node] = _copy_meta(self.graph.node_copy(node, self.get), node)
        return self.env[node]

    def finish(self, outputs) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        self.graph.eliminate_dead_code()
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.recompile()
        return gm


def _prefix_shape(node: fx.Node, seq) -> tuple:
    val = node.meta["val"]
    shape = []
    for i, s in enumerate(val.shape):
        if i == val.dim() - 2:
            shape.append(0)
        elif isinstance(s, torch.SymInt):
            raise SppoError(f"{describe_node(node)}: K/V dim {i} has a symbolic size {s}; only the "
                            "sequence dim may be dynamic")
        else:
            shape.append(int(s))
    return tuple(shape)


def _rewrite_position(b: _Builder, node: fx.Node, start: fx.Node, length: fx.Node):
    """arange(T) -> arange(start, start + c); buf[:T] -> buf[start:start + c]."""
    seq = b.seq
    if node.target is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        lo = arg_expr(node.args[2], seq) if len(node.args) > 2 and node.args[2] is not None else sympy.Integer(0)
        hi = arg_expr(node.args[3], seq) if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if lo == 0 and hi is not None and sympy.simplify(hi - seq) == 0 and step == 1:
            end = b.graph.call_function(operator.add, (start, length))
            return b.graph.call_function(aten.slice.Tensor, (b.get(node.args[0]), dim, start, end))
    else:
        if node.target is aten.arange.default:
            lo, hi, step = sympy.Integer(0), arg_expr(node.args[0], seq), 1
        else:
            lo, hi = arg_expr(node.args[0], seq), arg_expr(node.args[1], seq)
            step = node.args[2] if len(node.args) > 2 else 1
        if lo == 0 and hi is not None and sympy.simplify(hi - seq) == 0 and step == 1:
            end = b.graph.call_function(operator.add, (start, length))
            return b.graph.call_function(aten.arange.start, (start, end), dict(node.kwargs))
    raise SppoError(f"{describe_node(node)} takes positions other than 0..T-1 (e.g. a shifted range); "
                    "sppo_fx can offset only position ranges that start at 0 and end at the sequence length")


_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.view_as.default, aten.as_strided.default}
# ops whose result is a view of their input (a strided input gives a strided result)
_ALIASING_OPS = {aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
                 aten.squeeze.dims, aten.squeeze.default, aten.transpose.int, aten.permute.default,
                 aten.t.default, aten.expand.default, aten.alias.default, aten.detach.default,
                 aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
                 aten.narrow.default, aten.diagonal.default, operator.getitem}


def _needs_contiguous(node: fx.Node) -> bool:
    """Whether a view op (`view`, `as_strided`, ...) reads `node` directly or through views."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.target in _VIEW_OPS:
                return True
            if u.target in _ALIASING_OPS:
                stack.append(u)
    return False


def _sliced_input(b: _Builder, placeholder: fx.Node, node: fx.Node, spec: Boundary):
    """A chunk's slice of an input-derived value, made contiguous where the graph views it.

    The runtime hands the chunk program `value.narrow(seq_dim, start, c)`; with a dim of
    size > 1 before the sequence dim (batch > 1) that slice is strided, while the whole
    input was contiguous, so a `.view` the model applies to it (nanoGPT's
    `targets.view(-1)`) would fail. A contiguous copy makes the slice behave like the
    whole input for every op.
    """
    if spec.seq_dim is None or not _needs_contiguous(node):
        return placeholder
    leading = 1
    for s in node.meta["val"].shape[:spec.seq_dim]:
        leading *= int(s) if not isinstance(s, torch.SymInt) else 2  # symbolic: assume > 1
    if leading <= 1:
        return placeholder
    # no meta copied, like the K/V copies below: the cost model's fake run shapes it
    return b.graph.call_function(aten.contiguous.default, (placeholder,))


def chunk_program(gm: fx.GraphModule, seq: sympy.Symbol, param_names: list[str],
                  input_names: list[str], activations: list[str] = ()) -> ChunkedProgram:
    """Split an analysed graph (`seqdim.analyse` ran on it) into prologue, chunk, epilogue.

    Args:
        gm: the captured, mask-recognised, analysed graph.
        seq: the sequence-length symbol.
        param_names: placeholders bound to parameters/buffers/constants, in graph order.
        input_names: placeholders of the flat user inputs, in order.
        activations: placeholders receiving activations from the previous pipeline stage.

    Returns:
        The `ChunkedProgram`. Raises `SppoError` when an input-derived value cannot be
        sliced per chunk.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    role = {n: _info(n).role for n in nodes if "sppo_seq" in n.meta}
    prologue_roots = [n for n in nodes if role.get(n) == "prologue"]
    prologue_set = set()
    stack = list(prologue_roots)
    while stack:
        n = stack.pop()
        if n in prologue_set or n.op == "placeholder" or _is_size_node(n):
            continue
        prologue_set.add(n)
        stack.extend(n.all_input_nodes)
    epilogue_set = {n for n in nodes if role.get(n) == "epilogue"}
    reductions = [n for n in nodes if role.get(n) == "reduction"]
    out_node = next(n for n in nodes if n.op == "output")
    outputs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    loss_outputs = [o for o in outputs if role.get(o) in ("reduction", "epilogue")]
    send_nodes = [o for o in outputs if o not in loss_outputs]
    if not loss_outputs and not send_nodes or (loss_outputs and not reductions):
        raise SppoError("the loss is not a reduction over the sequence (sum, mean or cross-entropy); "
                        "sppo_fx needs a loss that sums or averages over tokens")
    for o in send_nodes:
        if not isinstance(o, fx.Node) or not _info(o).seq_dims:
            raise SppoError(f"stage output {o} has no sequence dim; a pipeline stage may only hand "
                            "per-token activations to the next stage")

    # Values the epilogue reads that depend on the inputs and are no reductions: each chunk
    # computes them, the first chunk hands them on (`loss_epilogue.carried_partial`).
    carried = []
    for n in nodes:
        if n in epilogue_set:
            carried += [a for a in n.all_input_nodes if a not in carried and not _is_size_node(a)
                        and role.get(a) not in ("reduction", "epilogue") and INPUT in _info(a).origin]

    # Values that cross from the prologue / user inputs into the per-chunk region.
    boundaries: list[fx.Node] = []
    for n in nodes:
        if n.op != "call_function" or n in prologue_set or n in epilogue_set or _is_size_node(n):
            continue
        for a in n.all_input_nodes:
            if (a in prologue_set or (a.op == "placeholder" and a.name in input_names)) \
                    and not _is_size_node(a) and a not in boundaries:
                boundaries.append(a)
    boundaries += [a for a in carried if (a in prologue_set or a.op == "placeholder") and a not in boundaries]
    boundary_specs = []
    for a in boundaries:
        dims = _info(a).seq_dims
        if not dims:
            boundary_specs.append(Boundary(a.name, None))
            continue
        size = a.meta["val"].shape[dims[0]]
        if len(dims) != 1 or sympy.simplify(size.node.expr - seq) != 0:
            raise SppoError(
                f"{describe_node(a)} is computed from the inputs with shape {tuple(a.meta['val'].shape)}: "
                "sppo_fx slices input-derived values per chunk and needs exactly one dim of the "
                "sequence length")
        boundary_specs.append(Boundary(a.name, dims[0]))

    # Prologue: runs once on the full sequence.
    pb = _Builder(seq)
    pb.length = pb.placeholder("seq_len")
    for name in input_names:
        pb.env[by_name[name]] = pb.placeholder(name, by_name[name])
    prologue = pb.finish([pb.get(a, lazy=True) for a in boundaries])

    # Chunk program.
    cb = _Builder(seq)
    for name in param_names:
        cb.env[by_name[name]] = cb.placeholder(name, by_name[name])
    for a, spec in zip(boundaries, boundary_specs):
        cb.env[a] = _sliced_input(cb, cb.placeholder(f"chunk_{a.name}", a), a, spec)
    recv_nodes = [by_name[name] for name in activations]
    for a in recv_nodes:
        cb.env[a] = cb.placeholder(a.name, a)
    sites = [n for n in nodes if role.get(n) == "attention"]
    prefixes = {}
    for s in sites:
        prefixes[s] = (cb.placeholder(f"{s.name}_k_prefix"), cb.placeholder(f"{s.name}_v_prefix"))
        for prefix in prefixes[s]:
            prefix.meta["seq_dim"] = 2  # [b, h_kv, p, d]: the prefix length (codegen compiles only it dynamic)
    start = cb.placeholder("chunk_start")
    cb.length = cb.placeholder("chunk_len")
    partials, kv_out, attention, red_sites = [], [], [], []
    for n in nodes:
        if n in cb.env or n.op in ("placeholder", "output") or n in prologue_set or n in epilogue_set:
            continue
        r = role.get(n)
        if _is_size_node(n):
            cb.get(n)
        elif r == "positional":
            cb.env[n] = _copy_meta(_rewrite_position(cb, n, start, cb.length), n)
        elif r == "attention":
            q, k, v = (cb.get(a) for a in n.args[:3])
            kp, vp = prefixes[n]
            # the chunk's own K/V leave the program as compact tensors (not views of e.g. a
            # fused QKV buffer, which would keep the whole buffer alive)
            k = cb.graph.call_function(aten.contiguous.default, (k,))
            v = cb.graph.call_function(aten.contiguous.default, (v,))
            kwargs = {key: n.kwargs[key] for key in ("scale", "enable_gqa", "window", "softcap", "alibi")
                      if n.kwargs.get(key) is not None}
            if n.kwargs.get("sinks") is not None:  # a learned [h] tensor: the chunk program reads it
                kwargs["sinks"] = cb.get(n.kwargs["sinks"])
            documents = n.args[3] if n.target is document_causal_attention else None
            if documents is not None:  # each query's position in its document, this chunk's slice
                kwargs["doc_pos"] = cb.get(documents)
            out = cb.graph.call_function(prefix_causal_attention, (q, kp, k, vp, v), kwargs)
            cb.env[n] = _copy_meta(out, n)
            kv_out += [k, v]
            attention.append(AttentionSite(n.name, source_line(n), _prefix_shape(n.args[1], seq),
                                           _prefix_shape(n.args[2], seq), n.args[1].meta["val"].dtype,
                                           n.kwargs.get("window"), documents.name if documents is not None else None))
        elif r == "reduction":
            op, parts = reduction_partials(cb, n)
            partials += parts
            red_sites.append(ReductionSite(n.name, op, source_line(n), len(parts) == 2))
        else:
            cb.copy(n)
    for a in carried:
        partials.append(carried_partial(cb, cb.get(a), start))
        red_sites.append(ReductionSite(a.name, "carried", source_line(a), False,
                                       tuple(input_ancestors(a, input_names))))
    chunk = cb.finish(partials + [cb.get(o) for o in send_nodes] + kv_out)
    # Drop boundary inputs the chunk program does not read (their consumers were dead).
    used = {p.name for p in chunk.graph.nodes if p.op == "placeholder" and p.users}
    for p in list(chunk.graph.nodes):
        if p.op == "placeholder" and p.name.startswith("chunk_") and p.name not in used \
                and p.name not in ("chunk_start", "chunk_len"):
            chunk.graph.erase_node(p)
    keep = [i for i, a in enumerate(boundaries) if f"chunk_{a.name}" in used]
    boundary_specs = [boundary_specs[i] for i in keep]
    prologue_out = next(n for n in prologue.graph.nodes if n.op == "output")
    prologue_out.args = (tuple(prologue_out.args[0][i] for i in keep),)
    prologue.graph.eliminate_dead_code()
    prologue.recompile()
    chunk.recompile()

    epilogue, epilogue_params = None, []
    if loss_outputs:
        epilogue, epilogue_params = build_epilogue(_Builder(seq), nodes, by_name, param_names, red_sites,
                                                   epilogue_set, loss_outputs[0])
    # Parameters neither program reads (e.g. another pipeline stage's) are not inputs.
    needed = set(epilogue_params)
    for ph in list(chunk.graph.nodes):
        if ph.op == "placeholder" and ph.name in param_names:
            if ph.users or ph.name in needed:
                needed.add(ph.name)
            else:
                chunk.graph.erase_node(ph)
    chunk.recompile()
    param_names = [name for name in param_names if name in needed]
    return ChunkedProgram(prologue=prologue, chunk=chunk, epilogue=epilogue, params=list(param_names),
                          epilogue_params=epilogue_params, boundaries=boundary_specs, attention=attention,
                          reductions=red_sites, recvs=[Activation.of(a, seq) for a in recv_nodes],
                          sends=[Activation.of(o, seq) for o in send_nodes])

