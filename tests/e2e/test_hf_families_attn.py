"""Hugging Face families whose attention has score variants, trained exactly in chunks:
Gemma 2 with attention logit soft-capping on (its only attention is written out: HF has no
SDPA path for it, so default and eager are the same code), with full and sliding-window
layers. Each test prints the largest relative gradient difference against eager (the
number docs/models-attention.md reports; run with -s to see it).

Bloom and MPT (ALiBi): tests/e2e/test_hf_families_alibi.py.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager, eager_loss_and_grads

T, BATCH, CHUNKS, VOCAB = 64, 2, 4, 100
GEMMA2 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=8,
              attn_logit_softcapping=5.0, final_logit_softcapping=30.0)


def _ids():
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(0))


def _largest_relative_grad_diff(model, ref_grads):
    worst = 0.0
    for name, p in model.named_parameters():
        if name in ref_grads:
            ref = ref_grads[name]
            worst = max(worst, float((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return worst


def _check(model, ids, label, **options):
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False, **options)
    _, ref_grads = eager_loss_and_grads(model, lambda m: m(input_ids=ids, labels=ids).loss)
    loss = compiled(input_ids=ids, labels=ids)
    loss.backward()
    print(f"\n{label}: largest relative grad diff {_largest_relative_grad_diff(model, ref_grads):.2e}")
    model.zero_grad(set_to_none=True)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    return compiled


@pytest.mark.parametrize("attn", [None, "eager"], ids=["default", "eager"])
def test_gemma2_softcapping_matches_eager(attn):
    torch.manual_seed(0)
    kwargs = dict(GEMMA2, sliding_window=128, layer_types=["full_attention"] * 2)
    if attn:
        kwargs["attn_implementation"] = attn
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**kwargs))
    compiled = _check(model, _ids(), f"gemma2 ({attn or 'default'})")
    assert len(compiled.program.attention) == 2


def test_gemma2_softcapping_with_sliding_window_layers_matches_eager():
    # alternating sliding (W = 16 < T) and full layers, as Gemma 2 ships: soft-cap in a band
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**GEMMA2, sliding_window=16,
                                                 layer_types=["sliding_attention", "full_attention"]))
    compiled = _check(model, _ids(), "gemma2 sliding+full")
    assert sorted(str(s.window) for s in compiled.program.attention) == ["16", "None"]


def _gemma2():
    torch.manual_seed(0)
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**GEMMA2, sliding_window=128, layer_types=["full_attention"] * 2))


@pytest.mark.parametrize("how", ["option", "budget", "saved plan"])
def test_gemma2_softcapping_refuses_a_streamed_skeleton_before_any_step(tmp_path, how):
    """The streamed K/V skeleton computes no soft-capping: skeleton="offload" (alone, with a
    budget, or a saved plan's) is an SppoError naming what to change (the streamed op raised
    a TypeError on `softcap=` at the first call), raised before any step: no gradient, no
    file in the offload dir."""
    model, ids = _gemma2(), _ids()
    options = {"option": dict(chunks=CHUNKS, skeleton="offload"),
               "budget": dict(budget="64MiB", skeleton="offload"),
               "saved plan": dict(plan=sppo_fx.Plan(T, [T // 2, T // 2], offload_ratios=[1.0, 0.0], tier="disk",
                                                    skeleton="offload"))}[how]
    compiled = sppo_fx.compile(model, offload="disk", offload_dir=str(tmp_path), compile=False, **options)
    with pytest.raises(SppoError, match=r"soft-capping.*skeleton='keep'"):
        compiled(input_ids=ids, labels=ids)
    assert all(p.grad is None for p in model.parameters()) and not list(tmp_path.iterdir())


def test_gemma2_softcapping_under_a_tight_budget_keeps_the_skeleton(tmp_path):
    """skeleton="auto" under a budget: the solver keeps the skeleton of a model whose
    attention soft-caps (it chose the streamed skeleton at the smallest budgets, which then
    failed on the first call), and the step is exact."""
    model, ids = _gemma2(), _ids()
    with pytest.raises(sppo_fx.InfeasibleBudget, match=r"K/V skeleton: keep\)") as err:
        sppo_fx.compile(model, budget=1, offload="disk", offload_dir=str(tmp_path), compile=False)(
            input_ids=ids, labels=ids)
    assert "offload" not in str(err.value).split("K/V skeleton:")[1].splitlines()[0]
    compiled = sppo_fx.compile(model, budget=err.value.minimum_bytes, offload="disk", offload_dir=str(tmp_path),
                               compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert compiled.plan.skeleton == "keep" and compiled.plan.num_chunks > 1
