"""Set-up of a pipeline step for `SppoCompiled.step` with stages > 1.

Every rank captures the same model on the same (micro-batch) shapes, runs the same passes
and splits it into the same stages, so all ranks know every stage's program (and hence
which parameters several stages share) without exchanging graphs; each rank then runs
its own stage.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sppo_fx.capture import Captured, capture, flatten_call
from sppo_fx.errors import SppoError
from sppo_fx.passes import transform_stages
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.passes.stage_split import StageGraph
from sppo_fx.plan import Plan
from sppo_fx.runtime.distributed import PipelineExecutor, check_agreement, fingerprint
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


def build_pipeline(model, fn, options, microbatches: list[tuple], planner, rank: int, world: int,
                   chunk_fn_factory=None, store=None, check_values: bool = True) -> PipelineState:
    """Capture, split and schedule; check that all ranks agree.

    Args:
        model / fn: as given to sppo_fx.compile.
        options: the CompileOptions.
        microbatches: [(args, kwargs, target)] of this step.
        planner: the SppoCompiled (its `plan_for` gives the chunk plan from a cost model); with
            neither chunks nor chunk_lengths set, the pipeline solver chooses the plan.
        rank / world: this rank and the number of ranks (= stages).
        chunk_fn_factory: (GraphModule, recompute=policy) -> the chunk runner (Inductor), or None.
        store: the ActivationStore when options.offload is set.
        check_values: compare every parameter's values across ranks (before the first step;
            later each rank has updated only its own stage's parameters).

    Returns:
        The PipelineState of this rank.
    """
    args, kwargs, target = microbatches[0]
    cap = capture(model, fn, options.loss_fn, args, kwargs, target, options.seq_dim)
    graph, stages, programs = transform_stages(cap, world, options.split_points, log=options.log_passes)
    program = programs[rank]
    cost = cost_model_from_graph(graph, cap.seq)
    seq_len = _seq_len(microbatches[0], options.seq_dim)
    prediction = None
    if options.chunks is None and options.chunk_lengths is None:
        best, considered = choose_plan(cost, ComputeModel(1.0), seq_len, world, len(microbatches), options.schedule)
        plan, prediction = Plan(seq_len, best.chunk_lengths), (best, considered)
    else:
        plan = planner.plan_for(seq_len, cost)
    users: dict[str, list[int]] = {}
    for s, prog in enumerate(programs):
        for name in prog.params:
            users.setdefault(cap.param_fqns[name][1], []).append(s)
    shared_ids = {fqn: gid for gid, fqn in enumerate(sorted(f for f, r in users.items() if len(r) > 1))}
    shared = {k: (shared_ids[cap.param_fqns[name][1]], users[cap.param_fqns[name][1]])
              for k, name in enumerate(program.params) if cap.param_fqns[name][1] in shared_ids}
    schedule = build_schedule(options.schedule, world, len(microbatches), plan.num_chunks)
    params = [cap.param_value(name) for name in program.params]
    quota = None
    if options.budget is not None:
        # this rank's own plan: offload ratios for its stage's activations
        plan, quota = rank_budget_plan(options, program, cap, params, plan, world, rank, len(microbatches), cost)
        offload = {(rank, m, i) for (m, i), q in quota.items() if q > 0}
        schedule = with_offload(schedule, offload)
    elif options.offload:
        # every chunk but the last of each micro-batch (the first to run backward) on every stage
        schedule = with_offload(schedule, {(s, m, i) for s in range(world) for m in range(len(microbatches))
                                           for i in range(plan.num_chunks - 1)})
    shapes = [[list(t.shape) for t in flatten_call(*mb)[0] if isinstance(t, torch.Tensor)] for mb in microbatches]
    named = list(cap.module.named_parameters(remove_duplicate=False))  # names as in cap.param_fqns
    graphs = [graph] + [g for prog in programs for g in (prog.prologue, prog.chunk, prog.epilogue) if g is not None]
    check_agreement(fingerprint(graphs, named, plan, schedule, shapes, shared=list(shared_ids),
                                check_values=check_values), rank, world)
    chunk_fn = chunk_fn_factory(program.chunk, recompute=chunk_recompute(options, plan)) if chunk_fn_factory else None
    executor = PipelineExecutor(program, params, plan, schedule, rank, world, chunk_fn, options.timeout_s, shared,
                                store, quota)
    return PipelineState(cap, stages, programs, executor, plan, prediction)


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


def require_world(stages: int) -> tuple[int, int]:
    """(rank, world) of the initialised process group, which must have `stages` ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise SppoError(f"stages={stages} needs torch.distributed: launch with `torchrun --nproc-per-node "
                        f"{stages} ...` and call sppo_fx.runtime.distributed.init_from_env() first")
    world = dist.get_world_size()
    if world != stages:
        raise SppoError(f"stages={stages} but the process group has {world} ranks; launch with "
                        f"--nproc-per-node {stages} (one stage per rank)")
    return dist.get_rank(), world
