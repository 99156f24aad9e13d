"""Stage split: one analysed graph -> P pipeline-stage graphs.

Nodes are grouped into the model's repeated blocks (`model.layers.3`, `model.h.0`: module
paths that end in a list index, from torch.export's `nn_module_stack`), plus what runs
before the first block (embeddings) and after the last (final norm, head, loss). The
blocks are cut into P contiguous groups of balanced cost (or at the user's split points:
module names, or `sppo_fx.split_point(x)` markers). Only per-token data crosses stages;
weights, positions and input-derived values are recomputed by the stage that reads them.

    stage 0                       stage 1                       stage P-1
    ───────                       ───────                       ─────────
    params, inputs                params, inputs, recv_h        params, inputs, recv_h
    embed, blocks 0..k-1   ─h─►   blocks k..l-1          ─h─►   blocks .., head, loss
    -> (h,)                       -> (h,)                       -> (loss,)

A value produced in stage s and read in stage s+2 is passed through stage s+1.
"""
from __future__ import annotations

import dataclasses
import re

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError
from sppo_fx.markers import SPLIT_POINT
from sppo_fx.chunk_attention.functions import document_causal_attention, windowed_causal_attention
from sppo_fx.passes.seqdim import DATA, SDPA

aten = torch.ops.aten
_BLOCK = re.compile(r"^(.*)\.(\d+)$")
_REFERENCE_LEN = 4096  # sequence length at which block costs are compared


@dataclasses.dataclass
class StageGraph:
    """One pipeline stage.

    Attributes:
        index: stage number.
        graph: the stage's GraphModule (placeholders: params, user inputs, received values).
        recvs: placeholders holding activations received from the previous stage.
        blocks: the model blocks this stage runs (module paths).
        cost: the balancing cost (FLOPs at the reference length).
    """

    index: int
    graph: fx.GraphModule
    recvs: list[str]
    blocks: list[str]
    cost: float


def block_of(node: fx.Node) -> str | None:
    """The outermost repeated block (`model.layers.3`) a node belongs to, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        if _BLOCK.match(path or ""):
            return path
    return None


def _numel(val, seq, length) -> float:
    n = 1
    for s in val.shape:
        n *= float(s.node.expr.subs(seq, length)) if isinstance(s, torch.SymInt) else int(s)
    return n


def node_flops(node: fx.Node, seq: sympy.Symbol, length: int = _REFERENCE_LEN) -> float:
    """A FLOP estimate at sequence length `length` (matmuls and attention dominate)."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor):
        return 0.0
    out = _numel(val, seq, length)
    if node.target in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default,
                       aten.bmm.default):
        a = node.args[1] if node.target is aten.addmm.default else node.args[0]
        k = a.meta["val"].shape[-1]
        k = float(k.node.expr.subs(seq, length)) if isinstance(k, torch.SymInt) else int(k)
        return 2.0 * out * k
    if node.target is SDPA or node.target in (windowed_causal_attention, document_causal_attention):
        q = node.args[0].meta["val"]
        t = _numel(q, seq, length) / (q.shape[-1] if isinstance(q.shape[-1], int) else 1)
        if not isinstance(q.shape[-2], torch.SymInt):
            return 4.0 * t
        keys = float(q.shape[-2].node.expr.subs(seq, length))
        return 2.0 * out * min(keys, node.kwargs.get("window") or keys)
    return out


