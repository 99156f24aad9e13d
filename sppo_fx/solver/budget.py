"""The budget solver: chunk count, chunk lengths and per-chunk offload ratios for a memory
budget (docs/architecture.md, section 2 "S4 Budget"; the paper's sequence-aware offloading).

The plans it searches are priced by `solver.memory_model` (peak bytes: the levels L1/L2,
the offload ratios a_i, recompute policies, the kept or streamed K/V skeleton and the
copy window) and `solver.clock` (step time).

Sequence-aware offload: chunk i's offload is sized to hide behind chunk i+1's forward at
the tier's write bandwidth, a_i = min(1, bw · t_fwd(i+1) / L2_i). On a CPU-only machine
the copies run on the cores the compute uses, so the time model charges every copied byte
(`copies_share_compute`) instead of hiding it — at the page cache's rate up to the bytes
the OS caches before writing back, at the disk's beyond — and offloads only what memory
requires.
When the peak still
exceeds the budget, the earliest chunks (which wait longest for their backward) go to
a_i = 1 first; then more chunks are tried. Offload beyond what hides costs
(bytes − hidden) / bw of stall. The solver returns the feasible plan with the least
predicted step time, or raises InfeasibleBudget with the smallest feasible budget.
"""
from __future__ import annotations

import dataclasses

from sppo_fx.errors import InfeasibleBudget
from sppo_fx.plan import Plan
from sppo_fx.solver.clock import (ELEMENTWISE_BACKWARD, Clock, StepTerms, attention_seconds, overhead_seconds,
                                  recompute_allocations)
from sppo_fx.solver.memory_model import (MemoryModel, chunk_starts, copy_window, predict_peak,
                                         skeleton_passes_of, streamed_block_counts, streamed_skeleton)
from sppo_fx.solver.partition import ChunkCostModel, balanced_lengths
from sppo_fx.util.units import mib_below_and_above, parse_bytes


def parse_budget(budget) -> int:
    """Bytes from an int or a string such as "12GiB", "500MiB", "1.5GB" (`units.parse_bytes`).

    Raises SppoError naming the accepted forms for anything else.
    """
    return parse_bytes(budget, "budget")


@dataclasses.dataclass
class BudgetPlan:
    """What the budget solver chose (also stored in the Plan)."""

    lengths: list[int]
    ratios: list[float]
    peak_bytes: int
    step_seconds: float
    recompute: str = "none"
    skeleton: str = "keep"
    copy_window_bytes: int | None = None
    terms: StepTerms | None = None


def _shared_copy_seconds(nbytes: float, bw: float, cache) -> float:
    """Seconds of processor time one pass over `nbytes` of copies takes where copies share
    the compute's cores: what the OS page cache absorbs at its rate, the rest at the
    disk's. `cache` is (cached bytes/s, cache bytes) or None."""
    if not cache or not cache[0]:
        return nbytes / bw
    cached = min(nbytes, cache[1]) if cache[1] else nbytes
    return cached / cache[0] + (nbytes - cached) / bw


def _reread_seconds(nbytes: float, file_bytes: float, written: float, bw: float, cache) -> float:
    """Seconds of a streamed skeleton's re-reads (`nbytes` over a step) where copies share
    the compute's cores: every pass reads the same file of `file_bytes`, which stays in the
    OS page cache when it fits beside the activations written (up to the cache's bytes); its
    re-reads then go at the cache's rate however many bytes they add up to, else at the
    disk's. `cache` is (cached bytes/s, cache bytes) or None."""
    if not nbytes:
        return 0.0
    if not cache or not cache[0]:
        return nbytes / bw
    room = cache[1] - min(written, cache[1]) if cache[1] else float("inf")
    return nbytes / (cache[0] if file_bytes <= room else bw)


