"""Soft-capping, attention sinks and ALiBi in the chunk attention.

The op (`chunk_attention/kernels/variants.py`, reached through `prefix_causal_attention(...,
softcap=, sinks=, alibi=)`) against a dense written-out reference, forward and backward,
over odd lengths, an empty prefix, grouped-query heads, windows and tiles smaller than the
prefix; then the recognition of written-out soft-capping and GPT-OSS-style sinks
(`passes/attention_variants.py`), exact against eager through `sppo_fx.compile`, and the
near variants that must be refused.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn

import sppo_fx
from sppo_fx.chunk_attention.functions import prefix_causal_attention, windowed_causal_attention
from sppo_fx.capture import capture, strip_asserts
from sppo_fx.errors import SppoError
from sppo_fx.chunk_attention.kernels import variants
from sppo_fx.chunk_attention.kernels.variants import dense_variant_attention
from sppo_fx.passes.masks.explicit_attention import recognize_explicit_attention

from conftest import assert_matches_eager

CASES = list(itertools.product([0, 7], [1, 5], [None, 2.0], [False, True], [False, True], [None, 3]))


def _inputs(b, h, h_kv, p, c, d, dtype, sink):
    g = torch.Generator().manual_seed(p * 31 + c)
    q = torch.randn(b, h, c, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, h_kv, p + c, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, h_kv, p + c, d, generator=g, dtype=dtype).requires_grad_()
    s = torch.randn(h, generator=g, dtype=dtype).requires_grad_() if sink else None
    return q, k, v, s


def _compare(p, c, softcap, sink, alibi, window, dtype=torch.float64, tol=1e-10, h=4, h_kv=2):
    q, k, v, s = _inputs(2, h, h_kv, p, c, 8, dtype, sink)
    slopes = [2.0 ** -(i + 1) for i in range(h)] if alibi else None
    ref = dense_variant_attention(q, k, v, softcap=softcap, sinks=s, alibi=slopes, window=window)
    out = prefix_causal_attention(q, k[:, :, :p], k[:, :, p:], v[:, :, :p], v[:, :, p:], enable_gqa=True,
                                  softcap=softcap, sinks=s, alibi=slopes, window=window)
    ins = [q, k, v] + ([s] if sink else [])
    grad = torch.randn_like(ref)
    for a, b in zip((out,) + torch.autograd.grad(out, ins, grad), (ref,) + torch.autograd.grad(ref, ins, grad)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("p, c, softcap, sink, alibi, window", CASES)
def test_op_matches_dense_reference(monkeypatch, p, c, softcap, sink, alibi, window):
    monkeypatch.setattr(variants, "BLOCK", 3)  # several key tiles in the prefix and the chunk
    _compare(p, c, softcap, sink, alibi, window)


def test_op_float32_default_tiles_mha():
    _compare(40, 13, 3.0, True, True, None, dtype=torch.float32, tol=2e-5, h=3, h_kv=3)


def test_sink_takes_weight_and_softcap_bounds_scores():
    # a huge sink takes (almost) all the weight; the output then goes to 0 (its value is 0)
    q, k, v, _ = _inputs(1, 2, 2, 3, 4, 8, torch.float64, False)
    out = prefix_causal_attention(q, k[:, :, :3], k[:, :, 3:], v[:, :, :3], v[:, :, 3:],
                                  sinks=torch.full((2,), 80.0, dtype=torch.float64))
    assert out.abs().max() < 1e-20
    # with a cap of 1e-6 every visible score is ~0: a uniform average over the visible keys
    out = prefix_causal_attention(q, k[:, :, :3], k[:, :, 3:], v[:, :, :3], v[:, :, 3:], softcap=1e-6)
    uniform = torch.stack([v[:, :, :3 + r + 1].mean(2) for r in range(4)], 2)
    torch.testing.assert_close(out, uniform, rtol=0, atol=1e-5)


def test_alibi_is_relative_to_absolute_positions():
    # a chunk's rows see the bias of their absolute distance to the prefix's keys: the same
    # rows computed as the tail of one unchunked call
    q, k, v, _ = _inputs(1, 2, 2, 6, 3, 8, torch.float64, False)
    full_q = torch.cat([torch.randn(1, 2, 6, 8, dtype=torch.float64), q], 2)
    slopes = [0.5, 0.25]
    whole = windowed_causal_attention(full_q, k, v, None, alibi=slopes)
    tail = prefix_causal_attention(q, k[:, :, :6], k[:, :, 6:], v[:, :, :6], v[:, :, 6:], alibi=slopes)
    torch.testing.assert_close(tail, whole[:, :, 6:])


@pytest.mark.slow
def test_op_under_inductor_with_a_dynamic_prefix():
    fn = torch.compile(lambda q, kp, k, vp, v, s: prefix_causal_attention(q, kp, k, vp, v, softcap=2.0, sinks=s),
                       dynamic=True, fullgraph=True)
    for p in (5, 9):
        q, k, v, s = _inputs(1, 2, 2, p, 4, 8, torch.float32, True)
        out = fn(q, k[:, :, :p], k[:, :, p:], v[:, :, :p], v[:, :, p:], s)
        ref = dense_variant_attention(q, k, v, softcap=2.0, sinks=s)
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        g = torch.autograd.grad(out.sum(), (q, k, s))
        torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), (q, k, s)), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- recognition from the graph

V, D, H = 61, 32, 4


class VariantLM(nn.Module):
    """One written-out attention layer with soft-capping and/or a GPT-OSS sink, in `style`."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V)
        self.sinks = nn.Parameter(torch.randn(H))
        self.per_query = nn.Parameter(torch.randn(1, H, 64, 1))

    def forward(self, idx, targets):
        B, T = idx.shape
        q, k, v = self.qkv(self.emb(idx)).split(D, dim=2)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
        st = self.style
        mask = torch.full((T, T), float("-inf")).triu(1)
        if "softcap" in st:
            att = torch.tanh(att / 3.0) * 3.0
        att = att + mask
        if st == "tanh_after_mask":
            att = torch.tanh(att / 3.0) * 3.0
        if "sink" in st:
            col = (self.per_query[:, :, :T] if st == "per_query_sink" else self.sinks.reshape(1, -1, 1, 1))
            att = torch.cat([att, col.expand(B, -1, T, -1)], dim=-1)
            att = att - att.max(dim=-1, keepdim=True).values
            probs = torch.softmax(att, dim=-1)
            y = torch.cat([v, torch.zeros_like(v[:, :, :1])], 2) if st == "unsliced_sink" else v
            probs = probs if st == "unsliced_sink" else probs[..., :-1]
            y = probs @ y
        else:
            y = torch.softmax(att, dim=-1) @ v
        logits = self.out(y.transpose(1, 2).reshape(B, T, D))
        return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def _data(seq=32):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, seq), generator=g), torch.randint(0, V, (2, seq), generator=g)


