"""Records of the what-if planner: the cluster it assumes, one plan's figures, the report."""
from __future__ import annotations

import dataclasses
from typing import Optional

from sppo_fx.whatif.models import ModelSpec
from sppo_fx.solver.profiles import DeviceProfile

GiB = 1 << 30

#: Policies; the first is SPPO's own, the others are the baselines.
POLICIES = ("sppo", "full_recompute", "naive_full_offload", "uniform_no_adaptive_offload")
BASELINES = POLICIES[1:]


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
            # what the runtime runs (`sppo_fx.plan.load_layout_plan`, compile(plan=...),
            # examples/train_pipeline.py --plan): the what-if's D ranks per stage are
            # sequence-parallel ranks, each chunk split evenly over them
            "layout": {"pp": self.best.stages, "dp": 1, "sp": self.best.seq_parallel},
            "plan": {"seq_len": self.seq_len, "chunk_lengths": list(self.best.chunk_lengths), "sp_splits": None},
            "offload_ratios_stage0": [round(a, 4) for a in self.best.offload_ratios[0]],
            "baselines": {k: v.figures() for k, v in self.baselines.items()},
            "speedup_over": {k: self.speedup(k) for k in self.baselines},
            "candidates_simulated": self.candidates,
            "search_seconds": self.search_seconds,
        })
        return out


# ----------------------------------------------------------------------------- costs
