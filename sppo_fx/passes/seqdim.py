"""Sequence-dimension analysis (docs/architecture.md, section 2 "S3 Sequence-dimension analysis").

Every node of a captured graph gets a `SeqInfo` in `node.meta["sppo_seq"]`:

    origin   what the value is computed from: "param" (weights, buffers, constants),
             "input" (user inputs: token ids, labels), "position" (arange over the
             sequence, positional slices of buffers) — a set
    kind     "size"     a symbolic int (sym_size and arithmetic on it)
             "param"    no sequence dim, computed from weights/constants only
             "input"    computed from user inputs only        (may go to the prologue)
             "position" computed from positions (+ weights) only
             "data"     everything else
    seq_dims dims of the tensor whose size involves the sequence symbol
    role     "token_local"    position i of the output depends on position i only
             "positional"     a position source rewritten with the chunk offset
                              (arange(T) -> arange(start, start + c), buffer[:T] slices)
             "attention"      causal SDPA: becomes attention over a K/V prefix
             "reduction"      a loss / sum / mean over the sequence: cross-chunk accumulation
             "epilogue"       computed from reductions only (e.g. `loss * 0.5`)
             "prologue"       input-only and position-mixing (e.g. the label shift
                              pad + slice): computed once on the full sequence
             "mask"           a T x T position-only tensor (only allowed as an SDPA mask,
                              which `recognize_causal_masks` removes first)

Anything else that mixes positions along the sequence (cumsum over hidden states along it,
non-causal attention, conv over time, sort, ...) raises `SppoError` naming the op and the
user's source line.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from sppo_fx.chunk_attention.functions import document_causal_attention, windowed_causal_attention
from sppo_fx.errors import SppoError, describe_node
from sppo_fx.markers import SPLIT_POINT
from sppo_fx.passes.loss_epilogue import LOSSES, additive_reduction, class_dim_reason, loss_reduction
from sppo_fx.passes.moe_dispatch import prove_dispatch

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default

SIZE, PARAM, INPUT, POSITION, DATA = "size", "param", "input", "position", "data"

# Ops that never mix positions, whatever their dims (views and copies keep each token's
# values at its own position). Reshapes are not among them: see `_RESHAPES`.
_LAYOUT_OPS = {
    aten.expand.default, aten.broadcast_to.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.detach_.default,
    aten.lift_fresh_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
    aten._to_copy.default, aten.type_as.default, aten.expand_as.default,
    aten.dropout.default, aten.stack.default, aten.broadcast_tensors.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
    SPLIT_POINT,
}
# reshapes: token-local only when each position's values stay together (_reshape_mixing_reason)
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
             aten.unflatten.int, aten.view_as.default, aten.reshape_as.default}
# op -> positions of the arguments that may hold the sequence length (as a shape, or a
# position range the chunk pass offsets); "all" for ops whose sizes are checked elsewhere
_SHAPE_ARGS = {
    aten.view.default: {1}, aten.reshape.default: {1}, aten._unsafe_view.default: {1},
    aten.expand.default: {1}, aten.broadcast_to.default: {1}, aten.unflatten.int: {2}, aten.arange.default: {0}, aten.arange.start: {0, 1},
    aten.arange.start_step: {0, 1}, aten.slice.Tensor: {2, 3}, aten.zeros.default: {0}, aten.ones.default: {0},
    aten.empty.memory_format: {0}, aten.full.default: {0}, aten.new_zeros.default: {1},
    aten.new_ones.default: {1}, aten.new_empty.default: {1}, aten.new_full.default: {1},
    aten.split.Tensor: {1}, aten.split_with_sizes.default: {1}, aten.empty_strided.default: {0, 1},
    SDPA: "all", windowed_causal_attention: "all", document_causal_attention: "all",
}
_MATMUL_OPS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
               aten.addmm.default, aten.baddbmm.default, aten.outer.default}
_SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
              aten.unbind.int, aten.tensor_split.sections}
# op -> (position of the reduced-dims argument, default when absent = all dims)
_DIM_REDUCTIONS = {
    aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1, aten.amin.default: 1,
    aten.var.correction: 1, aten.var_mean.correction: 1, aten.std.correction: 1,
    aten.logsumexp.default: 1, aten.max.dim: 1, aten.min.dim: 1, aten.argmax.default: 1,
    aten._softmax.default: 1, aten.softmax.int: 1, aten._log_softmax.default: 1,
    aten.log_softmax.int: 1, aten.norm.ScalarOpt_dim: 2, aten.linalg_vector_norm.default: 2,
    aten.all.dim: 1, aten.any.dim: 1,
}
# op -> (position of its `dim` argument, None where it is keyword-only; its default): ops
# that work along one dim, each slice along it on its own (a dim of None flattens first)
_ALONG_ONE_DIM = {aten.topk.default: (2, -1), aten.sort.default: (1, -1), aten.sort.stable: (None, -1),
                  aten.argsort.default: (1, -1), aten.argsort.stable: (None, -1),
                  aten.cumsum.default: (1, None), aten.cumprod.default: (1, None),
                  aten.repeat_interleave.self_int: (2, None)}
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default}
_LOSSES = LOSSES
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
              aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


@dataclasses.dataclass
class SeqInfo:
    """Per-node result of the sequence-dimension analysis."""

    kind: str
    origin: frozenset = frozenset()
    seq_dims: tuple = ()
    role: str = "token_local"
    note: str = ""

    def __str__(self):
        dims = ",".join(map(str, self.seq_dims)) or "-"
        return f"{self.kind:8s} {self.role:11s} seq_dims={dims}"


def expr_of(value) -> sympy.Expr | None:
    """The sympy expression of an int/SymInt/SymFloat (None for anything else)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value.node.expr
    if isinstance(value, int) and not isinstance(value, bool):
        return sympy.Integer(value)
    return None


