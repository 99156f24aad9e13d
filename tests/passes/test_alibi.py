"""ALiBi recognised from written-out attention (passes/alibi.py): a bias below the mask is
chunked exactly when it is slope_h * key position plus a per-row constant, with the slopes
read from the graph; near variants are refused by name before any step, leaving no gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager

H, D, V = 4, 4, 37
SLOPES = [0.5, 0.25, 0.125, 0.0625]


class BiasedLM(nn.Module):
    """One attention layer whose scores get `bias(self, t)` ([.., h, t or 1, t]) before a causal mask."""

    def __init__(self, bias, cast=None):
        super().__init__()
        self.bias, self.cast = bias, cast
        self.emb, self.qkv, self.out = nn.Embedding(V, H * D), nn.Linear(H * D, 3 * H * D), nn.Linear(H * D, V)
        self.register_buffer("slopes", torch.tensor(SLOPES).view(H, 1, 1))
        self.register_buffer("table", torch.randn(H, 64, 64))
        self.learned = nn.Parameter(torch.zeros(H, 64, 64))

    def forward(self, x, y):
        b, t = x.shape
        q, k, v = (z.view(b, t, H, D).transpose(1, 2) for z in self.qkv(self.emb(x)).split(H * D, 2))
        bias = self.bias(self, t)
        if self.cast is not None:
            bias = bias.to(self.cast).float()
        s = q @ k.transpose(-2, -1) * D ** -0.5 + bias
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = F.softmax(s, dim=-1) @ v
        return F.cross_entropy(self.out(o.transpose(1, 2).reshape(b, t, H * D)).flatten(0, 1), y.flatten())


def _pos(t):
    return torch.arange(t)


EXACT = {
    "slope*j (Bloom)": lambda m, t: m.slopes * _pos(t),
    "slope*(j-i) relative": lambda m, t: m.slopes * (_pos(t)[None, :] - _pos(t)[:, None]),
    "slope*(j+1-T) (MPT)": lambda m, t: m.slopes * torch.arange(1 - t, 1),
    "slope*j + a row term in i": lambda m, t: m.slopes * _pos(t) + (2.0 * _pos(t) - 3.0)[:, None],
}


@pytest.mark.parametrize("name", list(EXACT))
def test_alibi_forms_match_eager(name):
    torch.manual_seed(0)
    model = BiasedLM(EXACT[name])
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    compiled = sppo_fx.compile(model, chunks=3, compile=False)
    assert_matches_eager(model, lambda m: m(x, x), lambda: compiled(x, x))
    calls = [n for n in compiled.program.chunk.graph.nodes if n.op == "call_function" and n.kwargs.get("alibi")]
    assert [c.kwargs["alibi"] for c in calls] == [SLOPES]


REFUSED = {
    "quadratic in j": (lambda m, t: m.slopes * _pos(t) * _pos(t), "two position-dependent"),
    "slope varies per query": (lambda m, t: m.slopes * (_pos(t)[:, None] * _pos(t)[None, :]), "two position-dependent"),
    "learned [T, T] bias": (lambda m, t: m.learned[:, :t, :t], "learned parameter"),
    "[T, T] table buffer": (lambda m, t: m.table[:, :t, :t], "sliced to the sequence length"),
    "slope differs per batch row": (lambda m, t: torch.cat([m.slopes[None], 2 * m.slopes[None]]) * _pos(t),
                                    "differs between batch rows"),
    "j divided by a position": (
        lambda m, t: m.slopes * _pos(t) / (_pos(t) + 1), "divides by a position-dependent"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_near_variants_are_refused_by_name(name):
    bias, why = REFUSED[name]
    model = BiasedLM(bias)
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with pytest.raises(SppoError, match=why) as e:
        sppo_fx.compile(model, chunks=3, compile=False)(x, x)
    assert "not proven to be ALiBi" in str(e.value)
    assert all(p.grad is None for p in model.parameters())


def test_bias_rounded_to_bfloat16_is_refused():
    # eager adds round(slope * j) in bfloat16 (ulp 8 at 1024): the chunk op's unrounded bias
    # would differ from it, so it is refused rather than trained differently
    model = BiasedLM(EXACT["slope*j (Bloom)"], cast=torch.bfloat16)
    x = torch.randint(0, V, (2, 24))
    with pytest.raises(SppoError, match="rounds the position-dependent bias to torch.bfloat16"):
        sppo_fx.compile(model, chunks=3, compile=False)(x, x)
