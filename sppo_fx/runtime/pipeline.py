"""Set-up of a distributed step for `SppoCompiled.step` on a (pp, dp, sp) layout.

Every rank captures the same model on the same (micro-batch share) shapes, runs the same
passes and splits it into the same stages, so all ranks know every stage's program (and
hence which parameters several stages share) without exchanging graphs; each rank then
runs its own stage, on its data-parallel share of every micro-batch and, with sequence
parallelism, its share of every chunk's tokens (`passes.sequence_parallel`).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.utils._pytree as pytree

from sppo_fx.capture import Captured, capture, flatten_call
from sppo_fx.errors import SppoError
from sppo_fx.passes import batch_epilogue, transform_stages
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.passes.stage_split import StageGraph
from sppo_fx.plan import Plan
from sppo_fx.passes.sequence_parallel import shard_attention_heads
from sppo_fx.ops.seq_parallel import register_group
from sppo_fx.runtime.distributed import PipelineExecutor, check_agreement, fingerprint
from sppo_fx.runtime.mesh import ParallelMesh
from sppo_fx.schedule import build_schedule, with_offload
from sppo_fx.solver.partition import cost_model_from_graph
from sppo_fx.solver.pipeline import ComputeModel, choose_plan
from sppo_fx.solver.rank_budget import chunk_recompute, rank_budget_plan


def split_microbatches(args: tuple, kwargs: dict, target, count: int) -> list[tuple]:
    """Split every tensor whose dim 0 is the batch size into `count` micro-batches.

    Returns:
        [(args, kwargs, target)] per micro-batch.
    """
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs), target))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise SppoError("no input tensor to split into micro-batches")
    batch = tensors[0].shape[0]
    if batch % count:
        raise SppoError(f"the batch of {batch} sequences does not split into microbatches={count}; "
                        f"use a batch size divisible by {count}")
    size = batch // count
    out = []
    for m in range(count):
        part = [x[m * size:(m + 1) * size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
                else x for x in leaves]
        out.append(pytree.tree_unflatten(part, spec))
    return out


@dataclasses.dataclass
class PipelineState:
    """What one rank keeps between steps."""

    captured: Captured
    stages: list[StageGraph]
    programs: list[ChunkedProgram]
    executor: PipelineExecutor
    plan: Plan
    prediction: tuple | None = None
    graph: object = None  # the analysed captured graph
    program: ChunkedProgram | None = None  # this rank's stage program (sequence-parallel: sharded)


def data_shares(microbatches: list[tuple], mesh: ParallelMesh) -> list[tuple]:
    """This rank's data-parallel share of every micro-batch: the union over dp ranks of
    their m-th shares is micro-batch m, so summed partials see the whole micro-batch."""
    D = mesh.layout.dp
    if D == 1:
        return microbatches
    if (batch := _batch_size(microbatches[0])) % D:
        raise SppoError(f"each micro-batch has {batch} sequences, which do not split over data_parallel={D}; "
                        f"use a batch size divisible by microbatches x data_parallel")
    return [split_microbatches(a, k, t, D)[mesh.dp_rank] for a, k, t in microbatches]


def _batch_size(microbatch: tuple) -> int:
    leaves = pytree.tree_leaves(microbatch)
    return next(x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0)


def build_pipeline(model, fn, options, microbatches: list[tuple], planner, mesh: ParallelMesh,
                   chunk_fn_factory=None, store=None, check_values: bool = True) -> PipelineState:
    """Capture, split and schedule; check that all ranks agree.

    Args:
        model / fn: as given to sppo_fx.compile.
        options: the CompileOptions.
        microbatches: [(args, kwargs, target)] of this step (this rank's data-parallel share).
        planner: the SppoCompiled (its `plan_for` gives the chunk plan from a cost model); with
            neither chunks nor chunk_lengths set, the pipeline solver chooses the plan.
        mesh: this rank's place in the (pp, dp, sp) layout.
        chunk_fn_factory: (GraphModule, recompute=policy) -> the chunk runner (Inductor), or None.
        store: the ActivationStore when options.offload is set.
        check_values: compare every parameter's values across ranks (before the first step;
            later each rank has updated only its own stage's parameters).

    Returns:
        The PipelineState of this rank.
    """
    layout, stage = mesh.layout, mesh.pp_rank
    num_stages = layout.pp
    args, kwargs, target = microbatches[0]
    cap = capture(model, fn, options.loss_fn, args, kwargs, target, options.seq_dim)
    graph, stages, programs = transform_stages(cap, num_stages, options.split_points, log=options.log_passes,
                                               ones_inputs=options.ones_inputs)
    if layout.dp > 1:
        bind_global_batch(model, fn, options, microbatches[0], programs[-1], graph, layout.dp)
    program = programs[stage]
    if layout.sp > 1:
        group = register_group(f"sp.pp{mesh.pp_rank}.dp{mesh.dp_rank}", mesh.sp_group,
                               mesh.ranks[mesh.pp_rank][mesh.dp_rank])
        program = shard_attention_heads(program, layout.sp, group)
    cost = cost_model_from_graph(graph, cap.seq)
    seq_len = _seq_len(microbatches[0], options.seq_dim)
    prediction = None
    if options.chunks is None and options.chunk_lengths is None:
        best, considered = choose_plan(cost, ComputeModel(1.0), seq_len, num_stages, len(microbatches), options.schedule)
        plan, prediction = Plan(seq_len, best.chunk_lengths), (best, considered)
    else:
        plan = planner.plan_for(seq_len, cost)
    if getattr(options, "plan", None) is not None:
        plan = options.plan  # a saved plan (`sppo-fx plan --json`), checked below
    if plan.seq_len != seq_len:
        raise SppoError(f"the plan covers {plan.seq_len} tokens but the sequence has {seq_len}")
    for i in range(plan.num_chunks):
        plan.sp_split(i, layout.sp)  # raises when a chunk has fewer tokens than seq_parallel
    users: dict[str, list[int]] = {}
    for s, prog in enumerate(programs):
        for name in prog.params:
            users.setdefault(cap.param_fqns[name][1], []).append(s)
    shared_ids = {fqn: gid for gid, fqn in enumerate(sorted(f for f, r in users.items() if len(r) > 1))}
    shared = {k: (shared_ids[cap.param_fqns[name][1]], users[cap.param_fqns[name][1]])
              for k, name in enumerate(program.params) if cap.param_fqns[name][1] in shared_ids}
    schedule = build_schedule(options.schedule, num_stages, len(microbatches), plan.num_chunks)
    params = [cap.param_value(name) for name in program.params]
    quota = None
    if options.budget is not None:
        # this rank's own plan: offload ratios for its stage's activations
        plan, quota = rank_budget_plan(options, program, cap, params, plan, num_stages, stage, len(microbatches), cost)
        offload = {(stage, m, i) for (m, i), q in quota.items() if q > 0}
        schedule = with_offload(schedule, offload)
    elif options.offload:
        # every chunk but the last of each micro-batch (the first to run backward) on every stage
        schedule = with_offload(schedule, {(s, m, i) for s in range(num_stages) for m in range(len(microbatches))
                                           for i in range(plan.num_chunks - 1)})
    shapes = [[list(t.shape) for t in flatten_call(*mb)[0] if isinstance(t, torch.Tensor)] for mb in microbatches]
    named = list(cap.module.named_parameters(remove_duplicate=False))  # names as in cap.param_fqns
    graphs = [graph] + [g for prog in programs for g in (prog.prologue, prog.chunk, prog.epilogue) if g is not None]
    agreed = fingerprint(graphs, named, plan, schedule, shapes, shared=list(shared_ids), check_values=check_values)
    agreed["layout"] = str(layout)
    check_agreement(agreed, mesh.rank, layout.world, options.timeout_s)
    chunk_fn = chunk_fn_factory(program.chunk, recompute=chunk_recompute(options, plan)) if chunk_fn_factory else None
    executor = PipelineExecutor(program, params, plan, schedule, mesh, chunk_fn, options.timeout_s, shared,
                                store, quota)
    return PipelineState(cap, stages, programs, executor, plan, prediction, graph, program)


def bind_global_batch(model, fn, options, microbatch: tuple, program: ChunkedProgram, graph, dp: int) -> None:
    """data_parallel > 1: check the loss's use of the batch size (`passes.batch_epilogue`) on
    a second export of the call with the batch dim dynamic, and give `program` (the last
    stage's) the epilogue that reads the global batch where the loss reads it as a value.

    The export sees a stand-in batch (the share's rows repeated) of a size that is >= 2 (0
    and 1 would be specialised) and equals neither the sequence length nor another input's
    dim 0 (so the same inputs as `data_shares` splits carry the batch symbol). Costs one
    more torch.export of the model (about as long as the first), only when dp > 1."""
    local = _batch_size(microbatch)
    leaves, spec = pytree.tree_flatten(microbatch)
    batched = [isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == local for x in leaves]
    taken = {x.shape[0] for x, b in zip(leaves, batched) if isinstance(x, torch.Tensor) and x.dim() > 0 and not b}
    taken.add(_seq_len(microbatch, options.seq_dim))
    size = next(k for k in itertools.count(2) if k not in taken)
    stand_in = [x[torch.arange(size, device=x.device) % local] if b else x for x, b in zip(leaves, batched)]
    args, kwargs, target = pytree.tree_unflatten(stand_in, spec)
    cap = capture(model, fn, options.loss_fn, args, kwargs, target, options.seq_dim, batch_dynamic=True)
    epilogue = batch_epilogue(cap, program, graph, local * dp)
    if epilogue is not None:
        program.epilogue = epilogue


def _seq_len(microbatch: tuple, seq_dim: int) -> int:
    leaves, _spec, slots = flatten_call(*microbatch)
    return next(leaves[i].shape[seq_dim] for i in slots if leaves[i].dim() > seq_dim)


def pipeline_step(state: PipelineState, microbatches: list[tuple]) -> torch.Tensor:
    """Run one step on this rank: returns the loss (on every rank)."""
    inputs = []
    for mb in microbatches:
        leaves, _spec, slots = flatten_call(*mb)
        inputs.append([leaves[i] for i in slots])
    return state.executor.step(inputs)
