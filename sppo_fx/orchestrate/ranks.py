"""Many stages (a (pp, dp, sp) layout): capture -> passes (stage split, the batch epilogue
with data parallelism, the sequence-parallel pass) -> cost model -> solve -> codegen,
giving this rank's `runtime.product.RankProduct`, which `runtime.pipeline.start` turns
into the executor that runs it.

Every rank captures the same model on the same (micro-batch share) shapes, runs the same
passes and splits it into the same stages, so all ranks know every stage's program (and
hence which parameters several stages share) without exchanging graphs; before the first
step the ranks check that they agree (`runtime.distributed.check_agreement`).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.utils._pytree as pytree

from sppo_fx.capture import Captured, capture, flatten_call
from sppo_fx.errors import SppoError
from sppo_fx.util.log import get_logger, phase
from sppo_fx.options import CompileOptions
from sppo_fx.orchestrate.stage import chunk_plan, compile_chunk, needs_chunk_program
from sppo_fx.ops.seq_parallel import register_group
from sppo_fx.passes import batch_epilogue, transform_stages
from sppo_fx.passes.masks.values import check_seq_limit
from sppo_fx.passes.offload import RECOMPUTE_POLICIES
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.passes.sequence_parallel import shard_attention_heads
from sppo_fx.plan import Plan
from sppo_fx.runtime.distributed import check_agreement, fingerprint
from sppo_fx.runtime.mesh import ParallelMesh
from sppo_fx.runtime.pipeline import batch_size
from sppo_fx.runtime.product import RankProduct
from sppo_fx.schedule import build_schedule, with_offload
from sppo_fx.solver.partition import cost_model_from_graph
from sppo_fx.solver.pipeline_chunks import ComputeModel, choose_plan
from sppo_fx.solver.rank_budget import inflight_microbatches, offload_quota, solve_budget

log = get_logger(__name__)


@dataclasses.dataclass
class RankBuild:
    """What one rank built for a pipeline step (kept between steps)."""

    captured: Captured
    stages: list  # passes.stage_split.StageGraph per stage
    programs: list[ChunkedProgram]  # every stage's program
    product: RankProduct  # this rank's
    prediction: tuple | None = None  # (chosen PipelinePrediction, all considered) from the pipeline solver
    graph: object = None  # the analysed captured graph
    executor: object = None  # the runtime's PipelineExecutor running `product` (set by the caller)

    @property
    def plan(self) -> Plan:
        return self.product.plan

    @property
    def program(self) -> ChunkedProgram:
        """This rank's stage program (sequence-parallel: sharded)."""
        return self.product.program


