"""Sequence partitions: FLOPs-balanced chunk lengths and multiplexed partitioning.

A chunk of c tokens starting at token t costs

    F(c, t) = a·c + q·c·(t + (c + 1) / 2)

FLOPs forward: a per token (matmuls, norms, the head) and q per (query, key) pair of causal
attention (4·b·h·d summed over attention sites). Equal-length chunks have unequal cost
(the prefix grows), so FLOPs-balanced chunks are longer early and shorter late:

    tokens  |■■■■■■■■■■■■|■■■■■■■■|■■■■■■|■■■■■|      (equal cost per chunk)

Multiplexed partitioning (the paper's) cuts the first and last chunks, the ones the
pipeline's fill and drain bubbles wait on, into `stages` finer pieces without adding memory
(no chunk gets longer). In our schedule simulator the bubbles are set by the costliest
chunk in flight, so this pays off when the first/last chunks are the costly ones (even
lengths: the last chunk has the longest prefix) and not for FLOPs-balanced chunks, where
it gains nothing at one micro-batch and loses under 1F1B with several; the pipeline
solver predicts both and keeps the faster.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Tensors of one size that a chunk's programs allocate, `count` of them per chunk:
    `per_token` bytes per token of the chunk (activations and their gradients) plus `fixed`
    bytes (a weight's gradient, one per use per chunk). `backward`: made by the backward
    (an input's or a weight's gradient), else a forward output (again in a recompute).
    `matmul`: a matmul's output or gradient, which a compiled program allocates too (it
    fuses the other ops' outputs into fewer buffers)."""

    per_token: float
    fixed: float = 0.0
    count: float = 1.0
    backward: bool = False
    matmul: bool = False

    def nbytes(self, tokens: float) -> float:
        """Bytes of one such tensor in a chunk of `tokens` tokens."""
        return self.per_token * tokens + self.fixed


@dataclasses.dataclass
class ChunkCostModel:
    """Forward FLOPs of a chunk: a·c + q·c·(t + (c+1)/2).

    Attributes:
        per_token: a, FLOPs per token outside attention (whole model or one stage).
        per_pair: q, FLOPs per causal (query, key) pair, all attention sites.
        backward_factor: backward FLOPs / forward FLOPs.
        ops: ops of one chunk's forward (the clock's per-op overhead, `solver.clock`).
        attention: per attention site (batch x heads, head dim): the clock's pair cost.
        elementwise_bytes: bytes per token the forward's memory-bound ops (pointwise,
            norms, reductions, copies; not matmuls or attention) read and write: the
            clock's element-wise term (`solver.clock`).
        weight_bytes: bytes of the matmuls' operands that do not grow with the sequence
            (weights), read once by a chunk's forward: the clock's weight streaming
            (`solver.clock`), where they do not stay in the processor's cache.
        allocations: the tensors a chunk's forward and backward allocate (`Allocation`):
            the clock's allocation term (`solver.clock`, `solver.allocation`).
        recompute_allocates: a recompute policy allocates the forward's tensors again
            (the captured graph's list); False where `allocations` are a partition's
            traced graphs, whose backward holds the recompute (`budget.with_traced_allocations`).
    """

    per_token: float
    per_pair: float
    backward_factor: float = 2.0
    ops: int = 0
    attention: tuple = ()
    elementwise_bytes: float = 0.0
    weight_bytes: float = 0.0
    allocations: tuple = ()
    recompute_allocates: bool = True

    def forward_flops(self, length: int, start: int) -> float:
        return self.per_token * length + self.per_pair * length * (start + (length + 1) / 2)

    def cumulative(self, position: float) -> float:
        """FLOPs of tokens [0, position) in one chunk: a·x + q·x(x+1)/2."""
        return self.per_token * position + self.per_pair * position * (position + 1) / 2

    def scaled(self, factor: float) -> "ChunkCostModel":
        return ChunkCostModel(self.per_token * factor, self.per_pair * factor, self.backward_factor, self.ops,
                              tuple((bh * factor, d) for bh, d in self.attention), self.elementwise_bytes * factor,
                              self.weight_bytes * factor,
                              tuple(dataclasses.replace(a, count=a.count * factor) for a in self.allocations))


