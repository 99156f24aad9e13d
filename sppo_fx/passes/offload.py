"""Memory passes on a chunk program's AOTAutograd partition: recompute regions and
offload / wait nodes (docs/architecture.md, section 3 "Memory model": two levels of activations).

They run inside the partitioner (`memory_partitioner`), i.e. on the joint graph before
the forward/backward split (recompute tags) and on the two graphs right after it (offload
nodes), so the same graphs go to Inductor or run eagerly.

`tag_recompute(joint, policy)` marks forward nodes CheckpointPolicy.MUST_RECOMPUTE:

    policy "none"      nothing (the partitioner's own choice)
    policy "cheap"     everything but matmuls, convolutions and attention: only their outputs
                       are saved; norms, activations, rotary embeddings are recomputed
    policy "full"      every forward node: the backward recomputes the chunk from its inputs

`insert_offload_nodes(fw, bw, num_fwd_outputs)` rewrites every offloadable saved
activation x (slot k):

    forward                                   backward
      x = op(...)                               h  = placeholder          # was x
      h = sppo.offload(x, k)    # right after   ...
      ...                                       x  = sppo.wait(h, k, order)  # before x's first user
      return (*outs, ..., h, ...)

The reads are requested by the executor, not by the graph: `StageRunner.backward` (and a
schedule's PREFETCH action, earlier) asks the chunk's `ChunkMemory` for all of its slots,
last produced first, before the backward graph runs. With a copy window
(`Plan.copy_window_bytes`) the memory queues them and starts each read when what is in
flight fits the window, so the tensors come back layer by layer during the backward, not
all at its start; a wait on a read not started yet starts it at once. (Graph nodes for
these requests were extern calls that Inductor lowers and schedules one by one: about a
tenth of the backward's compile time on the bench model, for no effect once the executor
has asked.)

`accumulate_param_grads(bw, grad_index)` sends each parameter gradient to `.grad` as soon
as the backward produces it, and `fuse_grad_matmul(bw)` folds a linear layer's weight
gradient matmul into that accumulation:

    gw = mm(a, b)                   ->      sppo.accumulate_grad_mm(a, b, i)
    sppo.accumulate_grad(gw, i)             # .grad.addmm_(a, b): no gw buffer, no extra add

Offloadable: produced by this chunk (not a parameter, input or K/V prefix, nor a view of
one), not a forward output or a view of one (the chunk's K/V lives on anyway), the only
saved value on its storage, and dense (so it comes back with the same layout). At run
time the chunk's `ChunkMemory` decides per slot whether the data actually leaves the
device (byte quota of the plan) — one graph serves every chunk.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from sppo_fx.passes.aliasing import alias_base as _alias_base

RECOMPUTE_POLICIES = ("none", "cheap", "full")

# Outputs worth saving under the "cheap" policy (their recompute costs real FLOPs).
_EXPENSIVE = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution",
              "_scaled_dot_product", "scaled_dot_product", "_flash_attention", "_efficient_attention",
              "chunk_attention", "prefix_causal", "prefix_attention")


@dataclasses.dataclass(frozen=True)
class OffloadSlot:
    """One saved activation that the graphs route through offload/wait.

    Attributes:
        slot: index used by the ops.
        name: the forward node's name.
        shape: its (symbolic) shape, as text.
        dtype: its dtype.
    """

    slot: int
    name: str
    shape: str
    dtype: torch.dtype

    def __str__(self):
        return f"slot {self.slot}: {self.name} {self.shape} {str(self.dtype).replace('torch.', '')}"


#: collectives are never recomputed: a repeated all-to-all doubles the traffic, and its
#: place in the order of the ranks' collectives would be fixed by data alone, not by the
#: token chain that pairs them up across ranks (ops/seq_parallel.py)
_COLLECTIVES = ("seq_to_heads", "heads_to_seq")


def _is_expensive(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return any(key in name for key in _EXPENSIVE)


def _is_collective(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return any(key in name for key in _COLLECTIVES)


def _forward_nodes(joint: fx.GraphModule) -> set[fx.Node]:
    """Nodes of the joint graph that do not depend on a tangent (the forward computation)."""
    on_tangent: dict[fx.Node, bool] = {}
    for n in joint.graph.nodes:
        on_tangent[n] = (n.op == "placeholder" and n.name.startswith("tangents")) or \
            any(on_tangent[a] for a in n.all_input_nodes)
    return {n for n, t in on_tangent.items() if not t and n.op not in ("placeholder", "output")}


def tag_recompute(joint: fx.GraphModule, policy: str) -> fx.GraphModule:
    """Mark forward nodes of the joint graph for recomputation (see the module docstring).

    Args:
        joint: AOTAutograd's joint forward+backward graph.
        policy: "none" | "cheap" | "full".

    Returns:
        The same graph, with node.meta["recompute"] set where the policy says.
    """
    from torch.utils.checkpoint import CheckpointPolicy
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute policy {policy!r}: choose one of {RECOMPUTE_POLICIES}")
    if policy == "none":
        return joint
    for n in _forward_nodes(joint):
        if n.op != "call_function":
            continue
        # a multi-output op's outputs are its getitems: they share its fate; the tuple
        # itself cannot be saved, so an expensive one stays untagged
        owner = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n
        if _is_collective(owner):
            if owner is not n:  # the collective's outputs are saved; the tuple cannot be
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif policy == "full" or not _is_expensive(owner):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        elif not isinstance(n.meta.get("val"), (tuple, list)):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return joint


def _hint(x) -> int:
    from sppo_fx.util.compat import optimization_hint
    return optimization_hint(x)


def _dim_order(val: torch.Tensor) -> list[int] | None:
    """Outermost-first dim order of a dense, non-overlapping tensor (judged at the size
    hints; `sppo.wait` re-lays out a tensor whose layout differs at another size), or None."""
    shape = [_hint(s) for s in val.shape]
    stride = [_hint(s) for s in val.stride()]
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], -shape[d], d))
    acc = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != acc:
            return None
        acc *= shape[d]
    return order


def insert_offload_nodes(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int
                         ) -> tuple[fx.GraphModule, fx.GraphModule, list[OffloadSlot]]:
    """Route the offloadable saved activations through offload / wait nodes.

    Args:
        fw, bw: the partitioner's forward and backward graphs (changed in place).
        num_fwd_outputs: how many forward outputs are the program's own (the rest are saved
            for backward).

    Returns:
        (fw, bw, the slots in slot order).
    """
    ops = torch.ops.sppo
    out = next(n for n in fw.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    own = {_alias_base(o) for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    saved = [(k, o) for k, o in enumerate(outs) if k >= num_fwd_outputs and isinstance(o, fx.Node)
             and isinstance(o.meta.get("val"), torch.Tensor)]
    base_count: dict[fx.Node, int] = {}
    for _, o in saved:
        base_count[_alias_base(o)] = base_count.get(_alias_base(o), 0) + 1
    bw_inputs = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    position = {n: i for i, n in enumerate(bw.graph.nodes)}  # inserting keeps the others' order

    slots: list[OffloadSlot] = []
    routed = []  # (placeholder, slot, dim order, value)
    for k, node in saved:
        val = node.meta["val"]
        order = _dim_order(val)
        base = _alias_base(node)
        if (node.op != "call_function" or base.op != "call_function" or base_count[base] > 1
                or base in own or order is None or node.name not in bw_inputs or not bw_inputs[node.name].users):
            continue
        slot = len(slots)
        with fw.graph.inserting_after(node):
            handle = fw.graph.call_function(ops.offload.default, (node, slot))
        handle.meta["val"] = val.new_empty((*val.shape, 0))
        outs[k] = handle
        ph = bw_inputs[node.name]
        ph.meta["val"] = handle.meta["val"]
        routed.append((ph, slot, order, val))
        slots.append(OffloadSlot(slot, node.name, str(tuple(val.shape)), val.dtype))
    for ph, slot, order, val in routed:
        users = list(ph.users)
        with bw.graph.inserting_before(min(users, key=position.__getitem__)):
            got = bw.graph.call_function(ops.wait.default, (ph, slot, order))
        got.meta["val"] = val
        for u in users:
            u.replace_input_with(ph, got)
    out.args = (tuple(outs),)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    return fw, bw, slots


#: ops that return their input's memory without saying so in their schema
_UNANNOTATED_VIEWS = (torch.ops.aten._unsafe_view.default,)


def _storage_owner(n):
    """The node owning the storage node n's result may share (`aliasing.alias_base`, also
    through `_unsafe_view`)."""
    while True:
        n = _alias_base(n)
        if not (n.op == "call_function" and n.target in _UNANNOTATED_VIEWS and isinstance(n.args[0], fx.Node)):
            return n
        n = n.args[0]


def _shares_callers_memory(g, returned: set) -> bool:
    """Whether gradient node g may share memory with a tensor its graph's caller holds: a
    graph input (a tangent, a saved activation the runtime may recycle), what an `sppo` op
    hands over (a read-back buffer), or a tensor the graph returns, through any chain of
    views."""
    base = _storage_owner(g)
    if base.op == "placeholder" or getattr(base.target, "namespace", None) == "sppo":
        return True
    return any(_storage_owner(r) is base for r in returned)


def accumulate_param_grads(bw: fx.GraphModule, grad_index: dict[int, int]) -> fx.GraphModule:
    """Accumulate parameter gradients inside the backward graph as they are produced.

        g = <grad of input k>                  g = <grad of input k>
        ...                           ->       sppo.accumulate_grad(g, i)
        return (..., g, ...)                   ...
                                               return (..., None, ...)

    AOTAutograd's backward returns every gradient at its end; autograd then adds them to
    `.grad` one by one. For a chunk after the first that means two full sets of parameter
    gradients at once; accumulating in the graph frees each one right after its add. A
    gradient that may share memory with a graph input or a returned tensor is cloned first
    (`_shares_callers_memory`): op by op the runtime takes a gradient over as `.grad`.

    Args:
        bw: the backward graph (changed in place).
        grad_index: backward output position k -> parameter index i (the executor's).

    Returns:
        bw.
    """
    out = next(n for n in bw.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    for k in grad_index:
        if k < len(outs):
            outs[k] = None
    returned = {n for n in outs if isinstance(n, fx.Node)}  # what the graph still returns
    for k, i in grad_index.items():
        g = out.args[0][k] if k < len(out.args[0]) else None
        if not isinstance(g, fx.Node):
            continue
        with bw.graph.inserting_before(out):
            if _shares_callers_memory(g, returned):
                # the runtime may take a gradient over as `.grad` and add into it later
                # (runtime.memory.adopted_grad): never memory its caller holds
                clone = bw.graph.call_function(torch.ops.aten.clone.default, (g,))
                if "val" in g.meta:
                    clone.meta["val"] = g.meta["val"].clone()
                g = clone
            bw.graph.call_function(torch.ops.sppo.accumulate_grad.default, (g, i))
    out.args = (tuple(outs),)
    # Each add right after its gradient is produced (after the last producer, when the
    # output is a view of another gradient node), a clone between them.
    for n in [n for n in bw.graph.nodes if n.target is torch.ops.sppo.accumulate_grad.default]:
        g = n.args[0]
        if g.target is torch.ops.aten.clone.default and g.args[0].op != "placeholder":
            g.args[0].append(g)
        if g.op != "placeholder":
            g.append(n)
    bw.graph.lint()
    bw.recompile()
    return bw


_TRANSPOSES = (torch.ops.aten.permute.default, torch.ops.aten.t.default)


def _is_transpose_2d(n) -> bool:
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _TRANSPOSES
            and (n.target is torch.ops.aten.t.default or list(n.args[1]) == [1, 0]))


def _under_transposes(g) -> tuple[object, list]:
    """(the node under a chain of 2-D transposes that starts at g, the chain outermost
    first); every transpose after the first has one user, the one above it."""
    chain = []
    while _is_transpose_2d(g) and (not chain or len(g.users) == 1):
        chain.append(g)
        g = g.args[0]
    return g, chain


def fuse_grad_matmul(bw: fx.GraphModule) -> fx.GraphModule:
    """Fold weight-gradient matmuls into their accumulation (after `accumulate_param_grads`).

        gw = mm(a, b)                               sppo.accumulate_grad_mm(a, b, i)
        sppo.accumulate_grad(gw, i)        ->

        gw = permute(mm(a, b), [1, 0])              bt = permute(b, [1, 0])
        sppo.accumulate_grad(gw, i)        ->       at = permute(a, [1, 0])
                                                    sppo.accumulate_grad_mm(bt, at, i)

    and through any chain of 2-D transposes (`t(t(mm(a, b)))`, as AOTAutograd's graphs
    without Inductor's decompositions have it: an even count is no transpose), only where
    the matmul's result and each transpose have no other user. Compiled, a chunk after the
    first then adds its weight gradients inside the GEMM (`addmm_` with C = `.grad`),
    instead of writing a gradient-sized buffer and reading it back in a separate add. Op by
    op, the runtime adds them as autograd does, `mm` then `add_`, with the product in one
    buffer reused for every chunk (`runtime.memory.ProductBuffer`): a tier must not change
    the arithmetic of the op-by-op run without one (docs/architecture.md, S1), and no
    chunk allocates a gradient-sized tensor but the first.

    Args:
        bw: the backward graph (changed in place).

    Returns:
        bw.
    """
    aten = torch.ops.aten
    for acc in [n for n in bw.graph.nodes if n.target is torch.ops.sppo.accumulate_grad.default]:
        g, index = acc.args
        mm, chain = _under_transposes(g)
        transposed = len(chain) % 2 == 1
        if not (isinstance(mm, fx.Node) and mm.target is aten.mm.default and len(mm.users) == 1
                and len(g.users) == 1):
            continue
        a, b = mm.args
        with bw.graph.inserting_before(acc):
            if transposed:
                a, b = (bw.graph.call_function(aten.permute.default, (b, [1, 0])),
                        bw.graph.call_function(aten.permute.default, (a, [1, 0])))
                for n, src in ((a, mm.args[1]), (b, mm.args[0])):
                    if "val" in src.meta:
                        n.meta["val"] = src.meta["val"].permute(1, 0)
            fused = bw.graph.call_function(torch.ops.sppo.accumulate_grad_mm.default, (a, b, index))
        fused.meta.update({k: v for k, v in acc.meta.items() if k != "val"})
        bw.graph.erase_node(acc)
        for t in chain:  # outermost first: each is unused once the one above it is gone
            bw.graph.erase_node(t)
        bw.graph.erase_node(mm)
    bw.graph.lint()
    bw.recompile()
    return bw


def over_tensor_args(fn, args: list):
    """`fn(*args)` as a function of the tensors among `args` alone, which is what AOTAutograd
    traces: returns (positions of those tensors in `args`, g) with g(*tensors) calling `fn`
    on `args` with them in place, its outputs as a tuple. The other arguments (ints) are
    constants of the trace; `args`' tensors are not kept."""
    slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    constants = [None if isinstance(a, torch.Tensor) else a for a in args]

    def over_tensors(*tensors):
        full = list(constants)
        for i, t in zip(slots, tensors):
            full[i] = t
        return tuple(fn(*full))
    return slots, over_tensors


@dataclasses.dataclass
class PartitionRecord:
    """The graphs one compile produced (what `.graphs` shows)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    slots: list[OffloadSlot]
    recompute: str


def memory_partitioner(recompute: str = "none", offload: bool = True, records: list | None = None,
                       grad_index: dict[int, int] | None = None):
    """A partition function for AOTAutograd: tag recompute regions, min-cut partition, insert
    offload nodes, accumulate parameter gradients in the backward graph.

    Args:
        recompute: the recompute policy (see `tag_recompute`).
        offload: insert offload/wait nodes.
        records: a list that gets a `PartitionRecord` per partition.
        grad_index: backward output position -> parameter index, for
            `accumulate_param_grads` (None: gradients leave the graph as usual).

    Returns:
        `fn(joint, joint_inputs, *, num_fwd_outputs, **kw) -> (fw, bw)`.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kw):
        kw.pop("compiler", None)
        tag_recompute(joint, recompute)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor",
                                                     num_fwd_outputs=num_fwd_outputs, **kw)
        slots: list[OffloadSlot] = []
        if offload:
            fw, bw, slots = insert_offload_nodes(fw, bw, num_fwd_outputs)
        if grad_index:
            bw = accumulate_param_grads(bw, grad_index)
            bw = fuse_grad_matmul(bw)
        if records is not None:
            records.append(PartitionRecord(fw, bw, slots, recompute))
        return fw, bw

    return partition
