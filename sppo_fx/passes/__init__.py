"""FX passes, run in a visible order by `transform`.

    captured graph
      -> strip_asserts            drop export's metadata asserts, dead code
      -> specialise_ones          (only when the program is refused) an all-ones input -> constant ones, guarded
      -> recognize_cumsum_positions  cumsum of ones along the sequence -> arange(T) + 1
      -> recognize_causal_masks   SDPA(mask built from positions) -> causal / sliding-window attention
      -> recognize_explicit_attention  softmax(masked q@kᵀ·s) @ v, mask proved causal
                                  -> SDPA(is_causal=True, scale=s)
      -> analyse_seqdims          classify every value along the sequence (node.meta["sppo_seq"])
      -> chunk_program            prologue / per-chunk program / epilogue

Each pass is a function of a GraphModule (and the capture's facts) with no hidden state.
At DEBUG level the logger "sppo_fx.passes" shows the captured graph before the first pass
and every graph after its pass, with node counts and seconds (`SPPO_FX_LOG=debug`, see
sppo_fx/util/log.py; `log=True` / `log_passes=True` / SPPO_FX_LOG_PASSES=1 turn on just these).

The memory passes (`passes.offload`) run later, on the chunk program's AOTAutograd joint
graph and its forward/backward partition, as the partitioner that codegen hands to
AOTAutograd:

    chunk program -> AOTAutograd joint graph
      -> tag_recompute          recompute policy: CheckpointPolicy tags on forward nodes
      -> min-cut partition      forward graph, backward graph
      -> insert_offload_nodes   sppo.offload after saved tensors, sppo.wait before their use in backward
"""
from __future__ import annotations

import logging
import os
import time

import sympy
import torch
import torch.fx as fx

from sppo_fx.chunk_attention.functions import document_causal_attention, windowed_causal_attention
from sppo_fx.capture import Captured, strip_asserts
from sppo_fx.errors import SppoError, describe_node
from sppo_fx.util.log import enable, get_logger
from sppo_fx.passes.masks.causal import recognize_causal_masks
from sppo_fx.passes.masks.explicit_attention import recognize_explicit_attention
from sppo_fx.passes.positions import recognize_cumsum_positions
from sppo_fx.passes.ones_inputs import ONES_INPUTS, ones_candidates, specialise_ones
from sppo_fx.passes.loss_epilogue import LOSSES, additive_reduction, build_epilogue, loss_reduction
from sppo_fx.passes.moe_dispatch import prove_dispatch
from sppo_fx.passes.seq_chunk import ChunkedProgram, ReductionSite, _Builder, build_size, chunk_program
from sppo_fx.passes.seqdim import (_RESHAPES, SDPA, _has_seq, _is_size_node, _length_as_value, _mixing_reason,
                                   _tensor_inputs, analyse, expr_of, format_analysis, seq_dims_of)

_log = get_logger(__name__)
aten = torch.ops.aten


def _show_passes(flag: bool | None) -> None:
    """`log=True` (or SPPO_FX_LOG_PASSES=1): this logger at DEBUG, with a handler."""
    if flag is None:
        flag = os.environ.get("SPPO_FX_LOG_PASSES", "0").strip() not in ("", "0")
    if flag:
        enable(logging.getLogger("sppo_fx").level or logging.WARNING)  # keep the package's level
        _log.setLevel(logging.DEBUG)


def _nodes(gm: fx.GraphModule) -> int:
    return sum(1 for _ in gm.graph.nodes)


def analyse_seqdims(gm: fx.GraphModule, captured: Captured) -> fx.GraphModule:
    """Run the sequence-dimension analysis; results land in node.meta["sppo_seq"]."""
    analyse(gm, captured.seq, captured.param_fqns.keys())
    return gm


def transform(captured: Captured, log: bool | None = None,
              ones_inputs=ONES_INPUTS) -> tuple[fx.GraphModule, ChunkedProgram]:
    """Run the passes on a capture.

    Args:
        captured: the output of `capture.capture`.
        log: show each graph before and after its pass (default: env SPPO_FX_LOG_PASSES=1;
            the "sppo_fx.passes" logger at DEBUG shows them too).
        ones_inputs: inputs (by call keyword) that, when the program with them as data is
            refused and their example value is all ones, become constant ones guarded at
            every call (`passes/ones_inputs.py`).

    Returns:
        (the analysed captured graph, the ChunkedProgram).
    """
    try:
        try:
            return _transform(captured, log, [])
        except SppoError:
            if not (guards := ones_candidates(captured, ones_inputs)):
                raise
        return _transform(captured, log, guards)
    except SppoError as e:
        raise _with_input_labels(e, captured) from None