def arg_expr(arg, seq: sympy.Symbol) -> sympy.Expr | None:
    """The expression of a graph argument that is an int or a size node."""
    if isinstance(arg, fx.Node):
        return expr_of(arg.meta.get("val"))
    return expr_of(arg)


def _has_seq(size, seq) -> bool:
    return isinstance(size, torch.SymInt) and seq in size.node.expr.free_symbols


def seq_dims_of(val, seq: sympy.Symbol) -> tuple:
    if isinstance(val, torch.Tensor):
        return tuple(i for i, s in enumerate(val.shape) if _has_seq(s, seq))
    return ()


def _tensor_vals(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _is_size_node(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, int, float, bool, torch.SymFloat, torch.SymBool)) and \
        not isinstance(val, torch.Tensor)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if not _is_size_node(n)]


def _norm_dims(dims, ndim) -> list[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def _mixing_reason(node: fx.Node, seq, input_kinds) -> str | None:
    """Why `node` mixes positions along the sequence, or None if it is token-local."""
    target = node.target
    ins = [n.meta.get("val") for n in _tensor_inputs(node)]
    out_vals = _tensor_vals(node.meta.get("val"))
    in_seq = any(seq_dims_of(v, seq) for v in ins)
    out_seq = any(seq_dims_of(v, seq) for v in out_vals)
    if not in_seq and not out_seq:
        return None
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return None
    if target in _RESHAPES:
        return _reshape_mixing_reason(ins[0], out_vals[0], seq)
    if target in _LAYOUT_OPS or target is operator.getitem:
        return None
    if target in (aten._assert_tensor_metadata.default,):
        return None
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if target in _MATMUL_OPS:
        if target is aten.outer.default:
            return None
        a = node.args[1] if target in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
        a = a.meta.get("val")
        if _has_seq(a.shape[-1], seq):
            return "contracts over the sequence dimension"
        return None
    if target in _DIM_REDUCTIONS:
        pos = _DIM_REDUCTIONS[target]
        dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
        if target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int):
            dims = [node.args[1]]
        for d in _norm_dims(dims, x.dim()):
            if _has_seq(x.shape[d], seq):
                return f"reduces over the sequence dimension (dim {d})"
        return None
    if target in (aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default):
        k = len(node.args[1])
        if any(_has_seq(s, seq) for s in x.shape[x.dim() - k:]):
            return "normalises over the sequence dimension"
        return None
    if target in _SPLIT_OPS or target in (aten.select.int, aten.index_select.default):
        if target in (aten.select.int, aten.index_select.default):
            dim = node.args[1]
        elif target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        else:  # split / split_with_sizes / chunk / tensor_split: dim is the third argument
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if _has_seq(x.shape[dim % x.dim()], seq):
            return f"selects or splits along the sequence dimension (dim {dim})"
        return None
    if target is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        dim %= x.dim()
        if not _has_seq(x.shape[dim], seq):
            return None
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        start_e = arg_expr(start, seq) if start is not None else sympy.Integer(0)
        end_e = arg_expr(end, seq) if end is not None else None
        full_end = end_e is None or (end_e.is_number and int(end_e) >= 2**62) or \
            sympy.simplify(end_e - x.shape[dim].node.expr) == 0
        if start_e == 0 and full_end and step == 1:
            return None  # a full slice is an identity
        return "slices the sequence dimension at an offset"
    if target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        tensors = [t.meta.get("val") for t in node.args[0]]
        ref = out_vals[0]
        dim %= ref.dim()
        if not _has_seq(ref.shape[dim], seq):
            return None
        # cat with empty tensors (e.g. an empty K/V cache) is an identity
        nonempty = [t for t in tensors if not (isinstance(t.numel(), int) and t.numel() == 0)]
        if len(nonempty) <= 1:
            return None
        return "concatenates along the sequence dimension"
    if target in _ALONG_ONE_DIM:  # each slice along `dim` on its own (MoE routing's top-k)
        pos, default = _ALONG_ONE_DIM[target]
        dim = node.args[pos] if pos is not None and len(node.args) > pos else node.kwargs.get("dim", default)
        if dim is None:  # repeat_interleave without a dim flattens the tensor first
            return "works on the flattened tensor, sequence included"
        if _has_seq(x.shape[dim % x.dim()], seq):  # the MoE variants that do this: docs/models-moe.md
            hint = {aten.topk.default: " (a top-k over the tokens: expert-choice routing, whose experts pick "
                    "among all tokens)", aten.cumsum.default: " (e.g. a capacity limit numbering each expert's "
                    "tokens over the whole batch)"}.get(target, "")
            return f"works along the sequence dimension (dim {dim}){hint}"
        return None
    if target is aten.index.Tensor:
        return _index_mixing_reason(node, x, seq)
    if target is aten.embedding.default:  # weight[ids]: rows looked up by value
        if seq_dims_of(x, seq):
            return "looks up rows of a table that has a sequence dimension (rows of other positions)"
        return None
    if target is aten.repeat.default:
        repeats = list(node.args[1])
        shape = [1] * (len(repeats) - x.dim()) + list(x.shape)  # new dims are leading ones
        for d, (size, times) in enumerate(zip(shape, repeats)):
            if _has_seq(size, seq) and not (isinstance(times, int) and times == 1):
                return f"repeats along the sequence dimension (dim {d})"
        return None
    if target in _FACTORIES:
        return None  # sources: classified by `kind`, rewritten by the chunk pass
    if target is SDPA or target in (windowed_causal_attention, document_causal_attention):
        return "attention"
    if target in _LOSSES and (why := class_dim_reason(node, seq)):
        return why
    if target in _FULL_REDUCTIONS or target in _LOSSES:
        if target in _LOSSES and loss_reduction(node) == 0:
            return None  # reduction="none" is token-local
        return "reduces over the sequence"
    return f"is not known to keep positions apart along the sequence ({target})"


