"""Saved activations of a chunk program, measured through AOTAutograd's partition at
example sizes and fitted to sympy expressions of c, p, b."""
from __future__ import annotations

import functools
from typing import Callable

import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError
from sppo_fx.passes.aliasing import alias_base as _alias_base, is_view_op, storage_key
from sppo_fx.passes.offload import memory_partitioner, over_tensor_args
from sppo_fx.passes.cost.data import AllocatedTensor, SavedTensor, b, c, p
from sppo_fx.passes.cost.flops import _MATMUL, _op_name, _tensors
from sppo_fx.passes.cost.shapes import _input_specs, _placeholders, _renamed_shape

aten = torch.ops.aten


# ---------------------------------------------------------------- saved activations


def _static_dims(values: dict) -> set[int]:
    """Every static dim of the program's tensors, and products of adjacent static dims."""
    dims = set()
    for v in values.values():
        for t in _tensors(v):
            shape = [s for s in t.shape]
            for i in range(len(shape)):
                acc = 1
                for s in shape[i:]:
                    if isinstance(s, torch.SymInt):
                        break
                    acc *= int(s)
                    dims.add(acc)
    return dims


def _candidates(c0: int, p0: int, batch: int) -> list[tuple[int, sympy.Expr]]:
    base = [(c0, c), (p0, p), (p0 + c0, p + c), (c0 * (p0 + c0), c * (p + c)), (c0 * c0, c * c)]
    scaled = [(batch * v, b * e) for v, e in base[:3]] if batch > 1 else []
    return base + scaled


def choose_example(static_dims: set[int], batch: int) -> tuple[int, int]:
    """A (c0, p0) whose derived sizes collide with no static dim and with each other."""
    primes = [13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101]
    forbidden = set(static_dims) | {1, batch}
    for c0 in primes:
        for p0 in primes:
            if p0 <= c0:
                continue
            vals = [v for v, _ in _candidates(c0, p0, batch)]
            if len(set(vals)) == len(vals) and not (set(vals) & forbidden):
                # products with static dims (e.g. [h * c, d] after a flatten) must not collide either
                if not any(v * s in forbidden for v in vals[:3] for s in static_dims if s > 1):
                    return c0, p0
    return 13, 29  # pragma: no cover - every small prime pair collides; matching may be inexact


