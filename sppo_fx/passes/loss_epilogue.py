"""Losses over the sequence: what each chunk accumulates, and what a mean divides by.

A loss node with reduction="mean" becomes, per chunk, the same op with reduction="sum"
plus a *divisor partial* derived from the op's own reduction semantics; the epilogue
divides the total sum by the total divisor, so the result is the full sequence's mean:

    op (mean)                                   divisor partial per chunk
    ─────────                                   ─────────────────────────
    cross_entropy / nll_loss, class indices     sum(target != ignore_index)
      ... with class weights                    sum(weight[target] where target != ignore_index)
    cross_entropy, probability targets          numel(input) / classes   (ignore_index and
      (label smoothing too)                     weights do not change it)
    mse / l1 / smooth_l1 / huber / kl_div /     numel of the broadcast of the tensor arguments
      binary_cross_entropy(_with_logits) /      (kl_div's "batchmean" is sum / size(0), which
      soft_margin                               the epilogue computes from the whole sizes)
    mean(x)                                     numel(x)

A loss op not in these tables that reduces over the sequence is refused by the analysis
(`seqdim._mixing_reason`), naming the op.

Values the epilogue reads that come from the user's inputs but are not reductions over the
sequence (a per-sample weight's mean, a scalar input, a count of valid labels computed once
on the whole sequence) are *carried*: every chunk computes the value and only the chunk
starting at position 0 outputs it (the others output zeros), so the runtime's sum over the
chunks hands the epilogue the value itself. Summing over data- or sequence-parallel ranks
would count it once per replica, so `passes.transform_stages` refuses such a loss there.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node

aten = torch.ops.aten

CLASS_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
                aten.nll_loss2d.default}
ELEMENTWISE_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                      aten.huber_loss.default, aten.binary_cross_entropy.default,
                      aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
                      aten.soft_margin_loss.default}
LOSSES = CLASS_LOSSES | ELEMENTWISE_LOSSES
NONE, MEAN, SUM = 0, 1, 2


def loss_args(node: fx.Node) -> dict:
    """The loss node's arguments by schema name, defaults filled in."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def loss_reduction(node: fx.Node) -> int:
    """The `reduction` argument of a loss node: 0 none, 1 mean, 2 sum."""
    return int(loss_args(node)["reduction"])


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _class_dim(x) -> int:
    return 1 if x.dim() >= 2 else 0


def class_dim_reason(node: fx.Node, seq: sympy.Symbol) -> str | None:
    """Why a class loss mixes positions: its class dim (dim 1, or 0 for one sample) is the
    sequence dim (`cross_entropy(logits[B, T, V], probs[B, T, V])` normalises over T)."""
    if node.target not in CLASS_LOSSES:
        return None
    x = node.args[0].meta["val"]
    if seq in _expr(x.shape[_class_dim(x)]).free_symbols:
        return (f"takes its classes along the sequence dimension (dim {_class_dim(x)} of "
                f"{list(x.shape)}); move the classes to dim 1 (e.g. logits.transpose(1, 2))")
    return None


def _prob_targets(node: fx.Node) -> bool:
    """cross_entropy's own rule: a target of the input's shape holds class probabilities."""
    if node.target is not aten.cross_entropy_loss.default:
        return False
    x, t = node.args[0].meta["val"], node.args[1].meta["val"]
    return x.dim() == t.dim() and all(sympy.simplify(_expr(a) - _expr(b)) == 0 for a, b in zip(x.shape, t.shape))


def _broadcast_numel(node: fx.Node, tensors: list) -> sympy.Expr:
    shapes = [[_expr(s) for s in t.meta["val"].shape] for t in tensors]
    ndim = max(len(s) for s in shapes)
    numel = sympy.Integer(1)
    for d in range(ndim):
        sizes = {s[d - ndim + len(s)] for s in shapes if d - ndim + len(s) >= 0} - {sympy.Integer(1)}
        if len(sizes) > 1 and any(sympy.simplify(a - b) != 0 for a in sizes for b in sizes):
            raise SppoError(f"{describe_node(node)}: cannot tell how its arguments broadcast "
                            f"({[list(s) for s in shapes]}), so not what its mean divides by")
        numel *= next(iter(sizes), sympy.Integer(1))
    return numel


def _count(b, expr: sympy.Expr):
    return b.graph.call_function(aten.scalar_tensor.default, (b.expr(expr),), {"dtype": torch.int64})


def _class_divisor(b, node: fx.Node, args: dict):
    """Per chunk: the targets that count (not ignore_index), each weighted by its class's
    weight when the loss has class weights (PyTorch's weighted mean)."""
    target, weight = b.get(args["target"]), args["weight"]
    valid = b.graph.call_function(aten.ne.Scalar, (target, args["ignore_index"]))
    if weight is None:
        return b.graph.call_function(aten.sum.default, (valid,))
    safe = b.graph.call_function(aten.where.ScalarOther, (valid, target, 0))  # ignored labels index nothing
    picked = b.graph.call_function(aten.index.Tensor, (b.get(weight), [safe]))
    picked = b.graph.call_function(aten.where.ScalarOther, (valid, picked, 0.0))
    return b.graph.call_function(aten.sum.default, (picked,))


def _seq_dims(val, seq) -> list[int]:
    return [d for d, s in enumerate(val.shape) if seq in _expr(s).free_symbols]


