"""Causal-mask recognition: SDPA with a mask built from positions -> causal attention.

Hugging Face models build their causal mask from positions instead of passing
`is_causal=True`:

    arange(T) ─ unsqueeze ─┐
                           ├─ le ─ expand [b, 1, T, T] ─┐
    arange(T) ─ unsqueeze ─┘                            │
    q, k, v ───────────────────────────── scaled_dot_product_attention(q, k, v, mask)

This pass finds every SDPA whose `attn_mask` is computed from positions (and at most one
integer input read per token: packed documents) and proves, symbolically and for every
sequence length and input (`passes/masks/proof.py`, `passes/masks/document.py`), what the
mask is:

    causal                  -> scaled_dot_product_attention(q, k, v, None, 0.0, True)
    sliding window of W     -> windowed_causal_attention(q, k, v, W)      (chunk_attention/functions.py)
    causal inside packed    -> document_causal_attention(q, k, v, doc_pos[, window=W])
    documents                  doc_pos = document_positions(source input, convention)

after which the mask subgraph is dead and removed. A mask that depends on user inputs
(e.g. a padding `attention_mask`), or that cannot be proven to be one of these, raises
`SppoError`: an unproven mask is never taken for causal (docs/architecture.md, section 2 "S3").
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.fx as fx

from sppo_fx.chunk_attention.functions import document_causal_attention, windowed_causal_attention
from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.masks.document import document_positions_node, prove_mask
from sppo_fx.passes.masks.proof import NotProvable, record_seq_limit
from sppo_fx.passes.seqdim import SDPA, _is_size_node


def _is_seq(size, seq) -> bool:
    return isinstance(size, torch.SymInt) and sympy.simplify(size.node.expr - seq) == 0


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def recognize_causal_masks(gm: fx.GraphModule, seq: sympy.Symbol, param_names: set[str],
                           param_value: Callable[[str], torch.Tensor | None]) -> fx.GraphModule:
    """Rewrite SDPA calls whose mask is a position-built causal (or sliding-window) mask.

    Args:
        gm: the captured graph; modified in place and returned.
        seq: the sympy symbol of the sequence length.
        param_names: placeholders holding parameters, buffers or constants.
        param_value: the tensor of a parameter/buffer/constant placeholder (None for user
            inputs): a mask may be a registered buffer, e.g. a `tril` sliced to [:T, :T].

    Returns:
        `gm`, with recognised masks removed. Raises `SppoError` for a mask that depends on
        user inputs or is not provably causal.
    """
    changed, doc_nodes = False, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        nodes = _ancestors(mask)
        user_inputs = [n for n in nodes if n.op == "placeholder" and n.name not in param_names
                       and any(not _is_size_node(u) and u in nodes for u in n.users)]
        try:
            shape = mask.meta["val"].shape
            if len(shape) < 2 or not all(_is_seq(s, seq) for s in shape[-2:]):
                raise NotProvable("it is not a sequence x sequence mask that depends on the query and key "
                                  "positions")
            dtype = mask.meta["val"].dtype
            proven = prove_mask(mask, seq, param_value, "allowed" if dtype == torch.bool else "additive", dtype,
                                node.args[0].meta["val"].dim())
            kind = proven.kind
        except NotProvable as e:
            if user_inputs:
                raise SppoError(
                    f"{describe_node(node)}: its attention mask depends on the input "
                    f"'{user_inputs[0].name}' and is not provably causal attention inside packed documents "
                    f"({e}). sppo_fx recognises causal masks built from positions, and packed documents from "
                    "position_ids restarting at each document or from document ids; call the model without a "
                    "padding attention mask (attention_mask=None)") from None
            raise SppoError(
                f"{describe_node(node)}: its attention mask is not the causal mask or a sliding window "
                f"(not provable: {e}). sppo_fx supports causal attention, optionally with a sliding "
                "window, and refuses any mask it cannot prove to be one") from None
        args = list(node.args) + [None] * (6 - len(node.args))
        dropout = args[4] if args[4] is not None else node.kwargs.get("dropout_p", 0.0)
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
        if proven.documents is not None:
            if dropout:
                raise SppoError(f"{describe_node(node)}: attention inside packed documents with dropout is not "
                                "supported; set the attention dropout to 0")
            doc_pos = document_positions_node(gm, proven.documents, doc_nodes)
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(document_causal_attention, (*args[:3], doc_pos),
                                             {**kwargs, "window": kind.window})
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            node = new
        elif kind.window is None:
            node.args, node.kwargs = (args[0], args[1], args[2], None, dropout, True), kwargs
        else:
            if dropout:
                raise SppoError(f"{describe_node(node)}: sliding-window attention with dropout is not "
                                "supported; set the attention dropout to 0")
            with gm.graph.inserting_after(node):
                windowed = gm.graph.call_function(windowed_causal_attention, tuple(args[:3]),
                                                  {**kwargs, "window": kind.window})
            windowed.meta.update(node.meta)
            node.replace_all_uses_with(windowed)
            gm.graph.erase_node(node)
            node = windowed
        node.meta["sppo_causal_mask"] = mask.name
        node.meta["sppo_attention_window"] = kind.window
        node.meta["sppo_documents"] = proven.documents
        node.meta["sppo_seq_limit"] = proven.limit
        record_seq_limit(gm, proven.limit)  # the runtime refuses longer sequences
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
