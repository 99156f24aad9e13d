"""The CPU path of `attention.prefix_causal_attention`: two flash calls (prefix, causal
square) merged by log-sum-exp, against float64 SDPA over the concatenated K/V."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sppo_fx.chunk_attention.functions import prefix_causal_attention


def _reference(q, k_prefix, k, v_prefix, v):
    groups = q.shape[1] // k.shape[1]
    k_all = torch.cat([k_prefix, k], -2).repeat_interleave(groups, 1)
    v_all = torch.cat([v_prefix, v], -2).repeat_interleave(groups, 1)
    c, n = q.shape[-2], k_all.shape[-2]
    mask = torch.ones(c, n, dtype=torch.bool).tril(n - c)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def _inputs(c, p, heads, kv_heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q, k, v as a model makes them: [b, c, h, d] memory viewed as [b, h, c, d]
    q = torch.randn(2, c, heads, 32, generator=g).transpose(1, 2)
    k = torch.randn(2, c, kv_heads, 32, generator=g).transpose(1, 2)
    v = torch.randn(2, c, kv_heads, 32, generator=g).transpose(1, 2)
    k_prefix = torch.randn(2, kv_heads, p, 32, generator=g)
    v_prefix = torch.randn(2, kv_heads, p, 32, generator=g)
    return [t.to(dtype) for t in (q, k_prefix, k, v_prefix, v)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("c,p", [(48, 0), (48, 80), (33, 7)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_matches_sdpa_over_the_concatenation(dtype, tol, c, p, heads, kv_heads):
    inputs = [t.requires_grad_() for t in _inputs(c, p, heads, kv_heads, dtype)]
    out = prefix_causal_attention(*inputs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = _reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_no_mask_no_concatenation_no_repeated_heads():
    inputs = [t.requires_grad_() for t in _inputs(40, 64, 6, 2, torch.float32)]
    with _Calls() as mode:
        out = prefix_causal_attention(*inputs)
        out.backward(torch.ones_like(out))
    names = [str(f) for f, _, _ in mode.calls]
    flash = [(str(f), a, kw) for f, a, kw in mode.calls if "flash_attention_for_cpu" in str(f)]
    assert len(flash) == 4  # prefix and causal square, forward and backward
    assert all(kw.get("attn_mask") is None for _, _, kw in flash)
    # K/V heads unexpanded: k is argument 1 of the forward, 2 of the backward
    assert all(a[2 if "backward" in f else 1].shape[1] == 2 for f, a, _ in flash)
    assert not any("cat" in n or "repeat_interleave" in n or "masked_fill" in n for n in names)
