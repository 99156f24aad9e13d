"""Which FX nodes share storage: the alias helpers of the cost model (`passes/cost/`,
saved tensors grouped by storage) and the memory passes (`passes/offload.py`, one
offloadable value per storage).

A node whose op returns a view (schema return with non-writing alias info, or `getitem`)
aliases its first argument; `alias_base` follows such chains to the node that owns the
storage (docs/architecture.md, section 3 "Memory model").
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["is_view_op", "alias_base", "storage_key"]


def storage_key(t: torch.Tensor):
    """An identity of t's storage (None for tensors without one: sparse, nested)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # pragma: no cover - tensors without storage (sparse, nested)
        return None


def is_view_op(target) -> bool:
    """Whether calling `target` returns views of its inputs (getitem counts as one)."""
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        rets = target._schema.returns
        return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
    return False


def alias_base(node: fx.Node) -> fx.Node:
    """Follow view ops (and getitem of view-returning ops) to the node owning the storage."""
    seen = 0
    while seen < 1000:
        seen += 1
        if node.op != "call_function" or not node.args:
            return node
        if node.target is operator.getitem:
            parent = node.args[0]
            if isinstance(parent, fx.Node) and parent.op == "call_function" and is_view_op(parent.target) \
                    and parent.args and isinstance(parent.args[0], fx.Node):
                node = parent.args[0]
                continue
            return node
        if is_view_op(node.target) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return node
    return node
