"""Capture: torch.export of model + loss with a symbolic sequence length.

The user's callable (a model whose output is the loss, a model plus `loss_fn`, or a
function `(model, *inputs) -> loss`) is wrapped in a module whose forward takes the flat
list of input tensors and returns the scalar loss. `torch.export` traces it with the
sequence dim of every input that has the sequence length marked dynamic.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.util.log import get_logger

log = get_logger(__name__)


def extract_loss(output) -> torch.Tensor:
    """The loss inside a model output: a tensor, an object with `.loss`, or a dict."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise SppoError(
            f"the model returned {type(output).__name__}, which holds no loss: return a scalar "
            "tensor, an object with `.loss` or a dict with 'loss' (for Hugging Face models pass "
            "labels=...), or give sppo_fx.compile a loss_fn")
    if not isinstance(loss, torch.Tensor):
        raise SppoError(f"the loss is a {type(loss).__name__}, not a tensor")
    return loss


class LossModule(torch.nn.Module):
    """forward(*flat_tensors) -> scalar loss; owns the user's model as `model`."""

    def __init__(self, model: torch.nn.Module, fn: Callable | None, loss_fn: Callable | None,
                 spec: pytree.TreeSpec, leaves: list, tensor_slots: list[int]):
        super().__init__()
        self.model = model
        self._fn, self._loss_fn, self._spec = fn, loss_fn, spec
        self._leaves, self._slots = leaves, tensor_slots

    def forward(self, *tensors):
        leaves = list(self._leaves)
        for slot, t in zip(self._slots, tensors):
            leaves[slot] = t
        args, kwargs, target = pytree.tree_unflatten(leaves, self._spec)
        if self._fn is not None:
            out = self._fn(self.model, *args, **kwargs)
        else:
            out = self.model(*args, **kwargs)
        if self._loss_fn is not None:
            out = self._loss_fn(out, target)
        loss = extract_loss(out)
        if loss.dim() != 0:
            raise SppoError(f"the loss has shape {tuple(loss.shape)}; sppo_fx needs a scalar loss")
        return loss


@dataclasses.dataclass
class Captured:
    """The exported graph and how its placeholders bind to the user's model and inputs.

    Attributes:
        module: the LossModule that was exported (holds the user's model).
        program: the ExportedProgram.
        seq: sympy symbol of the sequence length.
        seq_range: (min, max) the traced graph is valid for.
        param_fqns: placeholder name -> ("parameter" | "buffer" | "constant", fqn).
        input_names: placeholder names of the flat user input tensors, in order.
        input_seq_dims: for each flat input, its sequence dim or None.
        input_labels: for each flat input, where the user passed it ("arg0", "labels", "target").
        batch: with `batch_dynamic=True`, the sympy symbols of the batched inputs' dim 0 (one per
            input unless the model's code equates them), else None.
    """

    module: LossModule
    program: torch.export.ExportedProgram
    seq: sympy.Symbol
    seq_range: tuple[int, float]
    param_fqns: dict[str, tuple[str, str]]
    input_names: list[str]
    input_seq_dims: list[int | None]
    input_labels: list[str] = dataclasses.field(default_factory=list)
    batch: frozenset | None = None

    def param_value(self, name: str) -> torch.Tensor | None:
        """The live tensor bound to a parameter/buffer/constant placeholder (None for inputs)."""
        if name not in self.param_fqns:
            return None
        kind, fqn = self.param_fqns[name]
        if kind == "parameter":
            return self.module.get_parameter(fqn)
        if kind == "buffer":
            return self.module.get_buffer(fqn)
        return self.program.constants[fqn]

    def copy_graph(self) -> fx.GraphModule:
        """A fresh GraphModule over a copy of the exported graph (passes may mutate it)."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.program.graph_module.graph, {}))
        inline_grad_mode_regions(graph, self.program.graph_module)
        return fx.GraphModule(torch.nn.Module(), graph)


def inline_grad_mode_regions(graph: fx.Graph, owner: torch.nn.Module) -> None:
    """Replace torch.export's `wrap_with_set_grad_enabled` regions by their ops, in place.

    A model's `torch.no_grad()` block (e.g. Hugging Face's rotary embedding before
    transformers 5.2x) is exported as a higher-order op over a submodule of `owner`; the
    passes work on plain ATen ops. A region that turns grad off gets its outputs detached
    when one of its inputs may require grad (derives from a placeholder that does), so no
    gradient flows through it, as in the model.
    """
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if hop is None:
        return
    grad: set[fx.Node] = set()  # nodes whose value may require grad
    erased: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in erased:
            continue
        if node.op == "placeholder":
            if getattr(node.meta.get("val"), "requires_grad", False):
                grad.add(node)
            continue
        if not (node.op == "call_function" and node.target is hop):
            if any(a in grad for a in node.all_input_nodes):
                grad.add(node)
            continue
        enabled, sub_attr, *inputs = node.args
        sub = getattr(owner, sub_attr.target)
        # A private copy of the region's graph, with its own nested regions inlined.
        body = fx.Graph()
        body_out = body.graph_copy(sub.graph, {})
        body.output(body_out)
        inline_grad_mode_regions(body, sub)
        placeholders = [n for n in body.nodes if n.op == "placeholder"]
        env = dict(zip(placeholders, inputs))
        with graph.inserting_before(node):
            for n in body.nodes:
                if n.op in ("placeholder", "output"):
                    continue
                env[n] = graph.node_copy(n, lambda a: env[a])
            outs = fx.node.map_arg(next(n for n in body.nodes if n.op == "output").args[0], lambda a: env[a])
            in_grad = any(isinstance(a, fx.Node) and a in grad for a in inputs)
            if in_grad and enabled:
                grad.update(env[n] for n in body.nodes if n in env)
            elif in_grad:
                def detach(v):
                    d = graph.call_function(torch.ops.aten.detach.default, (v,))
                    d.meta.update(v.meta)
                    return d
                outs = fx.node.map_arg(outs, detach)
        if isinstance(outs, (tuple, list)):
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(outs[user.args[1]])
                    graph.erase_node(user)
                    erased.add(user)
        else:
            node.replace_all_uses_with(outs)
        if node.users:
            raise SppoError(f"cannot inline the grad-mode region {node.name}: its outputs are used "
                            "other than by indexing")
        graph.erase_node(node)
        if not sub_attr.users:
            graph.erase_node(sub_attr)


def input_labels(args: tuple, kwargs: dict, target) -> list[str]:
    """Readable names of the tensor leaves of (args, kwargs, target), in flat order."""
    labels = []
    for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs), target))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        head, rest = path[0].idx, path[1:]
        if head == 0:
            name = f"arg{rest[0].idx}" + "".join(str(k) for k in rest[1:])
        elif head == 1:
            name = str(rest[0].key) + "".join(str(k) for k in rest[1:])
        else:
            name = "target" + "".join(str(k) for k in rest)
        labels.append(name)
    return labels


def flatten_call(args: tuple, kwargs: dict, target) -> tuple[list, pytree.TreeSpec, list[int]]:
    """Flatten (args, kwargs, target); returns leaves, spec, and the tensor leaf slots."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs), target))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return leaves, spec, slots


