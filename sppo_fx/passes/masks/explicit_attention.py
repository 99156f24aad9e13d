"""Explicit causal attention -> SDPA(is_causal=True, scale=s).

nanoGPT's non-flash path, minGPT and Hugging Face's "eager" attention write attention out:

    scores = (q * s_q) @ (k * s_k).transpose(-2, -1) * s          scaling anywhere on the way
    scores = masked_fill(scores, blocked, -inf)                   or  scores + additive_mask
                                                                  or  where(allowed, scores, -inf)
    probs  = softmax(scores [.float()], dim=-1 [, dtype=float32]) [.to(q.dtype)]
    probs  = dropout(probs, p)                                    p == 0 or not training
    out    = probs @ v

This pass matches that chain from each softmax over the key dim and rewrites it to

    scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=s_q * s_k * s)
    windowed_causal_attention(q, k, v, window=W, scale=...)      (a sliding window of W)
    document_causal_attention(q, k, v, doc_pos, window=W, ...)   (inside packed documents:
                                  a mask that also reads position ids or document ids,
                                  proven by `passes/masks/document.py`)

only after `mask_proof` has shown that the mask blocks exactly the keys after the query
(j - i >= 1), and for a window those at or before i - W, at every sequence length: `blocked` must evaluate to that Band, an additive
mask to 0 / (-inf or at most finfo.min), `allowed` to its complement. The mask may come
from a registered buffer that is lower-triangular over its whole extent sliced to
`[:T, :T]`, from `arange` comparisons, from `triu`/`tril` of a filled tensor, ...

Refused with an `SppoError` naming the op (no rewrite, nothing else changes):
- a mask that is not provably causal or a sliding window (a padding mask from an input, a
  bidirectional prefix, ...), or attention with no mask;
- attention dropout with p > 0 in training mode: its random mask over the T x T
  probabilities cannot be drawn per chunk in the order eager draws it;
- logit soft-capping in any other form than `cap * tanh(scores / cap)` below the mask, and
  attention sinks other than GPT-OSS's per-head column (`passes/attention_variants.py`,
  which proves both; proven ones go to `windowed_causal_attention(..., softcap=, sinks=)`);
- probabilities or scores used by anything besides the chain (e.g. returned weights).
A softmax that is not the head of such a chain is left alone (the sequence analysis then
refuses it if it reduces over the sequence).
"""
from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.chunk_attention.functions import document_causal_attention, windowed_causal_attention
from sppo_fx.passes.alibi import has_ancestor, match_baddbmm, match_bmm_out, prove_alibi, strip_bias
from sppo_fx.passes.attention_variants import match_sink, refuse_stray_tanh, strip_softcap
from sppo_fx.passes.masks.document import ProvenMask, document_positions_node, prove_mask
from sppo_fx.passes.masks.proof import CAST_OPS, NotProvable, evaluate_mask, is_blocking_fill, record_seq_limit
from sppo_fx.passes.seqdim import SDPA

aten = torch.ops.aten
_MATMUL = {aten.matmul.default}

_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_SCALE_MUL = {aten.mul.Tensor, aten.mul.Scalar}
_SCALE_DIV = {aten.div.Tensor, aten.div.Scalar}
# Falcon's `scores /= sqrt(d)`: in place on the scores only, whose chain nodes each have one
# user and are erased with the chain (an in-place scale of q or k would stay in the graph
# and scale them twice, so those are not stripped)
_INPLACE_SCALE = {aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
                  aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar}
_MASK_OPS = {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.add.Tensor, aten.where.self,
             aten.where.ScalarOther}
_WIDE = {torch.float32, torch.float64}


@dataclasses.dataclass
class _Chain:
    softmax: fx.Node
    out: fx.Node  # probs @ v
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    mask_op: fx.Node | None
    nodes: list  # scores .. out, each used only by the next
    dropout_issue: str | None
    softcap: float | None = None
    sink: object = None  # attention_variants.Sink
    bias: object = None  # alibi.Bias: an additive bias below the mask, proven ALiBi or refused


def _is_seq(size, seq) -> bool:
    return isinstance(size, torch.SymInt) and sympy.simplify(size.node.expr - seq) == 0


def _number(arg):
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None


