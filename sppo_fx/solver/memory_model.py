"""The memory model of one sequence on one device: what the budget solver predicts a plan
holds at its peak (docs/architecture.md, section 2 "S4 Budget"; `solver.budget` searches
the plans against it).

Bytes; chunk i has c_i tokens at start t_i:

    L1_i   its K/V skeleton (read by every later chunk, kept for the whole step; the chunk's
           own K/V output, saved by its graph too, is a second copy until its backward)
    L2_i   everything else it saves for its own backward (what is offloaded)
    a_i    the fraction of L2_i offloaded (a_{N-1} = 0: the last chunk runs backward first)

    forward, after chunk j:   2 sum_{i<=j} L1_i + sum_{i<j} (1 - a_i) L2_i + L2_j
    backward, at chunk j:     sum_i L1_i + sum_{i<=j} L1_i + dK/dV (sum_{i<j} L1_i) + sum_{i<j} (1 - a_i) L2_i
                              + L2_j + R_j + a_{j-1} L2_{j-1} (prefetched) + parameter gradients
    peak = the largest of these, plus `fixed_bytes` (what the model allocates regardless:
           parameter gradients, which the first backward -- chunk N-1's -- creates layer by
           layer while it frees that chunk's saved activations, so there the larger of the
           two counts, not their sum)

Sliding-window sites (`runtime.kv_window`): where `skeleton_rows.keeps_no_buffer` holds for the
chunk bounds (no chunk's window copies add up to the sequence), a windowed site keeps no
full-sequence buffer: its L1_i leaves the `sum_i L1_i` skeleton terms, and what it holds
instead is each chunk's copy of the window rows that reach past the previous chunk (none
when chunks are at least W-1 long), until that chunk's backward. Its dK/dV accumulators at
chunk j's backward are those of the chunks the windows of chunks >= j reach (whether or not
it keeps a buffer). `kept_skeleton_bytes` is the skeleton this predicts at the end of the
forward, what `StageRunner.skeleton_bytes` measures there.

With a copy window W (`Plan.copy_window_bytes`, `runtime.memory.CopyWindow`) the copies
in flight are bounded, so a chunk's offloaded part is never on the device all at once:

    forward, after chunk j:   ... + (1 - a_j) L2_j + min(a_{j-1} L2_{j-1} + a_j L2_j, W)
                                                                  (writes pending, this chunk's
                                                                   or the previous one's)
    backward, at chunk j:     ... + (1 - a_j) L2_j + min(a_j L2_j, L2_j / S)   (read back, in use)
                              + min(a_j L2_j + a_{j-1} L2_{j-1}, W)   (reads in flight, chunk
                                                                  j's or chunk j-1's) + R_j + ...

where S is the number of attention sites (layers): a tensor read back is consumed by its
layer's backward. The solver sets W to two layers' worth of the largest chunk's L2, then
widens it by half the room the plan leaves under the budget (at most one chunk's L2).

Recompute policies (`passes.offload.tag_recompute`) trade saved bytes for compute: each
has its own model, where L2 is what that policy's graphs save and R_j what chunk j's
backward rebuilds (the "none" policy's L2 minus this one's), at the price of
`recompute_fraction` of the chunk's forward time. The solver tries every policy given.

K/V skeleton offload (`skeleton="offload"`, `passes.skeleton`): the skeleton leaves the
device and is streamed into each attention one earlier chunk at a time, so the
`sum_i L1_i` terms go; what stays is a stream buffer (two blocks of one site), the dK/dV
accumulators of backward, and the chunk's own K/V, which its graph now saves as a
chunk-private tensor (L2 becomes L2 + L1). Reading the prefix back costs
sum_{j<i} L1_j per chunk in forward and again in backward, hidden behind that chunk's
compute where the bandwidth allows. For a sliding-window site a block holds only the
chunk's last W-1 rows and a chunk reads and accumulates gradients only for the blocks that
reach into its window (`streamed_skeleton`): reads, stream buffer and dK/dV are bounded by
W. The solver offloads the skeleton only when no plan with it kept fits.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import sympy

from sppo_fx.passes import cost as cost_model
from sppo_fx.passes.offload import RECOMPUTE_POLICIES
from sppo_fx.util.skeleton_rows import blocks_read, chunk_copy_rows, keeps_no_buffer, kept_first, window_firsts


@dataclasses.dataclass
class MemoryModel:
    """Per-chunk bytes as functions of (c, p), plus what every step allocates anyway.

    Attributes:
        level1: (c, p) -> K/V bytes of a chunk.
        level2: (c, p) -> chunk-private saved bytes.
        fixed_bytes: allocated by every step regardless of chunking (parameter gradients).
        working: (c, p) -> transient bytes while a chunk runs (its largest temporaries).
        recomputed: (c, p) -> bytes a chunk's backward rebuilds (recompute policies).
        recompute: the recompute policy this model describes.
        recompute_fraction: extra compute of that policy, as a fraction of forward time.
        sites: attention sites (the stream buffer of an offloaded skeleton is per site).
        tensors: chunk-private saved tensors of a chunk (the disk tier writes one file each).
        windowed: per sliding window W of some sites, (W, (c, p) -> K/V bytes of those
            sites' share of a chunk); `level1` counts them too.
        allocations: what this policy's forward and backward graphs allocate per chunk
            (`solver.partition.Allocation` lines in the chunk's tokens, from the traced
            partition, `passes.cost.saved.allocated_tensors`; the backward's include a
            recompute's forward ops); () where the trace gave none: the clock then counts
            the captured graph's (`ChunkCostModel.allocations`).
    """

    level1: object
    level2: object
    fixed_bytes: int = 0
    working: object = None
    recomputed: object = None
    recompute: str = "none"
    recompute_fraction: float = 0.0
    sites: int = 1
    windowed: tuple = ()
    tensors: int = 0
    allocations: tuple = ()

    def streamed_level2(self, c, p) -> int:
        """Chunk-private saved bytes with the skeleton offloaded: the chunk's own K/V are saved
        by its graph (they are no longer graph outputs)."""
        return self.level2(c, p) + self.level1(c, p)

    @classmethod
    def from_chunk_cost(cls, chunk_cost, fixed_bytes: int = 0, *, baseline=None, recompute: str = "none",
                        recompute_fraction: float = 0.0, windows: dict | None = None) -> "MemoryModel":
        """From `sppo_fx.passes.cost.ChunkCost` (sympy in c, p).

        Args:
            chunk_cost: the cost model of the graphs this policy runs.
            fixed_bytes: see the class.
            baseline: the "none" policy's ChunkCost (for the bytes a recompute rebuilds).
            recompute / recompute_fraction: see the class.
            windows: attention site name -> its sliding window, for the windowed sites.
        """
        def at(cc, key, expr=None):
            # the solver asks for the same (c, p) many times: substitute each pair once
            expr, batch = getattr(cc, key) if expr is None else expr, cc.batch

            @functools.lru_cache(maxsize=None)
            def value(c, p):
                return cost_model._to_int(expr.subs({cost_model.c: int(c), cost_model.p: int(p),
                                                     cost_model.b: batch}))
            return value
        rebuilt = None
        if baseline is not None:
            mine, full = at(chunk_cost, "level2_bytes"), at(baseline, "level2_bytes")
            rebuilt = lambda c, p: max(full(c, p) - mine(c, p), 0)  # noqa: E731
        by_window: dict[int, list] = {}
        for s in chunk_cost.saved:  # level 1 is named "<site>.k" / "<site>.v" (`passes.cost.saved`)
            window = (windows or {}).get(s.name.rsplit(".", 1)[0]) if s.level == 1 else None
            if window is not None:
                by_window.setdefault(window, []).append(s.bytes_expr)
        windowed = tuple((w, at(chunk_cost, None, sympy.Add(*exprs))) for w, exprs in sorted(by_window.items()))
        return cls(at(chunk_cost, "level1_bytes"), at(chunk_cost, "level2_bytes"), fixed_bytes,
                   recomputed=rebuilt, recompute=recompute, recompute_fraction=recompute_fraction,
                   windowed=windowed, tensors=sum(1 for s in chunk_cost.saved if s.level == 2),
                   allocations=allocation_lines(chunk_cost))


def allocation_lines(chunk_cost) -> tuple:
    """`ChunkCost.allocated` as the clock's `Allocation` lines in the chunk's tokens c, at
    the traced batch: sizes that grow with the prefix or are not a line in c (attention's
    own buffers, which the clock's attention term prices) are left out."""
    from sppo_fx.solver.partition import Allocation, _line_in
    counts: dict = {}
    for a in getattr(chunk_cost, "allocated", ()):
        expr = sympy.sympify(a.bytes_expr).subs(cost_model.b, chunk_cost.batch)
        if cost_model.p in expr.free_symbols:
            continue
        line = _line_in(expr, cost_model.c)
        if line is None:
            continue
        key = Allocation(line[0], line[1], backward=a.backward, matmul=a.matmul)
        counts[key] = counts.get(key, 0) + a.count
    return tuple(dataclasses.replace(k, count=float(n)) for k, n in sorted(
        counts.items(), key=lambda kv: (kv[0].per_token, kv[0].fixed, kv[0].backward, kv[0].matmul)))


def chunk_starts(lengths: list[int]) -> list[int]:
    """Each chunk's first position (a running sum: the solver calls this for thousands of
    candidate partitions, some of thousands of chunks)."""
    return list(itertools.accumulate(lengths[:-1], initial=0)) if lengths else []


def copy_window(mem: MemoryModel, lengths: list[int], skeleton: str = "keep") -> int:
    """The copy window the solver plans with: two layers' worth of the largest chunk's
    chunk-private saved bytes (a read of the next layer's tensors overlaps this layer's
    backward), capped at one chunk's, and at least 1 MiB (which wins over the cap)."""
    level2 = mem.streamed_level2 if skeleton == "offload" else mem.level2
    starts = chunk_starts(lengths)
    largest = max(level2(c, t) for c, t in zip(lengths, starts))
    return max(min(largest, 2 * largest // max(1, mem.sites)), 1 << 20)


def _kept_skeleton(mem: MemoryModel, lengths: list[int], starts: list[int], l1: list[int]):
    """The kept skeleton per chunk j (see the module docstring), in bytes: chunk j's rows of
    the full-sequence buffers, the window rows chunk j copies, and the dK/dV accumulators
    alive at chunk j's backward for the chunks before it."""
    n = len(lengths)
    bounds = [(t, t + c) for c, t in zip(lengths, starts)]
    buffer, copies, grads = list(l1), [0] * n, [0] * n
    for j in range(1, n):
        grads[j] = grads[j - 1] + l1[j - 1]
    for window, level1 in mem.windowed:
        mine = [level1(c, t) for c, t in zip(lengths, starts)]
        firsts = window_firsts(bounds, window)
        if keeps_no_buffer(bounds, firsts):
            buffer = [x - y for x, y in zip(buffer, mine)]
            copies = [x + (level1(r, t) if r else 0)
                      for x, r, t in zip(copies, chunk_copy_rows(bounds, firsts), starts)]
        expired, i = 0, 0  # chunks that end before chunk j's window: no window of chunks >= j reads them
        for j in range(n):
            lo = firsts[j]
            while i < j and bounds[i][1] <= lo:
                expired, i = expired + mine[i], i + 1
            grads[j] -= expired
    return buffer, copies, grads


def streamed_skeleton(mem: MemoryModel, lengths: list[int]):
    """The skeleton offloaded (`runtime.skeleton.KVSkeleton`), per chunk: the bytes of its
    stored block (a windowed site's chunk stores only the rows later windows read,
    `skeleton_rows.kept_first`), the bytes it reads back in forward (and again in backward:
    the blocks that reach into its window, `skeleton_rows.blocks_read`), and the dK/dV
    accumulators alive at its backward (of those same blocks). A packed-document site counts
    as causal (its documents are data: an upper bound of what the runtime stores and reads)."""
    starts = chunk_starts(lengths)
    bounds = [(t, t + c) for c, t in zip(lengths, starts)]
    n = len(lengths)
    causal = [mem.level1(c, t) for c, t in zip(lengths, starts)]
    stored = []  # per window: (W, stored bytes per chunk)
    for window, level1 in mem.windowed:
        causal = [x - level1(c, t) for x, c, t in zip(causal, lengths, starts)]
        rows = [e - kept_first(s, e, window) for s, e in bounds]
        stored.append((window, [level1(r, s) if r > 0 else 0 for r, (s, _) in zip(rows, bounds)]))
    blocks = [causal[j] + sum(st[j] for _, st in stored) for j in range(n)]
    causal_before = [0, *itertools.accumulate(causal)]
    reads = [causal_before[i] + sum(sum(st[j] for j in blocks_read(bounds, i, w)) for w, st in stored)
             for i in range(n)]
    return blocks, reads, reads  # the accumulators at chunk j's backward: the blocks it reads


def kept_skeleton_bytes(mem: MemoryModel, lengths: list[int]) -> int:
    """Bytes of K/V skeleton the runtime keeps (skeleton="keep") at the end of the forward:
    the full-sequence buffers and the window copies (`StageRunner.skeleton_bytes`)."""
    starts = chunk_starts(lengths)
    buffer, copies, _ = _kept_skeleton(mem, lengths, starts, [mem.level1(c, t) for c, t in zip(lengths, starts)])
    return sum(buffer) + sum(copies)


def predict_peak(mem: MemoryModel, lengths: list[int], ratios: list[float], skeleton: str = "keep",
                 window: int | None = None) -> int:
    """Peak device bytes of one step (see the module docstring); `skeleton` is "keep" or
    "offload"; `window` the copy window in bytes (None: unbounded copies)."""
    starts = chunk_starts(lengths)
    l1 = [mem.level1(c, t) for c, t in zip(lengths, starts)]
    level2 = mem.streamed_level2 if skeleton == "offload" else mem.level2
    l2 = [level2(c, t) for c, t in zip(lengths, starts)]
    work = [mem.working(c, t) if mem.working else 0 for c, t in zip(lengths, starts)]
    rebuilt = [mem.recomputed(c, t) if mem.recomputed else 0 for c, t in zip(lengths, starts)]
    n = len(lengths)
    l1_before, resident_before = [0] * (n + 1), [0.0] * (n + 1)  # running sums over chunks < j
    for j in range(n):
        l1_before[j + 1] = l1_before[j] + l1[j]
        resident_before[j + 1] = resident_before[j] + (1 - ratios[j]) * l2[j]
    # kept: the skeleton buffer of the chunks so far (and window copies), plus each chunk's
    # own K/V outputs, which its graph also saves for its backward (a second copy, alive
    # until that backward); offloaded: two blocks of one site streaming in (own K/V are in L2)
    kept = skeleton != "offload"
    if kept:
        buffer, copies, grads = _kept_skeleton(mem, lengths, starts, l1)
        stream = [0] * n
    else:
        blocks, _, grads = streamed_skeleton(mem, lengths)
        buffer, copies = [0] * n, [0] * n
        before = [0, *itertools.accumulate(blocks, max)]  # the largest block of the chunks < j
        stream = [2 * before[j] // max(1, mem.sites) for j in range(n)]
    skeleton_upto = [0, *itertools.accumulate(x + y for x, y in zip(buffer, copies))]  # chunks < j
    copies_upto = list(itertools.accumulate(copies))  # window copies of chunks <= j
    sites = max(1, mem.sites)
    whole_buffer = sum(buffer)
    peak = 0
    for j in range(n):  # forward
        held = l1_before[j + 1] + skeleton_upto[j + 1] if kept else stream[j]
        offloaded = ratios[j] * l2[j] + (ratios[j - 1] * l2[j - 1] if j > 0 else 0)
        mine = l2[j] if window is None else (1 - ratios[j]) * l2[j] + min(offloaded, window)
        peak = max(peak, held + resident_before[j] + mine + work[j])
    for j in range(n - 1, -1, -1):  # backward: skeleton (+ own K/V of chunks <= j) or a stream buffer,
        held = whole_buffer + copies_upto[j] + l1_before[j + 1] if kept else stream[n - 1]  # and dK/dV
        if window is None:  # the whole chunk is back, and the previous one is on its way
            mine, coming = l2[j], (ratios[j - 1] * l2[j - 1] if j > 0 else 0)
        else:
            offloaded = ratios[j] * l2[j] + (ratios[j - 1] * l2[j - 1] if j > 0 else 0)
            mine = (1 - ratios[j]) * l2[j] + min(ratios[j] * l2[j], l2[j] / sites)
            coming = min(offloaded, window)
        if j == n - 1:
            # the first backward: parameter gradients appear layer by layer as the layers'
            # saved activations are freed, so the two trade places rather than add up
            own = max(mine + rebuilt[j], mem.fixed_bytes)
        else:
            own = mine + rebuilt[j] + mem.fixed_bytes
        peak = max(peak, held + grads[j] + resident_before[j] + own + coming + work[j])
    return int(peak)


def streamed_block_counts(mem: MemoryModel, lengths: list[int]) -> list[int]:
    """Per chunk, the skeleton blocks it streams in one pass over all sites: every earlier
    chunk's (a streamed skeleton has causal sites only: `skeleton="offload"` refuses windowed
    and document sites)."""
    return [max(1, mem.sites) * i for i in range(len(lengths))]


def skeleton_passes_of(policy: str) -> int:
    """How often a streamed K/V skeleton is read per step under a recompute policy: in the
    forward, in the backward, and once more where the policy recomputes attention ("full":
    the recomputed forward calls each chunk's prefix attention again; "cheap" keeps
    attention's outputs)."""
    return 3 if policy == "full" else 2


def recompute_fraction(chunk_cost, policy: str) -> float:
    """Extra forward work of a recompute policy, as a fraction of the chunk's forward FLOPs
    (at the cost model's example chunk): "full" recomputes all of it, "cheap" the nodes
    that are not matmuls or attention (FLOPs understate these memory-bound ops)."""
    if policy == "none":
        return 0.0
    if policy == "full":
        return 1.0
    c0, p0 = chunk_cost.example
    vals = {cost_model.c: c0, cost_model.p: max(p0, c0), cost_model.b: chunk_cost.batch}
    total = sum(float(n.fwd_flops.subs(vals)) for n in chunk_cost.nodes)
    cheap = sum(float(n.fwd_flops.subs(vals)) for n in chunk_cost.nodes if n.kind not in ("matmul", "attention"))
    return cheap / total if total > 0 else 0.0


def memory_models(program, seq, params, policies=RECOMPUTE_POLICIES) -> list[MemoryModel]:
    """One MemoryModel per recompute policy, from the AOT partition each policy's graphs run
    (Inductor's min-cut partitioner plus the policy's recompute tags). The chunk program is
    traced once (and once more for the first chunk); each policy partitions that joint graph
    (`passes.cost.chunk_costs`).

    Args:
        program: the ChunkedProgram.
        seq: the captured sequence symbol.
        params: tensors for the program's parameter placeholders.
        policies: recompute policies to model.

    Returns:
        The models, in `policies` order; `fixed_bytes` is the parameter gradients.
    """
    grads = sum(t.numel() * t.element_size() for t in params if t.requires_grad)
    # one AOTAutograd trace partitioned per policy; "none" is every other policy's baseline
    costs = cost_model.chunk_costs(program, seq, params=params, partition="min_cut",
                                   recomputes=("none", *[r for r in policies if r != "none"]))
    base = costs["none"]
    windows = {site.name: site.window for site in program.attention if site.window is not None}
    models = []
    for policy in policies:
        cc = costs[policy]
        model = MemoryModel.from_chunk_cost(cc, grads, baseline=None if policy == "none" else base,
                                            recompute=policy, recompute_fraction=recompute_fraction(base, policy),
                                            windows=windows)
        model.sites = max(1, len(program.attention))
        if policy == "cheap" and model.recomputed is not None:
            # pointwise ops are rebuilt next to their use, block by block: about two
            # blocks' worth is alive at once, not the whole chunk's (as under "full",
            # where the forward is replayed ahead of the backward)
            whole, sites = model.recomputed, max(1, len(program.attention))
            model.recomputed = lambda c, p: 2 * whole(c, p) // sites  # noqa: E731
        models.append(model)
    return models
