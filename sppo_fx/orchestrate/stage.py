"""One stage (`stages=1`): capture -> passes -> cost model -> solve -> codegen, giving the
`runtime.product.StageProduct` that `runtime.local.chunked_loss` runs.

`prepare` runs once per traced shape (capture, every graph pass, the cost model) and
keeps the result in an `Entry`; `plan_call` solves the chunk plan of one sequence length
(a budget's plan is kept per length); `stage_product` compiles the chunk program the plan
needs (the skeleton pass first when the plan streams the K/V skeleton; kept per policy)
and gives the product.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from sppo_fx.capture import Captured, capture
from sppo_fx.codegen import CompiledProgram, compile_chunk_program
from sppo_fx.errors import SppoError
from sppo_fx.util.log import get_logger, phase
from sppo_fx.options import CompileOptions
from sppo_fx.passes import transform
from sppo_fx.passes.masks.values import check_ones_inputs, check_seq_limit
from sppo_fx.passes.offload import RECOMPUTE_POLICIES
from sppo_fx.passes.skeleton import refuse_unstreamable, unstreamable_attention
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan, even_plan
from sppo_fx.runtime.product import StageProduct
from sppo_fx.solver.partition import ChunkCostModel, balanced_lengths, cost_model_from_graph
from sppo_fx.solver.rank_budget import offload_quota, solve_budget

DEFAULT_CHUNKS = 4
log = get_logger(__name__)


@dataclasses.dataclass
class Entry:
    """What one capture yields, kept across calls of the same shapes."""

    captured: Captured
    graph: fx.GraphModule  # the analysed captured graph
    program: ChunkedProgram
    cost: ChunkCostModel | None = None
    memory: dict = dataclasses.field(default_factory=dict)  # recompute policy -> solver.memory_model.MemoryModel
    budget_plans: dict = dataclasses.field(default_factory=dict)  # seq_len -> Plan
    programs: dict = dataclasses.field(default_factory=dict)  # (recompute, skeleton, >1 chunk) -> CompiledProgram
    verified: bool = False  # verify=True has compared this entry's program with the model

    def params(self) -> list[torch.Tensor]:
        """The tensors of the program's parameter placeholders (the model's, now)."""
        return [self.captured.param_value(name) for name in self.program.params]

    def device(self) -> str:
        return next((self.captured.param_value(n).device.type for n in self.program.params), "cpu")


def prepare(model, fn, options: CompileOptions, call: tuple, tensors: list[torch.Tensor]) -> Entry:
    """Capture the call `(args, kwargs, target)`, run every graph pass and build the cost model."""
    args, kwargs, target = call
    seq_dim = options.seq_dim
    if options.compile and options.budget is None and any(t.device.type == "cpu" for t in tensors):
        from sppo_fx.codegen.inductor import start_cpu_probe
        start_cpu_probe()  # overlaps capture (codegen/inductor.py); with a budget: `solve_stage_budget`
    try:
        with phase("capturing the model (torch.export)", log):
            cap = capture(model, fn, options.loss_fn, args, kwargs, target, seq_dim)
        with phase("graph passes (masks, sequence analysis, chunk program)", log):
            graph, program = transform(cap, log=options.log_passes, ones_inputs=options.ones_inputs)
    except SppoError as e:
        if seq_dim == 1:
            raise
        raise type(e)(f"{e} (the inputs are chunked along seq_dim={seq_dim}: is that their sequence "
                      "dim?)") from e
    with phase("cost model (FLOPs and saved bytes per chunk)", log):
        cost = cost_model_from_graph(graph, cap.seq)
    return Entry(cap, graph, program, cost)


def chunk_plan(options: CompileOptions, seq_len: int, cost: ChunkCostModel | None = None) -> Plan:
    """The chunk plan without a budget: the given plan, the given lengths, or `chunks`
    chunks (default 4, fewer for shorter sequences), FLOP-balanced with a cost model and
    partition="balanced"."""
    o = options
    if o.plan is not None:
        if o.plan.seq_len != seq_len:
            raise SppoError(f"the given plan covers {o.plan.seq_len} tokens but the sequence has {seq_len}; "
                            "make a plan for this sequence length (sppo-fx plan --seq-len ...)")
        return o.plan
    if o.chunk_lengths is not None:
        return Plan(seq_len, list(o.chunk_lengths))
    n = min(DEFAULT_CHUNKS, seq_len) if o.chunks is None else o.chunks
    plan = even_plan(seq_len, n)
    if cost is not None and o.partition == "balanced":
        plan = Plan(seq_len, balanced_lengths(seq_len, n, cost))
    return plan


def memory_models(entry: Entry, policies) -> list:
    """The entry's MemoryModels of `policies` (built once per policy: AOTAutograd traces)."""
    from sppo_fx.solver.memory_model import memory_models as build
    missing = [r for r in policies if r not in entry.memory]
    if missing:
        # its phases: "memory model: saved activations under recompute ... (AOTAutograd
        # partitions)" when traced, "memory model: read from cache" when stored
        # (passes/cost/saved_cache.py)
        for model in build(entry.program, entry.captured.seq, entry.params(), missing):
            entry.memory[model.recompute] = model
    return [entry.memory[r] for r in policies]


