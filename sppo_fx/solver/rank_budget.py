"""The one budget solve of a stage program: one stage (`stages=1`) and every pipeline
rank call `solve_budget` with explicit arguments (sppo_fx/orchestrate/).

One stage: the solver (`solver/budget.py`) chooses the chunk lengths, the recompute policy
(every policy when `recompute="auto"`), the K/V skeleton's place and the offload ratios,
with the CPU copy model (copies share the compute's cores) and the OS page cache in front
of the disk tier.

A pipeline rank: the chunk lengths are shared by every rank (they fix the communication);
each rank chooses its own recompute policy and offload ratios for its stage. A stage
holds the activations of several micro-batches at once (those the schedule has in flight
on it); its parameter gradients exist once. So the solver plans one micro-batch's
sequence against

    share = fixed + (budget - fixed) / inflight        (fixed: the stage's parameter gradients)

and the rank's predicted peak is fixed + inflight * (sequence peak - fixed), an upper
bound as long as no more than `inflight` micro-batches hold activations at once (with
one micro-batch in flight both are the single-stage budget and peak).
"""
from __future__ import annotations

from sppo_fx.errors import InfeasibleBudget
from sppo_fx.util.log import get_logger
from sppo_fx.plan import Plan

log = get_logger(__name__)


def inflight_microbatches(schedule: str, stages: int, microbatches: int, chunks: int, stage: int) -> int:
    """How many micro-batches' activations a stage can hold at once under the schedule."""
    if schedule == "gpipe":
        return microbatches
    warmup = min(chunks - 1 + stages - 1 - stage, microbatches * chunks)  # 1F1B warm-up chunks
    return min(microbatches, -(-(warmup + 1) // chunks))


def solve_budget(cost, models: list, seq_len: int, budget: int, *, profile, device: str, offload: str | None,
                 skeletons=("keep",), chunk_lengths: list[int] | None = None, inflight: int = 1,
                 rank: int | None = None, schedule: str | None = None, compiled: bool = True):
    """Choose the chunks (unless given), recompute policy, skeleton place and offload ratios
    of one stage program under `budget`.

    Args:
        cost: the stage's ChunkCostModel (a pipeline rank's: the model's scaled to its stage).
        models: the stage program's MemoryModels, one per recompute policy to consider.
        seq_len / budget: tokens of one sequence; device bytes a step may add.
        profile: the DeviceProfile (compute rate, copy bandwidths, page cache).
        device: the device type the program runs on ("cpu" shares cores with the copies).
        offload: the tier ("disk", "host", "device").
        skeletons: the K/V skeleton places to consider.
        chunk_lengths: fixed chunk lengths (a pipeline's, shared by every rank); None: the
            solver chooses them.
        inflight: micro-batches whose activations the stage holds at once (see above).
        rank / schedule: a pipeline rank's index and schedule, named by its messages.
        compiled: the chunk programs run compiled (the clock's `compiled_speedup` applies).

    Returns:
        (the Plan, the MemoryModel of its recompute policy). Raises InfeasibleBudget naming
        the minimum when nothing fits.
    """
    from sppo_fx.solver.budget import budget_plan, solve
    from sppo_fx.solver.clock import Clock
    bandwidth = {"disk": profile.disk_write_bytes_per_s, "host": profile.d2h_bytes_per_s}.get(offload, float("inf"))
    fixed = models[0].fixed_bytes  # parameter gradients: the same under every policy
    share = fixed + (budget - fixed) // inflight
    fixed_chunks = {} if chunk_lengths is None else dict(chunk_counts=[len(chunk_lengths)],
                                                         lengths_for=lambda n: list(chunk_lengths))
    try:
        chosen = solve(cost, models, seq_len, share, rate=profile.flops_per_s, bandwidth=bandwidth,
                       c_half=profile.n_half, skeletons=skeletons, copies_share_compute=device == "cpu",
                       cache=(profile.disk_cached_write_bytes_per_s, profile.disk_cache_bytes)
                       if offload == "disk" else None, clock=Clock.of(profile, compiled, offload), **fixed_chunks)
    except InfeasibleBudget as e:
        if rank is None:
            raise
        minimum = fixed + inflight * (e.minimum_bytes - fixed)
        raise InfeasibleBudget(
            f"budget {budget / 2**20:.1f} MiB is below the minimum pipeline rank {rank} needs for its "
            f"stage: {minimum / 2**20:.1f} MiB ({inflight} micro-batches of {seq_len} tokens in flight "
            f"under schedule {schedule!r}, chunks {chunk_lengths}, every chunk but the last "
            f"offloaded; recompute policies tried: {', '.join(m.recompute for m in models)}). Raise the budget "
            f"to at least {minimum / 2**20:.1f} MiB, use more stages, or shorten the sequence",
            minimum) from e
    if inflight != 1:
        chosen.peak_bytes = fixed + inflight * (chosen.peak_bytes - fixed)
    plan = budget_plan(seq_len, chosen, budget, offload)
    if rank is None:
        log.info("plan: %d chunks, recompute %s, K/V skeleton %s, predicted peak %.1f MiB of %.1f MiB, "
                 "predicted step %.3g s", len(plan.chunk_lengths), plan.recompute, plan.skeleton,
                 plan.peak_bytes / 2**20, plan.budget_bytes / 2**20, plan.step_seconds)
    else:
        log.info("rank %d plan: recompute %s, offload ratios %s, predicted peak %.1f MiB of %.1f MiB (%d "
                 "micro-batches in flight)", rank, plan.recompute, [round(a, 3) for a in plan.offload_ratios],
                 plan.peak_bytes / 2**20, budget / 2**20, inflight)
    return plan, next(m for m in models if m.recompute == chosen.recompute)


def offload_quota(plan: Plan, memory, skeleton: str = "keep", microbatches: int = 1) -> dict:
    """{(micro-batch, chunk): bytes} each chunk offloads under a budget plan: its ratio of
    the chunk's saved activations (`memory`: the MemoryModel of the plan's recompute policy;
    with the skeleton streamed, the chunk saves what the streamed program saves)."""
    level2 = memory.streamed_level2 if skeleton == "offload" else memory.level2
    return {(m, i): a * level2(c, s) for m in range(microbatches)
            for i, (a, c, s) in enumerate(zip(plan.offload_ratios, plan.chunk_lengths, plan.starts))}
