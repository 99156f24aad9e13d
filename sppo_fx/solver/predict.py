"""Predictions for any single-stage plan: the peak memory and step time of the plan that
ran, whether or not the budget solver chose it (a fixed chunk count, a manual `offload`
tier), from the same memory and time models the solver uses (`solver/memory_model.py`, `solver/budget.py`).

The benchmark engine shows them beside the measured figures for every library row, so a
user can see how far to trust the solver's models.
"""
from __future__ import annotations

from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.plan import Plan
from sppo_fx.solver.budget import step_terms, with_traced_allocations
from sppo_fx.solver.memory_model import MemoryModel, predict_peak, skeleton_passes_of, streamed_block_counts
from sppo_fx.solver.clock import Clock


def plan_ratios(plan: Plan, offload: str | None) -> list[float]:
    """The offloaded fraction of each chunk's saved activations: the solver's ratios, or
    with a manual tier every chunk but the last fully (what the runtime does), or none."""
    if plan.offload_ratios is not None:
        return list(plan.offload_ratios)
    n = plan.num_chunks
    return [1.0] * (n - 1) + [0.0] if offload else [0.0] * n


def predict_plan(cost: ChunkCostModel, memory: MemoryModel, plan: Plan, *, offload: str | None, skeleton: str,
                 profile, device: str, compiled: bool = True) -> tuple[int, float]:
    """(predicted peak extra bytes, predicted step seconds) of `plan` on one device.

    Args:
        cost: the model's chunk FLOPs model.
        memory: the MemoryModel of the recompute policy the plan runs.
        plan: the chunk plan (with or without solver ratios).
        offload: the tier saved activations go to (None: kept).
        skeleton: "keep" or "offload".
        profile: the DeviceProfile (FLOP rate, chunk efficiency, tier bandwidths).
        device: "cpu" or "cuda" (on a CPU the copies share the compute's cores).
        compiled: the chunk programs run compiled (the profile's `compiled_speedup` applies).
    """
    return predict_terms(cost, memory, plan, offload=offload, skeleton=skeleton, profile=profile, device=device,
                         compiled=compiled)[:2]


def predict_terms(cost: ChunkCostModel, memory: MemoryModel, plan: Plan, *, offload: str | None, skeleton: str,
                  profile, device: str, compiled: bool = True):
    """`predict_plan`'s (peak, seconds) and the step's `solver.clock.StepTerms`."""
    lengths, ratios = list(plan.chunk_lengths), plan_ratios(plan, offload)
    window = plan.copy_window_bytes
    peak = predict_peak(memory, lengths, ratios, skeleton, window)
    level2 = memory.streamed_level2 if skeleton == "offload" else memory.level2
    l2 = [level2(c, t) for c, t in zip(lengths, plan.starts)]
    reads = None
    if skeleton == "offload":
        l1 = [memory.level1(c, t) for c, t in zip(lengths, plan.starts)]
        reads = [sum(l1[:i]) for i in range(len(lengths))]
    bandwidth = {"disk": profile.disk_write_bytes_per_s, "host": profile.d2h_bytes_per_s}.get(offload, float("inf"))
    cache = (profile.disk_cached_write_bytes_per_s, profile.disk_cache_bytes) if offload == "disk" else None
    terms = step_terms(with_traced_allocations(cost, memory), lengths, ratios, l2, profile.flops_per_s,
                       profile.n_half, bandwidth, memory.recompute_fraction, reads,
                       copies_share_compute=device == "cpu", cache=cache,
                       clock=Clock.of(profile, compiled, tier=offload, recompute=memory.recompute),
                       tensors=memory.tensors,
                       skeleton_blocks=streamed_block_counts(memory, lengths) if skeleton == "offload" else None,
                       skeleton_passes=skeleton_passes_of(memory.recompute))
    return int(peak), float(terms.total), terms