def _reshape_mixing_reason(x, out, seq) -> str | None:
    """A reshape keeps positions apart when each sequence dim of `x` becomes one of `out`,
    in order, with the same product of sizes after it: position p's values stay one block
    at the same place ([B, T, H] -> [B*T, H] or [B, T, n, H/n]). [B, H, T] -> [B, T, H], or
    [H, T] -> [T, H], would interleave positions."""
    dims_in, dims_out = seq_dims_of(x, seq), seq_dims_of(out, seq)
    if len(dims_in) != len(dims_out):
        return "reshapes the sequence dimension into another number of dims"
    for d, e in zip(dims_in, dims_out):
        for size in (x.shape[d], out.shape[e]):
            if seq in sympy.simplify(expr_of(size) / seq).free_symbols:  # e.g. T // 4: blocks of positions
                return f"splits the sequence dimension into blocks ({list(x.shape)} -> {list(out.shape)})"
        inner_in = sympy.Mul(*(expr_of(s) for s in x.shape[d + 1:]))
        inner_out = sympy.Mul(*(expr_of(s) for s in out.shape[e + 1:]))
        if sympy.simplify(inner_in - inner_out) != 0:
            return (f"reshapes so that positions interleave (dim {d} of {list(x.shape)} -> dim {e} of "
                    f"{list(out.shape)})")
    return None