@pytest.mark.parametrize("style, expect", [("softcap", {"softcap": 3.0}), ("sink", {"sinks"}),
                                           ("softcap_sink", {"softcap": 3.0, "sinks": None})])
def test_written_out_variants_are_chunked_exactly(style, expect):
    torch.manual_seed(0)
    model = VariantLM(style)
    x, y = _data()
    cap = capture(model, None, None, (x, y), {}, None, 1)
    gm = recognize_explicit_attention(strip_asserts(cap.copy_graph()), cap.seq, cap.param_value)
    sites = [n for n in gm.graph.nodes if n.target is windowed_causal_attention]
    assert len(sites) == 1 and sites[0].kwargs["window"] is None
    assert set(expect) <= {key for key, val in sites[0].kwargs.items() if val is not None}
    if "softcap" in expect:  # scale' = (1/3) * 3 / sqrt(8): the inner division folded
        assert sites[0].kwargs["softcap"] == 3.0
        assert math.isclose(sites[0].kwargs["scale"], 1 / math.sqrt(D // H))
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))


@pytest.mark.parametrize("style, message", [
    ("tanh_after_mask", "applied after the mask"),
    ("unsliced_sink", "not sliced off"),
    ("per_query_sink", "not one sink logit per head"),
])
def test_near_variants_refused(style, message):
    model = VariantLM(style)
    x, y = _data()
    with pytest.raises(SppoError, match=message):
        sppo_fx.compile(model, chunks=4, compile=False)(x, y)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- the Triton kernels

INTERPRETER_SCRIPT = r'''
import os
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
torch.set_num_threads(1)
from sppo_fx.chunk_attention.kernels.triton_launch import launch_variant_fwd, launch_variant_bwd
from sppo_fx.chunk_attention.kernels.variants import dense_variant_attention
for (p, c), softcap, sink, alibi in [((13, 20), 2.0, True, True), ((0, 20), 2.0, False, False),
                                     ((37, 5), 0.0, True, False), ((5, 18), 0.0, False, True)]:
    g = torch.Generator().manual_seed(p + c)
    h, h_kv, d = 4, 2, 8
    q, do = torch.randn(1, h, c, d, generator=g), torch.randn(1, h, c, d, generator=g)
    k, v = torch.randn(1, h_kv, p + c, d, generator=g), torch.randn(1, h_kv, p + c, d, generator=g)
    s = torch.randn(h, generator=g) if sink else None
    slopes = [2.0 ** -(i + 1) for i in range(h)] if alibi else None
    scale = d ** -0.5
    # 16 x 16 tiles: several diagonal, ragged and unmasked tiles in every row and column
    out, lse = launch_variant_fwd(q, k, v, scale, softcap, s, slopes, direct=True, block_m=16, block_n=16)
    dq, dk, dv, ds = launch_variant_bwd(do, q, k, v, out, lse, scale, softcap, s, slopes, direct=True,
                                        block_m=16, block_n=16)
    ins = [t.double().requires_grad_() for t in (q, k, v)] + ([s.double().requires_grad_()] if sink else [])
    ref = dense_variant_attention(*ins[:3], scale=scale, softcap=softcap or None,
                                  sinks=ins[3] if sink else None, alibi=slopes)
    for got, want in zip([out, dq, dk, dv] + ([ds] if sink else []), [ref] + list(torch.autograd.grad(ref, ins, do.double()))):
        err = (got.double() - want).abs().max().item()
        assert err < 1e-4, (p, c, softcap, sink, alibi, err)
print("KERNELS OK")
'''


@pytest.mark.slow
def test_triton_kernels_with_variants_under_the_interpreter(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be interpreted")
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "variants_interpreted.py"
    script.write_text(INTERPRETER_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(script)], env=env, cwd=repo, capture_output=True, text=True,
                         timeout=600)
    assert "KERNELS OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
