"""Cost model of the per-chunk program (docs/architecture.md, section 1 "Pipeline of steps": analyse).

For one chunk of `c` tokens whose queries see a K/V prefix of `p` earlier tokens, this
module gives, as sympy expressions of the symbols `c`, `p` and `b` (batch):

* per node of the chunk program: forward FLOPs, backward FLOPs and bytes written;
* the tensors the forward saves for backward, each classified as
  level 1 — the K/V "skeleton": the chunk's own K and V (the program outputs after the
  partials), which every later chunk reads and which stay for the whole step — or
  level 2 — chunk-private: everything else the chunk's backward needs (what SPPO
  offloads).

How the expressions are obtained
--------------------------------
*Shapes.* The chunk program is re-run on fake tensors under a `ShapeEnv` with two
symbolic sizes, the chunk length (`chunk_len` and the sequence dim of every chunk input)
and the prefix length (the K/V prefix inputs' dim -2 and `chunk_start`, which equals the
number of tokens before the chunk). Every node — including the ones the chunk pass
inserted without `meta["val"]` (the `cat` of prefix + chunk K/V, the attention call) —
gets a shape in `c` and `p`.

*Batch.* The traced batch `B` is static in the captured graph (views carry it as a
literal), so shapes never contain `b`. Costs are made linear in `b` by a documented rule:
a node (or saved tensor) whose tensors depend on `c`/`p` and whose leading dim is the
batch — `B` itself, or a flattened `B * f(c, p)` such as the `[B*c, vocab]` logits — is
scaled by `b / B`; others (position tables `[c, d]`, the attention mask `[c, p + c]`) are
not. Every expression is exact at `b = B`; for `B == 1` the rule cannot tell a batch dim
from a broadcast 1 and scales every `c`/`p`-dependent tensor. `ChunkCost.evaluate`
substitutes `b = B` unless told otherwise.

*FLOPs.* Matmuls (`linear`, `mm`, `bmm`, `matmul`, `addmm`, `baddbmm`): 2·M·N·K (+ M·N
for a bias). Causal chunk attention (q `[b, h, c, d]`, k/v `[b, h_kv, p + c, d]`):
2·b·h·c·(d + d_v)·(p + (c + 1)/2) — QKᵀ and PV over the lower-right causal region, i.e.
4·b·h·d·c·(p + (c + 1)/2) for d_v = d. Normalisations and softmax/cross-entropy count 5
FLOPs per input element (4 for RMSNorm); other pointwise ops and reductions 1 per element
(output for pointwise, input for reductions); views 0 FLOPs and 0 bytes; data movement
(`cat`, `embedding`, copies, factories) 0 FLOPs.

*Backward FLOPs* (approximate, the usual rule of thumb): a matmul costs 2·M·N·K per operand
that requires grad (dX and dW: 2x forward when both do); attention 2.5x forward (dQ, dK,
dV plus the recomputed probabilities); embedding backward is a scatter-add of its output
(1 per element); every other differentiable node 2x forward. Nodes that do not depend on
a parameter or a K/V prefix (token ids, positions, valid-token counts) cost nothing.

*Saved activations.* AOTAutograd's partitioner (`default_partition`, or
`min_cut_rematerialization_partition` — what Inductor uses, which recomputes cheap
pointwise ops and saves less) runs on the chunk program with concrete example inputs for
one chunk (`c0`, `p0` chosen so that c0, p0, p0 + c0, B·c0, ... collide with no static dim
of the program). The forward graph's saved outputs are grouped by the storage they alias
(q, k and v of a fused QKV projection are views of one buffer; saving q keeps the whole
buffer alive — this is what eager autograd does too), and each group's size is expressed
symbolically by matching its dims against c0, p0, p0 + c0, B·c0, ... Parameter-derived
saved values (weights, their transposes) are not activations and are dropped; saved K/V
prefix inputs are views of earlier chunks' skeleton and are dropped too. A second trace at
p = 0 covers the first chunk, where attention may take another path (the reference path
calls causal SDPA without a mask there); when it saves something else, `level2_bytes` is a
`sympy.Piecewise` (first chunk; otherwise). Checked against eager autograd
(`measure_saved_bytes`): the predictions are exact for the GPT, Llama and Hugging Face
Llama reference models at every (c, p) tried.

Findings worth knowing (documented in tests/passes/test_cost.py too): the reference attention
path saves `cat(prefix, k)` and `cat(prefix, v)` — per chunk, a private copy of all K/V
up to the chunk (kind "kv_concat", `2·b·h_kv·(p + c)·d` per layer) — and a float
`[c, p + c]` mask (kind "mask"). Both grow with the prefix; an attention kernel whose
backward reads the prefix from the skeleton would not need them.
"""
from sppo_fx.passes.cost.data import ChunkCost, NodeCost, SavedTensor, _to_int, b, c, p  # noqa: F401
from sppo_fx.passes.cost.flops import attention_flops, elementwise_bytes, node_cost  # noqa: F401
from sppo_fx.passes.cost.model import chunk_cost, chunk_costs, measure_saved_bytes  # noqa: F401
from sppo_fx.passes.cost.saved import (choose_example, example_inputs, saved_tensors,  # noqa: F401
                                        saved_tensors_by_policy)
from sppo_fx.passes.cost.shapes import shape_exprs, symbolic_values, traced_batch  # noqa: F401