def _length_as_value(node: fx.Node, seq) -> str | None:
    """The argument of `node` that carries the sequence length other than as a shape (a
    sum, a fill value, a repeat count), or None."""
    shapes = _SHAPE_ARGS.get(node.target, ())
    if shapes == "all":
        return None
    args = [(i, a) for i, a in enumerate(node.args) if i not in shapes] + list(node.kwargs.items())
    for where, arg in args:
        for a in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(a, fx.Node) and _is_size_node(a):
                expr = expr_of(a.meta.get("val"))
                if expr is not None and seq in expr.free_symbols:
                    return f"argument {where}: {expr}"
    return None


def _index_mixing_reason(node: fx.Node, x, seq) -> str | None:
    """`x[i0, i1, ...]` (advanced indexing, None for a dim taken whole). Token-local when
    it gathers from a tensor without a sequence dim by per-position indices (a table looked
    up by position ids, as `embedding` is), or when the indices pick along other dims only
    and hold no sequence dim themselves (the sequence dim is carried through whole)."""
    indices = list(node.args[1])
    x_seq = seq_dims_of(x, seq)
    if not x_seq:
        return None  # out[p] = x[i0[p], i1[p], ...]: position p reads its own indices only
    if any(d < len(indices) and indices[d] is not None for d in x_seq):
        return "indexes along the sequence dimension"
    if any(seq_dims_of(i.meta.get("val"), seq) for i in indices if isinstance(i, fx.Node)):
        return "indexes a sequence by indices that have a sequence dimension of their own"
    return None


def _origin(node: fx.Node, kinds: dict, param_names: set[str], seq, activations: set[str]) -> frozenset:
    if node.op == "placeholder":
        if node.name in activations:  # received from the previous pipeline stage
            return frozenset({PARAM, INPUT})
        return frozenset({PARAM}) if node.name in param_names else frozenset({INPUT})
    if node.op == "get_attr":
        return frozenset({PARAM})
    if node.target in _FACTORIES:
        return frozenset({POSITION}) if seq_dims_of(node.meta.get("val"), seq) else frozenset()
    acc = set()
    for n in _tensor_inputs(node):
        acc |= kinds[n].origin
    # A slice of weights/buffers whose length is the sequence length is a position source
    # (nanoGPT-style `freqs[:T]`).
    if acc <= {PARAM} and seq_dims_of(node.meta.get("val"), seq):
        acc.add(POSITION)
    return frozenset(acc)


def _kind(node: fx.Node, origin: frozenset) -> str:
    if _is_size_node(node) and node.op != "placeholder":
        return SIZE
    if INPUT in origin and (PARAM in origin or POSITION in origin):
        return DATA
    if origin == {INPUT}:
        return INPUT
    if POSITION in origin:
        return POSITION
    return PARAM


def _check_attention_length(node: fx.Node, seq) -> None:
    """A causal attention site is chunked as attention over the model's T positions: its
    queries' and keys' sequence dim (-2) must be exactly T. A dim that merely involves T
    (2T after folding a dim of 2 into it, B*T after folding the batch) holds other rows
    than positions 0..T-1 in order, and a chunk's causal prefix would be the wrong one."""
    for what, arg in (("queries", node.args[0]), ("keys", node.args[1])):
        size = expr_of(arg.meta["val"].shape[-2])
        if sympy.simplify(size - seq) != 0:
            shape = [str(expr_of(s).subs(seq, sympy.Symbol("T"))) for s in arg.meta["val"].shape]
            raise SppoError(
                f"{describe_node(node)}: causal attention whose {what} have {shape[-2]} rows along the "
                f"sequence dim (-2), not the model's sequence length T (shape [{', '.join(shape)}]); "
                "a reshape folded another dim into the sequence. "
                "sppo_fx chunks attention over positions 0..T-1 only: keep the other dim apart "
                "(e.g. as a batch or head dim)")


def is_causal_sdpa(node: fx.Node) -> bool:
    attn_mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return attn_mask is None and bool(is_causal)


