"""Entry points of the cost model: `chunk_cost` (a chunk program -> ChunkCost) and
`measure_saved_bytes`."""
from __future__ import annotations


import sympy
import torch

from sppo_fx.passes.cost.data import ChunkCost, p
from sppo_fx.passes.cost.flops import _tensors, node_cost
from sppo_fx.passes.cost.saved import _static_dims, choose_example, example_inputs
from sppo_fx.passes.cost.saved_cache import stored_saved_tensors_by_policy, stored_saved_tensors_for_examples
from sppo_fx.passes.cost.shapes import _input_specs, symbolic_values, traced_batch

aten = torch.ops.aten


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
    return chunk_costs(program, captured_seq, params=params, partition=partition, example=example,
                       first_chunk=first_chunk, device=device, recomputes=(recompute,))[recompute]


def chunk_costs(program, captured_seq=None, *, params: list[torch.Tensor] | None = None,
                partition: str = "default", example: tuple[int, int] | None = None,
                first_chunk: bool = True, device=None, recomputes=("none",)) -> dict[str, ChunkCost]:
    """`chunk_cost` for several recompute policies at the price of one: the symbolic
    shapes and FLOPs are computed once, and each AOTAutograd trace (the example chunk, and
    the first chunk's) is partitioned once per policy (`saved.saved_tensors_by_policy`),
    or read back from the memory model's cache (`saved_cache.py`).

    Returns:
        {policy: ChunkCost}, equal to `chunk_cost(..., recompute=policy)` for each.
    """
    values = symbolic_values(program, captured_seq)
    batch = traced_batch(program, captured_seq)
    nodes = _node_costs(program, captured_seq, values, batch)
    kw = dict(params=params, seq=captured_seq, partition=partition, device=device, recomputes=recomputes)
    # The first chunk has no prefix; attention may take another path there (the reference
    # path uses is_causal SDPA and saves no mask), so its saved set is traced on its own.
    ex = example or choose_example(_static_dims(values), batch)
    if first_chunk:
        (saved_by, ex, allocated_by), (first_by, _, _) = stored_saved_tensors_for_examples(
            program, values, batch, [ex, (ex[0], 0)], **kw)
    else:
        saved_by, ex, allocated_by = stored_saved_tensors_by_policy(program, values, batch, example=ex, **kw)
        first_by = {}
    fwd = sympy.expand(sympy.Add(*[n.fwd_flops for n in nodes]))
    bwd = sympy.expand(sympy.Add(*[n.bwd_flops for n in nodes]))
    out = {}
    for policy, saved in saved_by.items():
        level1 = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved if s.level == 1]))
        level2 = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved if s.level == 2]))
        saved_first = first_by.get(policy)
        if saved_first is not None:
            first = sympy.expand(sympy.Add(*[s.bytes_expr for s in saved_first if s.level == 2]).subs(p, 0))
            if sympy.expand(first - level2.subs(p, 0)) != 0:
                level2 = sympy.Piecewise((first, sympy.Eq(p, 0)), (level2, True))
        out[policy] = ChunkCost(fwd_flops=fwd, bwd_flops=bwd, saved=saved, level1_bytes=level1,
                                level2_bytes=level2, nodes=nodes, batch=batch, example=ex, partition=partition,
                                saved_first=saved_first, allocated=tuple(allocated_by.get(policy, ())))
    return out


def _node_costs(program, captured_seq, values, batch) -> list:
    """FLOPs and bytes of every call_function node of the chunk program, in c, p, b."""
    rename = values.rename

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
        nc.elementwise_bytes = sympy.expand(nc.elementwise_bytes.xreplace(rename))
        nodes.append(nc)
    return nodes


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
