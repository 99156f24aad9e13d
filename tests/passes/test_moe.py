"""Mixture-of-experts layers trained exactly in chunks (passes/moe_dispatch.py, docs/models-moe.md).

Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE at tiny sizes (1-2 layers, hidden 32, 4
experts, top-2, T = 32, batch 2, 4 chunks, float32), with and without the router's
auxiliary load-balancing loss (its coefficient raised to 1 so that its gradient counts),
against eager: the loss and every gradient. Near variants of the dispatch that are not
token-local (expert-choice routing, capacity limits, a grouped matmul whose groups are not
its rows' experts) are tiny modules of this file, refused by name before any step.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager

T, BATCH, CHUNKS, VOCAB, EXPERTS, TOP_K = 32, 2, 4, 64, 4, 2
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, router_aux_loss_coef=1.0, num_experts_per_tok=TOP_K)
FAMILIES = {
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(BASE, num_local_experts=EXPERTS, sliding_window=None)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(BASE, num_experts=EXPERTS, moe_intermediate_size=16, shared_expert_intermediate_size=32)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(BASE, num_experts=EXPERTS, moe_intermediate_size=16, head_dim=8)),
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(family, layers=1, **overrides):
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**dict(kwargs, num_hidden_layers=layers, **overrides)))


def _ids():
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(0))


def _dispatch_nodes(compiled) -> int:
    return sum(1 for n in compiled.graphs["captured"].graph.nodes if n.meta.get("sppo_moe"))


@pytest.mark.parametrize("family, aux", [("mixtral", False), ("mixtral", True), ("qwen2_moe", True),
                                         ("qwen3_moe", False), ("qwen3_moe", True)])
def test_moe_family_trains_exactly_in_chunks(family, aux):
    model = build(family, layers=2 if aux else 1, output_router_logits=aux)
    ids = _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert _dispatch_nodes(compiled) > 0  # the sort by expert ran per chunk
    ops = [r.op for r in compiled.program.reductions]
    # the aux loss's per-expert counts and probability sums are accumulated over the chunks
    assert (ops.count("histc"), ops.count("sum")) == ((2, 2) if aux else (0, 0)), ops


def test_aux_loss_alone_is_exact():
    # the load-balancing loss without the language-model loss: the router's gradient is all there is
    model = build("mixtral", layers=2, output_router_logits=True)
    ids = _ids()
    compiled = sppo_fx.compile(lambda m, ids: m(input_ids=ids).aux_loss, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids).aux_loss, lambda: compiled(model, ids))


def test_batched_mm_experts_are_exact():
    # the other dispatch HF offers: each token's row repeated top-k times, weights gathered per row
    model = build("mixtral", experts_implementation="batched_mm")
    ids = _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert _dispatch_nodes(compiled) > 0


def test_eager_experts_loop_is_refused_before_any_step():
    # HF's eager loop visits the experts that `nonzero` finds: sizes that depend on the data
    model = build("mixtral", experts_implementation="eager")
    ids = _ids()
    with pytest.raises(SppoError, match="data-dependent"):
        sppo_fx.compile(model, chunks=CHUNKS, compile=False)(input_ids=ids, labels=ids)
    assert all(p.grad is None for p in model.parameters())


# ---- near variants: tiny hand-written MoE layers -------------------------------------------

class TinyMoE(torch.nn.Module):
    """Embedding -> token-choice top-k MoE (sort by expert, grouped rows, inverse) -> head.
    `variant` swaps one step for a near variant that is not token-local."""

    def __init__(self, variant="token_choice", experts=EXPERTS, k=TOP_K, d=16):
        super().__init__()
        self.variant, self.E, self.k = variant, experts, k
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, d, d) / d ** 0.5)
        self.head = torch.nn.Linear(d, VOCAB)

    def dispatch(self, x):  # x [N, d]
        probs = self.router(x).softmax(-1)
        if self.variant == "expert_choice":  # each expert picks its top tokens over the whole batch
            weights, tokens = probs.topk(8, dim=0)  # [8, E]: 8 tokens per expert
            out = torch.zeros_like(x)
            for e in range(self.E):
                out = out.index_add(0, tokens[:, e], (x[tokens[:, e]] @ self.w[e]) * weights[:, e, None])
            return out
        weights, ids = probs.topk(self.k, dim=-1)
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
        if self.variant == "capacity_cumsum":  # GShard-style: number each expert's tokens in batch order
            onehot = torch.nn.functional.one_hot(flat_ids, self.E)
            rank = (onehot.cumsum(0) * onehot).sum(-1)
            flat_w = flat_w * (rank <= 8)
        sorted_ids, perm = torch.sort(flat_ids, descending=self.variant == "descending")
        rows = x[perm // self.k]
        if self.variant == "capacity_sorted":  # rank within the expert's group after the sort
            counts = torch.histc(sorted_ids.float(), bins=self.E, min=0, max=self.E - 1)
            starts = counts.cumsum(0) - counts
            rank = torch.arange(perm.shape[0]) - starts[sorted_ids]
            rows = rows * (rank < 8).unsqueeze(-1)
        if self.variant == "slot_number":  # keep the first 8 slots of the sorted batch
            rows = rows * (perm < 8).unsqueeze(-1)
        counts = torch.histc(sorted_ids.float(), bins=self.E, min=0, max=self.E - 1)
        ends = counts.cumsum(0).to(torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.w, ends) * flat_w[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0])
        return out[inv].view(x.shape[0], self.k, -1).sum(1)

    def forward(self, ids, labels):
        h = self.emb(ids)
        b, t, d = h.shape
        h = h + self.dispatch(h.reshape(-1, d)).reshape(b, t, d)
        return torch.nn.functional.cross_entropy(self.head(h).transpose(1, 2), labels)


def test_tiny_token_choice_moe_is_exact():
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    torch.manual_seed(0)
    model = TinyMoE()
    ids = _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))
    assert _dispatch_nodes(compiled) > 0


@pytest.mark.parametrize("variant, match", [
    ("expert_choice", r"aten\.topk.*expert-choice"),
    ("capacity_cumsum", r"aten\.cumsum.*capacity"),
    ("capacity_sorted", r"aten\.sub\.Tensor.*per-expert token counts.*capacity"),
    ("slot_number", r"aten\.lt\.Scalar.*row number of the whole flattened batch"),
    # rows in descending expert order, groups counted in ascending order: group e holds other experts' rows
    ("descending", r"grouped_mm_fallback.*not the expert groups of its rows' own sort"),
])
def test_not_token_local_dispatch_is_refused_by_name(variant, match):
    import transformers.integrations.moe  # noqa: F401
    torch.manual_seed(0)
    model = TinyMoE(variant)
    ids = _ids()
    with pytest.raises(SppoError, match=match):
        sppo_fx.compile(model, chunks=CHUNKS, compile=False)(ids, ids)
    assert all(p.grad is None for p in model.parameters())  # refused before any step


def test_histc_whose_bins_do_not_separate_the_experts_is_refused():
    # max = E - 2: expert E-1 shares the last bin with E-2, so the grouped matmul's groups are wrong
    import transformers.integrations.moe  # noqa: F401
    torch.manual_seed(0)
    model = TinyMoE()
    real_histc = torch.histc
    ids = _ids()
    try:
        torch.histc = lambda x, bins, min, max: real_histc(x, bins=bins, min=min, max=max - 1)
        with pytest.raises(SppoError, match=r"aten\.histc.*do not give each expert its own bin"):
            sppo_fx.compile(model, chunks=CHUNKS, compile=False)(ids, ids)
    finally:
        torch.histc = real_histc


def test_a_sum_over_the_sequence_feeding_the_loss_is_accumulated():
    # a vector reduced over the tokens (like the aux loss's probability sums), squared in the loss
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 8)

        def forward(self, ids):
            return self.emb(ids).sum(dim=1).pow(2).sum()

    torch.manual_seed(0)
    model, ids = M(), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(ids), lambda: compiled(ids))


# ---- Inductor, budget, parallel layouts --------------------------------------------------

@pytest.mark.slow
def test_mixtral_with_aux_loss_under_inductor_and_a_budget():
    # 1 layer and T = 16 keep Inductor's compile short (this took 591 s with 2 layers, T = 32)
    model = build("mixtral", layers=1, output_router_logits=True)
    ids = _ids()[:, :16]
    compiled = sppo_fx.compile(model, budget="64MiB")  # the solver picks the chunks
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))


@pytest.mark.slow
def test_mixtral_with_aux_loss_under_a_budget_that_splits_the_sequence():
    # at T = 256 a 1 MiB budget is below the one-chunk peak (about 1.8 MB), so the solver
    # must split the sequence (and recompute): the dispatch proof and the aux loss's
    # accumulation are then exercised across budget-chosen, unequal chunks
    model = build("mixtral", layers=1, output_router_logits=True)
    ids = torch.randint(0, VOCAB, (BATCH, 256), generator=torch.Generator().manual_seed(3))
    compiled = sppo_fx.compile(model, budget="1MiB", compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert len(compiled.plan.chunk_lengths) > 1, compiled.plan


@pytest.mark.slow
@pytest.mark.distributed
def test_mixtral_with_aux_loss_under_sequence_pipeline_and_data_parallelism():
    from sppo_fx.runtime.launch import run_local_ranks
    worker = os.path.join(ROOT, "tests", "helpers", "moe_parallel_worker.py")
    results = run_local_ranks([sys.executable, worker, json.dumps(["sp", "pp", "dp"])], 2, 300.0, cwd=ROOT)
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        for layout, cell in json.loads(out.strip().splitlines()[-1]).items():
            assert cell["loss_ok"] and not cell["bad"], (rank, layout, cell)


def _largest_grad_diff(family, aux, **overrides):
    """(eager loss, chunked loss, largest relative gradient difference) of one family."""
    model = build(family, layers=2, output_router_logits=aux, **overrides)
    ids = _ids()
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = sppo_fx.compile(model, chunks=CHUNKS, compile=False)(input_ids=ids, labels=ids)
    loss.backward()
    worst = max(((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in model.named_parameters()
                if n in ref)
    return ref_loss.item(), loss.item(), worst


if __name__ == "__main__":  # the table of docs/models-moe.md: python tests/passes/test_moe.py
    print("| family | aux loss | eager loss | chunked loss | largest relative gradient difference |")
    print("|---|---|---|---|---|")
    for fam in FAMILIES:
        for aux in (False, True):
            print("| {} | {} | {:.6f} | {:.6f} | {:.1e} |".format(fam, "on" if aux else "off",
                                                                 *_largest_grad_diff(fam, aux)))
    print("| mixtral (batched_mm) | on | {:.6f} | {:.6f} | {:.1e} |".format(
        *_largest_grad_diff("mixtral", True, experts_implementation="batched_mm")))