def device_profile(entry: Entry, options: CompileOptions, profile=None):
    """The DeviceProfile of the entry's device (`profile` when known already); where the
    plan may stream the K/V skeleton, its block read measured at the model's attention shape
    (`clock_calibration.with_model_reads`: a read's cost grows with heads and head dim); op by
    op with a tier, the machine's op cost through the memory passes
    (`profile_cache.with_pass_ops`; a profile handed in is used as it is)."""
    from sppo_fx.solver.clock_calibration import with_model_reads
    from sppo_fx.solver.profile_cache import device_profile as stored_or_calibrated, with_pass_ops
    if profile is None:
        profile = stored_or_calibrated(entry.device(), dir=options.offload_dir)
        if options.offload and not options.compile:
            profile = with_pass_ops(profile, entry.device(), options.offload_dir)
    if options.offload and options.skeleton in ("auto", "offload") and entry.cost is not None \
            and unstreamable_attention(entry.program.chunk) is None:
        profile = with_model_reads(profile, entry.cost)
    return profile


def plan_call(entry: Entry, options: CompileOptions, seq_len: int, tensors: list[torch.Tensor],
              profile=None) -> tuple[Plan, object]:
    """The plan of one call of `seq_len` tokens (`tensors`: its flat input tensors, checked
    first): solved under the budget (kept per length), else `chunk_plan`. Returns (plan, the
    DeviceProfile the solver used, or `profile`)."""
    check_seq_limit(entry.graph, seq_len)  # masks proven only up to a length (positions in a narrow dtype)
    check_ones_inputs(entry.graph, tensors)  # inputs the program assumes all ones (passes/ones_inputs.py)
    if options.skeleton == "offload":  # before the memory model's traces and a calibration
        refuse_unstreamable(entry.program.chunk)
    if options.budget is None:
        return chunk_plan(options, seq_len, entry.cost), profile
    cached = entry.budget_plans.get(seq_len)
    if cached is not None:
        return cached, profile
    o = options
    models = memory_models(entry, RECOMPUTE_POLICIES if o.recompute == "auto" else (o.recompute,))
    profile = device_profile(entry, o, profile)
    device = entry.device()
    if o.compile and device == "cpu":
        # after the memory model, whose two traces take both cores (passes/cost/saved_cache.py),
        # and after a calibration, whose matmuls it would slow: the probe's compiles overlap
        # the solver and chunk 0's trace (codegen/inductor.py)
        from sppo_fx.codegen.inductor import start_cpu_probe
        start_cpu_probe()
    # the skeleton can only leave the device for a tier, and only where its attention streams
    skeletons = (o.skeleton,)
    if o.skeleton == "auto" and o.offload:
        skeletons = ("keep", "offload") if unstreamable_attention(entry.program.chunk) is None else ("keep",)
    with phase(f"solving the budget for {seq_len} tokens", log):
        plan, _memory = solve_budget(entry.cost, models, seq_len, o.budget, profile=profile, device=device,
                                     offload=o.offload, skeletons=skeletons, compiled=o.compile,
                                     host_memory=o.host_memory)
    entry.budget_plans[seq_len] = plan
    return plan, profile


def needs_chunk_program(options: CompileOptions, recompute: str, skeleton: str) -> bool:
    """Whether the chunk program goes through codegen (Inductor, or the memory passes run
    eagerly) rather than running op by op as a GraphModule."""
    return options.compile or options.offload is not None or recompute != "none" or skeleton != "keep"


def compile_chunk(program: ChunkedProgram, *, backend: str = "eager", offload: bool = True, recompute: str = "none",
                  skeleton: str = "keep", eager_empty_prefix: bool = True) -> CompiledProgram:
    """Codegen of the chunk program: with skeleton="offload" first the skeleton pass
    (`passes.skeleton.stream_kv_skeleton`: the K/V prefix streamed from the skeleton), then
    the memory passes (offload nodes with `offload`, `recompute` regions, in-graph gradient
    accumulation) and Inductor (backend="inductor") or AOTAutograd's graphs run eagerly.
    Lazy: Inductor compiles at the program's first call."""
    gm = program.chunk
    if skeleton == "offload":
        from sppo_fx.passes.skeleton import stream_kv_skeleton
        gm = stream_kv_skeleton(program.chunk, len(program.attention))
    return compile_chunk_program(gm, backend=backend, offload=offload, recompute=recompute,
                                 eager_empty_prefix=eager_empty_prefix)


def stage_program(entry: Entry, options: CompileOptions, recompute: str, skeleton: str = "keep",
                  chunks: int = 2) -> CompiledProgram:
    """The entry's compiled chunk program for (recompute, skeleton), compiled once, when a
    plan first uses it. With more than one chunk, chunk 0 (`chunk_start` 0) runs the
    program's AOTAutograd graphs instead of a second Inductor compile (codegen/inductor.py,
    `eager_empty_prefix`)."""
    key = (recompute, skeleton, chunks > 1)
    prog = entry.programs.get(key)
    if prog is None:
        prog = compile_chunk(entry.program, backend="inductor" if options.compile else "eager",
                             offload=options.offload is not None, recompute=recompute, skeleton=skeleton,
                             eager_empty_prefix=chunks > 1)
        entry.programs[key] = prog
    return prog


def stage_product(entry: Entry, options: CompileOptions, plan: Plan) -> StageProduct:
    """What `runtime.local.chunked_loss` runs for `plan`."""
    skeleton, recompute = options.skeleton_for(plan), options.recompute_for(plan)
    quota = None
    if plan.offload_ratios is not None:  # a budget's plan, or a saved plan (`plan=`) with ratios
        (memory,) = memory_models(entry, (recompute,))
        quota = offload_quota(plan, memory, skeleton)
    chunk_fn = None  # None: the chunk GraphModule runs op by op under eager autograd
    if needs_chunk_program(options, recompute, skeleton):
        chunk_fn = stage_program(entry, options, recompute, skeleton, plan.num_chunks)
    return StageProduct(entry.program, entry.params(), plan, chunk_fn, skeleton, quota, options.tier_for(plan))
