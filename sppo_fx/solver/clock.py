"""The single-stage solver's clock: predicted step time of a chunk plan, split into terms.

    step = compute + attention + exposed copy + overheads

    compute      matmul FLOPs outside attention at the profile's rate and chunk efficiency
                 (`DeviceProfile.compute_seconds`), forward x (1 + backward factor + recompute)
    attention    per causal (query, key) pair and head: e + d·f seconds (forward and backward),
                 calibrated (`DeviceProfile.attention_pair_seconds`, `..._dim_seconds`); where
                 the profile has no such figure, attention FLOPs at the matmul rate instead
    exposed copy offload writes and reads, and a streamed skeleton's reads, that do not hide
                 behind compute (on a CPU-only machine nothing hides: the copies run on the
                 compute's cores, at the page cache's rate up to its size, the disk's beyond)
    overheads    per chunk: ops x `op_seconds` (Python, dispatch, launch of each op of the
                 chunk's forward and backward); per attention call (each site of each chunk,
                 each streamed block): `attention_call_seconds`, the chunk attention's fixed
                 cost forward + backward, which makes short chunks dearer than their pairs
                 say; per file the disk tier writes or reads:
                 `file_seconds`; per streamed skeleton block: its attention call's ops; per
                 stream of a streamed skeleton (chunk, pass): one read task at `file_seconds`

A streamed skeleton re-reads every earlier block per chunk (forward and backward): its bytes
and its blocks' attention calls grow as N^2 over N chunks, which these terms charge, so the
solver trades it against keeping the skeleton. Its files do not: the blocks sit in one file,
and each chunk's pass reads its prefix in one in-order task (`runtime.skeleton_log`).

Figures of zero (built-in GPU profiles, profiles stored before these fields) leave their
term out: what the clock cannot know it does not guess.
"""
from __future__ import annotations

import dataclasses

#: ops an attention call on one streamed block runs (attention, lse merge), forward + backward
BLOCK_OPS = 8


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
    """

    op_seconds: float = 0.0
    file_seconds: float = 0.0
    attention_pair_seconds: float = 0.0
    attention_pair_dim_seconds: float = 0.0
    compiled_speedup: float = 1.0
    attention_call_seconds: float = 0.0

    @classmethod
    def of(cls, profile, compiled: bool = True, tier: str | None = "disk") -> "Clock":
        """The clock of a `DeviceProfile` (fields it lacks count zero) for chunk programs
        run `compiled` or op by op, offloading to `tier` (files only on "disk")."""
        get = lambda name, default=0.0: float(getattr(profile, name, default) or default)  # noqa: E731
        return cls(get("op_seconds"), get("file_seconds") if tier == "disk" else 0.0, get("attention_pair_seconds"),
                   get("attention_pair_dim_seconds"), get("compiled_speedup", 1.0) if compiled else 1.0,
                   get("attention_call_seconds"))


@dataclasses.dataclass
class StepTerms:
    """Predicted seconds of one step, by term (see the module docstring)."""

    compute: float = 0.0
    attention: float = 0.0
    exposed_copy: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.attention + self.exposed_copy + self.overhead

    def describe(self) -> str:
        return (f"compute {self.compute:.3g} s + attention {self.attention:.3g} s + exposed copy "
                f"{self.exposed_copy:.3g} s + overheads {self.overhead:.3g} s")


def pairs(c: int, t: int) -> float:
    """Causal (query, key) pairs of a chunk of c tokens starting at t."""
    return c * (t + (c + 1) / 2)


def attention_seconds(cost, c: int, t: int, clock: Clock) -> float | None:
    """Forward + backward attention seconds of one chunk by the calibrated pair cost, or
    None where the clock or the cost model has no such figure (FLOPs then count it)."""
    sites = getattr(cost, "attention", ())
    if not sites or not (clock.attention_pair_seconds or clock.attention_pair_dim_seconds):
        return None
    per_pair = sum(bh * (clock.attention_pair_seconds + d * clock.attention_pair_dim_seconds) for bh, d in sites)
    return pairs(c, t) * per_pair / max(clock.compiled_speedup, 1e-9)


def overhead_seconds(cost, n_chunks: int, files: int, block_reads: int, clock: Clock,
                     recompute_fraction: float = 0.0) -> float:
    """Fixed costs: ops of every chunk's forward and backward (the backward runs about twice
    the forward's ops; a recompute runs `recompute_fraction` of the forward's again, its
    attention calls included), files of the disk tier, attention calls (every site of every
    chunk; streamed blocks, each its own call with `BLOCK_OPS` ops more for the merge)."""
    ops = getattr(cost, "ops", 0) * (1 + 2 + recompute_fraction) * n_chunks / max(clock.compiled_speedup, 1.0)
    calls = len(getattr(cost, "attention", ())) * n_chunks * (1 + recompute_fraction / 2)  # fwd = 1/2 a call
    calls += block_reads / 2  # block_reads: forward and backward
    return ((ops + BLOCK_OPS * block_reads) * clock.op_seconds + files * clock.file_seconds
            + calls * clock.attention_call_seconds)