def analyse(gm: fx.GraphModule, seq: sympy.Symbol, param_names: Iterable[str],
            activations: Iterable[str] = ()) -> dict[str, SeqInfo]:
    """Classify every node of `gm` (see the module docstring) and store it in node.meta.

    Args:
        gm: the captured graph (after `recognize_causal_masks`).
        seq: the sympy symbol of the sequence length.
        param_names: names of placeholders that hold parameters, buffers or constants.
        activations: placeholders that receive activations from an earlier pipeline stage
            (classified as data).

    Returns:
        {node name: SeqInfo}. Raises `SppoError` for a node that mixes positions and
        cannot be made exact per chunk.
    """
    param_names, activations = set(param_names), set(activations)
    prove_dispatch(gm, seq)  # MoE dispatches: node.meta["sppo_moe"] on what it proved token-local
    infos: dict[fx.Node, SeqInfo] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        origin = _origin(node, infos, param_names, seq, activations)
        kind = _kind(node, origin)
        info = SeqInfo(kind=kind, origin=origin, seq_dims=seq_dims_of(node.meta.get("val"), seq))
        infos[node] = info
        if node.op != "call_function" or kind == SIZE:
            continue
        if any(infos[n].role in ("reduction", "epilogue") for n in _tensor_inputs(node)):
            if info.seq_dims or any(infos[n].seq_dims for n in _tensor_inputs(node)):
                raise SppoError(
                    f"{describe_node(node)} combines a value reduced over the sequence with a "
                    "per-token value; sppo_fx needs the loss to be a reduction over the sequence "
                    "followed by scalar operations only")
            info.role = "epilogue"  # input values it reads are carried (passes/loss_epilogue.py)
            continue
        if any(free_unbacked_symbols(v) for v in _tensor_vals(node.meta.get("val"))):
            raise SppoError(
                f"{describe_node(node)} has a size that depends on the data (a boolean mask index, "
                "nonzero, ...); sppo_fx plans chunks and memory from sizes known before the step. "
                "Use a mask of fixed size (multiply or where) instead")
        value_use = _length_as_value(node, seq)
        if value_use is not None:
            raise SppoError(
                f"{describe_node(node)} uses the sequence length as a value ({value_use}); each chunk "
                "would compute it with the chunk's length. Pass the length in as an input, or use "
                "it only as a shape")
        if kind == PARAM:
            continue
        if node.meta.get("sppo_moe"):  # an MoE dispatch's op, proven per token by passes/moe_dispatch.py
            info.role, info.note = "token_local", node.meta["sppo_moe"]
            continue
        if node.target in _ARANGES or (node.target is aten.slice.Tensor and origin <= {PARAM, POSITION}
                                        and not any(infos[n].seq_dims for n in _tensor_inputs(node))):
            if info.seq_dims:
                info.role = "positional"
                continue
        reason = _mixing_reason(node, seq, infos)
        if reason is None:
            if len(info.seq_dims) > 1:
                info.role = "mask"
            continue
        if kind == INPUT:
            info.role = "prologue"
            continue
        if node.target in (windowed_causal_attention, document_causal_attention):  # proven by passes.masks.causal
            _check_attention_length(node, seq)
            info.role = "attention"
            continue
        if node.target is SDPA:
            if is_causal_sdpa(node) and (len(node.args) <= 4 or node.args[4] == 0.0):
                _check_attention_length(node, seq)
                info.role = "attention"
                continue
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            why = ("with dropout" if len(node.args) > 4 and node.args[4] else
                   "without a causal mask (is_causal=False and no attn_mask)" if mask is None else
                   "with an attention mask that is not a recognised causal mask")
            raise SppoError(
                f"{describe_node(node)}: attention {why}. sppo_fx chunks the sequence and needs "
                "causal attention (is_causal=True, or a causal mask built from positions), "
                "with dropout_p=0")
        if node.target in _FULL_REDUCTIONS or (node.target in _LOSSES and not class_dim_reason(node, seq)) \
                or additive_reduction(node, seq):
            if any(len(infos[n].seq_dims) > 1 for n in _tensor_inputs(node)):
                raise SppoError(
                    f"{describe_node(node)} reduces a value with more than one sequence dimension (a "
                    "T x T tensor): each chunk holds only its own block of it. Such a tensor may only "
                    "be a causal attention mask")
            info.role = "reduction"
            continue
        raise SppoError(
            f"{describe_node(node)} {reason}, which mixes positions along the sequence. "
            "sppo_fx cannot cut such a model into sequence chunks exactly; make the operation "
            "token-local or causal (causal attention is supported)")
    for node, info in infos.items():
        node.meta["sppo_seq"] = info
    return {n.name: i for n, i in infos.items()}


def format_analysis(gm: fx.GraphModule) -> str:
    """A readable table of the analysis stored in node.meta (one line per node)."""
    rows = []
    for node in gm.graph.nodes:
        info = node.meta.get("sppo_seq")
        if info is not None:
            rows.append(f"{node.name:40s} {info}")
    return "\n".join(rows)
