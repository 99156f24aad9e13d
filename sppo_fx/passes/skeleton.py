"""The skeleton pass: the chunk program's K/V prefix moves from its inputs to the runtime.

    chunk program                                     after stream_kv_skeleton
    ─────────────                                     ────────────────────────
    placeholder s_k_prefix  [b, h_kv, p, d]           placeholder s_k_prefix  [b, h_kv, p, d, 0]  (handle)
    out = prefix_causal_attention(                    out = streamed_prefix_attention(
            q, s_k_prefix, k, s_v_prefix, v)                  q, s_k_prefix, k, s_v_prefix, v, site=s)
    return (..., k, v)                                hk = sppo.kv_out(k, 2s); hv = sppo.kv_out(v, 2s+1)
                                                      return (..., hk, hv)                  (handles)

The program's signature keeps its shape (one prefix input per site and K/V, one K/V
output per site), but prefixes and K/V outputs are empty handles: the data lives in the
executor's `runtime.skeleton.KVSkeleton` and the attention op streams it in one earlier
chunk at a time (`sppo_fx.ops.skeleton`). The K/V skeleton can then leave the device.
A sliding-window site keeps its `window=W` and a packed-document site its `doc_pos`: the op
streams only the blocks that reach into the chunk's window or its documents
(`sppo_fx.ops.skeleton_window`). Score variants (logit soft-capping, sink logits, ALiBi)
are not streamed: `unstreamable_attention` names them, the solver then keeps the skeleton
(`skeleton="auto"`), and `skeleton="offload"` is refused before any step.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.errors import SppoError
from sppo_fx.ops.skeleton import streamed_prefix_attention


# attention arguments the streamed op (`ops.skeleton.streamed_prefix_attention`) computes
_STREAMED_KWARGS = ("scale", "enable_gqa", "window", "doc_pos")
_VARIANTS = {"softcap": "logit soft-capping (e.g. Gemma 2's attn_logit_softcapping)",
             "sinks": "attention sink logits (e.g. gpt-oss)", "alibi": "ALiBi biases (e.g. Bloom, MPT)"}


def unstreamable_attention(chunk: fx.GraphModule) -> str | None:
    """Why the K/V skeleton of this chunk program cannot be streamed, or None when it can:
    the first attention site whose call has an argument the streamed op does not compute."""
    for s, node in enumerate(n for n in chunk.graph.nodes
                             if n.op == "call_function" and n.target is prefix_causal_attention):
        for key, value in node.kwargs.items():
            if value is not None and key not in _STREAMED_KWARGS:
                what = _VARIANTS.get(key, f"the argument {key}=")
                return f"attention site {s} ({node.name}) uses {what}, which the streamed K/V skeleton does not compute"
    return None


def refuse_unstreamable(chunk: fx.GraphModule) -> None:
    """An SppoError naming what to change where the K/V skeleton of `chunk` would be
    streamed (`skeleton="offload"`, or a saved plan's skeleton) but cannot be."""
    why = unstreamable_attention(chunk)
    if why is not None:
        raise SppoError(f"the K/V skeleton cannot be streamed: {why}; use skeleton='keep' (or 'auto', which "
                        "keeps it for this model), and a saved plan (plan=) solved with the skeleton kept")


def stream_kv_skeleton(chunk: fx.GraphModule, num_sites: int) -> fx.GraphModule:
    """A copy of `chunk` whose K/V prefix and K/V outputs are skeleton handles.

    Args:
        chunk: the chunk program (`ChunkedProgram.chunk`).
        num_sites: its attention sites (`len(ChunkedProgram.attention)`).

    Returns:
        The new GraphModule (the input is unchanged).
    """
    refuse_unstreamable(chunk)
    graph = fx.Graph()
    graph.output(graph.graph_copy(chunk.graph, {}))
    gm = fx.GraphModule(chunk, graph, class_name=type(chunk).__name__)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is prefix_causal_attention]
    if len(sites) != num_sites:
        raise SppoError(f"stream_kv_skeleton: the chunk program has {len(sites)} prefix attention calls, "
                        f"its ChunkedProgram lists {num_sites} attention sites")
    outputs = list(out_node.args[0])
    first_kv = len(outputs) - 2 * num_sites
    for s, node in enumerate(sites):
        q, kp, k, vp, v = node.args
        for prefix in (kp, vp):
            if prefix.op != "placeholder" or len(prefix.users) != 1:
                raise SppoError(f"stream_kv_skeleton: the K/V prefix {prefix.name} of attention site {s} is "
                                "used by more than the attention call; its prefix cannot be streamed")
        if outputs[first_kv + 2 * s] is not k or outputs[first_kv + 2 * s + 1] is not v:
            raise SppoError(f"stream_kv_skeleton: the K/V outputs of attention site {s} are not its K and V")
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(streamed_prefix_attention, node.args, {**node.kwargs, "site": s})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for j, x in enumerate((k, v)):
            with gm.graph.inserting_before(out_node):
                handle = gm.graph.call_function(torch.ops.sppo.kv_out.default, (x, 2 * s + j))
            outputs[first_kv + 2 * s + j] = handle
    out_node.args = (tuple(outputs),)
    gm.graph.lint()
    gm.recompile()
    return gm