def build_rank(model, fn, options: CompileOptions, microbatches: list[tuple], mesh: ParallelMesh,
               check_values: bool = True) -> RankBuild:
    """Capture, split, plan, schedule and compile this rank's stage; check that all ranks agree.

    Args:
        model / fn: as given to sppo_fx.compile.
        options: the CompileOptions; with neither chunks, chunk_lengths nor plan set, the
            pipeline solver chooses the chunk plan.
        microbatches: [(args, kwargs, target)] of this step (this rank's data-parallel share).
        mesh: this rank's place in the (pp, dp, sp) layout.
        check_values: compare every parameter's values across ranks (before the first step;
            later each rank has updated only its own stage's parameters).
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
    check_seq_limit(graph, seq_len)  # masks proven only up to a length (narrow dtypes)
    prediction = None
    if options.plan is not None:
        plan = options.plan  # a saved plan (`sppo-fx plan --json`), checked below
    elif options.chunks is None and options.chunk_lengths is None:
        best, considered = choose_plan(cost, ComputeModel(1.0), seq_len, num_stages, len(microbatches), options.schedule)
        plan, prediction = Plan(seq_len, best.chunk_lengths), (best, considered)
    else:
        plan = chunk_plan(options, seq_len, cost)
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
        # this rank's own plan: recompute policy and offload ratios for its stage's activations
        plan, quota = _solve_rank(options, program, cap, params, plan, mesh, len(microbatches), cost)
        schedule = with_offload(schedule, {(stage, m, i) for (m, i), q in quota.items() if q > 0})
    elif options.offload:
        # every chunk but the last of each micro-batch (the first to run backward) on every stage
        schedule = with_offload(schedule, {(s, m, i) for s in range(num_stages) for m in range(len(microbatches))
                                           for i in range(plan.num_chunks - 1)})
    recompute = options.recompute_for(plan)
    chunk_fn = None  # None: the chunk GraphModule runs op by op under eager autograd
    if needs_chunk_program(options, recompute, "keep"):  # lazy: Inductor compiles at the first chunk
        chunk_fn = compile_chunk(program, backend="inductor" if options.compile else "eager",
                                 offload=options.offload is not None, recompute=recompute)
    shapes = [[list(t.shape) for t in flatten_call(*mb)[0] if isinstance(t, torch.Tensor)] for mb in microbatches]
    named = list(cap.module.named_parameters(remove_duplicate=False))  # names as in cap.param_fqns
    graphs = [graph] + [g for prog in programs for g in (prog.prologue, prog.chunk, prog.epilogue) if g is not None]
    agreed = fingerprint(graphs, named, plan, schedule, shapes, shared=list(shared_ids), check_values=check_values)
    agreed["layout"] = str(layout)
    check_agreement(agreed, mesh.rank, layout.world, options.timeout_s)
    product = RankProduct(program, params, plan, chunk_fn, "keep", quota, options.tier_for(plan), schedule=schedule,
                          shared=shared)
    return RankBuild(cap, stages, programs, product, prediction, graph)


def _solve_rank(options: CompileOptions, program, cap, params, plan: Plan, mesh: ParallelMesh, microbatches: int,
                cost) -> tuple[Plan, dict]:
    """This rank's budget plan for its stage (the chunk lengths every rank shares stay) and
    its offload quota per (micro-batch, chunk)."""
    from sppo_fx.solver.memory_model import memory_models
    from sppo_fx.solver.profile_cache import device_profile
    world, rank = mesh.layout.pp, mesh.pp_rank
    policies = RECOMPUTE_POLICIES if options.recompute == "auto" else (options.recompute,)
    with phase(f"rank {rank}: memory model of its stage under recompute {'/'.join(policies)} (AOTAutograd "
               "partitions)", log):
        models = memory_models(program, cap.seq, params, policies)
    device = next((t.device.type for t in params), "cpu")
    inflight = inflight_microbatches(options.schedule, world, microbatches, plan.num_chunks, rank)
    rank_plan, memory = solve_budget(cost.scaled(1.0 / world), models, plan.seq_len, options.budget,
                                     profile=device_profile(device, dir=options.offload_dir), device=device,
                                     offload=options.offload, chunk_lengths=list(plan.chunk_lengths),
                                     inflight=inflight, rank=rank, schedule=options.schedule,
                                     compiled=options.compile, host_memory=options.host_memory)
    return rank_plan, offload_quota(rank_plan, memory, "keep", microbatches)


def bind_global_batch(model, fn, options, microbatch: tuple, program: ChunkedProgram, graph, dp: int) -> None:
    """data_parallel > 1: check the loss's use of the batch size (`passes.batch_epilogue`) on
    a second export of the call with the batch dim dynamic, and give `program` (the last
    stage's) the epilogue that reads the global batch where the loss reads it as a value.

    The export sees a stand-in batch (the share's rows repeated) of a size that is >= 2 (0
    and 1 would be specialised) and equals neither the sequence length nor another input's
    dim 0 (so the same inputs as `runtime.pipeline.data_shares` splits carry the batch
    symbol). Costs one more torch.export of the model (about as long as the first), only
    when dp > 1."""
    local = batch_size(microbatch)
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