def _balanced_cuts(costs: list[float], parts: int) -> list[int]:
    """Indices where each of `parts` contiguous groups starts, minimising the largest group."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], choice[k][j] = v, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        i = choice[k][j]
        starts.append(i)
        j = i
    return sorted(starts)


def assign_stages(gm: fx.GraphModule, seq: sympy.Symbol, num_stages: int,
                  split_points: list[str] | None = None) -> dict[fx.Node, int]:
    """The stage of every data node (see the module docstring).

    Args:
        gm: the analysed captured graph.
        seq: the sequence symbol.
        num_stages: P.
        split_points: module names to cut before (e.g. ["layers.4"]); default: balance cost,
            or cut after `sppo_fx.split_point` markers when the model has them.

    Returns:
        {node: stage} for the nodes that compute per-token data, attention, the loss.
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and _is_stage_work(n)]
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    markers = [n for n in gm.graph.nodes if n.target is SPLIT_POINT]
    if split_points:
        cut_nodes = []
        for name in split_points:
            targets = {name, f"model.{name}"}
            first = next((n for n in nodes if any(p in targets for p, _ in (n.meta.get("nn_module_stack") or {}).values())), None)
            if first is None:
                raise SppoError(f"split point '{name}' names no module of the model that computes "
                                "per-token data; use module paths such as 'layers.4'")
            cut_nodes.append(order[first])
        cuts = sorted(cut_nodes)
    elif markers:
        cuts = sorted(order[m] + 1 for m in markers)
    else:
        units, unit_cost, unit_start = [], [], []
        for n in nodes:
            key = block_of(n) or ("<pre>" if not units or units == ["<pre>"] else "<post>")
            if not units or units[-1] != key:
                if key in units:  # a block's node after another block's (rare): keep order
                    key = units[-1]
                else:
                    units.append(key)
                    unit_cost.append(0.0)
                    unit_start.append(order[n])
            unit_cost[-1] += node_flops(n, seq)
        if num_stages > len(units):
            raise SppoError(f"stages={num_stages} but the model has only {len(units)} pieces to "
                            f"split ({', '.join(units)}); use stages <= {len(units)}")
        starts = _balanced_cuts(unit_cost, num_stages)
        cuts = [unit_start[s] for s in starts[1:]]
    if len(cuts) != num_stages - 1:
        raise SppoError(f"stages={num_stages} needs {num_stages - 1} split points, got {len(cuts)}")
    return {n: sum(order[n] >= c for c in cuts) for n in nodes}


def _is_stage_work(node: fx.Node) -> bool:
    info = node.meta.get("sppo_seq")
    return info is not None and (info.kind == DATA or info.role in ("reduction", "epilogue", "attention"))


def split_stages(gm: fx.GraphModule, seq: sympy.Symbol, param_names: list[str], input_names: list[str],
                 num_stages: int, split_points: list[str] | None = None) -> list[StageGraph]:
    """Split an analysed graph into `num_stages` stage graphs.

    Args:
        gm: the analysed captured graph.
        seq: the sequence symbol.
        param_names / input_names: parameter and user-input placeholders.
        num_stages: P >= 1.
        split_points: optional module names to cut before.

    Returns:
        The stage graphs in order. Markers (`sppo_fx.split_point`) are removed.
    """
    stage_of = assign_stages(gm, seq, num_stages, split_points)
    by_name = {n.name: n for n in gm.graph.nodes}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    # the latest stage reading each data node (the output counts as the last stage)
    last_use: dict[fx.Node, int] = {}
    for n, s in stage_of.items():
        for a in n.all_input_nodes:
            if a in stage_of:
                last_use[a] = max(last_use.get(a, -1), s)
    for a in out_node.all_input_nodes:
        if a in stage_of:
            last_use[a] = num_stages - 1
    stages = []
    carried: list[fx.Node] = []  # data values live at the boundary into the current stage
    for s in range(num_stages):
        graph = fx.Graph()
        env: dict[fx.Node, object] = {}
        for name in param_names + input_names:
            ph = graph.placeholder(name)
            ph.meta.update(by_name[name].meta)
            env[by_name[name]] = ph
        recvs = []
        for a in carried:
            ph = graph.placeholder(f"recv_{a.name}")
            ph.meta.update({k: v for k, v in a.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            env[a] = ph
            recvs.append(ph.name)

        def get(n):
            if n not in env:
                if n in stage_of:
                    raise AssertionError(f"sppo_fx internal error: {n.name} of stage {stage_of[n]} "
                                         f"read in stage {s} without being sent")
                env[n] = graph.node_copy(n, get)
            return env[n]

        own = [n for n in gm.graph.nodes if stage_of.get(n) == s]
        blocks = []
        for n in own:
            if n.target is SPLIT_POINT:
                env[n] = get(n.args[0])
                continue
            env[n] = graph.node_copy(n, get)
            b = block_of(n)
            if b and b not in blocks:
                blocks.append(b)
        if s == num_stages - 1:
            graph.output(fx.node.map_arg(out_node.args[0], get))
            carried = []
        else:
            carried = [a for a in list(carried) + own if last_use.get(a, -1) > s]
            if not carried:
                raise SppoError(f"stage {s} hands no per-token activation to stage {s + 1}")
            graph.output(tuple(get(a) for a in carried))
        graph.eliminate_dead_code()
        sg = fx.GraphModule(torch.nn.Module(), graph)
        stages.append(StageGraph(s, sg, recvs, blocks, sum(node_flops(n, seq) for n in own)))
    return stages
