"""Predicted step time of a parallel layout (pp × dp × sp) from the cost model and a link.

Per rank, for chunks of c tokens, b sequences, S sequence-parallel and D data-parallel ranks:

    compute   the pipeline schedule clock (`solver.pipeline_chunks.predict`) on 1/(D·S) of every
              chunk's FLOPs: D splits the sequences, S the tokens outside attention and
              the heads inside it (so ~1/S of each). A matmul then has 1/(D·S) of the rows,
              so the efficiency is eff(c / (D·S)) (see `ComputeModel`).
    all-to-all  S > 1: at every attention site of the stage, per chunk, 4 in the forward
              (q, k, v to [all tokens, H/S heads]; the output back) and 4 in the backward
              (their inverses). A rank holds b·H·(c/S)·d of each tensor and sends (S-1)/S of
              it: b·H·c·d·dtype·(S-1)/S² bytes per rank, the group moving S times that
              (H: that tensor's heads, K/V heads repeated up to S when fewer).
    all-reduce  D·S > 1: the stage's parameter gradients are summed over dp × sp after the
              last backward, one all-reduce per parameter: 2·(n-1)/n · bytes each (ring).
    p2p       P > 1: boundary activations forward and their gradients backward are posted
              with isend and overlap compute, except on the fill and drain: one forward
              transfer of the first chunk and one backward transfer of the last chunk per
              stage boundary are added; parameters used by several stages (tied
              embeddings) have their gradients exchanged after the last backward.

Collectives block the rank (the all-to-alls sit inside the chunk, the all-reduce after it),
so their time adds to compute. A collective of B bytes takes latency + B / bandwidth
(`LinkModel`, one per kind, calibrated by `sppo_fx/benchmark/calibration.py`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.pipeline_chunks import ComputeModel, predict


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Time of one collective: latency_s + bytes_sent / bytes_per_s.

    Attributes:
        latency_s: fixed cost of one call.
        bytes_per_s: bytes leaving a rank per second.
    """

    latency_s: float
    bytes_per_s: float

    def seconds(self, bytes_sent: float) -> float:
        return self.latency_s + bytes_sent / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """Shapes of one attention site (for the all-to-all bytes).

    Attributes:
        batch: sequences b. q_heads / kv_heads: heads of q and of k, v. head_dim: d.
        dtype_bytes: bytes per element.
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4


@dataclasses.dataclass
class LayoutPrediction:
    """Predicted figures of one rank of a layout, per step.

    Attributes:
        pp / dp / sp: the layout.
        compute_seconds: the schedule clock on this rank's share of the FLOPs.
        comm_seconds: {"all-to-all" | "all-reduce" | "p2p": seconds on the critical path}.
        comm_bytes: {kind: bytes this rank sends per step} (p2p: all of them, overlapped or not).
        comm_calls: {kind: collective calls per step}.
    """

    pp: int
    dp: int
    sp: int
    compute_seconds: float
    comm_seconds: dict[str, float]
    comm_bytes: dict[str, float]
    comm_calls: dict[str, int]

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + sum(self.comm_seconds.values())

    @property
    def label(self) -> str:
        return f"P={self.pp} D={self.dp} S={self.sp}"


def attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """The attention sites (SDPA nodes) of a captured, analysed graph."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            q, k = node.args[0].meta["val"], node.args[1].meta["val"]
            sites.append(AttentionSite(int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[-1]),
                                       q.dtype.itemsize))
    return sites


def predict_layout(cost: ChunkCostModel, compute: ComputeModel, lengths: list[int], pp: int = 1, dp: int = 1,
                   sp: int = 1, *, link_all_to_all: LinkModel | None = None, link_all_reduce: LinkModel | None = None,
                   link_p2p: LinkModel | None = None, sites: list[AttentionSite] = (),
                   param_bytes: list[int] = (), boundary_bytes_per_token: float = 0.0, microbatches: int = 1,
                   schedule: str = "1f1b", tied_param_bytes: list[int] = ()) -> LayoutPrediction:
    """Predict one rank's step of the layout pp × dp × sp (see the module docstring).

    Args:
        cost: FLOPs model of the whole model at the full micro-batch (all its sequences).
        compute: one rank's compute model (calibrated at the full micro-batch).
        lengths: chunk lengths of one micro-batch.
        pp / dp / sp: stages P, data replicas D, sequence-parallel ranks S.
        link_all_to_all / link_all_reduce / link_p2p: the links (needed when the layout uses them).
        sites: the model's attention sites at the full micro-batch (`attention_sites`).
        param_bytes: bytes of every parameter of the model (split evenly over stages).
        boundary_bytes_per_token: bytes crossing a stage boundary per token of the full
            micro-batch (all sequences), e.g. b·hidden·dtype.
        microbatches / schedule: the pipeline schedule.
        tied_param_bytes: bytes of every parameter that several stages use (tied
            embeddings); with P > 1 a stage sends each one's gradient to the others.

    Returns:
        The LayoutPrediction.
    """
    share = 1.0 / (dp * sp)  # of every chunk's FLOPs and of every matmul's rows
    clock = predict(cost.scaled(share), ComputeModel(compute.flops_per_s, compute.half_efficiency_tokens / share),
                    lengths, pp, microbatches, schedule)
    seconds = {"all-to-all": 0.0, "all-reduce": 0.0, "p2p": 0.0}
    sent = dict.fromkeys(seconds, 0.0)
    calls = dict.fromkeys(seconds, 0)
    if sp > 1:
        stage_sites = len(sites) / pp
        for site in sites:
            kv = site.kv_heads if site.kv_heads >= sp else sp  # repeated up to S
            for c in lengths:
                for heads in (site.q_heads, kv, kv, site.q_heads):  # q, k, v, out
                    moved = site.batch / dp * heads * c * site.head_dim * site.dtype_bytes * (sp - 1) / sp ** 2
                    # forward and backward, once per micro-batch, on this stage's share of sites
                    seconds["all-to-all"] += 2 * microbatches * link_all_to_all.seconds(moved) / pp
                    sent["all-to-all"] += 2 * microbatches * moved / pp
        calls["all-to-all"] = round(8 * microbatches * stage_sites * len(lengths))
    n = dp * sp
    if n > 1:
        for nbytes in param_bytes:
            moved = 2 * (n - 1) / n * nbytes
            seconds["all-reduce"] += link_all_reduce.seconds(moved) / pp
            sent["all-reduce"] += moved / pp
        calls["all-reduce"] = round(len(param_bytes) / pp)
    if pp > 1:
        per_token = boundary_bytes_per_token / dp / sp
        # stage 0 sends every chunk's activations, the last stage every chunk's gradients
        sent["p2p"] = microbatches * sum(lengths) * per_token
        calls["p2p"] = microbatches * len(lengths)
        seconds["p2p"] = (pp - 1) * (link_p2p.seconds(lengths[0] * per_token)
                                     + link_p2p.seconds(lengths[-1] * per_token))
        sent["p2p"] += sum(tied_param_bytes)
        calls["p2p"] += len(tied_param_bytes)
        seconds["p2p"] += sum(link_p2p.seconds(nbytes) for nbytes in tied_param_bytes)
    return LayoutPrediction(pp, dp, sp, clock.step_seconds, seconds, sent, calls)
