"""Inductor must not recycle the buffer of a tensor that a chunk program hands out.

A forward graph hands saved activations to `sppo.offload` and its own K and V to
`sppo.kv_out` (`sppo_fx/ops/offload.py`, `sppo_fx/ops/skeleton.py`). The runtime keeps
that tensor after the graph's last use of it: a kept slot until the backward's `sppo.wait`
returns it, an offloaded one until its copy is written (on another thread). Inductor sees an
extern call that returns an empty handle, takes the call for the buffer's last use, and may
then write a later kernel's output into the same memory: buffer reuse (`reuse` lines in
the generated wrapper) or an in-place kernel. The kept tensor would silently hold other
data, or the disk tier's checksum would catch the copy changed under it.

`hold_inputs_of(ops)` wraps the ops' Inductor lowering (the same implicit fallback Inductor
makes for a custom op) so that every buffer passed to one of them goes into the graph's
`never_reuse_buffers`, which Inductor's wrapper and scheduler consult before any reuse or
in-place update (`PythonWrapperCodegen.can_reuse`). The rest of the graph keeps Inductor's
buffer reuse. Before this, the forward graphs of a plan with a tier compiled with reuse off
altogether (`allow_buffer_reuse=False`), which cost the demo's plan about a tenth of its
step in fresh pages (docs/solver-clock.md).
"""
from __future__ import annotations

import functools

import torch

HELD_ATTR = "_sppo_holds_inputs"


def _storage_name(node) -> str | None:
    """The name of the buffer whose memory `node` (an Inductor IR value: a buffer, a view of
    one, or a box around either) lies in; None for a value without one."""
    from torch._inductor import ir
    seen = 0
    while node is not None and seen < 64:
        seen += 1
        if isinstance(node, ir.Buffer):
            return node.get_name()
        node = getattr(node, "data", None)
    return None


def _inductor_fallback(op: torch._ops.OpOverload):
    """The lowering Inductor makes for a custom op it has none for (`GraphLowering.
    call_function`: an implicit fallback with the op's layout constraint)."""
    from torch._inductor import lowering as L
    if op not in L.lowerings:
        tag = L.get_layout_constraint_tag(op, with_default=True)
        L.make_fallback(op, layout_constraint=L.tag_to_layout_constraint(tag), warn=False)
    return L.lowerings[op]


def hold_inputs_of(*ops: torch._ops.OpOverload) -> None:
    """Make every tensor input of `ops` a buffer Inductor never reuses (module docstring).
    Idempotent; affects every Inductor compile in this process that lowers these ops,
    which only sppo_fx's memory passes insert."""
    from torch._inductor import ir
    from torch._inductor import lowering as L
    from torch._inductor.virtualized import V
    for op in ops:
        inner = _inductor_fallback(op)
        if getattr(inner, HELD_ATTR, False):
            continue

        @functools.wraps(inner)
        def lower(*args, _op=op, _inner=inner, **kwargs):
            before = len(V.graph.operations)
            out = _inner(*args, **kwargs)
            held = [inp for operation in V.graph.operations[before:]
                    if isinstance(operation, ir.FallbackKernel) and operation.op_overload is _op
                    for inp in operation.inputs]
            if not held:  # no kernel of this op found: the lowering changed under us
                raise RuntimeError(f"sppo_fx: Inductor lowered {_op} without a fallback kernel; "
                                   "cannot keep its inputs' buffers from reuse")
            for inp in held:
                name = _storage_name(inp)
                if name is None:
                    raise RuntimeError(f"sppo_fx: an input of {_op} has no buffer Inductor could reuse "
                                       f"or hold ({type(inp).__name__})")
                V.graph.never_reuse_buffers.add(name)
            return out
        setattr(lower, HELD_ATTR, True)
        L.lowerings[op] = lower


def hold_handed_out_tensors() -> None:
    """`hold_inputs_of` the ops whose inputs the runtime keeps past the graph."""
    import sppo_fx.ops.offload  # noqa: F401 - registers the ops
    import sppo_fx.ops.skeleton  # noqa: F401
    hold_inputs_of(torch.ops.sppo.offload.default, torch.ops.sppo.kv_out.default)