def with_traced_allocations(cost: ChunkCostModel, model) -> ChunkCostModel:
    """`cost` with the allocations of the policy's traced forward and backward graphs
    (`MemoryModel.allocations`) where the memory model has them: AOTAutograd's backward
    allocates the intermediates of every op's derivative and the sums of gradients that
    the captured graph's one-gradient-per-input list leaves out (bench Llama, T = 1024,
    4 chunks op by op: 4.1 GiB of fresh non-matmul tensors a step under the profiler,
    against 2.3 GiB in that list)."""
    allocations = getattr(model, "allocations", ())
    if not allocations:
        return cost
    return dataclasses.replace(cost, allocations=allocations, recompute_allocates=False)


def step_terms(cost: ChunkCostModel, lengths, ratios, l2, rate, c_half, bw, recompute_fraction=0.0,
               skeleton_reads=None, copies_share_compute: bool = False, cache=None, clock=None,
               tensors: int = 0, skeleton_blocks=None, skeleton_passes: int = 2) -> StepTerms:
    """The step's predicted seconds by term (`solver.clock`): compute, attention (by the
    calibrated pair cost where `clock` has one, else inside compute's FLOPs), element-wise
    (bytes per token at the clock's element-wise bandwidth), exposed copy,
    overheads (`clock`'s per-op and per-file costs; `tensors`: saved tensors a chunk
    offloads, one file each; `skeleton_blocks`: blocks each chunk streams per site and pass,
    times sites, two files each). `skeleton_passes`: how often a streamed skeleton is read
    per step (`memory_model.skeleton_passes_of`: 3 where the recompute calls attention again)."""
    clock = clock or Clock()
    starts = chunk_starts(lengths)
    scale = 1 + cost.backward_factor + recompute_fraction
    terms = StepTerms()
    fwd = []
    weights, weights_fwd = clock.weight_seconds(cost, recompute_fraction), clock.weight_seconds(cost) / 2
    grad_sums = clock.weight_grad_seconds(cost)  # every chunk but the backward's first
    for i, (c, t) in enumerate(zip(lengths, starts)):
        attn = attention_seconds(cost, c, t, clock)
        flops = cost.forward_flops(c, t) if attn is None else cost.per_token * c
        f = flops / (rate * c / (c + c_half)) / max(clock.compiled_speedup, 1e-9)
        terms.compute += f * scale + weights
        if i != len(lengths) - 1:  # the last chunk's backward runs first and makes the sums
            terms.compute += grad_sums
        f += weights_fwd  # the forward's read of the weights
        if attn is not None:
            terms.attention += attn * (1 + recompute_fraction / (1 + cost.backward_factor))
            f += attn / (1 + cost.backward_factor)  # the forward's share (backward: about twice)
        terms.elementwise += clock.elementwise_seconds(cost, c, recompute_fraction)
        f += clock.elementwise_seconds(cost, c) / (1 + ELEMENTWISE_BACKWARD)  # the forward's share
        # the last chunk's backward runs first: it makes the weight gradients (compiled,
        # the others add into them)
        alloc_fwd, alloc_bwd = clock.allocation_parts(cost, c, weight_grads=i == len(lengths) - 1)
        terms.allocation += alloc_fwd * (1 + recompute_allocations(cost, recompute_fraction)) + alloc_bwd
        f += alloc_fwd
        fwd.append(f)
    files = sum(2 * tensors for a in ratios if a > 0)  # written, then read back
    reads_n = skeleton_passes * sum(skeleton_blocks or ())  # forward, backward (and a recompute)
    # a streamed skeleton on disk: one file per step, one in-order read per stream (chunk,
    # site, pass), `runtime.skeleton_log`; its blocks' attention calls stay per block
    streams = skeleton_passes * sum(1 for b in (skeleton_blocks or ()) if b)
    terms.overhead = overhead_seconds(cost, len(lengths), files + streams + (1 if reads_n else 0), reads_n, clock,
                                      recompute_fraction)
    if copies_share_compute:  # a CPU: every copy runs on the cores the compute uses
        written = sum(a * x for a, x in zip(ratios, l2))
        streamed = skeleton_passes * sum(skeleton_reads or ())  # a streamed prefix: read every pass
        terms.exposed_copy = (2 * _shared_copy_seconds(written, bw, cache)  # written, then read back
                              + _reread_seconds(streamed, max(skeleton_reads or (0,)), written, bw, cache))
        return terms
    stall = 0.0
    for i, a in enumerate(ratios):
        if a <= 0:
            continue
        copy = a * l2[i] / bw
        hide_fwd = fwd[i + 1] if i + 1 < len(fwd) else 0.0
        hide_bwd = fwd[i + 1] * cost.backward_factor if i + 1 < len(fwd) else 0.0
        stall += max(copy - hide_fwd, 0.0) + max(copy - hide_bwd, 0.0)  # write, then read back
    for i, read in enumerate(skeleton_reads or ()):
        # an offloaded skeleton: chunk i reads its whole prefix back in forward and in backward
        stall += max(read / bw - fwd[i], 0.0) + max(read / bw - fwd[i] * cost.backward_factor, 0.0)
        if skeleton_passes > 2:  # the recomputed forward reads it again, hidden by that forward
            stall += max(read / bw - fwd[i], 0.0)
    terms.exposed_copy = stall
    return terms