def _with_input_labels(error: SppoError, captured: Captured) -> SppoError:
    """The error with each graph input the passes quote by its placeholder name ('tensors_1')
    quoted by where the user passed it ('attention_mask'): what the user can change."""
    message = str(error)
    labels = [(n, lab) for n, lab in zip(captured.input_names, captured.input_labels or []) if n != lab]
    # longest names first: 'tensors_1' must not rewrite the front of 'tensors_12'
    for name, label in sorted(labels, key=lambda p: -len(p[0])):
        message = message.replace(f"'{name}'", f"'{label}'")
    if message == str(error) or type(error) is not SppoError:
        return error
    return SppoError(message).with_traceback(error.__traceback__)


def _transform(captured: Captured, log: bool | None, ones: list) -> tuple[fx.GraphModule, ChunkedProgram]:
    _show_passes(log)
    gm = captured.copy_graph()
    if log_debug := _log.isEnabledFor(logging.DEBUG):
        _log.debug("---- captured graph (before the passes) ----\n%s", gm.code)
    params = set(captured.param_fqns)
    steps = [
        ("strip_asserts", lambda g: strip_asserts(g)),
        ("specialise_ones", lambda g: specialise_ones(g, captured, ones) if ones else g),
        ("recognize_cumsum_positions", lambda g: recognize_cumsum_positions(g, captured.seq, captured.param_value)),
        ("recognize_causal_masks",
         lambda g: recognize_causal_masks(g, captured.seq, params, captured.param_value)),
        ("recognize_explicit_attention",
         lambda g: recognize_explicit_attention(g, captured.seq, captured.param_value)),
        ("analyse_seqdims", lambda g: analyse_seqdims(g, captured)),
    ]
    for name, step in steps:
        before, t0 = _nodes(gm), time.perf_counter()
        gm = step(gm)
        if log_debug:
            _log.debug("---- after %s (%d -> %d nodes, %.2f s) ----\n%s", name, before, _nodes(gm),
                      time.perf_counter() - t0, format_analysis(gm) if name == "analyse_seqdims" else gm.code)
    param_order = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in params]
    program = chunk_program(gm, captured.seq, param_order, captured.input_names)
    if log_debug:
        for name in ("prologue", "chunk", "epilogue"):
            _log.debug("---- after chunk_program: %s ----\n%s", name, getattr(program, name).code)
    return gm, program


__all__ = ["transform", "transform_stages", "batch_epilogue", "strip_asserts", "recognize_causal_masks", "recognize_explicit_attention",
           "analyse_seqdims", "chunk_program",
           "ChunkedProgram"]


def transform_stages(captured: Captured, num_stages: int, split_points: list[str] | None = None,
                     log: bool | None = None, ones_inputs=ONES_INPUTS):
    """`transform`, then split into pipeline stages and chunk each stage.

    Args:
        captured: the output of `capture.capture`.
        num_stages: number of pipeline stages P.
        split_points: module names to cut before (default: cost-balanced, or the model's
            `sppo_fx.split_point` markers).
        log: show each stage's graphs (as `transform`).

    Returns:
        (the analysed captured graph, [StageGraph], [ChunkedProgram per stage]).
    """
    from sppo_fx.passes.stage_split import split_stages
    gm, whole = transform(captured, log=log, ones_inputs=ones_inputs)
    _refuse_carried(whole, captured)
    params = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in captured.param_fqns]
    stages = split_stages(gm, captured.seq, params, captured.input_names, num_stages, split_points)
    programs = []
    for st in stages:
        analyse(st.graph, captured.seq, captured.param_fqns.keys(), st.recvs)
        used = [n.name for n in st.graph.graph.nodes if n.op == "placeholder" and n.name in captured.param_fqns]
        programs.append(chunk_program(st.graph, captured.seq, used, captured.input_names, st.recvs))
        _log.debug("---- stage %d: blocks %s ----\n%s", st.index, st.blocks, programs[-1].chunk.code)
    return gm, stages, programs


