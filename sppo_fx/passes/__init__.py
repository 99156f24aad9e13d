"""FX passes, run in a visible order by `transform`.

    captured graph
      -> strip_asserts            drop export's metadata asserts, dead code
      -> recognize_causal_masks   SDPA(mask built from positions) -> causal / sliding-window attention
      -> recognize_explicit_attention  softmax(masked q@kᵀ·s) @ v, mask proved causal
                                  -> SDPA(is_causal=True, scale=s)
      -> analyse_seqdims          classify every value along the sequence (node.meta["sppo_seq"])
      -> chunk_program            prologue / per-chunk program / epilogue

Each pass is a function of a GraphModule (and the capture's facts) with no hidden state.
At DEBUG level the logger "sppo_fx.passes" shows the captured graph before the first pass
and every graph after its pass, with node counts and seconds (`SPPO_FX_LOG=debug`, see
sppo_fx/log.py; `log=True` / `log_passes=True` / SPPO_FX_LOG_PASSES=1 turn on just these).

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

import torch.fx as fx

from sppo_fx.capture import Captured, strip_asserts
from sppo_fx.errors import SppoError
from sppo_fx.log import enable, get_logger
from sppo_fx.passes.causal_mask import recognize_causal_masks
from sppo_fx.passes.explicit_attention import recognize_explicit_attention
from sppo_fx.passes.seq_chunk import ChunkedProgram, chunk_program
from sppo_fx.passes.seqdim import analyse, format_analysis

_log = get_logger(__name__)


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


def transform(captured: Captured, log: bool | None = None) -> tuple[fx.GraphModule, ChunkedProgram]:
    """Run the passes on a capture.

    Args:
        captured: the output of `capture.capture`.
        log: show each graph before and after its pass (default: env SPPO_FX_LOG_PASSES=1;
            the "sppo_fx.passes" logger at DEBUG shows them too).

    Returns:
        (the analysed captured graph, the ChunkedProgram).
    """
    _show_passes(log)
    gm = captured.copy_graph()
    if log_debug := _log.isEnabledFor(logging.DEBUG):
        _log.debug("---- captured graph (before the passes) ----\n%s", gm.code)
    params = set(captured.param_fqns)
    steps = [
        ("strip_asserts", lambda g: strip_asserts(g)),
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


__all__ = ["transform", "transform_stages", "strip_asserts", "recognize_causal_masks", "recognize_explicit_attention",
           "analyse_seqdims", "chunk_program",
           "ChunkedProgram"]


def transform_stages(captured: Captured, num_stages: int, split_points: list[str] | None = None,
                     log: bool | None = None):
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
    gm, whole = transform(captured, log=log)
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