def _strip_scale(node, scale: float, chain: list, inplace: bool = False):
    """Follow mul/div by Python numbers upwards; returns (node, accumulated scale)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            (node.target in _SCALE_MUL | _SCALE_DIV or (inplace and node.target in _INPLACE_SCALE)):
        target = _INPLACE_SCALE.get(node.target, node.target)
        a, b = node.args[0], node.args[1]
        c = _number(b)
        if c is None and target in _SCALE_MUL and _number(a) is not None:
            a, c = b, _number(a)
        if c is None or not isinstance(a, fx.Node):
            break
        scale = scale * c if target in _SCALE_MUL else scale / c
        chain.append(node)
        node = a
    return node, scale


def _strip_casts(node, chain: list, wide_only: bool):
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in CAST_OPS:
        src, out = node.args[0].meta["val"].dtype, node.meta["val"].dtype
        if wide_only and out != src and out not in _WIDE:
            raise SppoError(f"{describe_node(node)}: the attention scores are cast to {out} before the "
                            "softmax; sppo_fx recognises explicit attention with scores kept in their "
                            "dtype or widened to float32")
        chain.append(node)
        node = node.args[0]
    return node


def _swaps_last_two(node: fx.Node) -> bool:
    nd = node.meta["val"].dim()
    if node.target is aten.transpose.int:
        return {node.args[1] % nd, node.args[2] % nd} == {nd - 2, nd - 1}
    if node.target is aten.permute.default:
        perm = [d % nd for d in node.args[1]]
        return perm == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _match(softmax: fx.Node, seq) -> _Chain | None:
    """The attention chain headed by `softmax`, or None if it is not one."""
    sink = match_sink(softmax, seq)
    x = softmax.args[0] if sink is None else sink.scores
    xv = x.meta["val"]
    if xv.dim() < 3 or softmax.args[1] % softmax.args[0].meta["val"].dim() != xv.dim() - 1 \
            or not (_is_seq(xv.shape[-1], seq) and _is_seq(xv.shape[-2], seq)):
        return None
    # downwards: (the sink column dropped), casts, dropout, then probs @ v
    down, node = ([sink.slice], sink.slice) if sink else ([], softmax)
    dropout_issue = None
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in CAST_OPS:
            pass
        elif u.target is aten.dropout.default:
            p, train = u.args[1], u.args[2] if len(u.args) > 2 else u.kwargs.get("train", True)
            if p and train:
                dropout_issue = (f"{describe_node(u)}: attention dropout (p={p}) in training mode draws a "
                                 "random mask over the T x T probabilities, which sppo_fx cannot draw per "
                                 "chunk as eager does; set the attention dropout to 0 or call model.eval()")
        elif u.target is aten.matmul.default and u.args[0] is node:
            down.append(u)
            out, v = u, u.args[1]
            break
        elif (flat := match_bmm_out(u, node)) is not None:  # Bloom: [b*h, T, T] @ [b*h, T, d]
            down += flat.nodes
            out, v = flat.out, flat.v
            break
        else:
            return None
        down.append(u)
        node = u
    # upwards: casts, mask, casts, (soft-capping), scale, casts, q @ kT
    up: list[fx.Node] = []
    s = _strip_casts(x, up, wide_only=True)
    mask_op = None
    if s.op == "call_function" and s.target in _MASK_OPS:
        mask_op = s
        up.append(s)
        s = _scores_operand(s)
        if s is None:
            return None
        s = _strip_casts(s, up, wide_only=True)
    s, bias = strip_bias(s)
    if bias is not None:
        up += bias.nodes
        s = _strip_casts(s, up, wide_only=True)
    s, softcap = strip_softcap(s)
    if softcap is not None:
        up += softcap.nodes
        below = _strip_casts(s, [], wide_only=False)
        if mask_op is None and below.op == "call_function" and below.target in _MASK_OPS:
            refuse_stray_tanh(softcap.nodes[1], "is applied after the mask (tanh(scores + mask))")
    s, scale = _strip_scale(s, 1.0, up, inplace=True)
    if s.op == "call_function" and s.target is aten.tanh.default:
        refuse_stray_tanh(s, "is not of the form cap * tanh(scores / cap) below the mask")
    s = _strip_casts(s, up, wide_only=True)
    flat = match_baddbmm(s) if bias is None else None
    if flat is not None:  # Bloom: baddbmm(B, q3, k3^T, beta, alpha).view(b, h, T, T)
        up.append(s)
        scores, q, k, bias = flat.nodes[2], flat.q, flat.k, flat.bias
        scale, q_scale, k_scale, k_scale2 = scale * flat.alpha, 1.0, 1.0, 1.0
    elif not (s.op == "call_function" and s.target is aten.matmul.default):
        return None
    else:
        scores = s
        q, q_scale = _strip_scale(scores.args[0], 1.0, [])
        kt, k_scale = _strip_scale(scores.args[1], 1.0, [])
        if not (kt.op == "call_function" and _swaps_last_two(kt)):
            return None
        k, k_scale2 = _strip_scale(kt.args[0], 1.0, [])
    nodes = [scores] + list(reversed(up)) + [softmax] + down
    scale = scale * q_scale * k_scale * k_scale2
    if softcap is not None:  # c2 * tanh(a * scale * q.k) = cap * tanh(scale' * q.k / cap)
        scale = softcap.inner * scale * softcap.cap
    return _Chain(softmax, out, q, k, v, scale, mask_op, nodes, dropout_issue,
                  softcap.cap if softcap is not None else None, sink, bias)


def _scores_operand(op: fx.Node) -> fx.Node | None:
    """The operand of a mask op that carries the scores (the one computed by a matmul)."""
    if op.target in (aten.where.self, aten.where.ScalarOther):
        return op.args[1] if isinstance(op.args[1], fx.Node) else None
    if op.target is aten.add.Tensor:
        a, b = op.args[0], op.args[1]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return None
        return b if has_ancestor(b, _MATMUL) and not has_ancestor(a, _MATMUL) else a
    return op.args[0]


def _mask_operand(op: fx.Node, chain_nodes: list):
    """(mask node, how it applies: 'blocked' | 'allowed' | 'additive', fill value)."""
    if op.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return op.args[1], "blocked", op.args[2]
    if op.target in (aten.where.self, aten.where.ScalarOther):
        return op.args[0], "allowed", op.args[2]
    a, b = op.args[0], op.args[1]
    return (b if a in chain_nodes else a), "additive", None


def _prove_causal(chain: _Chain, seq, param_value) -> tuple[str | None, ProvenMask | None]:
    """(None, proven) if the mask is causal or a sliding window (inside packed documents, when
    it reads position ids or document ids) for every length and input, else (why not, None)."""
    op = chain.mask_op
    if op is None:
        return "it has no mask (every query attends to every key)", None
    mask, how, fill = _mask_operand(op, chain.nodes)
    alpha = op.kwargs.get("alpha", 1) if op.target is aten.add.Tensor else 1
    if alpha != 1 or isinstance(alpha, bool):
        # scores + alpha * mask (or mask + alpha * scores): the proof is of the mask's own
        # values; alpha = 0 switches the mask off, a tiny one makes -inf a finite penalty
        return f"it adds the mask with alpha={alpha} (only alpha=1 is proved)", None
    dtype = op.meta["val"].dtype
    scores = _scores_operand(op)
    if scores is None or list(op.meta["val"].shape) != list(scores.meta["val"].shape):
        return (f"its mask broadcasts the scores from {tuple(scores.meta['val'].shape) if scores is not None else '?'}"
                f" to {tuple(op.meta['val'].shape)}"), None
    try:
        if how != "additive":
            fill_v = fill
            if isinstance(fill, fx.Node):
                fill_v = getattr(evaluate_mask(fill, seq, param_value), "value", None)
            if fill_v is None or not is_blocking_fill(fill_v, dtype):
                return f"its masked scores are filled with {fill_v}, not -inf or finfo({dtype}).min", None
        return None, prove_mask(mask, seq, param_value, how, dtype, chain.softmax.meta["val"].dim())
    except NotProvable as e:
        return f"its mask is not the causal mask or a sliding window ({e})", None


def _check_shapes(chain: _Chain, seq) -> str | None:
    q, k, v, out = (n.meta["val"] for n in (chain.q, chain.k, chain.v, chain.out))
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "q, k and v are not 4-D [batch, heads, seq, head_dim] tensors"
    if not all(_is_seq(t.shape[-2], seq) for t in (q, k, v)):
        return "q, k or v does not have the sequence length in dim -2"
    if not _kv_heads_broadcast(q, k, v) or q.shape[-1] != k.shape[-1]:
        return "q, k and v have different batch or head dims"
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        return f"q, k, v and the output have different dtypes ({q.dtype}, {k.dtype}, {v.dtype}, {out.dtype})"
    for n in chain.nodes[:-1]:
        if len(n.users) != 1:
            return f"the intermediate '{n.name}' is also used elsewhere (e.g. returned attention weights)"
    return None


def _kv_heads_broadcast(q, k, v) -> bool:
    """k and v have q's batch and head dims, or one head that the matmuls broadcast over
    q's (multi-query attention, as Falcon writes it): SDPA broadcasts it the same way."""
    if list(k.shape[:-2]) != list(v.shape[:-2]) or k.shape[0] != q.shape[0]:
        return False
    return list(q.shape[:-2]) == list(k.shape[:-2]) or (k.dim() == 4 and k.shape[1] == 1)


