"""Paper-scale what-if planning: SPPO plans for GPT-7B/13B/65B without capturing a graph.

`plan(model, seq_len, gpus, device)` answers "how would SPPO train this model on this
sequence length on this many GPUs, and how fast?" analytically: the FLOPs and bytes of
every chunk come from closed-form formulas of the model's shape, the step time and the
peak memory from simulating the chosen schedule (:mod:`sppo_fx.schedule.simulator`). Every
figure is a **model prediction** built on the assumptions below, not a measurement.

Model (the paper's Table 2 shapes; GPT blocks, MLP 4·h, vocabulary 50257, bf16)
-------------------------------------------------------------------------------
Per layer and per token (h = hidden size, b = 1 sequence per pipeline):

* parameters: 12·h² + 13·h per layer; embedding V·h on the first stage and a copy of the
  (tied) head V·h on the last stage; no learned position table (RoPE-style).
* forward FLOPs: 24·h² per token per layer (QKV, output projection, MLP) plus 2·h·V per
  token for the head; causal attention 4·h per (query, key) pair per layer (QKᵀ and PV:
  4·b·heads·head_dim). Backward: 2x forward for matmuls, 2.5x for attention
  (FlashAttention recomputes the probabilities).
* activation bytes (Korthikanti et al. 2022, bf16, FlashAttention so no s² scores):
  34·h bytes per token per layer in all, of which the level-1 "skeleton" K and V are
  2·h·2 = 4·h bytes and level 2 (everything else the backward needs) 30·h bytes (7.5x K+V;
  the paper quotes ~18x for its GPT block — we keep the Korthikanti count, which is the
  documented one). With full activation recomputation a layer saves only its input:
  2·h bytes per token, and the backward re-runs the forward.
* workspace held while a chunk computes: one layer's full activations (34·h bytes per
  token) and, on the last stage, fp32 logits (4·V bytes per token; a fused chunked
  cross-entropy that recomputes them in backward is assumed).
* static bytes per GPU: bf16 weights + bf16 gradients (4 bytes/param) replicated over
  the D sequence-parallel ranks of a stage, plus fp32 master weights and Adam m, v
  (12 bytes/param) **sharded over those D ranks** (ZeRO-1 / Megatron distributed
  optimizer); ``shard_optimizer=False`` keeps all 16 bytes/param on every GPU. Weights are
  split across pipeline stages by layers (``layers % stages == 0``).

Parallel layout (``gpus = P x D``)
----------------------------------
P pipeline stages (SPPO's sequence pipeline); each stage is D GPUs that share the stage's
layers and split every chunk's tokens D ways with DeepSpeed-Ulysses-style sequence
parallelism (an all-to-all before and after attention, so D must divide the number of
heads). The whole cluster processes **one sequence per step**, so
``tokens/GPU/s = seq_len / step_seconds / gpus``. Per layer and chunk, Ulysses moves
4 all-to-alls of ``(c/D)·h·2`` bytes in forward and 4 in backward, at the NVLink rate when
D fits in a node and the InfiniBand rate otherwise, not overlapped with compute. Stage
boundaries send ``(c/D)·h·2`` bytes (activation forward, gradient back) over a link of
the InfiniBand rate (NVLink when the whole job fits in one node). After the pipeline, the
gradients of each stage are reduced over its D ranks (ring, ``2·(D-1)/D·2`` bytes/param).
One micro-batch, chunk-level 1F1B (with M = 1 it runs every forward chunk, then every
backward chunk, on each stage).

Chunking and offload (the policies compared)
--------------------------------------------
Chunks are FLOPs-balanced (`balanced_lengths`), N a power of two with 1K-64K tokens per
GPU per chunk (at most 256 chunks). Policies:

* ``sppo`` (adaptive): sequence-aware offload ratios per stage: chunk i offloads
  ``a_i = min(1, F_{i+1} · BW / A_i)`` of its level-2 bytes ``A_i`` — what the D2H engine
  moves during the next chunk's forward ``F_{i+1}`` (BW: D2H, or min(D2H, disk write) for the
  disk tier) — and the last chunk (first to run backward) offloads nothing. If the plan
  still does not fit, the earliest chunks' ratios are raised to 1 (they wait longest for
  their backward). The multiplexed partition (first/last chunk cut P ways) is tried too.
* ``full_recompute``: the no-offload baseline — every layer recomputed in backward.
* ``naive_full_offload``: every chunk offloads all of its level-2 activations.
* ``uniform_no_adaptive_offload``: one offload ratio for every chunk (the smallest of
  0, 0.1, ..., 1 that fits), i.e. SPPO without sequence-aware ratios.

Each policy searches P (divisors of gpus with layers % P == 0 and heads % D == 0) and N,
pruning with a lower bound on the step time, and keeps the fastest plan whose simulated
peak fits the device memory (minus a 2 GiB reserve for the CUDA context and
communication buffers) and whose offloaded bytes fit the host memory per GPU (else the
disk tier is tried). Sequence lengths accept binary suffixes: 128K = 131072, 4M = 4·2^20.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Iterable, Optional

from tabulate import tabulate

from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.schedule import Schedule, build_schedule, with_offload
from sppo_fx.solver.partition import ChunkCostModel, balanced_lengths, multiplexed_lengths
from sppo_fx.solver.profiles import DeviceProfile, get_profile
from sppo_fx.schedule.simulator import ActionCosts, SimResult, simulate
from sppo_fx.units import parse_bytes

__all__ = ["ModelSpec", "MODELS", "Cluster", "PlanResult", "WhatIfReport", "POLICIES",
           "BASELINES", "get_model", "parse_tokens", "parse_bytes", "plan", "plan_config",
           "plan_simulation", "report_simulation", "format_report"]

GiB = 1 << 30

#: Policies; the first is SPPO's own, the others are the baselines.
POLICIES = ("sppo", "full_recompute", "naive_full_offload", "uniform_no_adaptive_offload")
BASELINES = POLICIES[1:]

#: Bytes per token per layer (bf16): all saved activations, of which K+V; recompute saves the input.
ACT_BYTES_PER_H = 34
KV_BYTES_PER_H = 4
RECOMPUTE_BYTES_PER_H = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT-style decoder (MLP 4·h, tied embedding/head, bf16 training).

    Attributes:
        name: label.
        layers: transformer blocks L.
        hidden: model width h.
        heads: attention heads (Ulysses sequence parallelism needs D | heads).
        vocab: vocabulary size V.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise SppoError(f"ModelSpec.{f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise SppoError(f"hidden={self.hidden} is not divisible by heads={self.heads}")

    @property
    def params_per_layer(self) -> int:
        """12·h² + 13·h (QKV, projection, MLP weights and biases, two norms)."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def params(self) -> int:
        """All parameters (one embedding, tied head)."""
        return self.layers * self.params_per_layer + self.vocab * self.hidden

    @property
    def chunk_cost(self) -> ChunkCostModel:
        """Forward FLOPs of the whole model: a = 24·h²·L + 2·h·V per token, q = 4·h·L per pair."""
        h, L = self.hidden, self.layers
        return ChunkCostModel(24.0 * h * h * L + 2.0 * h * self.vocab, 4.0 * h * L)