def solve(cost: ChunkCostModel, mem, seq_len: int, budget: int, *, rate: float, bandwidth: float,
          c_half: float = 64.0, chunk_counts=None, lengths_for=None, skeletons=("keep",),
          windowed: bool = True, copies_share_compute: bool = False, cache=None, clock: Clock | None = None,
          prefer_kept_skeleton: bool = False) -> BudgetPlan:
    """Choose chunks, offload ratios and a recompute policy that fit `budget` with the
    least predicted time.

    Args:
        cost: FLOPs model (for times and FLOPs-balanced lengths).
        mem: bytes model: a MemoryModel, or several (one per recompute policy).
        seq_len: tokens T.
        budget: device bytes.
        rate: sustained FLOP/s; bandwidth: offload tier bytes/s (write and read).
        c_half: chunk length at 50% compute efficiency.
        chunk_counts: candidate N (default 1, 2, 4, ... up to T/16).
        lengths_for: N -> lengths (default FLOPs-balanced).
        skeletons: K/V skeleton placements to consider, "keep" and/or "offload"; "offload"
            is tried only when no plan with the skeleton kept fits.
        windowed: plan with a copy window (`copy_window`; the executor bounds copies in
            flight to it); False: every read of a chunk starts before its backward.
        copies_share_compute: the offload copies run on the processors the compute runs on
            (a CPU-only machine: the disk tier's threads take cycles from the compute), so
            they add to the step time instead of hiding behind the next chunk's compute.
        cache: with `copies_share_compute`, (bytes/s, bytes) of the OS page cache in front
            of the disk tier (`DeviceProfile.disk_cached_write_bytes_per_s`,
            `disk_cache_bytes`): the bytes a step offloads up to that size cost the cached
            rate, the rest `bandwidth`.
        clock: per-op, per-file and attention figures (`solver.clock`; None: FLOPs and
            bandwidths alone).
        prefer_kept_skeleton: try "offload" only when no plan with the skeleton kept fits;
            False: every placement in `skeletons` competes on predicted time.

    Returns:
        The BudgetPlan. Raises InfeasibleBudget (with the minimum) when nothing fits.
    """
    models = list(mem) if isinstance(mem, (list, tuple)) else [mem]
    if chunk_counts is None:
        chunk_counts, n = [], 1
        while n <= max(1, seq_len // 16) and n <= 256:
            chunk_counts.append(n)
            n *= 2
    lengths_for = lengths_for or (lambda n: balanced_lengths(seq_len, n, cost))
    best, minimum = None, None
    for skeleton in skeletons:
        if skeleton == "offload" and best is not None and prefer_kept_skeleton:
            break
        for model in models:
            for n in chunk_counts:
                if n > seq_len:
                    break
                plan, floor = _plan_for(cost, model, lengths_for(n), budget, rate, bandwidth, c_half, skeleton,
                                        windowed, copies_share_compute, cache, clock)
                minimum = floor if minimum is None else min(minimum, floor)
                if plan is not None and (best is None or plan.step_seconds < best.step_seconds):
                    best = plan
    if best is None:
        policies = ", ".join(m.recompute for m in models)
        asked, needed = mib_below_and_above(budget, minimum or 0)
        raise InfeasibleBudget(
            f"budget {asked} MiB is below the minimum any plan needs for {seq_len} tokens: "
            f"{needed} MiB (every chunk but the last offloaded; recompute policies tried: "
            f"{policies}; K/V skeleton: {', '.join(skeletons)}). Raise the budget to at least "
            f"{needed} MiB or shorten the sequence", minimum or 0)
    return best


def _plan_for(cost, model: MemoryModel, lengths, budget, rate, bandwidth, c_half, skeleton, windowed=True,
              copies_share_compute=False, cache=None, clock=None):
    """(the fitting plan for these chunk lengths or None, the least peak any ratios give)."""
    n = len(lengths)
    window = copy_window(model, lengths, skeleton) if windowed else None
    starts = chunk_starts(lengths)
    level2 = model.streamed_level2 if skeleton == "offload" else model.level2
    l2 = [level2(c, t) for c, t in zip(lengths, starts)]
    fwd_s = [cost.forward_flops(c, t) / (rate * c / (c + c_half)) for c, t in zip(lengths, starts)]
    # sequence-aware: hide each chunk's offload behind the next chunk's forward (where
    # copies share the compute's cores nothing hides: offload only what memory needs)
    ratios = [0.0 if copies_share_compute else min(1.0, bandwidth * fwd_s[i + 1] / l2[i]) if l2[i] > 0 else 0.0
              for i in range(n - 1)] + [0.0]
    floor = predict_peak(model, lengths, [1.0] * (n - 1) + [0.0], skeleton, window)
    for i in range(n):  # earliest chunks leave the device first until the plan fits
        if predict_peak(model, lengths, ratios, skeleton, window) <= budget or i == n - 1:
            break
        ratios[i] = 1.0
    peak = predict_peak(model, lengths, ratios, skeleton, window)
    if peak > budget:
        return None, floor
    if window is not None and not any(ratios):
        window = None  # nothing leaves the device: no copies to bound
    if window is not None and peak < budget:
        # half the room left widens the window (more writes absorbed before the compute
        # waits, reads further ahead); the peak grows by at most that much
        window = min(window + (budget - peak) // 2, max(max(l2), window))
        peak = predict_peak(model, lengths, ratios, skeleton, window)
    reads = streamed_skeleton(model, lengths)[1] if skeleton == "offload" else None
    terms = step_terms(cost, lengths, ratios, l2, rate, c_half, bandwidth, model.recompute_fraction, reads,
                       copies_share_compute, cache, clock, model.tensors,
                       streamed_block_counts(model, lengths) if skeleton == "offload" else None,
                       skeleton_passes_of(model.recompute))
    return BudgetPlan(lengths, ratios, peak, terms.total, model.recompute, skeleton, window, terms), floor


def budget_plan(seq_len: int, chosen: BudgetPlan, budget: int, tier: str) -> Plan:
    """The Plan carrying the solver's choice."""
    return Plan(seq_len, chosen.lengths, offload_ratios=chosen.ratios, tier=tier, budget_bytes=budget,
                peak_bytes=chosen.peak_bytes, step_seconds=chosen.step_seconds, recompute=chosen.recompute,
                copy_window_bytes=chosen.copy_window_bytes,
                skeleton=chosen.skeleton, step_terms=dataclasses.asdict(chosen.terms) if chosen.terms else None)


