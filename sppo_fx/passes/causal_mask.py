"""Causal-mask recognition: SDPA with a mask built from positions -> SDPA(is_causal=True).

Hugging Face models build their causal mask from positions instead of passing
`is_causal=True`:

    arange(T) ─ unsqueeze ─┐
                           ├─ le ─ expand [b, 1, T, T] ─┐
    arange(T) ─ unsqueeze ─┘                            │
    q, k, v ───────────────────────────── scaled_dot_product_attention(q, k, v, mask)

This pass finds every SDPA whose `attn_mask` is computed from positions only (no user
input, no data), evaluates that small subgraph at two probe lengths (never at the real T,
so no T x T mask is materialised at run time), and if it equals the lower-triangular causal
mask, rewrites the call to

    scaled_dot_product_attention(q, k, v, None, 0.0, True)      # is_causal=True

after which the mask subgraph is dead and removed. A mask that depends on user inputs
(e.g. a padding `attention_mask`) or that is not causal raises `SppoError`.
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.seqdim import SDPA, _is_size_node

PROBE_LENGTHS = (3, 8)


def concrete_shape(val: torch.Tensor, seq: sympy.Symbol, length: int) -> list[int]:
    """The shape of a traced tensor with the sequence symbol set to `length`."""
    out = []
    for s in val.shape:
        if isinstance(s, torch.SymInt):
            out.append(int(s.node.expr.subs(seq, length)))
        else:
            out.append(int(s))
    return out


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _evaluate(nodes: list[fx.Node], target: fx.Node, seq, length, param_value: Callable):
    env = {}
    for n in nodes:
        if n.op == "placeholder":
            val = n.meta["val"]
            pv = param_value(n.name)
            env[n] = pv if pv is not None else torch.zeros(concrete_shape(val, seq, length), dtype=val.dtype)
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
        env[n] = n.target(*args, **kwargs)
    return env[target]


def _is_causal_mask(mask: torch.Tensor, length: int) -> bool:
    if mask.shape[-2:] != (length, length):
        return False
    tril = torch.ones(length, length, dtype=torch.bool).tril().expand(mask.shape)
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    allowed = mask == 0
    blocked = mask <= -1e4  # additive masks use -inf or finfo.min
    return bool((allowed == tril).all() and (blocked == ~tril).all())


def recognize_causal_masks(gm: fx.GraphModule, seq: sympy.Symbol, param_names: set[str],
                           param_value: Callable[[str], torch.Tensor | None]) -> fx.GraphModule:
    """Rewrite SDPA calls whose mask is a position-built causal mask to is_causal=True.

    Args:
        gm: the captured graph; modified in place and returned.
        seq: the sympy symbol of the sequence length.
        param_names: placeholders holding parameters, buffers or constants.
        param_value: returns the tensor of a parameter placeholder (None for user inputs).

    Returns:
        `gm`, with recognised masks removed. Raises `SppoError` for a mask that depends on
        user inputs or is not causal.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        nodes = _ancestors(mask)
        user_inputs = [n for n in nodes if n.op == "placeholder" and n.name not in param_names
                       and any(not _is_size_node(u) and u in nodes for u in n.users)]
        if user_inputs:
            raise SppoError(
                f"{describe_node(node)}: its attention mask depends on the input "
                f"'{user_inputs[0].name}'. sppo_fx recognises causal masks built from positions "
                "only; call the model without an attention mask (attention_mask=None) and "
                "without packed position ids")
        for length in PROBE_LENGTHS:
            value = _evaluate(nodes, mask, seq, length, param_value)
            if not isinstance(value, torch.Tensor) or not _is_causal_mask(value, length):
                raise SppoError(
                    f"{describe_node(node)}: its attention mask is not the causal mask (checked at "
                    f"sequence length {length}). sppo_fx supports causal attention only")
        args = list(node.args) + [None] * (6 - len(node.args))
        args[3], args[4], args[5] = None, args[4] if args[4] is not None else 0.0, True
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
        node.args, node.kwargs = tuple(args[:6]), kwargs
        node.meta["sppo_causal_mask"] = mask.name
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
