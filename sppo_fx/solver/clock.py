"""The single-stage solver's clock: predicted step time of a chunk plan, split into terms.

    step = compute + attention + element-wise + allocation + exposed copy + overheads

    compute      matmul FLOPs outside attention at the profile's rate and chunk efficiency
                 (`DeviceProfile.compute_seconds`), forward x (1 + backward factor + recompute);
                 and where the model's weights exceed the processor's cache, every chunk
                 reads them from memory in its forward, its backward (the input gradient's
                 matmuls) and a full recompute: weight bytes x `weight_read_seconds` each;
                 and every chunk but the backward's first adds its weight gradients into the
                 sums, which then lie beyond the cache too: 3 passes over them op by op
                 (`add_` reads the sum and the product, writes the sum), 2 compiled (the GEMM
                 reads and writes the sum), at the same price per byte
    attention    per causal (query, key) pair and head: seconds at the head dim d (forward and
                 backward), from the calibrated per-dim table (`DeviceProfile.attention_by_dim`,
                 interpolated), else e + d·f (`attention_pair_seconds`, `..._dim_seconds`); a
                 pair of a chunk's causal square (its own c(c+1)/2 pairs) costs
                 `attention_square` (by c) times a prefix pair (the kernel computes the
                 diagonal's tiles whole); a chunk of c queries pays `attention_size` (by c)
                 times the table's per-pair figure (short chunks dearer per pair); where
                 the profile has no such figure, attention FLOPs at the matmul rate instead
    element-wise bytes the memory-bound ops (pointwise, norms, reductions, copies, `cat`)
                 read and write per token (`ChunkCostModel.elementwise_bytes`, forward) at the
                 calibrated element-wise bandwidth (`elementwise_bytes_per_s`), forward x
                 (1 + `ELEMENTWISE_BACKWARD` + 1 when a recompute policy replays them)
    allocation   every tensor a chunk's forward and backward allocate: those of the recompute
                 policy's traced AOTAutograd graphs (`MemoryModel.allocations`, the backward's
                 derivative intermediates and gradient sums included, a recompute's forward
                 in the backward), else the captured graph's list (`ChunkCostModel.allocations`:
                 outputs, gradients, a weight's gradient per chunk; a recompute's forward
                 again), bytes x the calibrated price of a fresh block of that size
                 (`allocation_by_size`, `solver.allocation`: the allocator's page faults,
                 nothing where it reuses what it holds); compiled, the matmuls' only (Inductor
                 fuses the rest into fewer buffers)
    exposed copy offload writes and reads, and a streamed skeleton's reads, that do not hide
                 behind compute (on a CPU-only machine nothing hides: the copies run on the
                 compute's cores, at the page cache's rate up to its size, the disk's beyond;
                 a streamed skeleton's re-reads of its one file at the cache's rate while
                 the file fits it)
    overheads    per chunk: ops x `op_seconds` (Python, dispatch, launch of each op of the
                 chunk's forward and backward; measured on real programs, the memory
                 passes' for a plan with a tier, `DeviceProfile.pass_op_seconds`); per
                 attention call (each site of each chunk, each streamed block):
                 `attention_call_seconds`, the chunk attention's fixed cost forward +
                 backward, which makes short chunks dearer than their pairs say; per file
                 the disk tier writes or reads: `file_seconds`; per streamed skeleton block read: `read_seconds` (measured
                 on the streamed op, `clock_calibration.skeleton_read_seconds`; where the
                 profile has none, its attention call's ops and half a call); per stream of
                 a streamed skeleton (chunk, pass): one read task at `file_seconds`

A streamed skeleton re-reads every earlier block per chunk (forward and backward): its bytes
and its blocks' attention calls grow as N^2 over N chunks, which these terms charge, so the
solver trades it against keeping the skeleton. Its files do not: the blocks sit in one file,
and each chunk's pass reads its prefix in one in-order task (`runtime.skeleton_log`).

Figures of zero (built-in GPU profiles, profiles stored before these fields) leave their
term out: what the clock cannot know it does not guess.
"""
from __future__ import annotations

import dataclasses
import math

#: ops an attention call on one streamed block runs (attention, lse merge), forward + backward
BLOCK_OPS = 8

#: backward bytes of the element-wise ops over their forward's: a pointwise op's backward
#: reads the output gradient and its saved inputs and writes an input gradient (mul: 2
#: reads, 2 writes per side), and gradients of a broadcast or reused value are summed.
ELEMENTWISE_BACKWARD = 2.0