#: The paper's Table 2 models.
MODELS = {
    "gpt-7b": ModelSpec("gpt-7b", 32, 4096, 32),
    "gpt-13b": ModelSpec("gpt-13b", 40, 5120, 40),
    "gpt-65b": ModelSpec("gpt-65b", 80, 8192, 64),
}


def get_model(name: Optional[str] = None, layers: Optional[int] = None, hidden: Optional[int] = None,
              heads: Optional[int] = None, vocab: Optional[int] = None) -> ModelSpec:
    """A built-in model, optionally with fields overridden, or a custom one.

    Args:
        name: "gpt-7b", "gpt-13b", "gpt-65b", or None / "custom" (then layers, hidden
            and heads are required).
        layers / hidden / heads / vocab: overrides.

    Returns:
        The ModelSpec.
    """
    if name is None or name == "custom":
        if None in (layers, hidden, heads):
            raise SppoError("a custom model needs --layers, --hidden and --heads")
        return ModelSpec("custom", layers, hidden, heads, vocab or 50257)
    key = name.strip().lower()
    if key not in MODELS:
        raise SppoError(f"unknown model {name!r}; built-in: {', '.join(MODELS)} (or custom with "
                        f"--layers/--hidden/--heads)")
    base = MODELS[key]
    over = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab).items()
            if v is not None}
    if over:
        return dataclasses.replace(base, name=f"{base.name}(custom)", **over)
    return base


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_tokens(text) -> int:
    """``"4M"`` -> 4194304, ``"640K"`` / ``"640k"`` -> 655360, ``"1000"`` -> 1000.

    Suffixes are binary (K = 1024, M = 1024², G = 1024³); a decimal mantissa is allowed
    ("1.5M").
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise SppoError(f"sequence length must be >= 1, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if m is None:
        raise SppoError(f"cannot read the sequence length {text!r}: use an integer with an "
                        f"optional K/M/G suffix, e.g. 4M, 640K, 128k")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise SppoError(f"sequence length must be >= 1, got {text!r}")
    return int(round(value))


@dataclasses.dataclass
class Cluster:
    """Interconnect and host side of the cluster (per GPU figures).

    Attributes:
        gpus_per_node: GPUs sharing a node's NVLink.
        nvlink_bytes_per_s: per-GPU all-to-all / p2p rate inside a node (A100 NVLink3).
        ib_bytes_per_s: per-GPU rate between nodes (200 Gb/s HDR InfiniBand).
        link_latency_s: per-message latency.
        host_memory_bytes: pinned host memory available per GPU for offloaded activations
            (a 2 TiB node with 8 GPUs -> 256 GiB).
        reserve_bytes: device memory kept free (CUDA context, NCCL buffers, fragmentation).
    """

    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 150e9
    ib_bytes_per_s: float = 25e9
    link_latency_s: float = 10e-6
    host_memory_bytes: int = 256 * GiB
    reserve_bytes: int = 2 * GiB


@dataclasses.dataclass
class PlanResult:
    """One policy's plan and its predicted figures (per GPU).

    Attributes:
        policy: one of POLICIES.
        feasible: whether it fits device (and host) memory.
        stages / seq_parallel / chunks: P, D, N (gpus = P·D).
        chunk_lengths: tokens of the whole sequence per chunk.
        multiplexed: first/last chunks cut P ways.
        offload_ratios: per stage, per chunk, the fraction of level-2 bytes offloaded.
        tier: "host", "disk" or "none" (nothing offloaded).
        step_seconds: predicted step (simulated pipeline + gradient reduction).
        pipeline_seconds: the simulated pipeline makespan alone.
        bubble_fraction: 1 - busy / (P · pipeline makespan).
        stall_seconds: the longest time a stage's compute waited for prefetches.
        tokens_per_gpu_per_s: seq_len / step_seconds / gpus.
        peak_bytes_per_gpu: the largest simulated device peak over stages.
        peak_host_bytes_per_gpu: the largest host bytes of offloaded activations.
        model / seq_len / gpus / device: the question asked.
    """

    policy: str
    feasible: bool
    stages: int
    seq_parallel: int
    chunks: int
    chunk_lengths: list[int]
    multiplexed: bool
    offload_ratios: list[list[float]]
    tier: str
    step_seconds: float
    pipeline_seconds: float
    bubble_fraction: float
    stall_seconds: float
    tokens_per_gpu_per_s: float
    peak_bytes_per_gpu: float
    peak_host_bytes_per_gpu: float
    model: str = ""
    seq_len: int = 0
    gpus: int = 0
    device: str = ""

    def figures(self) -> dict:
        """The headline figures as JSON-ready values."""
        return {
            "feasible": self.feasible,
            "stages": self.stages,
            "seq_parallel": self.seq_parallel,
            "chunks": self.chunks,
            "multiplexed": self.multiplexed,
            "tier": self.tier,
            "step_seconds": self.step_seconds,
            "bubble_fraction": self.bubble_fraction,
            "stall_seconds": self.stall_seconds,
            "tokens_per_gpu_per_s": self.tokens_per_gpu_per_s,
            "peak_bytes_per_gpu": int(self.peak_bytes_per_gpu),
            "peak_host_bytes_per_gpu": int(self.peak_host_bytes_per_gpu),
        }


@dataclasses.dataclass
class WhatIfReport:
    """The answer of :func:`plan`: SPPO's plan and the baselines'.

    Attributes:
        best: the SPPO plan.
        baselines: {policy: PlanResult} for BASELINES.
        model / seq_len / gpus / profile / cluster / shard_optimizer: the question.
        candidates: how many (P, N, partition) configurations were simulated.
        search_seconds: wall time of the search.
    """

    best: PlanResult
    baselines: dict[str, PlanResult]
    model: ModelSpec
    seq_len: int
    gpus: int
    profile: DeviceProfile
    cluster: Cluster
    shard_optimizer: bool
    candidates: int
    search_seconds: float

    def speedup(self, baseline: str = "full_recompute") -> Optional[float]:
        """tokens/GPU/s of SPPO over a baseline's (None if the baseline does not fit)."""
        b = self.baselines.get(baseline)
        if b is None or not b.feasible or b.tokens_per_gpu_per_s <= 0:
            return None
        return self.best.tokens_per_gpu_per_s / b.tokens_per_gpu_per_s

    def to_dict(self) -> dict:
        """JSON-ready dict: stages, chunks, tokens_per_gpu_per_s, peak_bytes_per_gpu,
        baselines (each with the same figures) and details."""
        out = dict(self.best.figures())
        out.update({
            "prediction": "analytic model + schedule simulation (not a measurement)",
            "model": self.model.name,
            "layers": self.model.layers, "hidden": self.model.hidden, "heads": self.model.heads,
            "params": self.model.params,
            "seq_len": self.seq_len,
            "gpus": self.gpus,
            "device": self.profile.name,
            "shard_optimizer": self.shard_optimizer,
            "chunk_lengths": list(self.best.chunk_lengths),
            "offload_ratios_stage0": [round(a, 4) for a in self.best.offload_ratios[0]],
            "baselines": {k: v.figures() for k, v in self.baselines.items()},
            "speedup_over": {k: self.speedup(k) for k in self.baselines},
            "candidates_simulated": self.candidates,
            "search_seconds": self.search_seconds,
        })
        return out


