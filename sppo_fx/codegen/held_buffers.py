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
altogether (`allow_buffer_reuse=False`): the demo's plan ran 5% slower a step, the bench
model's faulted in 5% more pages (docs/solver-clock.md).
"""
from __future__ import annotations

import collections
import functools

import torch
import torch.fx as fx

HELD_ATTR = "_sppo_holds_inputs"


def _buffer_of(node):
    """The Inductor buffer `node` (a buffer, a view of one, or a box around either) lies in;
    None for a value without one."""
    from torch._inductor import ir
    for _ in range(64):
        if node is None or isinstance(node, ir.Buffer):
            return node
        node = getattr(node, "data", None)
    return None


def _sharing_names(buf) -> list[str]:
    """Names of other buffers whose memory `buf` occupies or aliases: the owner of a
    `NonOwningLayout` (a tensor computed straight into a `cat`'s buffer) or of a mutation
    layout, the inputs an op's output aliases, the buffers an op writes into. Defensive:
    torch 2.13 lowers the ops' inputs to buffers of their own (a tensor that also feeds a
    `cat` gets one besides the cat's), so no test reaches these branches."""
    from torch._inductor import ir
    names, layout = [], getattr(buf, "layout", None)
    if isinstance(layout, ir.NonOwningLayout):
        names.append(layout.view)
    if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
        names.append(layout.target)
    getter = getattr(buf, "get_defining_op", None)
    for obj in (buf, getter() if getter else None):
        for method in ("get_inputs_that_alias_output", "get_mutation_names"):
            try:
                names.extend(getattr(obj, method)())
            except (AttributeError, NotImplementedError):
                pass
    return names


def _held_names(node) -> set[str]:
    """The names of every buffer whose memory the tensor `node` stands for lies in."""
    from torch._inductor.virtualized import V
    held, todo = set(), [node]
    while todo:
        item = todo.pop()
        buf = _buffer_of(V.graph.try_get_buffer(item) if isinstance(item, str) else item)
        if buf is None or buf.get_name() in held:
            continue
        held.add(buf.get_name())
        todo.extend(_sharing_names(buf))
    return held


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
                names = _held_names(inp)
                if not names:
                    raise RuntimeError(f"sppo_fx: an input of {_op} has no buffer Inductor could reuse "
                                       f"or hold ({type(inp).__name__})")
                V.graph.never_reuse_buffers.update(names)
            return out
        setattr(lower, HELD_ATTR, True)
        L.lowerings[op] = lower


def hold_handed_out_tensors() -> None:
    """`hold_inputs_of` the ops whose inputs the runtime keeps past the graph."""
    import sppo_fx.ops.offload  # noqa: F401 - registers the ops
    import sppo_fx.ops.skeleton  # noqa: F401
    hold_inputs_of(torch.ops.sppo.offload.default, torch.ops.sppo.kv_out.default)


def _reinplaceable(node: fx.Node) -> bool:
    """Whether Inductor's `reinplace_inplaceable_ops` FX pass may turn `node` into an op that
    writes into its input's memory: index_put, scatters (and the view scatters it
    canonicalises into one), foreach ops, auto-functionalized custom ops."""
    if node.op != "call_function":
        return False
    hop = torch.ops.higher_order
    if node.target in (getattr(hop, "auto_functionalized", None), getattr(hop, "auto_functionalized_v2", None)):
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target.name()
    return "index_put" in name or "scatter" in name or name.startswith("aten::_foreach")


def defer_past_inplace_users(graph: fx.Graph) -> int:
    """Move each `sppo.offload`/`sppo.kv_out` call after the last later op that could be
    reinplaced into its input's memory (`_reinplaceable`, on any view of the same storage).

    Inductor's reinplacing pass, which runs on the FX graph before lowering and does not
    see `never_reuse_buffers`, writes such an op's result into its input when nothing uses
    that memory after it: with the offload call placed right after the value it saves, a
    later scatter into the saved value would overwrite the tensor the runtime holds. A use
    after the scatter stops it. Run as Inductor's post-grad custom pass (`DeferredHolds`),
    after its reordering passes and before the reinplacing. Returns the calls moved."""
    from torch.multiprocessing.reductions import StorageWeakRef
    held_ops = (torch.ops.sppo.offload.default, torch.ops.sppo.kv_out.default)

    def storage(node):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    views = collections.defaultdict(list)
    for n in nodes:
        s = storage(n)
        if s is not None:
            views[s].append(n)
    moved = 0
    for n in nodes:
        if n.op != "call_function" or n.target not in held_ops:
            continue
        s = storage(n.args[0])
        later = [u for v in views.get(s, ()) for u in v.users if order[u] > order[n] and _reinplaceable(u)]
        if later:
            max(later, key=order.__getitem__).append(n)
            moved += 1
    if moved:
        graph.lint()
    return moved


def deferred_holds(then=None):
    """Inductor's `post_grad_custom_post_pass` that runs `defer_past_inplace_users`, then
    `then` (a custom pass already configured, kept). Its `uuid` (for Inductor's cache key)
    names this pass, sppo_fx's source digest and `then`'s."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from sppo_fx.util.disk_cache import source_digest

    class DeferredHolds(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            defer_past_inplace_users(graph)
            if then is not None:
                then(graph)

        def uuid(self):
            inner = then.uuid() if hasattr(then, "uuid") else (None if then is None else repr(then))
            return ("sppo_fx.defer_past_inplace_users", source_digest(), inner)
    return DeferredHolds()
