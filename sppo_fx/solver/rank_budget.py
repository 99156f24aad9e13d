"""One pipeline rank's budget plan: the single-stage budget solver (`solver/budget.py`)
applied to this rank's stage program.

The chunk lengths are shared by every rank (they fix the communication); each rank
chooses its own recompute policy and offload ratios from its stage's memory models and
its device profile, exactly as `SppoCompiled._budget_plan` (sppo_fx/api.py) does for one
stage: every recompute policy when `recompute="auto"`, the CPU copy model (copies share
the compute's cores) and the OS page cache in front of the disk tier.

A stage holds the activations of several micro-batches at once (those the schedule has
in flight on it); its parameter gradients exist once. So the solver plans one
micro-batch's sequence against

    share = fixed + (budget - fixed) / inflight        (fixed: the stage's parameter gradients)

and the rank's predicted peak is fixed + inflight * (sequence peak - fixed), an upper
bound as long as no more than `inflight` micro-batches hold activations at once.
"""
from __future__ import annotations

from sppo_fx.errors import InfeasibleBudget
from sppo_fx.log import get_logger, phase
from sppo_fx.passes.offload import RECOMPUTE_POLICIES
from sppo_fx.plan import Plan

log = get_logger(__name__)


def inflight_microbatches(schedule: str, stages: int, microbatches: int, chunks: int, stage: int) -> int:
    """How many micro-batches' activations a stage can hold at once under the schedule."""
    if schedule == "gpipe":
        return microbatches
    warmup = min(chunks - 1 + stages - 1 - stage, microbatches * chunks)  # 1F1B warm-up chunks
    return min(microbatches, -(-(warmup + 1) // chunks))


def chunk_recompute(options, plan: Plan) -> str:
    """The recompute policy this rank's chunk program runs: the budget plan's choice, else
    the option ("auto" without a budget means "none")."""
    if plan.recompute:
        return plan.recompute
    return "none" if options.recompute == "auto" else options.recompute


def rank_budget_plan(options, program, cap, params, plan: Plan, world: int, rank: int, microbatches: int, cost,
                     profile=None):
    """Solve this rank's recompute policy and offload ratios for its stage under `options.budget`.

    Args:
        options: the CompileOptions (budget, recompute, offload, offload_dir, schedule).
        program / cap / params: this rank's stage program, the captured model, and the
            tensors of the program's parameter placeholders.
        plan: the chunk plan every rank shares.
        world / rank / microbatches: the pipeline's shape.
        cost: the whole model's chunk cost model (this stage does 1/world of it).
        profile: the DeviceProfile (default: this machine's, stored or calibrated once,
            `solver.profile_cache.device_profile`).

    Returns:
        (this rank's Plan, {(micro-batch, chunk): offload byte quota}). Raises
        InfeasibleBudget naming this rank's minimum when nothing fits.
    """
    from sppo_fx.solver.budget import budget_plan, memory_models, solve
    from sppo_fx.solver.profile_cache import device_profile
    policies = RECOMPUTE_POLICIES if options.recompute == "auto" else (options.recompute,)
    with phase(f"rank {rank}: memory model of its stage under recompute {'/'.join(policies)} (AOTAutograd "
               "partitions)", log):
        models = memory_models(program, cap.seq, params, policies)
    device = next((t.device.type for t in params), "cpu")
    profile = profile or device_profile(device, dir=options.offload_dir)
    bandwidth = {"disk": profile.disk_write_bytes_per_s, "host": profile.d2h_bytes_per_s}.get(options.offload,
                                                                                           float("inf"))
    inflight = inflight_microbatches(options.schedule, world, microbatches, plan.num_chunks, rank)
    fixed = models[0].fixed_bytes  # parameter gradients: the same under every policy
    share = fixed + (options.budget - fixed) // inflight
    try:
        chosen = solve(cost.scaled(1.0 / world), models, plan.seq_len, share,
                       rate=profile.flops_per_s, bandwidth=bandwidth, c_half=profile.n_half,
                       chunk_counts=[plan.num_chunks], lengths_for=lambda n: list(plan.chunk_lengths),
                       copies_share_compute=device == "cpu",
                       cache=(profile.disk_cached_write_bytes_per_s, profile.disk_cache_bytes)
                       if options.offload == "disk" else None)
    except InfeasibleBudget as e:
        minimum = fixed + inflight * (e.minimum_bytes - fixed)
        raise InfeasibleBudget(
            f"budget {options.budget / 2**20:.1f} MiB is below the minimum pipeline rank {rank} needs for its "
            f"stage: {minimum / 2**20:.1f} MiB ({inflight} micro-batches of {plan.seq_len} tokens in flight "
            f"under schedule {options.schedule!r}, chunks {plan.chunk_lengths}, every chunk but the last "
            f"offloaded; recompute policies tried: {', '.join(policies)}). Raise the budget to at least "
            f"{minimum / 2**20:.1f} MiB, use more stages, or shorten the sequence",
            minimum) from e
    chosen.peak_bytes = fixed + inflight * (chosen.peak_bytes - fixed)
    rank_plan = budget_plan(plan.seq_len, chosen, options.budget, options.offload)
    log.info("rank %d plan: recompute %s, offload ratios %s, predicted peak %.1f MiB of %.1f MiB (%d micro-batches "
             "in flight)", rank, rank_plan.recompute, [round(a, 3) for a in rank_plan.offload_ratios],
             rank_plan.peak_bytes / 2**20, options.budget / 2**20, inflight)
    mem = next(m for m in models if m.recompute == chosen.recompute)
    quota = {(m, i): a * mem.level2(c, s) for m in range(microbatches)
             for i, (a, c, s) in enumerate(zip(rank_plan.offload_ratios, plan.chunk_lengths, plan.starts))}
    return rank_plan, quota