def recognize_explicit_attention(gm: fx.GraphModule, seq: sympy.Symbol, param_value) -> fx.GraphModule:
    """Rewrite provably causal explicit attention to SDPA(is_causal=True); see the module docstring.

    Args:
        gm: the captured graph (after `recognize_causal_masks`); modified in place.
        seq: the sequence-length symbol.
        param_value: returns the live tensor of a parameter/buffer/constant placeholder, None
            for user inputs.

    Returns:
        `gm`. Raises `SppoError` for explicit attention that cannot be made exact.
    """
    changed, doc_nodes = False, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAX:
            continue
        chain = _match(node, seq)
        if chain is None:
            continue
        why = _check_shapes(chain, seq)
        proven = None
        if why is None:
            why, proven = _prove_causal(chain, seq, param_value)
        if why is not None:
            raise SppoError(f"{describe_node(chain.softmax)}: explicit attention that sppo_fx cannot chunk "
                            f"exactly: {why}. sppo_fx supports causal attention only")
        if chain.dropout_issue:
            raise SppoError(chain.dropout_issue)
        kind = proven.kind
        doc_pos = document_positions_node(gm, proven.documents, doc_nodes) if proven.documents else None
        variant = {}
        if chain.softcap is not None:
            variant["softcap"] = chain.softcap
        if chain.bias is not None and (slopes := prove_alibi(chain.bias, seq, param_value, chain.softmax)):
            variant["alibi"] = slopes
        if chain.sink is not None:
            with gm.graph.inserting_before(chain.out):  # [1, h, 1, 1] -> [h], one logit per query head
                variant["sinks"] = gm.graph.call_function(aten.reshape.default, (chain.sink.per_head, [chain.sink.heads]))
                variant["sinks"].meta["val"] = chain.sink.per_head.meta["val"].reshape(chain.sink.heads)
        if variant and doc_pos is not None:
            raise SppoError(f"{describe_node(chain.softmax)}: soft-capping, attention sinks or ALiBi inside packed "
                            "documents are not supported by sppo_fx's chunked attention yet; train on unpacked "
                            "sequences")
        with gm.graph.inserting_before(chain.out):
            if variant:
                sdpa = gm.graph.call_function(windowed_causal_attention, (chain.q, chain.k, chain.v),
                                              {"scale": chain.scale, "window": kind.window, **variant})
                sdpa.meta["sppo_attention_window"] = kind.window
            elif doc_pos is not None:
                sdpa = gm.graph.call_function(document_causal_attention, (chain.q, chain.k, chain.v, doc_pos),
                                              {"scale": chain.scale, "window": kind.window})
                sdpa.meta["sppo_attention_window"] = kind.window
                sdpa.meta["sppo_documents"] = proven.documents
            elif kind.window is None:
                sdpa = gm.graph.call_function(SDPA, (chain.q, chain.k, chain.v, None, 0.0, True),
                                              {"scale": chain.scale})
            else:
                sdpa = gm.graph.call_function(windowed_causal_attention, (chain.q, chain.k, chain.v),
                                              {"scale": chain.scale, "window": kind.window})
                sdpa.meta["sppo_attention_window"] = kind.window
        for key in ("val", "stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in chain.out.meta:
                sdpa.meta[key] = chain.out.meta[key]
        sdpa.meta["sppo_explicit_attention"] = chain.softmax.name
        sdpa.meta["sppo_seq_limit"] = proven.limit
        record_seq_limit(gm, proven.limit)  # the runtime refuses longer sequences
        chain.out.replace_all_uses_with(sdpa)
        # erased explicitly: DCE keeps random ops such as a (p=0 or eval-mode) dropout
        extra = chain.sink.nodes[1:] + chain.sink.nodes[:1] if chain.sink is not None else []
        for n in list(reversed(chain.nodes[chain.nodes.index(chain.softmax):])) + extra + \
                list(reversed(chain.nodes[:chain.nodes.index(chain.softmax)])):
            if not n.users:
                gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


__all__ = ["recognize_explicit_attention"]