def _distinct(tensors) -> list[torch.Tensor]:
    """The example inputs, each with storage of its own: torch.export binds inputs that are
    one object (model(x, x)) to one placeholder, and the program would then read the first
    input where the user later passes a different second one (a silently wrong loss)."""
    out, seen = [], set()
    for t in tensors:
        key = t.untyped_storage().data_ptr() if t.numel() else None
        out.append(t.clone() if key is not None and key in seen else t)
        seen.add(key)
    return out


def capture(model: torch.nn.Module, fn: Callable | None, loss_fn: Callable | None, args: tuple,
            kwargs: dict, target, seq_dim: int, batch_dynamic: bool = False) -> Captured:
    """Export `model` (+ `fn` / `loss_fn`) on example inputs with a dynamic sequence length.

    Args:
        model: the user's module (its parameters are the ones trained).
        fn: optional `(model, *args, **kwargs) -> loss-like` (decorator form).
        loss_fn: optional `(output, target) -> loss`.
        args, kwargs, target: example call; tensors with the sequence length at `seq_dim`
            get a dynamic sequence dim.
        seq_dim: the sequence dim of the inputs (1 for [batch, seq]).
        batch_dynamic: mark dim 0 dynamic too on every input whose dim 0 is the batch size
            (the first input's; the tensors `runtime.pipeline.data_shares` splits), for the
            data-parallel analysis (`passes.batch_epilogue`); the batch must be >= 2 and
            differ from the sequence length.

    Returns:
        A `Captured`. Raises `SppoError` if no input has a sequence dim or export fails.
    """
    leaves, spec, slots = flatten_call(args, kwargs, target)
    tensors = _distinct(leaves[i] for i in slots)
    candidates = [t for t in tensors if t.dim() > seq_dim]
    if not candidates:
        raise SppoError(f"no input tensor has a dim {seq_dim} (seq_dim={seq_dim}); pass token ids "
                        "shaped [batch, seq] or set seq_dim")
    length = candidates[0].shape[seq_dim]
    seq_dims = [seq_dim if t.dim() > seq_dim and t.shape[seq_dim] == length else None for t in tensors]
    dim = torch.export.Dim.DYNAMIC
    dynamic = [{seq_dim: dim} if d is not None else None for d in seq_dims]
    batch = next(t.shape[0] for t in tensors if t.dim() > 0) if batch_dynamic else None
    if batch is not None:
        if seq_dim == 0 or batch < 2 or batch == length:  # export would specialise or unify the two
            raise SppoError(f"internal: a batch-dynamic capture needs a batch of >= 2 sequences other than "
                            f"the sequence length and seq_dim > 0 (batch {batch}, length {length})")
        dynamic = [{**(d or {}), **({0: dim} if t.dim() > 0 and t.shape[0] == batch else {})}
                   for d, t in zip(dynamic, tensors)]
    dynamic = tuple(d or None for d in dynamic)
    module = LossModule(model, fn, loss_fn, spec, leaves, slots)
    log.info("torch.export: %s with %d input tensor(s), sequence dim %d of length %d marked dynamic",
             type(model).__name__, len(tensors), seq_dim, length)
    try:
        program = torch.export.export(module, tuple(tensors), dynamic_shapes={"tensors": dynamic}, strict=False)
    except SppoError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what to change
        raise SppoError(f"torch.export could not trace the model with a dynamic sequence length: "
                        f"{type(e).__name__}: {e}{_old_torch_hint()}") from e
    refuse_random_ops(program)
    sig = program.graph_signature
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    param_fqns = {}
    for s in sig.input_specs:
        if s.kind == InputKind.PARAMETER:
            param_fqns[s.arg.name] = ("parameter", s.target)
        elif s.kind == InputKind.BUFFER:
            param_fqns[s.arg.name] = ("buffer", s.target)
        elif s.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            param_fqns[s.arg.name] = ("constant", s.target)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    first = user_inputs[seq_dims.index(seq_dim)]
    size = placeholders[first].meta["val"].shape[seq_dim]
    if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
        raise SppoError(
            f"torch.export specialised the sequence length to {size}: the model's code depends on "
            "the exact length (e.g. a Python branch on x.shape[1] or a mask buffer sliced to the "
            "full block size). Remove that dependency so the length can stay symbolic")
    seq = size.node.expr
    batch_syms = None
    if batch is not None:
        # one symbol per input (export gives each dynamic dim its own unless code equates them)
        sizes = [placeholders[name].meta["val"].shape[0] for name, t in zip(user_inputs, tensors)
                 if t.dim() > 0 and t.shape[0] == batch]
        if not all(isinstance(b, torch.SymInt) and isinstance(b.node.expr, sympy.Symbol) for b in sizes):
            raise SppoError(
                "torch.export specialised the batch size: the model's code depends on the exact batch size "
                "(e.g. a reshape to a fixed batch), so data_parallel cannot give each rank a share of the "
                "batch. Use the batch size only as a shape (x.shape[0], view(b, ...)) or train with "
                "data_parallel=1")
        batch_syms = frozenset(b.node.expr for b in sizes)
    vr = program.range_constraints.get(seq)
    lo = int(vr.lower) if vr is not None else 2
    hi = float(vr.upper) if vr is not None and vr.upper.is_finite else float("inf")
    log.info("captured %d nodes, %d parameters/buffers; sequence length %s traced for %d..%s",
             len(program.graph.nodes), len(param_fqns), seq, lo, hi)
    return Captured(module=module, program=program, seq=seq, seq_range=(lo, hi),
                    param_fqns=param_fqns, input_names=user_inputs, input_seq_dims=seq_dims,
                    input_labels=input_labels(args, kwargs, target), batch=batch_syms)


