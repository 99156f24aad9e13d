"""Ulysses sequence parallelism as a pass on a chunk program.

With S sequence-parallel ranks, each rank runs the chunk program on its share of the
chunk's tokens: `chunk_start` / `chunk_len` are that share's, so positions (RoPE tables,
`arange`, learned position embeddings) are offset for the rank's tokens with no change to
the program. Only attention mixes tokens; around every attention call the pass puts the
all-to-alls of `ops.seq_parallel`:

    chunk program                             after the pass
    ─────────────                             ──────────────
    k = contiguous(k); v = contiguous(v)      k, t = seq_to_heads(k, t)  (repeat K/V heads first
                                              v, t = seq_to_heads(v, t)   when S exceeds them)
    out = prefix_causal_attention(            q, t = seq_to_heads(q, t)
        q, k_prefix, k, v_prefix, v)          out, t = heads_to_seq(prefix_causal_attention(
                                                  q, k_prefix, k, v_prefix, v), t)
    outputs: ..., k, v                        outputs: ..., k, v  (this rank's heads, whole chunk)

The token `t` chains every all-to-all of the program to the one before it (the first takes
None): collectives pair up across ranks by their order alone, and a compiler may otherwise
run independent ones (q, k, v's, and their gradients') in a different order on each rank
(`ops.seq_parallel`).

so the K/V a rank keeps (its skeleton, its K/V prefix) holds H_kv/S heads of every token:
1/S of the whole. A new placeholder `sp_chunk_len` (the whole chunk's tokens) follows
`chunk_len`. Everything else in the program is token-wise, and its reductions become
partial sums of this rank's tokens, which the executor sums over the ranks
(docs/architecture.md, section 3b "Parallel layout and sequence parallelism").
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.errors import SppoError
from sppo_fx.passes.seq_chunk import ChunkedProgram
import sppo_fx.ops.seq_parallel  # noqa: F401  (registers sppo.seq_to_heads / heads_to_seq)

_seq_to_heads = torch.ops.sppo.seq_to_heads.default
_heads_to_seq = torch.ops.sppo.heads_to_seq.default


def kv_repeats(q_heads: int, kv_heads: int, parts: int, site: str = "attention") -> int:
    """How many times each K/V head is repeated so that `parts` ranks each get whole heads.

    Raises SppoError (naming what to change) when the heads do not split over `parts`.
    """
    if q_heads % parts:
        raise SppoError(f"{site}: {q_heads} query heads do not split over seq_parallel={parts}; "
                        f"use a seq_parallel that divides {q_heads}")
    if kv_heads % parts == 0:
        return 1
    if parts % kv_heads == 0 and q_heads % kv_heads == 0:
        return parts // kv_heads  # each rank gets one (repeated) K/V head of its query group
    raise SppoError(f"{site}: {kv_heads} K/V heads neither split over seq_parallel={parts} nor divide "
                    f"it; use a seq_parallel that divides {kv_heads} or that {kv_heads} divides")


def shard_attention_heads(program: ChunkedProgram, parts: int, group: str) -> ChunkedProgram:
    """The program of one of `parts` sequence-parallel ranks (see the module docstring).

    Args:
        program: the chunk program of a stage (from `passes.seq_chunk.chunk_program`).
        parts: the sequence-parallel degree S.
        group: the name of the SP process group (`ops.seq_parallel.register_group`).

    Returns:
        A new ChunkedProgram; its attention sites' K/V shapes have this rank's heads.
    """
    if parts == 1:
        return program
    gm = fx.GraphModule(program.chunk, _copy_graph(program.chunk))
    g = gm.graph
    chunk_len = next(n for n in g.nodes if n.op == "placeholder" and n.name == "chunk_len")
    with g.inserting_after(chunk_len):
        total = g.placeholder("sp_chunk_len")
    calls = [n for n in g.nodes if n.op == "call_function" and n.target is prefix_causal_attention]
    if len(calls) != len(program.attention):
        raise SppoError(f"the chunk program has {len(calls)} attention calls for {len(program.attention)} "
                        "attention sites")
    output = next(n for n in g.nodes if n.op == "output")
    outs = list(output.args[0])
    n_kv = 2 * len(calls)
    kv_outs = outs[len(outs) - n_kv:]
    documents = [s for s in program.attention if s.documents is not None]
    if documents:
        raise SppoError(f"attention {documents[0].name} ({documents[0].source}) masks packed documents, which "
                        f"seq_parallel={parts} does not support yet (each rank would need the whole chunk's "
                        "document positions): use seq_parallel=1 with packed documents")
    per_head = [c for c in calls if c.kwargs.get("sinks") is not None or c.kwargs.get("alibi") is not None]
    if per_head:
        raise SppoError(f"attention {per_head[0].name} has per-head attention sinks or ALiBi slopes, which "
                        f"seq_parallel={parts} does not split across ranks' heads yet: use seq_parallel=1")
    sites = []
    token = None  # the last all-to-all's token, in graph order (calls are in graph order)

    def collective(op, x, size):
        nonlocal token
        node = g.call_function(op, (x, token, size, parts, group))
        token = g.call_function(operator.getitem, (node, 1))
        return g.call_function(operator.getitem, (node, 0))

    for k_idx, (call, site) in enumerate(zip(calls, program.attention)):
        q, kp, k, vp, v = call.args[:5]
        if "val" not in q.meta:
            raise SppoError(f"attention {site.name}: the query's shape is unknown to the sequence-parallel pass")
        q_heads, kv_heads = q.meta["val"].shape[1], site.k_shape[1]
        repeats = kv_repeats(int(q_heads), int(kv_heads), parts, f"attention {site.name} ({site.source})")
        with g.inserting_before(call):
            if repeats > 1:
                k = g.call_function(torch.ops.aten.repeat_interleave.self_int, (k, repeats, 1))
                v = g.call_function(torch.ops.aten.repeat_interleave.self_int, (v, repeats, 1))
            k2 = collective(_seq_to_heads, k, total)
            v2 = collective(_seq_to_heads, v, total)
            q2 = collective(_seq_to_heads, q, total)
        kwargs = dict(call.kwargs)
        if repeats > 1 or kv_heads != q_heads:
            kwargs["enable_gqa"] = True
        with g.inserting_after(call):
            att = g.call_function(prefix_causal_attention, (q2, kp, k2, vp, v2), kwargs)
        with g.inserting_before(att.next):  # in order (inserting_after would stack them in reverse)
            back = collective(_heads_to_seq, att, chunk_len)
        call.replace_all_uses_with(back)
        g.erase_node(call)
        kv_outs[2 * k_idx], kv_outs[2 * k_idx + 1] = k2, v2
        heads = int(kv_heads) * repeats // parts
        sites.append(dataclasses.replace(site, k_shape=_with_heads(site.k_shape, heads),
                                         v_shape=_with_heads(site.v_shape, heads)))
    output.args = (tuple(outs[:len(outs) - n_kv]) + tuple(kv_outs),)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return dataclasses.replace(program, chunk=gm, attention=sites, seq_parallel=parts)


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    return graph


def _with_heads(shape: tuple, heads: int) -> tuple:
    shape = list(shape)
    shape[1] = heads
    return tuple(shape)
