"""OPT-style positions from a cumulative sum over the attention mask (issue 30 item 4).

`position_ids = (cumsum(mask, 1) * mask - 1).long()`: with no attention_mask the mask is a
tensor of ones built in the model, whose cumsum is rewritten to a position range
(passes/positions.py); an attention_mask given as an input makes the cumsum input-only,
computed once on the whole sequence in the prologue (exact whatever it holds). Near
variants of the pattern are refused by name before any step.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError
from sppo_fx.passes import transform
from sppo_fx.passes.positions import ones_cumsum_reason

from conftest import assert_matches_eager

T, BATCH, CHUNKS, VOCAB = 64, 2, 4, 100
OPT = dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)


def _ids(t=T):
    return torch.randint(0, VOCAB, (BATCH, t), generator=torch.Generator().manual_seed(0))


def _opt(attn=None):
    torch.manual_seed(0)
    return tf.OPTForCausalLM(tf.OPTConfig(**OPT, **({"attn_implementation": attn} if attn else {})))


@pytest.mark.parametrize("attn", [None, "eager"], ids=["default", "eager"])
def test_opt_trains_exactly_in_chunks(attn):
    model, ids = _opt(attn), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert len(compiled.program.attention) == 2
    # the positions are a range offset per chunk, not a cumsum the chunk would restart
    assert not any(n.target is torch.ops.aten.cumsum.default for n in compiled.program.chunk.graph.nodes)


def test_opt_with_packed_documents_trains_exactly_in_chunks():
    # position_ids restarting at each document (packed sequences): the positions are an input
    # and whatever HF derives from them (the learned positions, and masking_utils' packed mask
    # where it detects one) must match eager; the boundary (24) falls inside a 16-token chunk
    model, ids = _opt(), _ids()
    pos = torch.cat([torch.arange(24), torch.arange(T - 24)])[None].repeat(BATCH, 1)
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids, position_ids=pos, use_cache=False).loss,
                         lambda: compiled(input_ids=ids, labels=ids, position_ids=pos, use_cache=False))


def test_opt_with_a_padding_attention_mask_is_refused_before_any_step():
    model, ids = _opt(), _ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with pytest.raises(SppoError, match="attention mask depends on the input"):
        sppo_fx.compile(model, chunks=CHUNKS, compile=False)(input_ids=ids, labels=ids, attention_mask=mask)
    assert all(p.grad is None for p in model.parameters())


class PosModel(nn.Module):
    """A tiny causal LM with OPT's position rule; `kind` picks what the cumsum sums."""

    def __init__(self, kind="ones", dtype=torch.float32):
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.emb = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(2 * T + 2, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, VOCAB)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids, labels, mask=None):
        x = self.emb(ids)
        B, L = ids.shape
        if self.kind == "input":
            m = mask
        elif self.kind == "twos":
            m = torch.full((B, L), 2.0, dtype=self.dtype)
        elif self.kind == "hidden":
            m = (x[..., 0] > 0).to(self.dtype)  # data: which tokens are "real" depends on the weights
        else:
            m = torch.ones(B, L, dtype=self.dtype)
        if self.kind == "times_param":
            m = m * self.scale
        if self.kind == "off_by_one":
            pos = (torch.cumsum(m, 1) * m).long()  # starts at 1: still a range, offset per chunk
        else:
            pos = (torch.cumsum(m, 1) * m - 1).long()
        x = x + self.pos(pos + 2)
        q, k, v = self.qkv(x).view(B, L, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, 16)
        return F.cross_entropy(self.head(x + y).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("kind, dtype", [("ones", torch.float32), ("ones", torch.int64), ("ones", torch.bool),
                                         ("off_by_one", torch.float32)])
def test_cumsum_of_ones_is_a_position_range(kind, dtype):
    torch.manual_seed(0)
    model, ids = PosModel(kind, dtype), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))


def test_cumsum_over_an_input_mask_with_zeros_is_computed_once_in_the_prologue():
    torch.manual_seed(0)
    model, ids = PosModel("input"), _ids()
    mask = torch.ones(BATCH, T)
    mask[0, :7] = 0
    mask[1, 40:] = 0  # zeros anywhere: each chunk's positions need every earlier chunk's
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(ids, ids, mask), lambda: compiled(ids, ids, mask))
    assert any(n.target is torch.ops.aten.cumsum.default for n in compiled.program.prologue.graph.nodes)


@pytest.mark.parametrize("kind, why", [
    ("twos", "the constant 2.0, not 1"),  # a sum of twos is 2(k+1): not the range the rewrite makes
    ("hidden", "not a constant built from positions"),  # a cumsum over data along the sequence
    ("times_param", "not a constant built from positions"),  # ones times a weight
])
def test_near_variants_are_refused_naming_the_cumsum(kind, why):
    torch.manual_seed(0)
    model, ids = PosModel(kind), _ids()
    with pytest.raises(SppoError, match=r"aten\.cumsum\.default.*works along the sequence dimension"):
        sppo_fx.compile(model, chunks=CHUNKS, compile=False)(ids, ids)
    assert all(p.grad is None for p in model.parameters())
    # and the recogniser says why it left the cumsum alone
    from sppo_fx.capture import capture, strip_asserts
    cap = capture(model, None, None, (ids, ids), {}, None, 1)
    gm = strip_asserts(cap.copy_graph())
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cumsum.default)
    assert re.search(why, ones_cumsum_reason(node, cap.seq, cap.param_value))


@pytest.mark.parametrize("dtype, limit", [(torch.float32, 2 ** 24), (torch.float16, 2048), (torch.bfloat16, 256),
                                          (torch.int64, None)])
def test_a_float_sum_records_the_longest_exact_sequence(dtype, limit):
    torch.manual_seed(0)
    model, ids = PosModel("ones", dtype), _ids()
    from sppo_fx.capture import capture
    gm, _program = transform(capture(model, None, None, (ids, ids), {}, None, 1))
    got = gm.meta.get("sppo_seq_limit")
    assert (got.max_len if got else None) == limit
    if limit is not None:
        assert "cumsum" in got.message(limit + 1)
