"""The mask prover evaluates masks at their real shapes, broadcasts and dtypes.

Each case is a one-layer model whose attention mask is built one way. A mask is accepted
only when eager's broadcast value is a causal (or windowed) band at every length the model
can run; positions in a narrow dtype are accepted only up to the length where they stay
exact, and a longer sequence is refused before the step, naming the dtype.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx.capture import capture, strip_asserts
from sppo_fx.errors import SppoError
from sppo_fx.passes import recognize_causal_masks, recognize_explicit_attention

from conftest import assert_matches_eager

V, D, H, N = 37, 16, 2, 160
NEG = float("-inf")
BOOL = torch.bool


def _pos(t, dtype=torch.int64, start=0, step=1):
    return torch.arange(start, start + step * t, step, dtype=dtype)


def _causal_from(i):
    return i[:, None] >= i[None, :]


class MaskLM(nn.Module):
    """Embedding, one attention whose mask is `build(T, scores, self)`, and a head."""

    def __init__(self, build, sdpa=False):
        super().__init__()
        self.build, self.sdpa = build, sdpa
        self.emb, self.qkv, self.out = nn.Embedding(V, D), nn.Linear(D, 3 * D), nn.Linear(D, V)
        self.register_buffer("tril", torch.ones(N, N, dtype=BOOL).tril())
        self.register_buffer("tril3", torch.ones(1, N, N, dtype=BOOL).tril())

    def forward(self, x, y):
        b, t = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.emb(x)).split(D, 2))
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.build(t, None, self))
        else:
            o = F.softmax(self.build(t, q @ k.transpose(-2, -1) * 0.5, self), dim=-1) @ v
            o = o.mean(0) if o.dim() == 5 else o
        return F.cross_entropy(self.out(o.transpose(1, 2).reshape(b, t, D)).view(-1, V), y.view(-1))


ACCEPTED = {  # name: (build, sdpa, window)
    "ones_triu": (lambda T, a, m: a.masked_fill(torch.ones(T, T, dtype=BOOL).triu(1), NEG), False, None),
    "step_2_range": (lambda T, a, m: torch.where(_causal_from(_pos(T, step=2)), a, NEG), False, None),
    "offset_ranges": (lambda T, a, m: torch.where(_causal_from(_pos(T, start=5)), a, NEG), False, None),
    "transposed_anticausal": (lambda T, a, m: a.masked_fill(torch.ones(T, T, dtype=BOOL).tril(-1).t(), NEG),
                              False, None),
    "buffer_offset_slice": (lambda T, a, m: torch.where(m.tril[1:T + 1, 1:T + 1], a, NEG), False, None),
    "buffer_select": (lambda T, a, m: torch.where(m.tril3[0, :T, :T], a, NEG), False, None),
    "finfo_min_additive": (lambda T, a, m: a + torch.full((T, T), torch.finfo(a.dtype).min).triu(1), False, None),
    "int16_difference": (lambda T, a, m: torch.where((lambda i: i[:, None] - i[None, :] >= 0)(
        _pos(T, torch.int16)), a, NEG), False, None),
    "float_positions_window": (lambda T, a, m: torch.where((lambda i: (i[:, None] >= i[None, :])
                                                           & (i[:, None] - i[None, :] < 3))(_pos(T).float()), a, NEG),
                               False, 3),
    "sdpa_bool_buffer": (lambda T, a, m: m.tril[:T, :T], True, None),
}

REFUSED = {  # name: (build, sdpa, what the message names)
    # shapes: each broadcasts to something that is not a band of j - i
    "ones_1xT_triu": (lambda T, a, m: a.masked_fill(torch.ones(1, T, dtype=BOOL).triu(1), NEG), False, "varies with j"),
    "ones_Tx1_tril_where": (lambda T, a, m: torch.where(torch.ones(T, 1, dtype=BOOL).tril(), a, NEG), False,
                            "varies with"),
    "full_Tx1_additive": (lambda T, a, m: a + torch.full((T, 1), NEG).triu(1), False, "varies with"),
    "sdpa_narrow_and_ones": (lambda T, a, m: torch.ones(1, T, dtype=BOOL).tril() & torch.ones(T, T, dtype=BOOL),
                             True, "varies with"),
    "buffer_row_broadcast": (lambda T, a, m: torch.where(m.tril[:1, :T], a, NEG), False, "varies with j"),
    "buffer_shifted_slice": (lambda T, a, m: torch.where(m.tril[:T, 1:T + 1], a, NEG), False, "offset j - i = -1"),
    "key_range_only": (lambda T, a, m: torch.where(_pos(T)[None, :] >= 0, a, NEG), False, "varies with j"),
    "constant_true": (lambda T, a, m: torch.where(torch.ones(T, T, dtype=BOOL), a, NEG), False, "same for every"),
    "mask_broadcasts_scores": (lambda T, a, m: a + torch.stack([torch.full((T, T), NEG).triu(1)] * 2)[:, None, None],
                               False, "broadcasts the scores"),
    # dtypes: positions that wrap or round
    "uint8_difference": (lambda T, a, m: torch.where((lambda i: i[:, None] - i[None, :] >= 0)(_pos(T, torch.uint8)),
                                                     a, NEG), False, "torch.uint8"),
    "int8_offset_constant": (lambda T, a, m: torch.where((lambda i: i[:, None] + 200 >= i[None, :] + 200)(
        _pos(T, torch.int8)), a, NEG), False, "torch.int8"),
    # 300 wraps to 44 in int8: eager's window is 44 tokens, not 300
    "int8_window_constant": (lambda T, a, m: torch.where((lambda d: (d >= 0) & (d < 300))(
        (lambda i: i[:, None] - i[None, :])(_pos(T, torch.int8))), a, NEG), False, "does not hold 300"),
    "float16_half_offset": (lambda T, a, m: torch.where((lambda i: i[:, None] >= i[None, :] - 0.1)(
        _pos(T).half()), a, NEG), False, "float16"),
    # values and ranges
    "offset_start_off_by_one": (lambda T, a, m: torch.where(_pos(T, start=1)[:, None] >= _pos(T)[None, :], a, NEG),
                                False, "offset j - i = 1"),
    "mixed_steps": (lambda T, a, m: torch.where(_pos(T, step=2)[:, None] >= _pos(T)[None, :], a, NEG), False,
                    "varies with"),
    "transposed_causal": (lambda T, a, m: a.masked_fill(torch.ones(T, T, dtype=BOOL).triu(1).t(), NEG), False,
                          "not the query's own position"),
    "causal_only_below_100": (lambda T, a, m: torch.where((lambda d: (d <= 0) | (d >= 100))(
        _pos(T)[None, :] - _pos(T)[:, None]), a, NEG), False, "not one range"),
    "finite_large_negative": (lambda T, a, m: a + torch.full((T, T), -1e9).triu(1), False, "neither 0 nor"),
    "float16_min_on_float32": (lambda T, a, m: a + torch.full((T, T), torch.finfo(torch.float16).min).triu(1),
                               False, "neither 0 nor"),
    "sdpa_float_zero_one": (lambda T, a, m: torch.ones(T, T).tril(), True, "neither 0 nor"),
    "bool_added": (lambda T, a, m: a + torch.ones(T, T, dtype=BOOL).tril(), False, "boolean mask is added"),
}


# refused though eager's mask is causal: finite fills and constants that round or wrap are
# not proven (a safe refusal: the prover does not reason about them), and a causal mask that
# broadcasts the scores to more dims (rewritten to one SDPA, `o.mean(0)` would average the batch)
EAGER_CAUSAL = {"finite_large_negative", "float16_min_on_float32", "float16_half_offset", "int8_offset_constant",
                "mask_broadcasts_scores"}


def _data(t=24, batch=2):
    g = torch.Generator().manual_seed(t)
    return torch.randint(0, V, (batch, t), generator=g), torch.randint(0, V, (batch, t), generator=g)


def _prove(model):
    x, y = _data()
    cap = capture(model, None, None, (x, y), {}, None, 1)
    gm = recognize_causal_masks(strip_asserts(cap.copy_graph()), cap.seq, set(cap.param_fqns), cap.param_value)
    return recognize_explicit_attention(gm, cap.seq, cap.param_value)


def _sites(gm):
    return [n for n in gm.graph.nodes if "sppo_explicit_attention" in n.meta or "sppo_causal_mask" in n.meta]


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_masks_that_are_causal_bands_are_proven(name):
    build, sdpa, window = ACCEPTED[name]
    sites = _sites(_prove(MaskLM(build, sdpa)))
    assert [n.meta.get("sppo_attention_window") for n in sites] == [window]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_masks_that_are_not_causal_bands_after_broadcasting_are_refused(name):
    build, sdpa, what = REFUSED[name]
    model = MaskLM(build, sdpa)
    if name not in EAGER_CAUSAL:  # eager's broadcast mask is indeed not causal (at 128 tokens)
        t = 128
        ref = build(t, None, model) if sdpa else build(t, torch.randn(2, H, t, t), model)
        seen = ref if ref.dtype == BOOL else ref > -1e30
        seen = seen[(0,) * (seen.dim() - 2)].expand(t, t)
        assert not torch.equal(seen, torch.ones(t, t, dtype=BOOL).tril())
    with pytest.raises(SppoError, match=what):
        _prove(model)


@pytest.mark.parametrize("name", ["ones_1xT_triu", "uint8_difference", "sdpa_narrow_and_ones"])
def test_refused_masks_leave_no_gradient_end_to_end(name):
    build, sdpa, what = REFUSED[name]
    model = MaskLM(build, sdpa)
    x, y = _data()
    with pytest.raises(SppoError, match=what):
        sppo_fx.compile(model, chunks=4, compile=False)(x, y)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["step_2_range", "transposed_anticausal", "buffer_offset_slice",
                                  "float_positions_window"])
def test_proven_masks_train_exactly(name):
    build, sdpa, _window = ACCEPTED[name]
    torch.manual_seed(0)
    model = MaskLM(build, sdpa)
    x, y = _data(32)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))


@pytest.mark.parametrize("dtype, limit", [(torch.uint8, 256), (torch.bfloat16, 257), (torch.int8, 128)])
def test_narrow_positions_are_exact_up_to_their_limit_and_refused_past_it(dtype, limit):
    """i[:, None] >= i[None, :] on arange(T, dtype) is causal while arange's values are exact."""
    def build(T, a, m):
        return torch.where(_causal_from(torch.arange(T).to(dtype)), a, NEG)
    model = MaskLM(build)
    gm = _prove(model)
    assert gm.meta["sppo_seq_limit"].max_len == limit and gm.meta["sppo_seq_limit"].dtype == dtype
    # eager agrees: causal at the limit, not one token past it
    causal = lambda t: torch.equal(_causal_from(torch.arange(t).to(dtype)), torch.ones(t, t, dtype=BOOL).tril())  # noqa: E731
    assert causal(limit) and not causal(limit + 1)
    torch.manual_seed(0)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    x, y = _data(32)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))
    x, y = _data(limit + 1, batch=1)
    with pytest.raises(SppoError, match=f"{dtype}.*at most {limit} tokens"):
        compiled(x, y)
    assert all(p.grad is None for p in model.parameters())