#: ops whose results depend on the random number generator's state (dropout in training
#: mode and the like): the chunked program draws its numbers in another order than the
#: model, so loss and gradients would not be the model's
_RANDOM_OPS = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")


def _old_torch_hint() -> str:
    """What to change when torch < 2.13's export fails on a loss it cannot keep dynamic
    (docs/masks-and-models.md, "Torch versions")."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) >= (2, 13):
        return ""
    return (f"; on torch {torch.__version__}, cross_entropy with probability targets fixes the sequence length "
            "(write it as -(p * logits.log_softmax(-1)).sum(-1).mean()) and binary_cross_entropy with a weight "
            "fails on symbolic sizes (weight the elementwise loss instead), or use torch >= 2.13")


def refuse_random_ops(program) -> None:
    """Raise SppoError at the first op of the exported program that draws random numbers."""
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")[-1]
        if name in _RANDOM_OPS:
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            if not train or p == 0:
                continue  # the identity
        elif torch.Tag.nondeterministic_seeded not in node.target.tags or "attention" in name:
            continue  # attention's dropout_p is refused where attention is analysed (passes/seqdim.py)
        raise SppoError(f"{describe_node(node)} draws random numbers (dropout in training mode): chunks run "
                        "in another order than the model, so the random mask and hence loss and gradients "
                        "would differ from the model's. Call model.eval() or set the dropout probability "
                        "to 0 to train with sppo_fx")


def strip_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove export's `_assert_tensor_metadata` checks (side-effecting, so DCE keeps them
    and the values they check alive) and dead code."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
                torch.ops.aten._assert_tensor_metadata.default,
                torch.ops.aten._assert_scalar.default,
                torch.ops.aten.sym_constrain_range_for_size.default):
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