# ----------------------------------------------------------------------------- costs


@dataclasses.dataclass
class _Candidate:
    stages: int
    seq_parallel: int
    lengths: list[int]
    multiplexed: bool


class _Planner:
    """Costs and evaluation of candidates for one (model, seq, gpus, device) question."""

    def __init__(self, model: ModelSpec, seq_len: int, gpus: int, profile: DeviceProfile,
                 cluster: Cluster, shard_optimizer: bool):
        self.m, self.T, self.gpus, self.prof, self.cl = model, seq_len, gpus, profile, cluster
        self.shard = shard_optimizer
        self.usable = profile.memory_bytes - cluster.reserve_bytes
        self.simulated = 0
        self.min_peak: Optional[tuple[float, _Candidate]] = None
        self._sched_cache: dict[tuple[int, int], Schedule] = {}
        self._off_cache: dict[tuple, Schedule] = {}   # schedules with OFF/PRE/WAIT by offloaded set

    # -- layout ------------------------------------------------------------------
    def layouts(self, stages: Optional[int] = None) -> list[tuple[int, int]]:
        """(P, D) pairs allowed by the model and the GPU count."""
        out = []
        for P in range(1, self.gpus + 1):
            if self.gpus % P or (stages is not None and P != stages):
                continue
            D = self.gpus // P
            if self.m.layers % P or self.m.heads % D:
                continue
            out.append((P, D))
        return out

    def chunk_counts(self, D: int, chunks: Optional[int] = None) -> list[int]:
        if chunks is not None:
            return [chunks] if chunks <= self.T else []
        local = self.T / D
        out, n = [], 1
        while n <= min(256, self.T):
            if 1024 <= local / n <= 65536 or (n == 1 and local < 1024):
                out.append(n)
            n *= 2
        if not out:  # very long sequences: as many chunks as allowed
            out = [min(256, self.T)]
        return out

    def link_rates(self, P: int, D: int) -> tuple[float, float]:
        """(pipeline link, Ulysses / gradient reduction rate) bytes/s per GPU."""
        cl = self.cl
        sp = cl.nvlink_bytes_per_s if D <= cl.gpus_per_node else cl.ib_bytes_per_s
        pp = cl.nvlink_bytes_per_s if P * D <= cl.gpus_per_node else cl.ib_bytes_per_s
        return pp, sp

    def stage_params(self, P: int) -> list[int]:
        Ls = self.m.layers // P
        out = []
        for s in range(P):
            p = Ls * self.m.params_per_layer
            if s == 0:
                p += self.m.vocab * self.m.hidden
            if s == P - 1 and P > 1:
                p += self.m.vocab * self.m.hidden
            out.append(p)
        return out

    def static_bytes(self, P: int, D: int) -> list[float]:
        per_param = 4.0 + (12.0 / D if self.shard else 12.0)
        return [p * per_param for p in self.stage_params(P)]

    def grad_reduce_seconds(self, P: int, D: int) -> float:
        if D == 1:
            return 0.0
        _, sp = self.link_rates(P, D)
        return max(2.0 * (D - 1) / D * 2.0 * p / sp for p in self.stage_params(P))

    def tables(self, cand: _Candidate, recompute: bool) -> dict:
        """Per [stage][chunk] seconds and bytes of one GPU."""
        m, prof = self.m, self.prof
        P, D = cand.stages, cand.seq_parallel
        Ls = m.layers // P
        h, V = float(m.hidden), float(m.vocab)
        _, sp = self.link_rates(P, D)
        rate = prof.flops_per_s
        n = len(cand.lengths)
        fl = [[0.0] * n for _ in range(P)]
        bl = [[0.0] * n for _ in range(P)]
        act = [[0.0] * n for _ in range(P)]
        kv = [[0.0] * n for _ in range(P)]
        snd = [[0.0] * n for _ in range(P)]
        ws = [[0.0] * n for _ in range(P)]
        level2 = (RECOMPUTE_BYTES_PER_H if recompute else ACT_BYTES_PER_H - KV_BYTES_PER_H) * h
        start = 0
        for i, c in enumerate(cand.lengths):
            cl = c / D
            eff_rate = rate * prof.efficiency(cl)
            mm = 24.0 * h * h * c / D
            attn = 4.0 * h * c * (start + (c + 1) / 2.0) / D
            a2a = 0.0 if D == 1 else 4.0 * cl * h * 2.0 * (D - 1) / D / sp
            layer_f = (mm + attn) / eff_rate + a2a
            layer_b = (2.0 * mm + 2.5 * attn) / eff_rate + a2a
            head_f = 2.0 * h * V * cl / eff_rate
            for s in range(P):
                last = s == P - 1
                f = Ls * layer_f + (head_f if last else 0.0)
                b = Ls * layer_b + (2.0 * head_f if last else 0.0)
                if recompute:
                    b += Ls * layer_f
                fl[s][i], bl[s][i] = f, b
                act[s][i] = level2 * cl * Ls
                kv[s][i] = KV_BYTES_PER_H * h * cl * Ls
                snd[s][i] = 2.0 * h * cl
                ws[s][i] = ACT_BYTES_PER_H * h * cl + (4.0 * V * cl if last else 0.0)
            start += c
        return dict(fwd=fl, bwd=bl, act=act, kv=kv, snd=snd, ws=ws)

    @staticmethod
    def lower_bound(tab: dict, P: int) -> float:
        """A lower bound on the pipeline makespan (no communication, no stalls).

        Stage s cannot start F(s, i) before chunk i has passed the earlier stages
        (sum of F(s', i), s' < s), and after B(s, j) chunk j still has to pass back through
        them; in between, stage s runs all of its remaining work in sequence.
        """
        fwd, bwd = tab["fwd"], tab["bwd"]
        n = len(fwd[0])
        up_f = [0.0] * n      # sum over earlier stages of F(s', i)
        up_b = [0.0] * n
        best = 0.0
        for s in range(P):
            f, b = fwd[s], bwd[s]
            fill, done = 0.0, 0.0
            for i in range(n):
                fill = max(fill, up_f[i] - done)
                done += f[i]
            drain, later = 0.0, 0.0
            for j in range(n):       # backward order is N-1 .. 0: chunks < j come after B(s, j)
                drain = max(drain, up_b[j] - later)
                later += b[j]
            best = max(best, fill + sum(f) + sum(b) + drain)
            for i in range(n):
                up_f[i] += f[i]
                up_b[i] += b[i]
        return best

    def memory_floor(self, tab: dict, cand: _Candidate) -> float:
        """Bytes no policy can avoid on the fullest stage: when the first backward starts,
        the static bytes, every chunk's K/V and the K/V gradient accumulators, and the
        backward's workspace are all on the device."""
        static = self.static_bytes(cand.stages, cand.seq_parallel)
        return max(static[s] + 2.0 * sum(tab["kv"][s]) + tab["ws"][s][-1] for s in range(cand.stages))

    # -- simulation ----------------------------------------------------------------
    def schedule(self, P: int, N: int, ratios: Optional[list[list[float]]]) -> Schedule:
        key = (P, N)
        if key not in self._sched_cache:
            self._sched_cache[key] = build_schedule("1f1b", P, 1, N)
        base = self._sched_cache[key]
        if not ratios:
            return base
        mask = tuple(tuple(a > 0 for a in row) for row in ratios)
        ck = (P, N, mask)
        if ck not in self._off_cache:
            keys = [(s, 0, i) for s in range(P) for i in range(N) if mask[s][i]]
            self._off_cache[ck] = with_offload(base, keys) if keys else base
        return self._off_cache[ck]

    def run(self, cand: _Candidate, tab: dict, ratios, tier: str, record: bool = False) -> SimResult:
        P, D = cand.stages, cand.seq_parallel
        n = len(cand.lengths)
        off = None
        if ratios:
            off = [[ratios[s][i] * tab["act"][s][i] for i in range(n)] for s in range(P)]
        costs = ActionCosts(forward_seconds=tab["fwd"], backward_seconds=tab["bwd"],
                            activation_bytes=tab["act"], offload_bytes=off, kv_bytes=tab["kv"],
                            send_bytes=tab["snd"], workspace_bytes=tab["ws"],
                            static_bytes=self.static_bytes(P, D))
        pp, _ = self.link_rates(P, D)
        self.simulated += 1
        return simulate(self.schedule(P, n, ratios), costs, self.prof, link_bytes_per_s=pp,
                        link_latency_s=self.cl.link_latency_s, tier=tier, record_events=record)

    def fits(self, sim: SimResult) -> bool:
        return sim.max_peak_bytes <= self.usable

    def _note_peak(self, sim: SimResult, cand: _Candidate):
        if self.min_peak is None or sim.max_peak_bytes < self.min_peak[0]:
            self.min_peak = (sim.max_peak_bytes, cand)

    # -- policies --------------------------------------------------------------------
    def hide_ratios(self, tab: dict, bw: float) -> list[list[float]]:
        """Sequence-aware ratios: a_i = min(1, F_{i+1}·bw / A_i); the last chunk 0."""
        out = []
        for f_row, a_row in zip(tab["fwd"], tab["act"]):
            n = len(a_row)
            row = [min(1.0, f_row[i + 1] * bw / a_row[i]) if a_row[i] > 0 else 0.0
                   for i in range(n - 1)] + [0.0]
            out.append(row)
        return out

    def evaluate(self, policy: str, cand: _Candidate, tab: dict):
        """(SimResult, ratios, tier) of the policy's plan on this candidate, or None."""
        P = cand.stages
        n = len(cand.lengths)
        if policy == "full_recompute":
            sim = self.run(cand, tab, None, "host")
            self._note_peak(sim, cand)
            return (sim, [[0.0] * n for _ in range(P)], "none") if self.fits(sim) else None
        for tier in ("host", "disk"):
            res = self._evaluate_tier(policy, cand, tab, tier)
            if res is None:
                continue
            sim, ratios = res
            if sim.max_peak_bytes > self.usable:
                continue
            if max(sim.peak_host_bytes.values()) <= self.cl.host_memory_bytes or tier == "disk":
                return sim, ratios, tier
        return None

    def _evaluate_tier(self, policy, cand, tab, tier):
        P, n = cand.stages, len(cand.lengths)
        prof = self.prof
        bw = prof.d2h_bytes_per_s if tier == "host" else min(prof.d2h_bytes_per_s,
                                                              prof.disk_write_bytes_per_s)
        if policy == "naive_full_offload":
            ratios = [[1.0] * n for _ in range(P)]
            sim = self.run(cand, tab, ratios, tier)
            self._note_peak(sim, cand)
            return sim, ratios
        if policy == "uniform_no_adaptive_offload":
            grid = [k / 10 for k in range(11)]
            lo, hi, found = 0, len(grid) - 1, None
            while lo <= hi:  # smallest ratio that fits (the peak falls as the ratio grows)
                mid = (lo + hi) // 2
                ratios = [[grid[mid]] * n for _ in range(P)]
                sim = self.run(cand, tab, ratios, tier)
                self._note_peak(sim, cand)
                if self.fits(sim):
                    found, hi = (sim, ratios), mid - 1
                else:
                    lo = mid + 1
            return found
        if policy == "sppo":
            ratios = self.hide_ratios(tab, bw)
            sim = self.run(cand, tab, ratios, tier)
            self._note_peak(sim, cand)
            for _ in range(6):  # raise the earliest chunks to 1 until the peak fits
                if self.fits(sim):
                    return sim, ratios
                changed = False
                for s in range(P):
                    excess = sim.peak_bytes[s] - self.usable
                    if excess <= 0:
                        continue
                    need = excess * 1.05
                    for i in range(n - 1):
                        if need <= 0:
                            break
                        add = (1.0 - ratios[s][i]) * tab["act"][s][i]
                        if add > 0:
                            ratios[s][i] = 1.0
                            need -= add
                            changed = True
                if not changed:
                    break
                sim = self.run(cand, tab, ratios, tier)
                self._note_peak(sim, cand)
            return (sim, ratios) if self.fits(sim) else None
        raise SppoError(f"unknown policy {policy!r}; choose one of {POLICIES}")

    def result(self, policy: str, cand: _Candidate, found, feasible: bool = True) -> PlanResult:
        sim, ratios, tier = found
        P, D = cand.stages, cand.seq_parallel
        step = sim.step_seconds + self.grad_reduce_seconds(P, D)
        if tier != "none" and not any(a > 0 for row in ratios for a in row):
            tier = "none"
        return PlanResult(
            policy=policy, feasible=feasible, stages=P, seq_parallel=D, chunks=len(cand.lengths),
            chunk_lengths=list(cand.lengths), multiplexed=cand.multiplexed, offload_ratios=ratios,
            tier=tier, step_seconds=step, pipeline_seconds=sim.step_seconds,
            bubble_fraction=sim.bubble_fraction, stall_seconds=max(sim.stall_seconds.values()),
            tokens_per_gpu_per_s=(self.T / step / self.gpus) if feasible and step > 0 else 0.0,
            peak_bytes_per_gpu=sim.max_peak_bytes,
            peak_host_bytes_per_gpu=max(sim.peak_host_bytes.values()),
            model=self.m.name, seq_len=self.T, gpus=self.gpus, device=self.prof.name)

    def candidates(self, policy: str, stages=None, chunks=None) -> list[_Candidate]:
        out = []
        for P, D in self.layouts(stages):
            for N in self.chunk_counts(D, chunks):
                lengths = balanced_lengths(self.T, N, self.m.chunk_cost)
                out.append(_Candidate(P, D, lengths, False))
                if policy == "sppo" and P > 1 and N > 1 and chunks is None:
                    mux = multiplexed_lengths(lengths, P)
                    if len(mux) <= 512:
                        out.append(_Candidate(P, D, mux, True))
        return out

    def search(self, policy: str, stages=None, chunks=None) -> Optional[PlanResult]:
        """The fastest feasible plan of a policy (branch and bound on the lower bound)."""
        recompute = policy == "full_recompute"
        scored = []
        for cand in self.candidates(policy, stages, chunks):
            tab = self.tables(cand, recompute)
            floor = self.memory_floor(tab, cand)
            if floor > self.usable:
                if self.min_peak is None or floor < self.min_peak[0]:
                    self.min_peak = (floor, cand)
                continue
            lb = self.lower_bound(tab, cand.stages) + self.grad_reduce_seconds(cand.stages, cand.seq_parallel)
            scored.append((lb, cand.stages, len(cand.lengths), cand.multiplexed, cand, tab))
        scored.sort(key=lambda x: x[:4])
        best: Optional[PlanResult] = None
        for lb, _, _, _, cand, tab in scored:
            if best is not None and lb >= best.step_seconds:
                break
            found = self.evaluate(policy, cand, tab)
            if found is None:
                continue
            res = self.result(policy, cand, found)
            if best is None or res.step_seconds < best.step_seconds:
                best = res
        return best

    def infeasible(self, policy: str) -> PlanResult:
        """Placeholder result of a policy with no feasible plan (figures of the least-memory
        configuration seen, tokens/GPU/s 0)."""
        peak, cand = self.min_peak if self.min_peak else (float("nan"), None)
        P = cand.stages if cand else 0
        return PlanResult(policy=policy, feasible=False, stages=P,
                          seq_parallel=cand.seq_parallel if cand else 0,
                          chunks=len(cand.lengths) if cand else 0,
                          chunk_lengths=list(cand.lengths) if cand else [],
                          multiplexed=cand.multiplexed if cand else False, offload_ratios=[[]],
                          tier="none", step_seconds=0.0, pipeline_seconds=0.0, bubble_fraction=0.0,
                          stall_seconds=0.0, tokens_per_gpu_per_s=0.0,
                          peak_bytes_per_gpu=peak if math.isfinite(peak) else 0.0,
                          peak_host_bytes_per_gpu=0.0, model=self.m.name, seq_len=self.T,
                          gpus=self.gpus, device=self.prof.name)