def _match_dim(v: int, c0: int, p0: int, batch: int, static: set[int]) -> tuple[sympy.Expr, bool]:
    for val, e in _candidates(c0, p0, batch):
        if v == val:
            return e, True
    if v in static or v in (0, 1):
        return sympy.Integer(v), True
    for val, e in _candidates(c0, p0, batch):
        if val > 0 and v % val == 0 and (v // val) in static:
            return (v // val) * e, True
    return sympy.Integer(v), False


def _data_dependent(graph: fx.Graph, is_data: Callable[[fx.Node], bool]) -> dict[fx.Node, bool]:
    """node -> whether it depends on a placeholder for which `is_data` holds (graph order)."""
    dep: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        dep[n] = is_data(n) if n.op == "placeholder" else any(dep.get(a, False) for a in n.all_input_nodes)
    return dep


def example_inputs(program, c_len: int, prefix: int, *, params: list[torch.Tensor] | None = None,
                   seq=None, requires_grad: bool = True, seed: int = 0, device=None) -> list:
    """Concrete arguments for one call of the chunk program.

    Args:
        program: a `ChunkedProgram`.
        c_len: chunk length.
        prefix: prefix length (also `chunk_start`).
        params: tensors for the parameter placeholders (default: random, N(0, 0.02); integer
            ones zeros). With `requires_grad`, float `p_*` (parameter) placeholders get
            detached copies that require grad, as in training.
        seq: the captured sequence symbol (see `symbolic_values`).
        requires_grad: make parameters and K/V prefixes require grad.
        seed: RNG seed for the random tensors.
        device: where to create the random tensors (default: the device of `params`, else
            CPU). Attention may save different tensors per device (the Triton kernel on
            CUDA saves no mask), so trace on the device you will train on.

    Returns:
        The argument list, in placeholder order. Integer chunk inputs (token ids, labels)
        are zeros, which is valid for embeddings and cross-entropy.
    """
    gen = torch.Generator().manual_seed(seed)
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    args, k = [], 0
    for name, role, spec in _input_specs(program, seq):
        if role == "start":
            args.append(prefix)
        elif role == "len":
            args.append(c_len)
        elif role == "param" and params is not None:
            t = params[k].detach()
            if requires_grad and t.is_floating_point() and name.startswith("p_"):
                t.requires_grad_(True)
            args.append(t)
            k += 1
        else:
            shape, dtype = spec
            fill = prefix if role == "prefix" else c_len
            shape = [fill if s is None else s for s in shape]
            if dtype.is_floating_point:
                t = (torch.randn(shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
                grad = requires_grad and (role == "prefix" or (role == "param" and name.startswith("p_")))
                t.requires_grad_(grad)
            else:
                t = torch.zeros(shape, dtype=dtype, device=device)
            args.append(t)
            k += role == "param"
    return args


def _partitioner(partition: str, recompute: str):
    """The AOTAutograd partition function whose saved set is measured (see `_aot_forwards`)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    if partition not in ("default", "min_cut"):
        raise SppoError(f"unknown partition {partition!r}; choose 'default' or 'min_cut'")
    if recompute != "none" and partition != "min_cut":
        raise SppoError("a recompute policy needs partition='min_cut'")
    if partition == "default":
        return default_partition
    if recompute != "none":
        return memory_partitioner(recompute, offload=False)
    return functools.partial(min_cut_rematerialization_partition, compiler="inductor")


def _copy_joint(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of AOTAutograd's joint graph that a partitioner may change (recompute tags,
    dead-code elimination) without touching the original: new nodes with the same names,
    targets and (shallow-copied) meta, the same module attributes."""
    import copy
    import warnings
    with warnings.catch_warnings():  # deepcopy of the output's pytree spec warns on a deprecated alias
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(joint.graph)
    from torch.fx._lazy_graph_module import _make_graph_module
    return _make_graph_module(joint, graph)


def _aot_forwards(program, args: list, partition: str, recomputes=("none",)):
    """Trace the chunk program's joint forward+backward graph once with AOTAutograd and
    partition it once per recompute policy.

    Returns ({policy: (forward graph, #forward outputs, backward graph)}, tensor argument
    slots). Each
    policy's partitioner gets its own copy of the one joint graph (`_copy_joint`), so the
    partitions are those of separate traces, at the price of one trace.
    """
    from torch._functorch.aot_autograd import aot_function

    parts = {r: _partitioner(partition, r) for r in recomputes}
    rec = {}

    def part(joint, inputs, **kw):
        for policy, fn in parts.items():
            fw, bw = fn(_copy_joint(joint), inputs, **kw)
            rec[policy] = (fw, kw["num_fwd_outputs"], bw)
        return fw, bw

    slots, fn = over_tensor_args(program.chunk, args)

    def keep(gm, _inputs):
        return gm

    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=part)
    # the partitions' graphs are read, never run (but the last forward, once): their
    # Python code is generated only where called
    with _use_lazy_graph_module(True):
        compiled(*[args[i] for i in slots])
    if len(rec) != len(parts):
        raise SppoError("cost model: AOTAutograd produced no forward/backward partition "
                        "(does the chunk program depend on anything that requires grad?)")
    return rec, slots


def saved_tensors(program, values, batch: int, *, params: list[torch.Tensor] | None = None,
                  seq=None, partition: str = "default", example: tuple[int, int] | None = None,
                  device=None, recompute: str = "none") -> tuple[list[SavedTensor], tuple[int, int]]:
    """The saved-for-backward storages of one chunk, with symbolic sizes.

    Args:
        program: a `ChunkedProgram`.
        values: `symbolic_values(program)` (gives the level-1 K/V shapes and static dims).
        batch: the traced batch B.
        params: parameter tensors (default: random ones of the right shapes).
        seq: the captured sequence symbol.
        partition: "default" or "min_cut" (AOTAutograd partitioner).
        example: (c0, p0) to trace at (default: chosen to avoid ambiguous dims).
        device: device of the example tensors (see `example_inputs`).
        recompute: recompute policy (partition "min_cut" only; see `passes.offload`).

    Returns:
        (saved tensors, level 1 first; the (c0, p0) used).
    """
    by_policy, ex, _ = saved_tensors_by_policy(program, values, batch, params=params, seq=seq, partition=partition,
                                               example=example, device=device, recomputes=(recompute,))
    return by_policy[recompute], ex


def saved_tensors_by_policy(program, values, batch: int, *, params: list[torch.Tensor] | None = None,
                            seq=None, partition: str = "default", example: tuple[int, int] | None = None,
                            device=None, recomputes=("none",)
                            ) -> tuple[dict[str, list[SavedTensor]], tuple[int, int], dict[str, tuple]]:
    """`saved_tensors` for several recompute policies from one AOTAutograd trace (the joint
    graph is partitioned once per policy, `_aot_forwards`), and what each policy's forward
    and backward graphs allocate (`allocated_tensors`).

    Returns:
        ({policy: saved tensors, level 1 first}, the (c0, p0) used, {policy: allocated}).
    """
    static = _static_dims(values)
    c0, p0 = example or choose_example(static, batch)
    args = example_inputs(program, c0, p0, params=params, seq=seq, device=device)
    forwards, slots = _aot_forwards(program, args, partition, tuple(dict.fromkeys(recomputes)))
    saved = {policy: _classify_saved(program, values, batch, seq, fw, n_out, slots, (c0, p0), static)
             for policy, (fw, n_out, _) in forwards.items()}
    allocated = {policy: allocated_tensors(fw, bw, (c0, p0), batch, static)
                 for policy, (fw, _, bw) in forwards.items()}
    return saved, (c0, p0), allocated


def allocated_tensors(fw: fx.GraphModule, bw: fx.GraphModule, example: tuple[int, int], batch: int,
                      static: set[int]) -> tuple[AllocatedTensor, ...]:
    """The fresh tensors AOTAutograd's forward and backward graphs allocate, op by op: every
    output of a call that is not a view of an input and not an input written in place, with
    its size as an expression of c, p, b (dims matched as the saved tensors' are,
    `_match_dim`), counted per (size, graph, matmul or not). Outputs whose size the example
    cannot tell (a dim matched to no expression) count at the example's size."""
    c0, p0 = example
    found: dict[tuple, int] = {}
    for backward, gm in ((False, fw), (True, bw)):
        for node in gm.graph.nodes:
            if node.op != "call_function" or is_view_op(node.target):
                continue
            outs = _tensors(node.meta.get("val"))
            if not outs:
                continue
            ins = {storage_key(t) for n in node.all_input_nodes for t in _tensors(n.meta.get("val"))}
            matmul = _op_name(node.target) in _MATMUL
            for t in outs:
                key = storage_key(t)
                if key is not None and key in ins:
                    continue
                dims = [_match_dim(int(s), c0, p0, batch, static)[0] for s in t.shape]
                nbytes = sympy.expand(sympy.Mul(*dims) * t.element_size()) if dims else sympy.Integer(t.element_size())
                entry = (nbytes, backward, matmul)
                found[entry] = found.get(entry, 0) + 1
    return tuple(AllocatedTensor(e, bwd, mm, n) for (e, bwd, mm), n in found.items())


def _classify_saved(program, values, batch: int, seq, fw: fx.GraphModule, n_out: int, slots: list[int],
                    example: tuple[int, int], static: set[int]) -> list[SavedTensor]:
    """The saved outputs of one AOT forward graph as `SavedTensor`s (level 1 first)."""
    rename = values.rename
    c0, p0 = example
    names = [n for n, _, _ in _input_specs(program, seq)]
    roles = {n: r for n, r, _ in _input_specs(program, seq)}
    fw_ph = _placeholders(fw)
    ph_role = {ph: roles[names[i]] for ph, i in zip(fw_ph, slots)}
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    saved_nodes = [n for n in outs[n_out:] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]

    # Level 1: the chunk's K/V outputs (symbolic shapes from the fake run).
    chunk_out = next(n for n in program.chunk.graph.nodes if n.op == "output").args[0]
    kv_nodes = list(chunk_out)[program.num_partials:]
    result: list[SavedTensor] = []
    sizes = {c, p}
    for i, kv in enumerate(kv_nodes):
        val = values[kv]
        shape = _renamed_shape(val, rename)
        shape = _batch_shape(shape, batch, sizes)
        site = program.attention[i // 2].name if i // 2 < len(program.attention) else kv.name
        numel = sympy.Mul(*shape)
        result.append(SavedTensor(f"{site}.{'kv'[i % 2]}", shape, val.dtype,
                                  sympy.expand(numel * val.element_size()), 1, "kv", (kv.name,)))
    # K/V outputs of the AOT forward graph (to spot a saved value that *is* the skeleton).
    kv_fw_bases = {}
    for i, o in enumerate(outs[program.num_partials:program.num_partials + len(kv_nodes)]):
        if isinstance(o, fx.Node):
            kv_fw_bases[_alias_base(o)] = o

    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in saved_nodes:
        groups.setdefault(_alias_base(n), []).append(n)
    data_dep = _data_dependent(fw.graph, lambda ph: ph_role.get(ph) != "param")
    for base, members in groups.items():
        val = base.meta.get("val")
        if not isinstance(val, torch.Tensor):
            val = members[0].meta["val"]
        role = ph_role.get(base)
        if role in ("param", "prefix"):
            continue  # weights / views of earlier chunks' skeleton: not this chunk's activations
        matched = [_match_dim(int(s), c0, p0, batch, static) for s in val.shape]
        shape = tuple(e for e, _ in matched)
        exact = all(ok for _, ok in matched)
        depends = any(e.free_symbols & {c, p, b} for e in shape)
        if not depends and not data_dep[base]:
            continue  # parameter-derived (e.g. a transposed weight): per step, not per chunk
        if base in kv_fw_bases and val.numel() == kv_fw_bases[base].meta["val"].numel():
            continue  # the K/V output itself: counted once, at level 1
        shape = _batch_shape(shape, batch, {c, p})
        if role == "input":
            kind = "input"
        elif _is_prefix_cat(base, ph_role):
            kind = "kv_concat"
        elif len(shape) == 2 and shape[0] == c and shape[1] == p + c:
            kind = "mask"
        else:
            kind = "activation"
        numel = sympy.Mul(*shape) if shape else sympy.Integer(1)
        result.append(SavedTensor(base.name, shape, val.dtype, sympy.expand(numel * val.element_size()),
                                  2, kind, tuple(m.name for m in members), exact))
    return result


def _batch_shape(shape: tuple, batch: int, sizes: set) -> tuple:
    """Put the batch symbol into a symbolic shape (leading B, or a flattened B * f(c, p))."""
    if not shape or not any(e.free_symbols & sizes for e in shape):
        return shape
    lead = shape[0]
    if batch == 1:
        return (b * lead,) + tuple(shape[1:])
    if lead == batch:
        return (b,) + tuple(shape[1:])
    coeff, rest = lead.as_coeff_Mul()
    if rest.free_symbols & sizes and coeff.is_Integer and int(coeff) % batch == 0:
        return ((int(coeff) // batch) * b * rest,) + tuple(shape[1:])
    return shape


def _is_prefix_cat(node: fx.Node, ph_role: dict) -> bool:
    if node.op != "call_function" or _op_name(node.target) != "cat":
        return False
    parts = node.args[0] if node.args else []
    return any(isinstance(a, fx.Node) and ph_role.get(_alias_base(a)) == "prefix" for a in parts)
