"""Hugging Face families with ALiBi, trained exactly in chunks: Bloom (HF writes its attention
out only: default and eager are the same code; the bias is `slopes * arange(T)` through
`baddbmm`) and MPT (`slopes * (j + 1 - max_seq_len)` sliced to the last T columns, added to
the scores). Each test prints the largest relative gradient difference against eager
(docs/models-attention.md reports it; run with -s to see it).
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from sppo_fx.errors import SppoError

from test_hf_families_attn import _check, _ids, CHUNKS, T

import sppo_fx

BLOOM = dict(vocab_size=100, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0, hidden_dropout=0.0)
MPT = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, max_seq_len=128, expansion_ratio=2)


def _bloom(attn=None, **kw):
    torch.manual_seed(0)
    cfg = tf.BloomConfig(**dict(BLOOM, **kw))
    if attn:
        cfg._attn_implementation = attn
    return tf.BloomForCausalLM(cfg)


def _slopes(compiled):
    g = compiled.program.chunk.graph
    return [n.kwargs["alibi"] for n in g.nodes if n.op == "call_function" and n.kwargs.get("alibi") is not None]


@pytest.mark.parametrize("attn", [None, "eager"], ids=["default", "eager"])
def test_bloom_matches_eager(attn):
    compiled = _check(_bloom(attn), _ids(), f"bloom ({attn or 'default'})")
    assert len(compiled.program.attention) == 2
    # Bloom's slopes for 4 heads: 2^-2, 2^-4, 2^-6, 2^-8, read from the graph
    assert _slopes(compiled) == [[0.25, 0.0625, 0.015625, 0.00390625]] * 2


def test_bloom_with_heads_not_a_power_of_two_matches_eager():
    # 6 heads: the slopes of 4 heads, then 2 interleaved ones from the next power of two (not powers of 2)
    compiled = _check(_bloom(hidden_size=48, n_head=6), _ids(), "bloom (6 heads)")
    assert len(_slopes(compiled)[0]) == 6


def test_bloom_with_a_padding_attention_mask_is_refused_by_name():
    model = _bloom()
    ids = _ids()
    padded = torch.ones_like(ids)
    padded[0, :5] = 0  # an all-ones mask is accepted (tests/passes/test_ones_inputs.py); padding is not
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    with pytest.raises(SppoError, match="(cumsum|attention_mask|input)"):
        compiled(input_ids=ids, labels=ids, attention_mask=padded)
    assert all(p.grad is None for p in model.parameters())


def test_mpt_matches_eager():
    torch.manual_seed(0)
    model = tf.MptForCausalLM(tf.MptConfig(**MPT))
    compiled = _check(model, _ids(), "mpt")
    assert len(compiled.program.attention) == 2
    assert len(_slopes(compiled)) == 2