def _profile(device) -> DeviceProfile:
    return device if isinstance(device, DeviceProfile) else get_profile(str(device))


def _model(model) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else get_model(str(model))


def plan(model, seq_len, gpus: int, device="a100-80gb", *, cluster: Optional[Cluster] = None,
         stages: Optional[int] = None, chunks: Optional[int] = None, shard_optimizer: bool = True,
         baselines: Iterable[str] = BASELINES) -> WhatIfReport:
    """Choose the SPPO plan (P, N, offload ratios) and predict it and the baselines.

    Args:
        model: a ModelSpec or a built-in name ("gpt-7b", "gpt-13b", "gpt-65b").
        seq_len: tokens per sequence (int or "4M" / "640K").
        gpus: total GPUs (= stages x sequence-parallel width).
        device: a DeviceProfile or a built-in profile name.
        cluster: interconnect / host-memory figures (default Cluster()).
        stages / chunks: fix P and/or N instead of searching.
        shard_optimizer: shard fp32 master weights and Adam states over the D ranks.
        baselines: which baselines to predict too.

    Returns:
        The WhatIfReport. Raises InfeasibleBudget (an SppoError) when no SPPO plan fits,
        naming the smallest device memory any configuration needs.
    """
    t0 = time.perf_counter()
    m, prof = _model(model), _profile(device)
    T = parse_tokens(seq_len)
    if not isinstance(gpus, int) or gpus < 1:
        raise SppoError(f"gpus must be a positive integer, got {gpus!r}")
    if chunks is not None and not (isinstance(chunks, int) and 1 <= chunks <= T):
        raise SppoError(f"chunks must be an integer in [1, {T}] (the sequence length), got {chunks!r}")
    cl = cluster or Cluster()
    pl = _Planner(m, T, gpus, prof, cl, shard_optimizer)
    if not pl.layouts(stages):
        why = f"stages={stages}: " if stages is not None else ""
        raise SppoError(f"{why}no pipeline layout of {gpus} GPUs fits {m.name}: stages must divide "
                        f"both gpus ({gpus}) and layers ({m.layers}), and gpus/stages must divide "
                        f"heads ({m.heads})")
    best = pl.search("sppo", stages, chunks)
    if best is None:
        need = pl.min_peak[0] + cl.reserve_bytes if pl.min_peak else float("nan")
        cand = pl.min_peak[1] if pl.min_peak else None
        where = (f" (the least-memory configuration is {cand.stages} stages x {cand.seq_parallel}-way "
                 f"sequence parallel, {len(cand.lengths)} chunks)") if cand else ""
        raise InfeasibleBudget(
            f"no SPPO plan for {m.name} at {T} tokens on {gpus} x {prof.name} fits in "
            f"{prof.memory_bytes / GiB:.1f} GiB of device memory: the minimum needed is at least "
            f"{need / GiB:.1f} GiB per GPU{where}, including {cl.reserve_bytes / GiB:.0f} GiB reserve "
            f"(static bytes, K/V and their gradients cannot be offloaded in this model). "
            f"Use more GPUs, a shorter sequence or a device with more memory.",
            int(need) if math.isfinite(need) else 0)
    base = {}
    for policy in baselines:
        pl.min_peak = None
        res = pl.search(policy, stages, chunks)
        base[policy] = res if res is not None else pl.infeasible(policy)
    return WhatIfReport(best=best, baselines=base, model=m, seq_len=T, gpus=gpus, profile=prof,
                        cluster=cl, shard_optimizer=shard_optimizer, candidates=pl.simulated,
                        search_seconds=time.perf_counter() - t0)


