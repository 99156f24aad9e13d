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

The offload tier (`offload="auto"`, the default under a budget): the solve runs once per
candidate tier, each on that tier's bandwidth, page cache and clock, and the fastest
predicted plan that fits wins; the Plan records it (`Plan.tier`, `Plan.tier_steps`). A
tier is a candidate only where it frees device memory (`frees_device_memory`: the disk
always; host memory only where the device is not host memory, i.e. not on a CPU) and, for
the host tier, only while the plan's pinned host bytes (`host_bytes`) fit the host memory
it may use (`host_memory`, default `host_memory_available()`). A pipeline rank chooses its
own tier like its own ratios: its store is its own process's, nothing crosses ranks.
"""
from __future__ import annotations

import os

from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.util.log import get_logger
from sppo_fx.util.units import mib_below_and_above
from sppo_fx.plan import Plan

log = get_logger(__name__)


def inflight_microbatches(schedule: str, stages: int, microbatches: int, chunks: int, stage: int) -> int:
    """How many micro-batches' activations a stage can hold at once under the schedule."""
    if schedule == "gpipe":
        return microbatches
    warmup = min(chunks - 1 + stages - 1 - stage, microbatches * chunks)  # 1F1B warm-up chunks
    return min(microbatches, -(-(warmup + 1) // chunks))


#: the tiers `offload="auto"` compares ("device" never frees device memory)
AUTO_TIERS = ("host", "disk")
#: the share of the host's available memory the host tier may pin by default: pinned pages
#: cannot be swapped out, and the process, the page cache and other processes need the rest
HOST_MEMORY_SHARE = 0.5


def frees_device_memory(tier: str, device: str) -> bool:
    """Whether offloading to `tier` frees memory of a `device` ("cpu", "cuda", ...): the
    disk always; host memory only where the device is not host memory itself (on a CPU
    the host tier keeps the tensor where it is, `runtime/store/host.py`); the device tier
    never."""
    return tier == "disk" or (tier == "host" and device != "cpu")


def host_memory_available() -> int:
    """Bytes of host memory the host tier may pin by default: `HOST_MEMORY_SHARE` of what
    the OS reports available (MemAvailable, within the cgroup's limit), shared by the
    processes torchrun starts on this host (LOCAL_WORLD_SIZE). 0 where it cannot be read
    (then the host tier is no candidate unless `host_memory` is given)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        return 0
    try:  # cgroup v2: what the limit leaves
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit.isdigit():
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(avail * HOST_MEMORY_SHARE) // max(int(local) if local.isdigit() else 1, 1)


def candidate_tiers(offload: str | None, device: str, budget: int) -> list[str]:
    """The tiers a budget solve compares: with "auto" those of `AUTO_TIERS` that free
    memory of `device`; else the given tier, refused (SppoError) where it frees none."""
    if offload == "auto":
        return [t for t in AUTO_TIERS if frees_device_memory(t, device)]
    if offload is not None and not frees_device_memory(offload, device):
        why = ("the device is host memory" if offload == "host" else "it keeps every tensor on the device")
        raise SppoError(f"offload={offload!r} frees no memory of a {device} device ({why}), so it cannot help meet "
                        f"budget={budget / 2**20:.1f} MiB: give offload='auto' (the default with a budget) or "
                        "'disk'")
    return [offload]


def host_bytes(plan: Plan, memory, inflight: int = 1) -> int:
    """Host bytes a plan's offloads hold at most: every chunk's offloaded share (held until
    its backward reads it back) and a streamed K/V skeleton (held for the step), for each
    micro-batch in flight (`memory`: the MemoryModel of the plan's recompute policy)."""
    streamed = plan.skeleton == "offload"
    held = sum(offload_quota(plan, memory, plan.skeleton or "keep").values())
    if streamed:
        held += sum(memory.level1(c, s) for c, s in zip(plan.chunk_lengths, plan.starts))
    return int(held * inflight)


def solve_budget(cost, models: list, seq_len: int, budget: int, *, profile, device: str, offload: str | None,
                 skeletons=("keep",), chunk_lengths: list[int] | None = None, inflight: int = 1,
                 rank: int | None = None, schedule: str | None = None, compiled: bool = True,
                 host_memory: int | None = None):
    """Choose the chunks (unless given), recompute policy, skeleton place and offload ratios
    of one stage program under `budget`.

    Args:
        cost: the stage's ChunkCostModel (a pipeline rank's: the model's scaled to its stage).
        models: the stage program's MemoryModels, one per recompute policy to consider.
        seq_len / budget: tokens of one sequence; device bytes a step may add.
        profile: the DeviceProfile (compute rate, copy bandwidths, page cache).
        device: the device type the program runs on ("cpu" shares cores with the copies).
        offload: the tier ("disk", "host"; None: no tier, nothing costs a copy), or "auto":
            the fastest of `candidate_tiers`.
        skeletons: the K/V skeleton places to consider.
        chunk_lengths: fixed chunk lengths (a pipeline's, shared by every rank); None: the
            solver chooses them.
        inflight: micro-batches whose activations the stage holds at once (see above).
        rank / schedule: a pipeline rank's index and schedule, named by its messages.
        compiled: the chunk programs run compiled (the clock's `compiled_speedup` applies).
        host_memory: host bytes the host tier may pin (None: `host_memory_available()`;
            0 there: unknown, then "auto" leaves the host tier out and a given "host" is
            not limited).

    Returns:
        (the Plan, the MemoryModel of its recompute policy). Raises InfeasibleBudget naming
        the minimum when nothing fits, SppoError when the given tier frees no device memory
        or its plan needs more host memory than `host_memory`.
    """
    tiers = candidate_tiers(offload, device, budget)
    if "host" in tiers and host_memory is None:
        host_memory = host_memory_available()
    # unknown (0): "auto" does not risk pinning what may not be there; a given "host" is the user's call
    limit = host_memory if offload == "auto" or host_memory else None
    found, refused, infeasible = {}, {}, None
    for tier in tiers:
        try:
            plan, memory = _solve_tier(cost, models, seq_len, budget, profile=profile, device=device, tier=tier,
                                       skeletons=skeletons, chunk_lengths=chunk_lengths, inflight=inflight,
                                       rank=rank, schedule=schedule, compiled=compiled)
        except InfeasibleBudget as e:  # the same floor on every tier: the memory model's
            infeasible = infeasible or e
            continue
        if tier == "host" and limit is not None and (pinned := host_bytes(plan, memory, inflight)) > limit:
            refused[tier] = pinned
            continue
        found[tier] = plan, memory
    if not found:
        if infeasible is not None:
            raise infeasible
        raise SppoError(f"the plan for budget={budget / 2**20:.1f} MiB pins {refused['host'] / 2**30:.2f} GiB of host "
                        f"memory, more than the host tier may use ({host_memory / 2**30:.2f} GiB): give "
                        "offload='auto' or 'disk', a larger host_memory=, or a larger budget")
    tier = min(found, key=lambda t: found[t][0].step_seconds)  # ties: AUTO_TIERS' order
    plan, memory = found[tier]
    if offload == "auto":
        plan.tier_steps = {t: found[t][0].step_seconds if t in found else None for t in tiers}
        log.info("%soffload='auto' chose the %s tier (predicted step: %s%s)", "" if rank is None else f"rank {rank}: ",
                 tier,
                 ", ".join(f"{t} {p.step_seconds:.3g} s" for t, (p, _m) in found.items()),
                 "".join(f"; host refused: pins {b / 2**30:.2f} GiB of {host_memory / 2**30:.2f} GiB"
                         for b in refused.values()))
    return plan, memory


def _solve_tier(cost, models: list, seq_len: int, budget: int, *, profile, device: str, tier: str, skeletons,
                chunk_lengths, inflight: int, rank, schedule, compiled: bool):
    """`solve_budget` on one tier: its bandwidth, page cache (disk) and clock."""
    offload = tier  # None: no tier (infinite bandwidth, nothing costs a copy)
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
        asked, needed = mib_below_and_above(budget, minimum)
        raise InfeasibleBudget(
            f"budget {asked} MiB is below the minimum pipeline rank {rank} needs for its "
            f"stage: {needed} MiB ({inflight} micro-batches of {seq_len} tokens in flight "
            f"under schedule {schedule!r}, chunks {chunk_lengths}, every chunk but the last "
            f"offloaded; recompute policies tried: {', '.join(m.recompute for m in models)}). Raise the budget "
            f"to at least {needed} MiB, use more stages, or shorten the sequence",
            minimum) from e
    if inflight != 1:
        chosen.peak_bytes = fixed + inflight * (chosen.peak_bytes - fixed)
    plan = budget_plan(seq_len, chosen, budget, offload)
    if rank is None:
        log.info("plan: %d chunks, %s tier, recompute %s, K/V skeleton %s, predicted peak %.1f MiB of %.1f MiB, "
                 "predicted step %.3g s", len(plan.chunk_lengths), tier, plan.recompute, plan.skeleton,
                 plan.peak_bytes / 2**20, plan.budget_bytes / 2**20, plan.step_seconds)
    else:
        log.info("rank %d plan: %s tier, recompute %s, offload ratios %s, predicted peak %.1f MiB of %.1f MiB (%d "
                 "micro-batches in flight)", rank, tier, plan.recompute, [round(a, 3) for a in plan.offload_ratios],
                 plan.peak_bytes / 2**20, budget / 2**20, inflight)
    return plan, next(m for m in models if m.recompute == chosen.recompute)


def offload_quota(plan: Plan, memory, skeleton: str = "keep", microbatches: int = 1) -> dict:
    """{(micro-batch, chunk): bytes} each chunk offloads under a budget plan: its ratio of
    the chunk's saved activations (`memory`: the MemoryModel of the plan's recompute policy;
    with the skeleton streamed, the chunk saves what the streamed program saves)."""
    level2 = memory.streamed_level2 if skeleton == "offload" else memory.level2
    return {(m, i): a * level2(c, s) for m in range(microbatches)
            for i, (a, c, s) in enumerate(zip(plan.offload_ratios, plan.chunk_lengths, plan.starts))}