def cost_model_from_graph(gm: fx.GraphModule, seq: sympy.Symbol) -> ChunkCostModel:
    """Estimate a and q from an analysed captured graph (matmul and SDPA nodes).

    a counts 2·K·N per token for every linear/matmul whose rows are tokens; q counts
    4·b·h·d per attention site (QK^T and PV). The element-wise bytes per token are those of
    the token-local memory-bound nodes (`passes.cost.elementwise_bytes`), by the difference
    of their bytes at two lengths; a node whose bytes are not linear in the sequence (an
    explicit T x T mask or softmax) belongs to attention, which the chunk program replaces.
    """
    from sppo_fx.passes.cost import elementwise_bytes
    from sppo_fx.passes.stage_split import node_flops
    per_token, per_pair, ops, sites, moved, weights = 0.0, 0.0, 0, [], 0.0, 0.0
    allocated: dict = {}
    with_grad = _carries_grad(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ops += 1
        for a in _node_allocations(node, seq, with_grad):
            allocated[a] = allocated.get(a, 0) + 1
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            q = node.args[0].meta["val"]
            b, h, d = int(q.shape[0]), int(q.shape[1]), int(q.shape[-1])
            per_pair += 4.0 * b * h * d
            sites.append((b * h, d))
            continue
        moved += _per_token(elementwise_bytes(node), seq)
        info = node.meta.get("sppo_seq")
        if info is None or not info.seq_dims:
            continue
        f1, f2 = node_flops(node, seq, 1024), node_flops(node, seq, 2048)
        per_token += max(f2 - f1, 0.0) / 1024
        if node.target in _MATMULS:
            weights += sum(_fixed_bytes(a) for a in node.args if isinstance(a, fx.Node))
    allocations = tuple(dataclasses.replace(a, count=float(n)) for a, n in sorted(
        allocated.items(), key=lambda kv: (kv[0].per_token, kv[0].fixed, kv[0].backward, kv[0].matmul)))
    return ChunkCostModel(per_token, per_pair, ops=ops, attention=tuple(sites), elementwise_bytes=moved,
                          weight_bytes=weights, allocations=allocations)


def _carries_grad(gm: fx.GraphModule) -> set:
    """Nodes whose value needs a gradient: the floating-point parameters (placeholders of a
    fixed shape) and everything computed from them."""
    out = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if (isinstance(val, torch.Tensor) and val.is_floating_point()
                    and not any(isinstance(s, torch.SymInt) for s in val.shape)):
                out.add(node)
        elif any(n in out for n in node.all_input_nodes):
            if any(t.is_floating_point() for t in _value_tensors(val)):
                out.add(node)
    return out


def _value_tensors(val) -> list:
    from sppo_fx.passes.cost.flops import _tensors
    return _tensors(val)


def _node_allocations(node: fx.Node, seq: sympy.Symbol, with_grad: set) -> list[Allocation]:
    """The tensors one node's forward and backward allocate: each fresh output (not a view
    of an input), and in the backward a gradient of each input that needs one, shaped as
    that input (a weight's: its whole size, per chunk). Sizes linear in the sequence count
    per token; other sizes that grow with it (an explicit T x T mask) are attention's,
    which the chunk program replaces, and are left out."""
    from sppo_fx.passes.aliasing import is_view_op, storage_key
    from sppo_fx.passes.cost.flops import _MATMUL, _nbytes, _op_name
    outs = _value_tensors(node.meta.get("val"))
    if not outs or node.target is operator.getitem:
        return []
    matmul = _op_name(node.target) in _MATMUL
    ins = [(n, t) for n in node.all_input_nodes for t in _value_tensors(n.meta.get("val"))]
    in_storages = {storage_key(t) for _, t in ins}
    found = []
    view = is_view_op(node.target)
    for t in outs:
        if view or (storage_key(t) is not None and storage_key(t) in in_storages):
            continue
        found.append((_nbytes(t), False))
    if node in with_grad and not view:
        found += [(_nbytes(t), True) for n, t in ins if n in with_grad and t.is_floating_point()]
    allocs = []
    for nbytes, backward in found:
        line = _line_in(nbytes, seq)
        if line is not None:
            allocs.append(Allocation(line[0], line[1], backward=backward, matmul=matmul))
    return allocs


@functools.lru_cache(maxsize=4096)
def _line_in(expr, seq: sympy.Symbol) -> tuple[float, float] | None:
    """(slope, intercept) of an expression in the sequence length when it is a line in it
    (a constant included), else None. Cached: a graph's nodes share a few shapes, and
    sympy's expansion is most of the cost model's time otherwise."""
    expr = sympy.expand(sympy.sympify(expr))
    if not expr.free_symbols:
        return 0.0, float(expr)
    slope = _per_token(expr, seq)
    rest = expr - slope * seq
    return (slope, float(rest)) if slope and not rest.free_symbols else None


_MATMULS = (torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)


def _fixed_bytes(node: fx.Node) -> float:
    """Bytes of a tensor operand whose shape does not depend on the sequence (a weight,
    a bias); 0 for one that does (the tokens)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(isinstance(s, torch.SymInt) for s in val.shape):
        return 0.0
    return float(val.numel() * val.element_size())


def _per_token(expr, seq: sympy.Symbol) -> float:
    """The slope in the sequence length of an expression linear in it (else 0)."""
    expr = sympy.expand(sympy.sympify(expr))
    if not expr.free_symbols:
        return 0.0
    if expr.free_symbols != {seq} or sympy.degree(expr, seq) != 1:
        return 0.0
    return float(expr.coeff(seq, 1))


def balanced_lengths(seq_len: int, chunks: int, cost: ChunkCostModel) -> list[int]:
    """Chunk lengths with (as nearly as integers allow) equal forward FLOPs.

    Args:
        seq_len: tokens T.
        chunks: N (≤ T).
        cost: the chunk cost model.

    Returns:
        N lengths ≥ 1 summing to T.
    """
    if chunks < 1 or seq_len < chunks:
        raise SppoError(f"the sequence has {seq_len} tokens, fewer than chunks={chunks}: use chunks <= {seq_len}")
    total = cost.cumulative(seq_len)
    a, q = cost.per_token, cost.per_pair
    ends = []
    for i in range(1, chunks):
        target = total * i / chunks
        if q > 0:  # solve a·x + q·x(x+1)/2 = target
            bq = a + q / 2
            x = (-bq + math.sqrt(bq * bq + 2 * q * target)) / q
        else:
            x = seq_len * i / chunks
        ends.append(int(round(x)))
    ends.append(seq_len)
    # keep every chunk at least one token long
    lengths, prev = [], 0
    for k, e in enumerate(ends):
        lo = prev + 1
        hi = seq_len - (chunks - 1 - k)
        e = min(max(e, lo), hi)
        lengths.append(e - prev)
        prev = e
    return lengths


def multiplexed_lengths(lengths: list[int], stages: int) -> list[int]:
    """Cut the first and the last chunk into `stages` near-equal pieces each.

    The pieces next to the fill and drain bubbles get shorter; no chunk gets longer, so the
    peak activation memory does not grow.
    """
    if stages <= 1 or len(lengths) < 2:
        return list(lengths)

    def cut(c):
        k = min(stages, c)
        return [c // k + (1 if j < c % k else 0) for j in range(k)]

    return cut(lengths[0]) + list(lengths[1:-1]) + cut(lengths[-1])