def plan_config(model, seq_len, gpus: int, device="a100-80gb", *, stages: int, chunks: int,
                policy: str = "sppo", cluster: Optional[Cluster] = None,
                shard_optimizer: bool = True, multiplexed: bool = False) -> PlanResult:
    """Plan and simulate one fixed configuration (P, N) under a policy.

    Args:
        model / seq_len / gpus / device / cluster / shard_optimizer: as for :func:`plan`.
        stages / chunks: P and N.
        policy: one of POLICIES.
        multiplexed: cut the first and last chunks P ways.

    Returns:
        The PlanResult; ``feasible`` is False (with the figures of the attempt) when the
        plan does not fit.
    """
    m, prof = _model(model), _profile(device)
    T = parse_tokens(seq_len)
    pl = _Planner(m, T, gpus, prof, cluster or Cluster(), shard_optimizer)
    if gpus % stages or m.layers % stages or m.heads % (gpus // stages):
        raise SppoError(f"stages={stages} does not fit {gpus} GPUs and {m.name} (stages must divide "
                        f"gpus and layers; gpus/stages must divide heads)")
    lengths = balanced_lengths(T, chunks, m.chunk_cost)
    if multiplexed:
        lengths = multiplexed_lengths(lengths, stages)
    cand = _Candidate(stages, gpus // stages, lengths, multiplexed)
    tab = pl.tables(cand, policy == "full_recompute")
    found = pl.evaluate(policy, cand, tab)
    if found is not None:
        return pl.result(policy, cand, found)
    n = len(lengths)
    ratios = ([[1.0] * (n - 1) + [0.0] for _ in range(stages)] if policy != "full_recompute" else None)
    sim = pl.run(cand, tab, ratios, "host")
    return pl.result(policy, cand, (sim, ratios or [[0.0] * n for _ in range(stages)], "host"),
                     feasible=False)


def plan_simulation(result: PlanResult, model=None, device=None, *, cluster: Optional[Cluster] = None,
                    shard_optimizer: bool = True) -> SimResult:
    """Re-simulate a PlanResult with every event recorded (for :mod:`sppo_fx.trace`).

    Args:
        result: a PlanResult from :func:`plan` or :func:`plan_config`.
        model: the ModelSpec or name (default: ``result.model``, which must be built-in).
        device: the profile or its name (default: ``result.device``).
        cluster / shard_optimizer: as used for the plan.

    Returns:
        The SimResult with events and memory timelines.
    """
    m = _model(model if model is not None else result.model)
    return _simulate_result(result, m, _profile(device or result.device), cluster, shard_optimizer)


def _simulate_result(result: PlanResult, m: ModelSpec, prof: DeviceProfile, cluster, shard) -> SimResult:
    pl = _Planner(m, result.seq_len, result.gpus, prof, cluster or Cluster(), shard)
    cand = _Candidate(result.stages, result.seq_parallel, list(result.chunk_lengths), result.multiplexed)
    tab = pl.tables(cand, result.policy == "full_recompute")
    ratios = result.offload_ratios if result.tier != "none" else None
    return pl.run(cand, tab, ratios, result.tier if result.tier in ("host", "disk") else "host",
                  record=True)


def report_simulation(report: WhatIfReport, policy: str = "sppo") -> SimResult:
    """The recorded simulation of one plan of a report (SPPO's by default)."""
    res = report.best if policy == "sppo" else report.baselines[policy]
    if not res.feasible:
        raise SppoError(f"the {policy} plan does not fit; there is nothing to simulate")
    return _simulate_result(res, report.model, report.profile, report.cluster, report.shard_optimizer)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def format_report(report: WhatIfReport) -> str:
    """Human-readable tables of a WhatIfReport."""
    m, b = report.model, report.best
    lines = [
        f"SPPO what-if plan — MODEL PREDICTIONS (analytic costs + schedule simulation), not measurements",
        f"model {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, vocab {m.vocab}, "
        f"{m.params / 1e9:.2f}B params; sequence {report.seq_len:,} tokens; {report.gpus} x "
        f"{report.profile.name} ({report.profile.flops_per_s / 1e12:.0f} TFLOP/s achievable, "
        f"D2H {report.profile.d2h_bytes_per_s / 1e9:.0f} GB/s, {_gib(report.profile.memory_bytes)} GiB)",
        "",
    ]
    rows = [("pipeline stages P", b.stages),
            ("sequence-parallel width D (Ulysses)", b.seq_parallel),
            ("chunks N", f"{b.chunks}" + (" (multiplexed: first/last cut P ways)" if b.multiplexed else "")),
            ("tokens per GPU per chunk", f"{min(b.chunk_lengths) / b.seq_parallel:,.0f} .. "
                                         f"{max(b.chunk_lengths) / b.seq_parallel:,.0f}"),
            ("offload tier", b.tier),
            ("offload ratio, stage 0, chunks 0/mid/last",
             " / ".join(f"{b.offload_ratios[0][k]:.2f}" for k in (0, len(b.offload_ratios[0]) // 2, -1))),
            ("step time", f"{b.step_seconds:.3f} s (pipeline {b.pipeline_seconds:.3f} s)"),
            ("bubble fraction", f"{b.bubble_fraction:.1%}"),
            ("prefetch stall (worst stage)", f"{b.stall_seconds:.3f} s"),
            ("tokens / GPU / s", f"{b.tokens_per_gpu_per_s:,.1f}"),
            ("peak device memory / GPU", f"{_gib(b.peak_bytes_per_gpu)} GiB of "
                                         f"{_gib(report.profile.memory_bytes)} GiB"),
            ("peak host memory / GPU", f"{_gib(b.peak_host_bytes_per_gpu)} GiB")]
    lines.append("Chosen SPPO plan (adaptive sequence-aware offload)")
    lines.append(tabulate(rows, tablefmt="simple"))
    lines.append("")
    comp = []
    for name, r in [("sppo (adaptive offload)", b)] + list(report.baselines.items()):
        sp = (b.tokens_per_gpu_per_s / r.tokens_per_gpu_per_s) if r.feasible and r.tokens_per_gpu_per_s else None
        comp.append((name, "yes" if r.feasible else "NO", r.stages or "-", r.seq_parallel or "-",
                     r.chunks or "-", f"{r.tokens_per_gpu_per_s:,.1f}" if r.feasible else "-",
                     f"{r.step_seconds:.3f}" if r.feasible else "-",
                     f"{r.bubble_fraction:.1%}" if r.feasible else "-",
                     _gib(r.peak_bytes_per_gpu), f"{sp:.2f}x" if sp else "-"))
    lines.append("Policies compared (each with its own best P, N)")
    lines.append(tabulate(comp, headers=["policy", "fits", "P", "D", "N", "tokens/GPU/s", "step s",
                                         "bubble", "peak GiB", "SPPO speedup"]))
    lines.append("")
    lines.append(f"Assumptions: one sequence per step; GPUs = P x D with D-way Ulysses sequence "
                 f"parallelism inside a stage; bf16 activations 34·h bytes/token/layer (K+V 4·h); "
                 f"optimizer states {'sharded over D (ZeRO-1)' if report.shard_optimizer else 'not sharded (16 B/param)'}; "
                 f"{_gib(report.cluster.reserve_bytes)} GiB device reserve; host memory "
                 f"{_gib(report.cluster.host_memory_bytes)} GiB/GPU. See sppo_fx/whatif.py.")
    lines.append(f"Searched {report.candidates} simulated configurations in {report.search_seconds:.2f} s.")
    return "\n".join(lines)