def _refuse_carried(program: ChunkedProgram, captured: Captured) -> None:
    """A loss that reads input values besides its per-token reductions (`loss * w.mean()`)
    is computed exactly on one process only: the runtime sums the partials of every data-
    and sequence-parallel rank, which would count such a value once per rank (and a
    per-sample input's value differs between the ranks' shares of the batch)."""
    labels = dict(zip(captured.input_names, captured.input_labels or captured.input_names))
    for site in program.reductions:
        if site.op == "carried":
            names = ", ".join(labels.get(n, n) for n in site.inputs) or site.name
            raise SppoError(
                f"the loss reads the input {names} outside its reductions over the sequence "
                f"({site.source}); sppo_fx computes such a loss on one process only, not with "
                "stages, data_parallel or seq_parallel. Fold the input into a per-token loss "
                "(e.g. weight each token's loss with reduction='none' before its sum) or train "
                "on one process")



def batch_epilogue(captured: Captured, program: ChunkedProgram, graph: fx.GraphModule, batch: int):
    """Data parallelism: prove that the batch size enters `program` only as shapes and through
    its summed partials, and give the epilogue that reads it as a value the global batch.

    Each data-parallel rank captures and runs its share of the batch, so every size of the
    batch dim in the captured program is the local share's (a literal); the runtime sums the
    ranks' partials before the epilogue. That is exact when (a) each sample's values up to the
    loss's reductions are its own (no op mixes samples: `mean(0)`, batch-wise softmax, ...),
    (b) the reductions sum over samples (partials add up over the ranks' shares), and (c)
    what reads the batch size as a value after them (`loss / x.shape[0]`, kl_div's
    'batchmean') reads the whole micro-batch's. `captured` is an export of the same call with
    the batch dim dynamic (`capture(batch_dynamic=True)`): its batch symbols show every use.

    Args:
        captured: the batch-dynamic capture (`captured.batch`: the batch symbols).
        program: the last stage's ChunkedProgram of the ordinary (local-share) capture.
        graph: that capture's analysed graph (`transform_stages`' first result).
        batch: the micro-batch's global batch size.

    Returns:
        The epilogue to use instead of `program.epilogue` (the batch bound to `batch`), or
        None when the epilogue does not read the batch size. Raises SppoError for (a), for a
        batch size read before the reductions, or when the two captures' losses differ.
    """
    gm = strip_asserts(captured.copy_graph())
    nodes = list(gm.graph.nodes)
    seqs = _input_symbols(nodes, captured)
    Bs = sorted(captured.batch, key=str)
    same = {**{s: seqs[0] for s in seqs}, **{B: Bs[0] for B in Bs}}  # the inputs' sizes are equal at run time
    dispatch = set().union(*(prove_dispatch(gm, B) for B in Bs))  # MoE rows are per sample as per token
    after: set[fx.Node] = set()  # computed from the loss's reductions over the sequence
    frontier, reads_batch = [], False
    for node in nodes:
        if node.op != "call_function" or _is_size_node(node):
            continue
        value_use = next((w for B in Bs if (w := _length_as_value(node, B)) is not None), None)
        if any(a in after for a in node.all_input_nodes):
            after.add(node)
            reads_batch |= value_use is not None
            continue
        if node.name in dispatch:
            continue
        ins = [a.meta.get("val") for a in _tensor_inputs(node)]
        full = node.target in (aten.sum.default, aten.mean.default) or \
            (node.target in LOSSES and loss_reduction(node) != 0) or any(additive_reduction(node, B) for B in Bs)
        if full and any(seq_dims_of(v, s) for v in ins for s in seqs):
            frontier.append(node)
            after.add(node)
            continue
        if value_use is not None:
            _refuse_batch(node, f"uses the batch size as a value ({value_use}) before the loss's reduction over "
                          "the sequence; each rank would compute it with its share's batch size. Use it only "
                          "after the reduction (e.g. loss.sum() / x.shape[0]) or as a shape")
        if (why := batch_mixing_reason(node, Bs, same)) is not None:
            _refuse_batch(node, f"{why}, which mixes the samples of the batch before the loss's reduction; "
                          "each data-parallel rank holds only its share of the samples. Reduce over the "
                          "samples only in the loss (e.g. a mean or sum over all tokens)")
    sites = [r for r in program.reductions if r.op != "carried"]
    static = {n.name: n for n in graph.graph.nodes}
    if len(sites) != len(frontier) or len(sites) != len(program.reductions) or any(
            static[r.name].target is not n.target for r, n in zip(sites, frontier)):
        raise SppoError("data_parallel: the loss's reductions of the batch-dynamic capture do not match the "
                        "program's, so sppo_fx cannot prove how the loss uses the batch size; train with "
                        "data_parallel=1")
    if not reads_batch:
        return None  # the epilogue is the same function at every batch size

    class Bound(_Builder):
        def expr(self, expr):
            return build_size(self.graph, expr, {**{s: self.length for s in seqs}, **{B: batch for B in Bs}})

    by_name = {n.name: n for n in nodes}
    red = [ReductionSite(n.name, r.op, r.source, r.has_count) for r, n in zip(sites, frontier)]
    loss = next(n for n in nodes if n.op == "output").args[0]
    loss = loss[0] if isinstance(loss, (list, tuple)) else loss
    params = [n.name for n in nodes if n.op == "placeholder" and n.name in captured.param_fqns]
    epilogue, eparams = build_epilogue(Bound(captured.seq), nodes, by_name, params, red, after - set(frontier), loss)
    if eparams != program.epilogue_params:
        raise SppoError("data_parallel: the batch-dynamic capture's loss reads other parameters than the "
                        "program's; train with data_parallel=1")
    return epilogue


