"""Costs of one (model, sequence, GPUs, device) question and the search over pipeline
layouts, chunkings and offload ratios (the policies are in the package docstring)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from sppo_fx.errors import SppoError
from sppo_fx.whatif.models import ACT_BYTES_PER_H, KV_BYTES_PER_H, RECOMPUTE_BYTES_PER_H, ModelSpec
from sppo_fx.whatif.results import POLICIES, Cluster, PlanResult
from sppo_fx.schedule import Schedule, build_schedule, with_offload
from sppo_fx.schedule.simulator import ActionCosts, SimResult, simulate
from sppo_fx.solver.partition import balanced_lengths, multiplexed_lengths
from sppo_fx.solver.profiles import DeviceProfile


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
