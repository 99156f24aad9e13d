"""Paper-scale what-if planning: SPPO plans for GPT-7B/13B/65B without capturing a graph.

Modules: `models.py` (model specs, sequence-length parsing), `results.py` (cluster, plan and
report records), `search.py` (costs and the search over layouts and chunkings), `plan.py`
(the entry points), `report.py` (tables). docs/architecture.md, section 1 "Pipeline of steps".

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
from sppo_fx.whatif.models import MODELS, ModelSpec, get_model, parse_tokens
from sppo_fx.whatif.entry import plan, plan_config, plan_simulation, report_simulation
from sppo_fx.whatif.report import format_report
from sppo_fx.whatif.results import BASELINES, POLICIES, Cluster, PlanResult, WhatIfReport
from sppo_fx.util.units import parse_bytes

__all__ = ["ModelSpec", "MODELS", "Cluster", "PlanResult", "WhatIfReport", "POLICIES",
           "BASELINES", "get_model", "parse_tokens", "parse_bytes", "plan", "plan_config",
           "plan_simulation", "report_simulation", "format_report"]