def _input_symbols(nodes, captured: Captured) -> list:
    """The sequence-length symbols of the user inputs' sequence dims (one per input unless
    the model's code equates them)."""
    by_name = {n.name: n for n in nodes}
    out = {captured.seq}
    for name, dim in zip(captured.input_names, captured.input_seq_dims):
        if dim is not None and isinstance(size := by_name[name].meta["val"].shape[dim], torch.SymInt):
            out |= size.node.expr.free_symbols
    return sorted(out, key=str)


def _refuse_batch(node: fx.Node, why: str):
    raise SppoError(f"data_parallel: {describe_node(node)} {why}")


def batch_mixing_reason(node: fx.Node, Bs: list, same: dict) -> str | None:
    """Why `node` mixes samples along the batch dim (any symbol of `Bs`), or None if each
    sample's values depend on that sample only: the sequence analysis' rule for positions with
    the batch for the sequence, except reshapes (a sample's values may fold with its positions,
    [B, T, V] -> [B*T, V], as one block) and attention (over dims -2 and -1, after the batch).
    `same` maps every batch and sequence symbol to one of each (the inputs' sizes are equal)."""
    if node.target in (SDPA, windowed_causal_attention, document_causal_attention):
        for a in node.args[:3]:
            if any(_has_seq(s, B) for s in a.meta["val"].shape[-2:] for B in Bs):
                return "attends along the batch dimension"
        return None
    if node.target in _RESHAPES:
        x, out = node.args[0].meta["val"], node.meta["val"]
        B = same[Bs[0]]
        blocks = []
        for v in (x, out):
            sizes = [sympy.sympify(expr_of(s)).subs(same) for s in v.shape]
            dims = [d for d, e in enumerate(sizes) if B in e.free_symbols]
            if not dims and v is x:
                return None
            if len(dims) != 1:
                return "reshapes the batch dimension into another number of dims"
            per = sympy.simplify(sizes[dims[0]] / B)
            if B in per.free_symbols:
                return f"splits the batch dimension into blocks ({list(x.shape)} -> {list(out.shape)})"
            blocks.append(sympy.simplify(per * sympy.Mul(*sizes[dims[0] + 1:])))
        if sympy.simplify(blocks[0] - blocks[1]) != 0:
            return f"reshapes so that samples interleave ({list(x.shape)} -> {list(out.shape)})"
        return None
    if node.target in (aten.pad.default, aten.constant_pad_nd.default):  # pads the last len(pad) // 2 dims
        x = node.args[0].meta["val"]
        if not any(_has_seq(s, B) for s in x.shape[x.dim() - len(node.args[1]) // 2:] for B in Bs):
            return None
    why = next((w for B in Bs if (w := _mixing_reason(node, B, {})) is not None), None)
    return why.replace("sequence", "batch") if why else None
