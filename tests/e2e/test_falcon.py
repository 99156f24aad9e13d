"""Falcon's written-out attention (issue 30 item 4): proven causal and chunked exactly.

Falcon's "eager" path scales the scores in place (`scores /= sqrt(d)`), adds a mask built
by `where(causal, 0, finfo.min)`, and broadcasts one K/V head over the query heads (multi-
query attention) in its matmuls. The recogniser (passes/masks/explicit_attention.py) accepts the
in-place scale on the scores only and one K/V head, as SDPA broadcasts it; near variants
(an off-by-one band, a fill that does not block, an in-place scale of q) are refused or
stay exact.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager

T, BATCH, CHUNKS, VOCAB = 64, 2, 4, 100
FALCON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              attention_dropout=0.0, hidden_dropout=0.0)


def _ids():
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("extra", [{}, {"new_decoder_architecture": True, "num_kv_heads": 2}],
                         ids=["multi_query", "grouped"])
@pytest.mark.parametrize("attn", [None, "eager"], ids=["default", "eager"])
def test_falcon_trains_exactly_in_chunks(attn, extra):
    torch.manual_seed(0)
    kwargs = dict(FALCON, **extra, **({"attn_implementation": attn} if attn else {}))
    model, ids = tf.FalconForCausalLM(tf.FalconConfig(**kwargs)), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert len(compiled.program.attention) == 2


class FalconLike(nn.Module):
    """Falcon's eager attention written out, one K/V head; `variant` breaks one thing."""

    def __init__(self, variant="ok"):
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(VOCAB, 32)
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 16)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids, labels):
        x = self.emb(ids)
        B, L, _ = x.shape
        q = self.q(x).view(B, L, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, 1, 8).permute(2, 0, 3, 1, 4)
        if self.variant == "q_in_place":
            q = q.mul_(0.5)  # not the scores: stays in the graph, must not be taken as the scale
        i = torch.arange(L)
        shift = 1 if self.variant == "off_by_one" else 0
        fill = -1.0 if self.variant == "weak_fill" else torch.finfo(torch.float32).min
        mask = torch.where(i[None, :] <= i[:, None] + shift, torch.zeros(()), fill)
        scores = q @ k.transpose(-1, -2)
        scores /= math.sqrt(8)
        probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32)
        y = (probs @ v).transpose(1, 2).reshape(B, L, 32)
        return F.cross_entropy(self.head(x + y).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("variant", ["ok", "q_in_place"])
def test_written_out_multi_query_attention_is_exact(variant):
    torch.manual_seed(0)
    model, ids = FalconLike(variant), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))
    assert len(compiled.program.attention) == 1


@pytest.mark.parametrize("variant, why", [
    ("off_by_one", r"last visible key is at offset j - i = 1"),  # each query sees the next token
    ("weak_fill", r"neither 0 nor -inf"),  # -1 only lowers a blocked key's weight
])
def test_near_variants_are_refused_with_the_reason(variant, why):
    torch.manual_seed(0)
    model, ids = FalconLike(variant), _ids()
    with pytest.raises(SppoError, match=why):
        sppo_fx.compile(model, chunks=CHUNKS, compile=False)(ids, ids)
    assert all(p.grad is None for p in model.parameters())