def additive_reduction(node: fx.Node, seq: sympy.Symbol) -> bool:
    """A reduction over every sequence dim whose chunks' results add up to the whole's: a sum
    over dims (the router probabilities summed over tokens of a load-balancing loss), or a
    histogram with a fixed range (tokens per expert; without one, its bins follow the data's
    min and max, which differ per chunk)."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or _seq_dims(out, seq) or not isinstance(node.args[0], fx.Node):
        return False
    x = node.args[0].meta["val"]
    if node.target is aten.histc.default:
        lo = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
        hi = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
        return lo < hi and len(_seq_dims(x, seq)) > 0
    return node.target is aten.sum.dim_IntList and len(_seq_dims(x, seq)) == 1


def reduction_partials(b, node: fx.Node) -> tuple[str, list]:
    """The partials a chunk outputs for a reduction over the sequence: [sum] or [sum, divisor].

    `b` is the chunk program's builder (`seq_chunk._Builder`: `graph`, `get(node)` for the
    chunk's value of a node, `expr(sympy expr)` for a size at the chunk's length)."""
    if node.target in (aten.sum.default, aten.mean.default):
        x = b.get(node.args[0])
        total = b.graph.call_function(aten.sum.default, (x,), dict(node.kwargs))
        if node.target is aten.sum.default:
            return "sum", [total]
        numel = b.graph.call_function(aten.sym_numel.default, (x,))
        return "mean", [total, b.graph.call_function(aten.scalar_tensor.default, (numel,), {"dtype": torch.int64})]
    if node.target in (aten.histc.default, aten.sum.dim_IntList):  # additive_reduction: the same op per chunk
        return node.target._schema.name.split("::")[-1], [b.graph.node_copy(node, b.get)]
    if node.target not in LOSSES:
        raise SppoError(f"{describe_node(node)} reduces over the sequence, and sppo_fx does not know "
                        "what its chunks' partial results add up to")
    args = loss_args(node)
    name = node.target._schema.name.split("::")[-1].removesuffix("_loss")
    reduction = int(args["reduction"])
    mapped = {k: b.get(v) if isinstance(v, fx.Node) else v for k, v in args.items()}
    mapped["reduction"] = SUM
    schema = node.target._schema.arguments
    total = b.graph.call_function(node.target, tuple(mapped[a.name] for a in schema if not a.kwarg_only),
                                  {a.name: mapped[a.name] for a in schema if a.kwarg_only})
    if reduction == SUM:
        return f"{name}(sum)", [total]
    if reduction != MEAN:
        raise SppoError(f"{describe_node(node)}: reduction={reduction} is not one sppo_fx can accumulate")
    if _prob_targets(node):
        x = node.args[0].meta["val"]
        samples = sympy.Mul(*(_expr(s) for d, s in enumerate(x.shape) if d != _class_dim(x)))
        return f"{name}(mean, probability targets)", [total, _count(b, samples)]
    if node.target in CLASS_LOSSES:
        return f"{name}(mean)", [total, _class_divisor(b, node, args)]
    tensors = [v for v in args.values() if isinstance(v, fx.Node)]
    return f"{name}(mean)", [total, _count(b, _broadcast_numel(node, tensors))]


def carried_partial(b, value, start):
    """`value` from the chunk that starts at position 0, zeros from every other chunk: the
    sum over the chunks is `value` itself (where, not a product: inf * 0 is nan)."""
    at = b.graph.call_function(aten.scalar_tensor.default, (start,), {"dtype": torch.int64})
    first = b.graph.call_function(aten.eq.Scalar, (at, 0))
    zeros = b.graph.call_function(aten.zeros_like.default, (value,))
    return b.graph.call_function(aten.where.self, (first, value, zeros))


def input_ancestors(node: fx.Node, input_names) -> list[str]:
    """The user-input placeholders `node` is computed from, in graph order."""
    seen, stack, found = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in input_names:
            found.add(n.name)
        stack.extend(n.all_input_nodes)
    return [name for name in input_names if name in found]


def build_epilogue(eb, nodes, by_name, param_names, red_sites, epilogue_set, loss):
    """The epilogue graph: (seq_len, *params it reads, *partial totals) -> loss.

    `eb` is an empty `seq_chunk._Builder`; each site's totals stand for its node (a mean:
    total sum / total divisor), and the epilogue's nodes are copied after them."""
    eb.length = eb.placeholder("seq_len")
    for name in param_names:
        eb.env[by_name[name]] = eb.placeholder(name, by_name[name])
    for site in red_sites:
        n = by_name[site.name]
        total = eb.placeholder(f"{n.name}_{'carried' if site.op == 'carried' else 'sum'}")
        if site.has_count:
            count = eb.placeholder(f"{n.name}_count")
            total = eb.graph.call_function(aten.div.Tensor, (total, count))
        eb.bind(n, total)
    for n in nodes:
        if n in epilogue_set:
            eb.get(n, lazy=True)
    epilogue = eb.finish([eb.get(loss, lazy=True)])
    for p in list(epilogue.graph.nodes):
        if p.op == "placeholder" and p.name in param_names and not p.users:
            epilogue.graph.erase_node(p)
    epilogue.recompile()
    return epilogue, [p.name for p in epilogue.graph.nodes if p.op == "placeholder" and p.name in param_names]