@dataclasses.dataclass(frozen=True)
class Clock:
    """The per-machine figures of the clock's terms beyond FLOPs and bandwidths.

    Attributes:
        op_seconds: fixed cost of one op of a chunk program (Python, dispatch, launch).
        file_seconds: fixed cost of one file the disk tier writes and reads back.
        attention_pair_seconds / attention_pair_dim_seconds: attention forward + backward
            seconds per (query, key) pair and head: e + d·f (0: use FLOPs).
        attention_call_seconds: fixed cost of one chunk attention call, forward + backward
            (Python, dispatch, its small ops and buffers; 0: not charged).
        compiled_speedup: compiled chunk programs' speed over op-by-op graphs (>= 1 faster).
        attention_by_dim: ((head dim, seconds per pair and head), ...) measured at those head
            dims; () to use e + d·f. The cost is not linear in d: on a CPU a head dim of 8
            costs what 32 does (vector width), twice e + 8·f fitted at 16 and 64.
        attention_square: ((chunk length c, factor), ...): seconds of a pair in a chunk's
            causal square over a prefix pair's, measured at those c, interpolated in log c
            and held beyond them (() : 1, the same).
        attention_size: ((chunk length c, factor), ...): a pair's seconds at c queries over
            the table's (measured at 256 queries), interpolated in log c, held beyond (():
            1).
        elementwise_bytes_per_s: bytes/s of a chain of element-wise ops on chunk-sized
            tensors (0: the element-wise term is left out).
        read_seconds: what one streamed skeleton block read adds beyond its pairs (0:
            `BLOCK_OPS` ops and half an attention call stand in).
        weight_read_seconds: seconds per weight byte read from memory rather than the
            cache (0: not charged); cache_bytes: the cache weights must exceed for it.
        allocation_by_size: ((bytes, seconds per byte), ...): the price of allocating a
            fresh tensor of that size (() : the allocation term left out).
        op_by_op: the chunk programs run op by op (every op allocates its output), else
            compiled (only the matmuls' outputs and gradients are charged).
        weight_grads_every_chunk: every chunk allocates its weight gradients: op by op
            without a tier or a recompute policy, where autograd runs the plain chunk
            program (`mm`, then `add_` into `.grad`). Else a weight gradient is allocated
            once a step, by the backward's first chunk: the memory passes' graphs
            (compiled, or op by op with a tier) fold the later chunks' into their
            accumulation (`passes.offload.fuse_grad_matmul`: inside the GEMM compiled,
            through one reused product buffer op by op).
    """

    op_seconds: float = 0.0
    file_seconds: float = 0.0
    attention_pair_seconds: float = 0.0
    attention_pair_dim_seconds: float = 0.0
    compiled_speedup: float = 1.0
    attention_call_seconds: float = 0.0
    attention_by_dim: tuple = ()
    attention_square: tuple = ()
    attention_size: tuple = ()
    elementwise_bytes_per_s: float = 0.0
    read_seconds: float = 0.0
    weight_read_seconds: float = 0.0
    cache_bytes: int = 0
    allocation_by_size: tuple = ()
    op_by_op: bool = False
    weight_grads_every_chunk: bool = False

    @classmethod
    def of(cls, profile, compiled: bool = True, tier: str | None = "disk",
           recompute: str = "none") -> "Clock":
        """The clock of a `DeviceProfile` (fields it lacks count zero) for chunk programs
        run `compiled` or op by op, offloading to `tier` (files only on "disk"). Op by op
        with a tier, the programs are the memory passes' graphs: an op costs the profile's
        `pass_op_seconds` where it has one (a recompute policy without a tier runs them too,
        and is charged the plain programs' figure). Weight gradients are allocated in every
        chunk only by autograd's plain chunk program: op by op, without a tier, `recompute`
        "none" (the solver's clock of a tierless run, one for all its policies, charges them
        so)."""
        get = lambda name, default=0.0: float(getattr(profile, name, default) or default)  # noqa: E731
        op = get("pass_op_seconds") if not compiled and tier is not None else 0.0
        return cls(op or get("op_seconds"), get("file_seconds") if tier == "disk" else 0.0, get("attention_pair_seconds"),
                   get("attention_pair_dim_seconds"), get("compiled_speedup", 1.0) if compiled else 1.0,
                   get("attention_call_seconds"),
                   _table(profile, "attention_by_dim"), _table(profile, "attention_square"),
                   _table(profile, "attention_size"),
                   get("elementwise_bytes_per_s"), get("skeleton_read_seconds"), get("weight_read_seconds"),
                   int(get("cache_bytes")), _table(profile, "allocation_by_size"), not compiled,
                   not compiled and tier is None and recompute == "none")

    def weight_seconds(self, cost, recompute_fraction: float = 0.0) -> float:
        """Seconds one chunk spends reading the model's weights from memory: its forward,
        its backward's input-gradient matmuls and a recompute's forward each read them once;
        0 where they fit the cache or the profile has no figure."""
        return (2 + recompute_fraction) * self._weights_from_memory(cost) * self.weight_read_seconds

    def weight_grad_seconds(self, cost) -> float:
        """Seconds one chunk other than the backward's first spends adding its weight
        gradients into their sums where the model's weights exceed the cache: the sums
        are weight-sized and come from memory; op by op `add_` passes over them 3 times
        (reads the sum and the chunk's product, writes the sum), compiled the GEMM 2 times
        (reads and writes the sum in place). 0 where they fit the cache or the profile has
        no figure."""
        return (3 if self.op_by_op else 2) * self._weights_from_memory(cost) * self.weight_read_seconds

    def _weights_from_memory(self, cost) -> float:
        """The model's weight bytes where they exceed the cache and the profile prices
        reading them from memory, else 0."""
        weights = getattr(cost, "weight_bytes", 0.0)
        return weights if self.weight_read_seconds and weights > self.cache_bytes else 0.0

    def elementwise_seconds(self, cost, tokens: float, recompute_fraction: float = 0.0) -> float:
        """Seconds of the element-wise ops of `tokens` tokens, forward and backward; a
        recompute policy (any `recompute_fraction` > 0: "cheap" replays the element-wise
        ops, "full" everything) runs their forward once more. 0 without a bandwidth."""
        bw = self.elementwise_bytes_per_s
        per_token = getattr(cost, "elementwise_bytes", 0.0)
        if not bw or not per_token:
            return 0.0
        passes = 1 + ELEMENTWISE_BACKWARD + (1 if recompute_fraction > 0 else 0)
        return per_token * tokens * passes / bw / max(self.compiled_speedup, 1e-9)

    def allocation_seconds(self, cost, tokens: float, recompute_fraction: float = 0.0,
                           forward_only: bool = False) -> float:
        """Seconds a chunk of `tokens` tokens spends allocating its tensors, forward and
        backward (`forward_only`: the forward's), each at the price of its size; a
        recompute's forward allocates `recompute_fraction` of the forward's again (not where
        the list is a traced partition's, `recompute_allocations`). 0 without a price table."""
        forward, backward = self.allocation_parts(cost, tokens)
        if forward_only:
            return forward
        return forward * (1.0 + recompute_allocations(cost, recompute_fraction)) + backward

    def allocation_parts(self, cost, tokens: float, weight_grads: bool = True) -> tuple[float, float]:
        """(forward, backward) seconds of a chunk's allocations (`allocation_seconds`), in
        one pass over them; without the matmuls' weight gradients (fixed-size backward
        allocations) where `weight_grads` is False, unless every chunk allocates its own
        (`weight_grads_every_chunk`)."""
        if not self.allocation_by_size:
            return 0.0, 0.0
        parts = [0.0, 0.0]
        skip_weights = not (self.weight_grads_every_chunk or weight_grads)
        for a in getattr(cost, "allocations", ()):
            if skip_weights and a.backward and a.matmul and not a.per_token:
                continue
            if self.op_by_op or a.matmul:
                nbytes = a.nbytes(tokens)
                parts[a.backward] += a.count * nbytes * allocation_price(self.allocation_by_size, nbytes)
        return parts[0], parts[1]

    def pair_seconds(self, d: float) -> float:
        """Forward + backward seconds of one (query, key) pair of one head at head dim d:
        the per-dim table interpolated linearly (below its smallest dim: that dim's figure,
        a narrower head does not run faster; above its largest: the last segment's slope),
        else e + d·f."""
        if not self.attention_by_dim:
            return self.attention_pair_seconds + d * self.attention_pair_dim_seconds
        return _interpolate(self.attention_by_dim, d, extend=True)

    def square_factor(self, c: float) -> float:
        """A causal-square pair's cost over a prefix pair's for a chunk of c queries."""
        return _by_length(self.attention_square, c)

    def size_factor(self, c: float) -> float:
        """A pair's cost in a chunk of c queries over the per-dim table's (256 queries)."""
        return _by_length(self.attention_size, c)


