"""Explicit causal attention (nanoGPT's non-flash path, minGPT, HF eager) -> SDPA(is_causal=True).

The rewrite happens only when the mask is proved causal for every sequence length; every
other mask and attention dropout in training are refused (soft-capping: test_attention_variants.py).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx.capture import capture, strip_asserts
from sppo_fx.errors import SppoError
from sppo_fx.passes.masks.explicit_attention import recognize_explicit_attention
from sppo_fx.passes.seqdim import SDPA

from conftest import assert_matches_eager
from nanogpt_style import NanoGPT

V, D, H, BLOCK = 61, 32, 4, 96


class ExplicitLM(nn.Module):
    """One attention layer written out, in the variant named by `style`."""

    def __init__(self, style, window=4, dropout=0.0):
        super().__init__()
        self.style, self.window = style, window
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V)
        self.drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool))
        if style == "corrupt_buffer":  # causal at every short length, wrong at row 90
            mask[90, 45] = False
        self.register_buffer("bias", mask.view(1, 1, BLOCK, BLOCK))

    def forward(self, idx, targets):
        B, T = idx.shape
        q, k, v = self.qkv(self.emb(idx)).split(D, dim=2)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        s = 1.0 / math.sqrt(D // H)
        i = torch.arange(T)
        st = self.style
        if st == "scale_before":
            att = (q * s ** 0.5) @ (k * s ** 0.5).transpose(-2, -1)
        elif st == "scale_divide":
            att = q @ k.permute(0, 1, 3, 2) / math.sqrt(D // H)
        else:
            att = (q @ k.transpose(-2, -1)) * s
        if st == "softcap":
            att = torch.tanh(att / 50.0) * 50.0
        if st in ("bool_buffer", "corrupt_buffer", "softcap", "dropout", "scale_before", "scale_divide"):
            att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf"))
        elif st == "additive_triu":
            att = att + torch.full((T, T), float("-inf")).triu(1)
        elif st == "additive_finfo":
            att = att + torch.where(i[None, :] <= i[:, None], 0.0, torch.finfo(att.dtype).min)
        elif st == "where_allowed":
            att = torch.where(i[:, None] >= i[None, :], att, float("-inf"))
        elif st == "window":  # sliding window: causal and j > i - window
            blocked = (i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - self.window)
            att = att.masked_fill(blocked, float("-inf"))
        elif st == "off_by_one":  # blocks the diagonal too
            att = att.masked_fill(i[None, :] >= i[:, None], float("-inf"))
        elif st == "fp32_softmax":
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        # st == "no_mask": bidirectional
        if st == "fp32_softmax":
            p = F.softmax(att.float(), dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            p = F.softmax(att, dim=-1)
        y = (self.drop(p) @ v).transpose(1, 2).contiguous().view(B, T, D)
        logits = self.out(y)
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


def _data(batch=2, seq=32):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (batch, seq), generator=g), torch.randint(0, V, (batch, seq), generator=g)


def _rewritten(model, seq=24):
    x, y = _data(seq=seq)
    cap = capture(model, None, None, (x, y), {}, None, 1)
    gm = recognize_explicit_attention(strip_asserts(cap.copy_graph()), cap.seq, cap.param_value)
    return gm


CAUSAL = ["bool_buffer", "scale_before", "scale_divide", "additive_triu", "additive_finfo",
          "where_allowed", "fp32_softmax"]


@pytest.mark.parametrize("style", CAUSAL)
def test_causal_variants_become_sdpa(style):
    gm = _rewritten(ExplicitLM(style))
    sdpa = [n for n in gm.graph.nodes if n.target is SDPA]
    assert len(sdpa) == 1 and sdpa[0].args[5] is True
    assert sdpa[0].kwargs["scale"] == pytest.approx(1 / math.sqrt(D // H))
    assert not any(n.target in (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default)
                   for n in gm.graph.nodes)


@pytest.mark.parametrize("style", CAUSAL)
def test_causal_variants_match_eager(style):
    torch.manual_seed(0)
    model = ExplicitLM(style)
    x, y = _data()
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))


def test_explicit_sliding_window_becomes_windowed_attention_and_matches_eager():
    torch.manual_seed(0)
    model = ExplicitLM("window")
    gm = _rewritten(model)
    from sppo_fx.chunk_attention.functions import windowed_causal_attention
    windowed = [n for n in gm.graph.nodes if n.target is windowed_causal_attention]
    assert len(windowed) == 1 and windowed[0].kwargs["window"] == model.window
    x, y = _data()
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))


@pytest.mark.parametrize("style, message", [
    ("corrupt_buffer", "not a lower-triangular or banded table"),
    ("off_by_one", "not the causal mask"),
    ("no_mask", "no mask"),
])
def test_non_causal_attention_refused(style, message):
    with pytest.raises(SppoError, match=message):
        _rewritten(ExplicitLM(style))


def test_corrupt_buffer_passes_the_short_probes():
    # the refused buffer is causal at the lengths a probe-based check would try
    mask = ExplicitLM("corrupt_buffer").bias[0, 0]
    for t in (3, 8, 24, 64):
        assert torch.equal(mask[:t, :t], torch.ones(t, t, dtype=torch.bool).tril())


def test_attention_dropout_in_training_refused_and_exact_in_eval():
    torch.manual_seed(0)
    model = ExplicitLM("dropout", dropout=0.1)
    x, y = _data()
    # refused at capture, as every random op in training mode (capture.refuse_random_ops)
    with pytest.raises(SppoError, match="dropout in training mode"):
        sppo_fx.compile(model, chunks=4, compile=False)(x, y)
    model.eval()
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))


@pytest.mark.parametrize("mask_style", ["buffer", "arange"])
def test_nanogpt_non_flash_matches_eager(mask_style):
    torch.manual_seed(0)
    model = NanoGPT(flash=False, mask_style=mask_style)
    x, y = _data(batch=2)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))
    assert len(compiled.program.attention) == 2


@pytest.mark.parametrize("alpha", [0.0, 1e-38, -1.0])
def test_a_mask_added_with_alpha_is_refused(alpha):
    """`torch.add(scores, mask, alpha=a)` is scores + a * mask: alpha 0 switches the mask
    off, a tiny alpha makes -inf a finite penalty, -1 adds +inf. The proof is of the mask's
    own values, so only alpha=1 is accepted (found by a review: these trained silently
    wrong)."""
    import torch.nn.functional as F

    import sppo_fx
    from sppo_fx.errors import SppoError

    class AlphaMasked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.qkv, self.out = torch.nn.Embedding(37, 8), torch.nn.Linear(8, 24), torch.nn.Linear(8, 37)

        def forward(self, x, y):
            b, t = x.shape
            q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(self.emb(x)).split(8, 2))
            mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
            o = F.softmax(torch.add(q @ k.transpose(-2, -1) * 0.5, mask, alpha=alpha), dim=-1) @ v
            return F.cross_entropy(self.out(o.transpose(1, 2).reshape(b, t, 8)).flatten(0, 1), y.flatten())

    model = AlphaMasked()
    x = torch.randint(0, 37, (2, 12))
    with pytest.raises(SppoError, match="alpha="):
        sppo_fx.compile(model, chunks=3, compile=False)(x, x)
    assert all(p.grad is None for p in model.parameters())