def recompute_allocations(cost, recompute_fraction: float) -> float:
    """The share of a chunk's forward allocations a recompute policy makes again: its
    `recompute_fraction` for the captured graph's list, 0 for a traced partition's, whose
    backward graph holds the recompute (`ChunkCostModel.recompute_allocates`)."""
    return recompute_fraction if getattr(cost, "recompute_allocates", True) else 0.0


def _table(profile, name: str) -> tuple:
    return tuple(sorted((float(a), float(b)) for a, b in (getattr(profile, name, ()) or ())))


def _by_length(table, c: float, empty: float = 1.0) -> float:
    """A figure measured at some lengths (or sizes): interpolated in log c, held beyond;
    `empty` if none was measured."""
    if not table:
        return empty
    return _interpolate(tuple((math.log(max(n, 1.0)), x) for n, x in table), math.log(max(c, 1.0)), extend=False)


def allocation_price(table, nbytes: float) -> float:
    """Seconds per byte of allocating a fresh block of `nbytes` (`Clock.allocation_by_size`):
    interpolated in log size, the nearest figure beyond the table; 0 without one."""
    return _by_length(table, nbytes, empty=0.0) if nbytes > 0 else 0.0


def _interpolate(table, x: float, extend: bool) -> float:
    """Piecewise linear through sorted (x, y) points: below the first, its y; above the
    last, the last segment extended (`extend`) or the last y."""
    if x <= table[0][0] or len(table) == 1:
        return table[0][1]
    if x >= table[-1][0] and not extend:
        return table[-1][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            break  # else the last segment, extended
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclasses.dataclass
class StepTerms:
    """Predicted seconds of one step, by term (see the module docstring)."""

    compute: float = 0.0
    attention: float = 0.0
    exposed_copy: float = 0.0
    overhead: float = 0.0
    elementwise: float = 0.0
    allocation: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.attention + self.elementwise + self.allocation + self.exposed_copy + self.overhead

    def describe(self) -> str:
        return (f"compute {self.compute:.3g} s + attention {self.attention:.3g} s + element-wise "
                f"{self.elementwise:.3g} s + allocation {self.allocation:.3g} s + exposed copy "
                f"{self.exposed_copy:.3g} s + overheads {self.overhead:.3g} s")


def pairs(c: int, t: int) -> float:
    """Causal (query, key) pairs of a chunk of c tokens starting at t."""
    return c * (t + (c + 1) / 2)


def attention_seconds(cost, c: int, t: int, clock: Clock) -> float | None:
    """Forward + backward attention seconds of one chunk by the calibrated pair cost, or
    None where the clock or the cost model has no such figure (FLOPs then count it)."""
    sites = getattr(cost, "attention", ())
    if not sites or not (clock.attention_by_dim or clock.attention_pair_seconds or clock.attention_pair_dim_seconds):
        return None
    per_pair = sum(bh * clock.pair_seconds(d) for bh, d in sites)
    weighted = clock.size_factor(c) * (c * t + clock.square_factor(c) * c * (c + 1) / 2)  # prefix, square
    return weighted * per_pair / max(clock.compiled_speedup, 1e-9)


def overhead_seconds(cost, n_chunks: int, files: int, block_reads: int, clock: Clock,
                     recompute_fraction: float = 0.0) -> float:
    """Fixed costs: ops of every chunk's forward and backward (the backward runs about twice
    the forward's ops; a recompute runs `recompute_fraction` of the forward's again, its
    attention calls included), files of the disk tier, attention calls (every site of every
    chunk; streamed blocks, each its own call with `BLOCK_OPS` ops more for the merge)."""
    ops = getattr(cost, "ops", 0) * (1 + 2 + recompute_fraction) * n_chunks / max(clock.compiled_speedup, 1.0)
    calls = len(getattr(cost, "attention", ())) * n_chunks * (1 + recompute_fraction / 2)  # fwd = 1/2 a call
    if clock.read_seconds:  # measured on the streamed op itself
        return (ops * clock.op_seconds + files * clock.file_seconds + calls * clock.attention_call_seconds
                + block_reads * clock.read_seconds)
    calls += block_reads / 2  # block_reads: forward and backward
    return ((ops + BLOCK_OPS * block_reads) * clock.op_seconds + files * clock.file_seconds
            + calls * clock.attention_call_seconds)
